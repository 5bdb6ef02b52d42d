"""`bastion doctor` on a real setup: a healthy one, then the acceptance's five broken ones.

Acceptance (issue 12): "`bastion doctor` reports every check on a healthy setup and
names the broken one (with its fix) on each of five broken setups (gateway down,
group-writable policy, wrong pinned host key, locked vault, advisory isolation)."

The healthy setup is green on every check, nothing skipped: a real gateway with
strong isolation (`bastion isolate setup` with a second uid, so this module needs
root and useradd, as CI has), unlocked, a policy pinning the fixture sshd's real
host key, a file witness in bastion.toml, and a keyring backend that keeps secrets
(the tests' file keyring, selected the way `test_lifecycle` does; this machine has
no Secret Service). Without root the isolation check cannot be green: the module
then runs in advisory mode and expects `isolation` to fail everywhere, and only
there. Each broken setup breaks one thing, runs the real `bastion doctor` (human
and --json), asserts that exactly the named check fails with its fix, that the
checks which depend on it are skipped, that every other check is as healthy as
before, and exit 1 -- then mends the setup. The bastion lives under a fresh
/tmp/bastion-doctor-* (mode 0755): the agent user must reach its socket directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bastion.core.policy import host_key_fingerprint
from tests.harness import (
    Bastion,
    cli_argv,
    make_bastion,
    policy_toml,
    remove_user,
    write_bastion_toml,
)

DOCTOR_USER = "bastion-test-doctor"  # not test_isolate's user: those tests remove theirs
NAMES = {
    "ssh client",
    "gateway",
    "home",
    "vault",
    "sandbox",
    "landlock",
    "isolation",
    "mode.home",
    "mode.vault",
    "mode.host_key",
    "mode.journal",
    "config",
    "policy",
    "host.web1",
    "witness",
    "keyring",
}


def _can_isolate() -> bool:
    return os.geteuid() == 0 and bool(shutil.which("useradd")) and Path("/usr/bin/python3").exists()


@dataclass
class Setup:
    b: Bastion
    strong: bool
    env: dict[str, str]

    def restart(self) -> None:
        self.b.stop_daemon()
        self.b.start_daemon()
        self.b.unlock()


@pytest.fixture(scope="module")
def setup(sshd_server: Any, client_key: tuple[Path, str]) -> Iterator[Setup]:
    strong = _can_isolate()
    root = Path(tempfile.mkdtemp(prefix="bastion-doctor-"))
    root.chmod(0o755)
    b = make_bastion(root, sshd_server.info, client_key[0], start=False)
    try:
        write_bastion_toml(b, f'[witness]\nfile = "{root / "witness.jsonl"}"\n')
        if strong:
            remove_user(DOCTOR_USER)
            b.cli("isolate", "setup", "--user", DOCTOR_USER, "--socket-dir", str(root / "door"))
        b.start_daemon()
        b.unlock()
        env = {
            **os.environ,
            "PYTHON_KEYRING_BACKEND": "tests.keyring_file_backend.FileKeyring",
            "BASTION_TEST_KEYRING": str(root / "keyring.json"),
        }
        yield Setup(b, strong, env)
    finally:
        b.close()
        shutil.rmtree(root, ignore_errors=True)
        if strong:
            remove_user(DOCTOR_USER)


def run_doctor(s: Setup) -> tuple[int, dict[str, dict[str, Any]], list[str]]:
    """The real CLI, --json and human: exit status, checks by name, the human lines.
    Both runs must agree on every check's mark and on the exit status."""
    runs = [
        subprocess.run(
            cli_argv(s.b.home.root, "doctor", *flag),
            capture_output=True,
            text=True,
            timeout=60,
            env=s.env,
            stdin=subprocess.DEVNULL,
        )
        for flag in (("--json",), ())
    ]
    as_json, human = runs
    for r in runs:
        assert "Traceback" not in r.stderr, r.stderr
    assert as_json.returncode == human.returncode, (as_json, human)
    doc = json.loads(as_json.stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    assert len(checks) == len(doc["checks"]), "two checks with one name"
    assert doc["ok"] == (as_json.returncode == 0)
    lines = human.stdout.splitlines()
    marks = {"ok": "✓", "fail": "✗", "warn": "!", "skip": "-"}
    assert [line[0] for line in lines] == [marks[c["status"]] for c in doc["checks"]], lines
    if as_json.returncode:
        failed = [c["name"] for c in doc["checks"] if c["status"] == "fail"]
        assert (
            human.stderr
            == f"bastion: doctor: failed: {', '.join(failed)}; each check names its fix\n"
        )
    else:
        assert human.stderr == ""
    return as_json.returncode, checks, lines


def expect(
    s: Setup,
    fails: dict[str, str],
    skips: frozenset[str] = frozenset(),
    gone: frozenset[str] = frozenset(),
) -> dict[str, dict[str, Any]]:
    """Doctor fails exactly `fails` (name -> a phrase of its fix), skips `skips`, no longer
    has `gone`, and says of every other check what it says of a healthy setup."""
    rc, checks, lines = run_doctor(s)
    assert rc == 1
    assert set(checks) == (NAMES - gone) | skips, sorted(checks)
    healthy = {"isolation": "ok" if s.strong else "fail"}
    for name, c in checks.items():
        want = "fail" if name in fails else "skip" if name in skips else healthy.get(name, "ok")
        assert c["status"] == want, c
    for name, phrase in fails.items():
        c = checks[name]
        assert phrase in c["fix"], c
        (shown,) = [line for line in lines if line.startswith(f"✗ {name} ")]
        assert shown.endswith(f" -- fix: {c['fix']}"), shown
    return checks


# -- healthy ----------------------------------------------------------------------------------


def test_a_healthy_setup_is_green_on_every_check(setup: Setup) -> None:
    rc, checks, lines = run_doctor(setup)
    assert set(checks) == NAMES
    not_ok = {n: c for n, c in checks.items() if c["status"] != "ok"}
    if setup.strong:
        assert rc == 0 and not_ok == {}, not_ok
        assert checks["isolation"]["detail"].startswith("strong: agents run as uid ")
        assert f"({DOCTOR_USER})" in checks["isolation"]["detail"]
    else:
        assert rc == 1 and list(not_ok) == ["isolation"], not_ok
    assert all(c["fix"] is None for c in checks.values() if c["status"] == "ok")
    sshd = setup.b.sshd
    assert checks["host.web1"]["detail"] == (
        f"{sshd.address}:{sshd.port} presents the pinned key {host_key_fingerprint(sshd.host_key)}"
    )
    assert "proxyusefdpass" in checks["ssh client"]["detail"].lower()
    assert checks["vault"]["detail"].startswith("unlocked (epoch ")
    assert "policy" in checks and "web1" in checks["policy"]["detail"]
    assert "every credential is in the vault" in checks["policy"]["detail"]
    assert checks["witness"]["detail"].startswith("delivering to file ")
    assert "tests.keyring_file_backend.FileKeyring" in checks["keyring"]["detail"]
    assert len(lines) == len(NAMES)


# -- broken, one thing at a time ----------------------------------------------------------------


def test_gateway_down(setup: Setup) -> None:
    setup.b.stop_daemon()
    try:
        checks = expect(
            setup, {"gateway": "`bastion daemon`"}, skips=frozenset({"home", "vault", "witness"})
        )
        assert "the gateway is not running" in checks["gateway"]["detail"]
    finally:
        setup.b.start_daemon()
        setup.b.unlock()


def test_a_group_writable_policy_file(setup: Setup) -> None:
    policy = setup.b.home.policies / "test.toml"
    policy.chmod(0o664)
    try:
        checks = expect(
            setup,
            {"policy": f"chmod go-w {policy}"},
            skips=frozenset({"host"}),  # no policy, no hosts to probe
            gone=frozenset({"host.web1"}),
        )
        assert checks["policy"]["fix"] == f"chmod go-w {policy}"
        assert "writable by group or others (mode 664)" in checks["policy"]["detail"]
        assert setup.b.op("status")["policy"]["ok"] is False  # the gateway refuses it too
    finally:
        policy.chmod(0o600)


def test_a_wrong_pinned_host_key(setup: Setup, tmp_path: Path) -> None:
    b = setup.b
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], timeout=30)
    wrong = " ".join(other.with_suffix(".pub").read_text().split()[:2])
    b.write_policy(policy_toml(b.sshd, host_key=wrong))
    try:
        checks = expect(setup, {"host.web1": f"bastion hostkey {b.sshd.address} --port"})
        detail = checks["host.web1"]["detail"]
        assert f"presents ssh-ed25519 {host_key_fingerprint(b.sshd.host_key)}" in detail
        assert f"the policy pins ssh-ed25519 {host_key_fingerprint(wrong)}" in detail
        assert "HOST_KEY_MISMATCH" in detail
    finally:
        b.write_policy(policy_toml(b.sshd))


