"""The JSON of a path that is not UTF-8: shown escaped, kept exactly."""

from __future__ import annotations

import base64
import os

from bastion.core.subject import ProcessInfo, Subject, exact_base64, shown_path


def test_a_path_that_is_not_utf8_is_shown_escaped_and_kept_exactly() -> None:
    raw = b"/opt/bin\xff\xfe/agent"
    exe = os.fsdecode(raw)
    assert shown_path(exe) == "/opt/bin\\xff\\xfe/agent"
    assert base64.b64decode(exact_base64(exe) or "") == raw
    assert exact_base64("/usr/bin/caf\u00e9") is None  # UTF-8 is kept as it is
    info = ProcessInfo(7, 1, 1.0, 1000, exe, None, "agent", (exe, "--flag"))
    doc = info.as_json()
    assert doc["exe"] == "/opt/bin\\xff\\xfe/agent" and doc["cmdline"][1] == "--flag"
    assert [base64.b64decode(a) for a in doc["cmdline_base64"]] == [raw, b"--flag"]
    subject = Subject(7, 1.0, exe, None, 1000, "n1")
    assert base64.b64decode(subject.as_json()["exe_base64"]) == raw
    assert "exe_base64" not in Subject(7, 1.0, "/usr/bin/node", None, 1000, "n1").as_json()
