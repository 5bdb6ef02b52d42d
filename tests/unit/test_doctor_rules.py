"""`bastion doctor`'s judgements, without a machine to break: each `judge_*` over the
facts a check gathers, the gateway and vault checks over a `status` reply, the exit
status, and the one-line rendering. tests/integration/test_doctor.py breaks a real
setup five ways; this file covers the branches a real machine cannot easily show
(an old ssh, a keyring without a backend, a failing witness, a door gone)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from bastion.cli.doctor import line, render
from bastion.config import Config, WitnessConfig
from bastion.core.policy import build_policy, host_key_fingerprint
from bastion.data import EXAMPLE_POLICY
from bastion.home import Home
from bastion.ops import doctor
from bastion.ops.doctor import Check, Context, Status
from bastion.sandbox.isolation import Isolation

KEY1 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGTn3rMnQ4caK5KXXDWfLOi0KRSSxWda2/bv8ow7cg06"
KEY2 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID/S3ghEp/P2hE0Hj28lsUaWTDSfIg4C/2VA1mNVQ4MM"
POLICY = f"""
[hosts.web1]
address = "10.0.0.5"
port = 2222
host_key = "{KEY1}"

[[hosts.web1.accounts]]
user = "deploy"
credential = "deploy-key"
"""
HOME = Home(Path("/srv/b home"))
ISO = Isolation("bastion-agent", 990, "bastion-agent", 990, 1000, Path("/run/bastion-1000"))


def ctx(gateway: dict[str, Any] | None = None, error: str | None = None) -> Context:
    return Context(
        HOME, gateway, error, HOME.policies, None, "not loaded", Config(), None, "", 1000
    )


def status(**over: Any) -> dict[str, Any]:
    base = {
        "locked": False,
        "vault_epoch": 4,
        "boot_id": "boot_x",
        "pid": 42,
        "agent_socket": str(HOME.agent_socket),
        "isolation": "advisory",
        "guarantees": [],
        "listeners": {"agent": {"serving": True}, "operator": {"serving": True}},
        "keys_held": {"vault_keys": 1},
        "policy": {"ok": True, "error": None},
        "witness": None,
    }
    return {**base, **over}


def st(mode: int, uid: int = 1000) -> os.stat_result:
    return os.stat_result((mode, 1, 1, 1, uid, uid, 0, 0, 0, 0))


# -- the exit status and the lines -----------------------------------------------------------


def test_only_a_failure_fails() -> None:
    ok, warn, skip = (Check(s.value, s, "d") for s in (Status.OK, Status.WARN, Status.SKIP))
    assert doctor.summary([ok, warn, skip]) == 0
    assert doctor.summary([]) == 0
    assert doctor.summary([ok, Check("x", Status.FAIL, "broken", "mend it"), warn]) == 1


def test_a_line_has_a_mark_the_name_the_detail_and_the_fix_only_when_wrong() -> None:
    assert line(Check("gateway", Status.OK, "answering", "never shown")) == (
        "✓ gateway        answering"
    )
    assert line(Check("vault", Status.FAIL, "locked", "bastion unlock")) == (
        "✗ vault          locked -- fix: bastion unlock"
    )
    assert line(Check("keyring", Status.WARN, "none", "use the passphrase")).startswith("! ")
    assert line(Check("witness", Status.SKIP, "none configured")).startswith("- witness ")
    shown = line(Check("host.web1", Status.FAIL, "error \x1b[2J\u202e", "fix\x07"))
    assert "\x1b" not in shown and "\u202e" not in shown and "\x07" not in shown
    assert render([Check("a", Status.OK, "x"), Check("b", Status.OK, "y")]).count("\n") == 1


def test_json_carries_the_status_by_value() -> None:
    assert Check("vault", Status.FAIL, "locked", "bastion unlock").as_json() == {
        "name": "vault",
        "status": "fail",
        "detail": "locked",
        "fix": "bastion unlock",
    }


def test_a_check_that_breaks_is_a_failure_not_a_traceback() -> None:
    def broken(_: Context) -> list[Check]:
        raise RuntimeError("boom")

    (c,) = doctor.run_checks(ctx(), [broken])
    assert (c.name, c.status) == ("broken", Status.FAIL) and "RuntimeError: boom" in c.detail


# -- the ssh client ---------------------------------------------------------------------------

GOOD_G = "user root\nproxyusefdpass yes\nknownhostscommand /bin/echo x\n"


@pytest.mark.parametrize(
    ("banner", "rc", "parsed", "want", "said"),
    [
        (None, 0, "", Status.FAIL, "no `ssh` on PATH"),
        ("dropbear_2022.83", 0, GOOD_G, Status.FAIL, "not OpenSSH"),
        ("OpenSSH_8.4p1 Debian-5, OpenSSL 1.1.1", 0, GOOD_G, Status.FAIL, "too old"),
        ("OpenSSH_6.5p1", 0, GOOD_G, Status.FAIL, "too old"),
        (
            "OpenSSH_9.2p1 Debian-2",
            255,
            "/tmp/c: line 9: Bad configuration option: knownhostscommand\n",
            Status.FAIL,
            "Bad configuration option: knownhostscommand",
        ),
        ("OpenSSH_9.2p1 Debian-2", 0, "user root\n", Status.FAIL, "refuses"),
        ("OpenSSH_9.2p1 Debian-2, OpenSSL 3", 0, GOOD_G, Status.OK, "ProxyUseFdpass yes"),
        ("OpenSSH_10.0p2", 0, GOOD_G, Status.OK, "OpenSSH_10.0p2"),
    ],
)
def test_the_ssh_client_must_be_openssh_8_5_and_accept_the_generated_config(
    banner: str | None, rc: int, parsed: str, want: Status, said: str
) -> None:
    c = doctor.judge_ssh_client(banner, rc, parsed)
    assert c.status is want and said in c.detail, c
    assert (c.fix is None) == (want is Status.OK)


# -- file modes -------------------------------------------------------------------------------


def test_file_modes() -> None:
    path = Path("/h/vault.json")
    ok = doctor.judge_mode("mode.vault", path, st(stat.S_IFREG | 0o600), 1000, True)
    assert ok.status is Status.OK and "mode 600" in ok.detail
    shared = doctor.judge_mode("mode.vault", path, st(stat.S_IFREG | 0o640), 1000, True)
    assert shared.status is Status.FAIL and shared.fix == "chmod go-rwx /h/vault.json"
    readable_dir = doctor.judge_mode("mode.home", Path("/h"), st(stat.S_IFDIR | 0o755), 1000, False)
    assert readable_dir.status is Status.OK  # readable is fine where nothing is secret
    writable = doctor.judge_mode(
        "mode.journal", Path("/h/j"), st(stat.S_IFDIR | 0o775), 1000, False
    )
    assert writable.status is Status.FAIL and writable.fix == "chmod go-w /h/j"
    assert "writable by group or others (mode 775)" in writable.detail
    theirs = doctor.judge_mode("mode.home", Path("/h"), st(stat.S_IFDIR | 0o700, 0), 1000, False)
    assert theirs.status is Status.FAIL and (theirs.fix or "").startswith("chown 1000 /h ")
    assert "run doctor as uid 0 if that is the operator" in (theirs.fix or "")
    gone = doctor.judge_mode("mode.home", Path("/h"), None, 1000, False)
    assert gone.status is Status.FAIL and "bastion init" in (gone.fix or "")


# -- the policy -------------------------------------------------------------------------------


def test_the_policy_verdict() -> None:
    policy = build_policy([("a.toml", "/p/a.toml", POLICY)])
    d = Path("/p")
    assert doctor.judge_policy(d, policy, None, ["deploy-key"]).status is Status.OK
    missing = doctor.judge_policy(d, policy, None, ["other"])
    assert missing.status is Status.FAIL and "'deploy-key', not in the vault" in missing.detail
    assert missing.fix == "bastion key generate deploy-key (or import it); or edit /p/a.toml"
    unknown = doctor.judge_policy(d, policy, None, None)  # the vault file cannot be read
    assert unknown.status is Status.OK and "credential" not in unknown.detail
    error = "/p/a.toml: refusing policy file writable by group or others (mode 664)"
    refused = doctor.judge_policy(d, None, f"{error}; fix with: chmod go-w /p/a.toml", None)
    assert refused.status is Status.FAIL and refused.fix == "chmod go-w /p/a.toml"
    assert refused.detail.startswith(error) and "fix with" not in refused.detail
    syntax = doctor.judge_policy(d, None, "/p/a.toml: invalid TOML", None)
    assert syntax.status is Status.FAIL and str(EXAMPLE_POLICY) in (syntax.fix or "")
    stale = doctor.judge_policy(d, policy, None, ["deploy-key"], "/p/b.toml: bad")
    assert stale.status is Status.FAIL and "the running gateway refuses it" in stale.detail
    empty = doctor.judge_policy(d, build_policy([]), None, [])
    assert empty.status is Status.WARN and "agents can reach nothing" in empty.detail


def test_certificate_accounts_need_a_ca_in_the_vault() -> None:
    """A policy whose accounts log in with certificates, and no CA to sign them: every
    request to them would be refused, so the policy check fails naming each account."""
    certs = POLICY + "".join(
        f'\n[[hosts.web1.accounts]]\nuser = "{user}"\nauth = "certificate"\n'
        'source_address = ["10.0.0.1"]\n'
        for user in ("ops", "backup")
    )
    policy = build_policy([("a.toml", "/p/a.toml", certs)])
    d = Path("/p")
    missing = doctor.judge_policy(d, policy, None, ["deploy-key"], None, no_ca=True)
    assert missing.status is Status.FAIL, missing
    assert missing.detail == 'ops@web1, backup@web1: auth = "certificate", no CA in the vault'
    assert (missing.fix or "").startswith("`bastion ca init`")
    # With a CA (or OpenBao signing), certificate accounts need no credential in the vault.
    signed = doctor.judge_policy(d, policy, None, ["deploy-key", "bastion-ca-1"], None)
    assert signed.status is Status.OK and "every credential is in the vault" in signed.detail
    plain = build_policy([("a.toml", "/p/a.toml", POLICY)])  # key accounts need no CA
    assert doctor.judge_policy(d, plain, None, ["deploy-key"], None, no_ca=True).status is Status.OK


# -- the keyring ------------------------------------------------------------------------------


def test_the_keyring_backend_must_keep_secrets() -> None:
    import keyring.backends.fail

    class PlaintextKeyring:
        pass

    class Chainer:
        def __init__(self) -> None:
            self.backends: list[object] = []  # keyring's chainer, with nothing to chain

    class SecretService:
        pass

    assert doctor.judge_keyring(keyring.backends.fail.Keyring()).status is Status.WARN
    assert "plain text" in doctor.judge_keyring(PlaintextKeyring()).detail
    assert doctor.judge_keyring(Chainer()).status is Status.WARN
    assert doctor.judge_keyring(None, "ValueError: no such backend").status is Status.WARN
    ok = doctor.judge_keyring(SecretService())
    assert ok.status is Status.OK and "SecretService" in ok.detail


# -- the gateway, the vault, isolation --------------------------------------------------------


def test_the_gateway_and_the_vault() -> None:
    down = "the gateway is not running (no operator socket at /x); start it with `bastion daemon`"
    (gw,) = doctor.check_gateway(ctx(None, down))
    assert gw.status is Status.FAIL and "`bastion daemon`" in (gw.fix or "")
    assert gw.detail == "the gateway is not running (no operator socket at /x)"
    assert doctor.check_vault(ctx(None, down))[0].status is Status.SKIP
    (hung,) = doctor.check_gateway(ctx(None, "timed out"))
    assert hung.status is Status.FAIL and "log" in (hung.fix or "")
    assert doctor.check_gateway(ctx(status()))[0].status is Status.OK
    deaf = status(listeners={"agent": {"serving": False, "last_error": "EMFILE"}})
    (c,) = doctor.check_gateway(ctx(deaf))
    assert c.status is Status.FAIL and "agent socket is NOT SERVING: EMFILE" in c.detail
    (locked,) = doctor.check_vault(ctx(status(locked=True)))
    assert locked.status is Status.FAIL and locked.fix == "bastion unlock"
    assert "VAULT_LOCKED" in locked.detail
    assert doctor.check_vault(ctx(status()))[0].status is Status.OK


def test_isolation_online() -> None:
    judge = doctor.judge_isolation
    strong = status(isolation="strong", guarantees=[["agents run as another uid", True]])
    assert judge(HOME, strong, ISO, {}).status is Status.OK
    weak = status(isolation="strong", guarantees=[["a", True], ["b", False], ["c", False]])
    c = judge(HOME, weak, ISO, {})
    assert c.status is Status.FAIL and "NOT HELD: b (and 1 more)" in c.detail
    advisory = judge(HOME, status(), None, {})
    assert advisory.status is Status.FAIL and advisory.detail.startswith("advisory: ")
    assert "sudo bastion --home '/srv/b home' isolate setup" in (advisory.fix or "")
    stale = judge(HOME, status(), ISO, {})  # isolation.json written after the gateway started
    assert stale.fix == f"restart `bastion daemon`: it was started without {HOME.isolation}"
    seen = judge(HOME, status(agent_socket=str(ISO.agent_socket)), ISO, {})
    assert "an agent connected as the operator's uid" in (seen.fix or "")


def test_isolation_offline_is_the_mode_the_gateway_would_start_in() -> None:
    judge = doctor.judge_isolation
    none = judge(HOME, None, None, {})
    assert none.status is Status.FAIL and none.detail.startswith("advisory (no ")
    assert "isolate setup" in (none.fix or "")
    door = judge(HOME, None, ISO, {}, "/run/bastion-1000 is gone (/run is emptied at boot)")
    assert door.status is Status.FAIL and (door.fix or "").endswith("isolate setup again")
    loose = judge(HOME, None, ISO, {"vault": False, "home": True})
    assert loose.status is Status.FAIL and "['vault']" in loose.detail
    assert judge(HOME, None, ISO, {"vault": True, "home": True}).status is Status.OK


# -- the witness, the hosts -------------------------------------------------------------------


def test_the_witness() -> None:
    judge = doctor.judge_witness
    on = Config(witness=WitnessConfig(file=Path("/mnt/w.jsonl")))
    target = {"address": "/mnt/w.jsonl", "waiting": 0, "failing": False, "last_error": None}
    health = {"waiting": 0, "buffer_max": 10, "targets": {"file": target}}
    assert judge(Config(), None, True).status is Status.SKIP
    assert judge(None, None, True).status is Status.SKIP
    assert judge(on, None, False).status is Status.SKIP
    assert judge(on, None, True).status is Status.FAIL  # bastion.toml edited after the start
    assert judge(on, health, True).status is Status.OK
    failing = {**target, "failing": True, "last_error": "ENOSPC"}
    c = judge(on, {**health, "waiting": 3, "targets": {"file": failing}}, True)
    assert c.status is Status.FAIL and "FAILING: ENOSPC; 3 waiting" in c.detail
    full = judge(on, {**health, "full": True, "refusing": True}, True)
    assert full.status is Status.FAIL and "refusing, full" in full.detail


def test_a_host_must_present_its_pinned_key() -> None:
    policy = build_policy([("a.toml", "/p/a.toml", POLICY)])
    host = policy.hosts["web1"]
    ok = doctor.judge_host(host, KEY1 + " comment", None)
    assert ok.status is Status.OK and host_key_fingerprint(KEY1) in ok.detail
    wrong = doctor.judge_host(host, KEY2, None)
    assert wrong.status is Status.FAIL and "HOST_KEY_MISMATCH" in wrong.detail
    assert host_key_fingerprint(KEY2) in wrong.detail
    assert "`bastion hostkey 10.0.0.5 --port 2222`" in (wrong.fix or "")
    down = doctor.judge_host(host, None, "Connect call failed")
    assert down.status is Status.FAIL and "10.0.0.5:2222 unreachable" in down.detail
    assert "/p/a.toml" in (down.fix or "")


def test_the_sandbox_says_what_a_run_gets_here_and_the_fix_when_it_cannot() -> None:
    from bastion import sandbox

    ok = doctor.judge_sandbox(sandbox.Machine(None, 7))
    assert [c.status for c in ok] == [doctor.Status.OK, doctor.Status.OK]
    off = sandbox.Unavailable("user namespaces are turned off", "sudo sysctl -w x=1")
    bad = doctor.judge_sandbox(sandbox.Machine(off, 4))
    assert bad[0].status is doctor.Status.FAIL and bad[0].fix == "sudo sysctl -w x=1"
    assert "turned off" in bad[0].detail
    assert bad[1].status is doctor.Status.WARN and "X11" in bad[1].detail