def test_a_locked_vault(setup: Setup) -> None:
    setup.b.op("lock")
    try:
        checks = expect(setup, {"vault": "bastion unlock"})
        assert checks["vault"]["fix"] == "bastion unlock"
        assert "VAULT_LOCKED" in checks["vault"]["detail"]
    finally:
        setup.b.unlock()


def test_advisory_isolation(setup: Setup) -> None:
    """Agents as the operator's own uid: no isolation.json, the gateway restarted. Then
    isolation.json back but the gateway not restarted: the fix says restart it."""
    b = setup.b
    record, aside = b.home.isolation, b.home.isolation.with_suffix(".aside")
    if setup.strong:
        record.rename(aside)
        setup.restart()
    try:
        assert b.op("status")["isolation"] == "advisory"
        checks = expect(setup, {"isolation": "isolate setup"}, skips=frozenset())
        c = checks["isolation"]
        assert c["detail"].startswith("advisory: agents run as the operator's own uid")
        assert c["fix"].startswith(f"sudo bastion --home {b.home.root} isolate setup")
        if setup.strong:
            aside.rename(record)
            stale = expect(setup, {"isolation": "restart `bastion daemon`"})["isolation"]
            assert "started without" in stale["fix"]
    finally:
        if aside.exists():
            aside.rename(record)
        if setup.strong:
            setup.restart()
            assert b.op("status")["isolation"] == "strong"
