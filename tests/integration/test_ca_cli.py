"""`bastion ca` (issue 13): the vault's user CA from the operator's side, through the
real CLI, offline on the vault file (with --passphrase-stdin) and through a running
gateway, and the OpenBao login sealed in the vault without ever being shown.

What a target does with the CA (a real sshd trusting it) is the certificate tests'
business; here: the CA is made once, `ca public` is a file ssh-keygen reads key by
key and whose comments are the sshd_config a target needs, a rotation lists both
CAs with the newest signing, only an older CA can be retired, the reserved labels
stay out of `bastion key`'s reach, and no private key or token reaches an output,
a log, a file in plaintext, or a process's argv.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from bastion.vault import Vault
from tests.harness import (
    PASSPHRASE,
    Bastion,
    Terminal,
    cli_argv,
    policy_toml,
    wait_for,
    write_bastion_toml,
)

PASS = PASSPHRASE + "\n"
TOKEN = "hvs.cacli-token-" + "5f3a9c1e77d04b2a"
SECRET_ID = "approle-secret-" + "0e8b6d2f4c1a9e73"
OPENBAO = "bastion-openbao"
BIN = Path(sys.executable).parent  # where the `bastion` entry point is installed

Out = subprocess.CompletedProcess[str]


def cli(b: Bastion, *args: str, stdin: str | None = None) -> Out:
    """The real CLI, whatever its exit; stdin closed unless given (no terminal)."""
    r = subprocess.run(
        cli_argv(b.home.root, *args),
        input=None if stdin is None else stdin.encode(),
        stdin=subprocess.DEVNULL if stdin is None else None,
        capture_output=True,
        timeout=60,
    )
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode())


def ok(r: Out) -> Out:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    assert r.stderr == "", r.stderr
    return r


def refused(r: Out, *phrases: str) -> None:
    """Exit 1, one `bastion: ` line naming the problem, nothing on stdout."""
    assert r.returncode == 1, f"exit {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    assert r.stderr.startswith("bastion: ") and r.stderr.count("\n") == 1, r.stderr
    assert r.stdout == "", r.stdout
    for phrase in phrases:
        assert phrase in r.stderr, r.stderr


def digest(b: Bastion) -> str:
    """The vault file as it is (online: nothing else writes it while these tests look)."""
    return hashlib.sha256(b.home.vault.read_bytes()).hexdigest()


def keys(b: Bastion) -> list[tuple[str, str]]:
    """The vault's keys (offline, each unlock and lock rewrites the file's epoch)."""
    return [(k.label, k.fingerprint) for k in Vault.open(b.home.vault).list_keys()]


def ssh_keygen_fingerprints(path: Path) -> list[str]:
    """What `ssh-keygen -l -f` reads from a file of public keys: one fingerprint per key."""
    r = subprocess.run(
        ["ssh-keygen", "-l", "-E", "sha256", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return [line.split()[1] for line in r.stdout.splitlines()]


def check_ca_file(tmp_path: Path, text: str, expected: list[dict[str, str]]) -> None:
    """`ca public` as a target gets it: every line a comment or a CA key, each key line
    accepted by ssh-keygen on its own and the whole file listing the CAs in order."""
    lines = text.splitlines()
    keys = [line for line in lines if not line.startswith("#")]
    assert len(keys) == len(expected), text
    for i, (line, ca) in enumerate(zip(keys, expected, strict=True)):
        one = tmp_path / f"ca-line-{i}.pub"
        one.write_text(line + "\n")
        assert ssh_keygen_fingerprints(one) == [ca["fingerprint"]], line
        assert line.split()[:2] == ca["public_key"].split()[:2]
    whole = tmp_path / "bastion_user_ca.pub"
    whole.write_text(text + "\n")
    assert ssh_keygen_fingerprints(whole) == [ca["fingerprint"] for ca in expected]
    comments = "\n".join(line for line in lines if line.startswith("#"))
    assert "TrustedUserCAKeys /etc/ssh/bastion_user_ca.pub" in comments, text
    assert "AuthorizedPrincipalsFile /etc/ssh/bastion_principals/%u" in comments, text
    assert "Do not set ForceCommand" in comments and "override" in comments, text


def public_json(b: Bastion) -> dict[str, object]:
    doc = json.loads(ok(cli(b, "ca", "public", "--json")).stdout)
    assert isinstance(doc, dict)
    return doc


def private_needles(b: Bastion, label: str) -> list[bytes]:
    """Every form in which a vault key's private half could leak: any private key file,
    and the key's secret scalar raw, in hex, and in base64 at each of its three
    alignments (read offline: no epoch change, nothing left unlocked)."""
    private = Vault.open(b.home.vault).read_private_key(PASSPHRASE.encode(), label).pyca_key
    if isinstance(private, ec.EllipticCurvePrivateKey):
        raw = private.private_numbers().private_value.to_bytes(32, "big")
    else:
        raw = private.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
    shifted = [base64.b64encode(bytes(pad) + raw)[4:36] for pad in range(3)]
    return [b"PRIVATE KEY", raw, raw.hex().encode(), *shifted]


def files_holding(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def sealed_login(b: Bastion) -> dict[str, str]:
    """The OpenBao login as the vault keeps it (the gateway must be stopped)."""
    v = Vault.open(b.home.vault)
    v.unlock(PASSPHRASE.encode())
    try:
        login = json.loads(v.secret(OPENBAO))
    finally:
        v.lock()
    assert isinstance(login, dict)
    return login


# -- the tests ---------------------------------------------------------------------------


def test_init_offline_once_and_public_is_a_file_a_target_trusts(
    bastion: Bastion, tmp_path: Path
) -> None:
    b = bastion
    b.stop_daemon()
    refused(cli(b, "ca", "public"), "no user CA", "`bastion ca init`")

    r = ok(cli(b, "ca", "init", "--passphrase-stdin", stdin=PASS))
    line, hint = r.stdout.splitlines()
    assert line.startswith("ssh-ed25519 ") and hint.startswith("# created bastion-ca-1 ("), r
    assert "`bastion ca public`" in hint
    ca_file = tmp_path / "init-output.pub"  # init's own output is a valid CA file too
    ca_file.write_text(r.stdout)
    (fingerprint,) = ssh_keygen_fingerprints(ca_file)
    assert f"({fingerprint})" in hint

    before = keys(b)
    refused(
        cli(b, "ca", "init", "--passphrase-stdin", stdin=PASS),
        "already holds a user CA",
        "`bastion ca rotate`",
    )
    assert keys(b) == before  # nothing was added

    doc = public_json(b)
    assert doc["signing"] == "bastion-ca-1"
    (ca,) = doc["authorities"]  # type: ignore[misc]
    assert (ca["label"], ca["fingerprint"]) == ("bastion-ca-1", fingerprint)
    text = ok(cli(b, "ca", "public")).stdout.rstrip("\n")
    assert text == doc["sshd_config"]
    check_ca_file(tmp_path, text, [ca])
    assert "rotation is under way" not in text  # one CA: no overlap to explain

    # The CA is a vault key under a reserved label: listed, never in `bastion key`'s reach.
    listed = ok(cli(b, "key", "list")).stdout
    assert f"bastion-ca-1\tssh-ed25519\t{fingerprint}\n" in listed
    refused(
        cli(b, "key", "remove", "bastion-ca-1", "--passphrase-stdin", stdin=PASS),
        "'bastion-' are bastion's own",
    )
    refused(
        cli(b, "key", "generate", "bastion-ca-2", "--passphrase-stdin", stdin=PASS),
        "'bastion-' are bastion's own",
    )
    assert keys(b) == before
    assert public_json(b) == doc


def test_init_rotate_retire_through_the_running_gateway(bastion: Bastion, tmp_path: Path) -> None:
    """No passphrase is given and there is no terminal: only the gateway can have done it.
    Rotation lists both CAs, oldest first, the newest signing; the signing CA cannot be
    retired; the old one is retired by fingerprint and the file lists one again."""
    b = bastion
    epoch = b.op("status")["vault_epoch"]
    refused(cli(b, "ca", "public"), "no user CA", "`bastion ca init`")
    first = ok(cli(b, "ca", "init")).stdout.splitlines()[0]
    assert first.startswith("ssh-ed25519 ")
    assert "bastion-ca-1" in {k["label"] for k in b.op("key_list")}  # the gateway's vault

    r = ok(cli(b, "ca", "rotate", "--type", "ecdsa"))
    second, hint = r.stdout.splitlines()
    assert second.startswith("ecdsa-sha2-nistp256 ") and hint.startswith("# bastion-ca-2 (")
    assert "signs from now on" in hint and "`bastion ca retire bastion-ca-1`" in hint, hint

    doc = public_json(b)
    cas = doc["authorities"]
    assert [c["label"] for c in cas] == ["bastion-ca-1", "bastion-ca-2"]  # type: ignore[union-attr]
    assert doc["signing"] == "bastion-ca-2"
    assert (
        [c["public_key"].split()[:2] for c in cas]
        == [  # type: ignore[union-attr]
            first.split()[:2],
            second.split()[:2],
        ]
    )
    text = ok(cli(b, "ca", "public")).stdout.rstrip("\n")
    check_ca_file(tmp_path, text, cas)  # type: ignore[arg-type]
    assert "rotation is under way" in text

    before = digest(b)
    refused(cli(b, "ca", "retire", "bastion-ca-2"), "signs now", "`bastion ca rotate` first")
    refused(cli(b, "ca", "retire", "bastion-ca-9"), "no user CA 'bastion-ca-9'")
    assert digest(b) == before

    old = cas[0]  # type: ignore[index]
    r = ok(cli(b, "ca", "retire", old["fingerprint"]))
    assert r.stdout.startswith(f"retired bastion-ca-1 ({old['fingerprint']}); "), r.stdout
    after = public_json(b)
    assert [c["label"] for c in after["authorities"]] == ["bastion-ca-2"]  # type: ignore[union-attr]
    check_ca_file(tmp_path, str(after["sshd_config"]), after["authorities"])  # type: ignore[arg-type]
    assert b.op("status")["vault_epoch"] == epoch  # no unlock or lock happened on the way

    # Still out of `bastion key`'s reach through the gateway, and no output shows a secret.
    before = digest(b)
    refused(cli(b, "key", "remove", "bastion-ca-2"), "'bastion-' are bastion's own")
    refused(cli(b, "key", "generate", "bastion-ca-3"), "'bastion-' are bastion's own")
    assert digest(b) == before
    shown = "".join(
        ok(cli(b, *args)).stdout
        for args in (("key", "list"), ("key", "list", "--json"), ("key", "public", "bastion-ca-2"))
    ) + json.dumps(after)
    b.stop_daemon()
    for needle in private_needles(b, "bastion-ca-2"):
        assert needle not in shown.encode()
        assert needle not in b.log.read_bytes()


def test_retire_completes_only_the_older_cas(bastion: Bastion) -> None:
    if not (BIN / "bastion").exists():
        pytest.skip(f"no `bastion` entry point in {BIN} (pip install -e .)")
    b = bastion
    ok(cli(b, "ca", "init"))
    ok(cli(b, "ca", "rotate"))

    def offered(*words: str) -> list[str]:
        line = ["bastion", "--home", str(b.home.root), *words]
        env = {
            **os.environ,
            "_BASTION_COMPLETE": "bash_complete",
            "COMP_WORDS": " ".join([*line, ""]),
            "COMP_CWORD": str(len(line)),
        }
        r = subprocess.run(
            [str(BIN / "bastion")], env=env, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0 and r.stderr == "", r.stderr
        return [w.partition(",")[2] for w in r.stdout.splitlines()]

    assert offered("ca", "retire") == ["bastion-ca-1"]  # not the signing bastion-ca-2
    assert "bastion-ca-1" not in offered("key", "remove")  # bastion's own label
    b.stop_daemon()
    assert offered("ca", "retire") == ["bastion-ca-1"]  # from the vault file, no passphrase


def test_openbao_token_is_sealed_and_never_shown(bastion: Bastion) -> None:
    """Through the gateway: the token goes in on stdin, comes back only from the vault
    with the passphrase, and is in no output, no file in plaintext and no argv."""
    b = bastion
    proc = subprocess.Popen(
        cli_argv(b.home.root, "ca", "openbao-login"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:  # argv is fixed at exec: read it (and the environment) while the CLI waits
        argv_file = Path(f"/proc/{proc.pid}/cmdline")
        wait_for(lambda: b"openbao-login" in argv_file.read_bytes())  # exec'd by now
        cmdline = argv_file.read_bytes()
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        out, err = proc.communicate(TOKEN.encode() + b"\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    assert out == b"sealed the OpenBao token in the vault (secret bastion-openbao)\n"
    assert b"openbao-login" in cmdline  # the right process was read
    assert b.daemon is not None
    gateway_argv = Path(f"/proc/{b.daemon.pid}/cmdline").read_bytes()
    for shown in (out, err, cmdline, environ, gateway_argv):
        assert TOKEN.encode() not in shown

    # Empty stdin: refused, the sealed token untouched.
    before = digest(b)
    refused(cli(b, "ca", "openbao-login", stdin=""), "no OpenBao token", "nothing was stored")
    refused(
        cli(b, "ca", "openbao-login", stdin="two words\n"),
        "the token must be one word of printable characters",
        "nothing was stored",
    )
    assert digest(b) == before

    b.stop_daemon()
    assert sealed_login(b) == {"token": TOKEN}
    assert Vault.open(b.home.vault).secret_labels() == [OPENBAO]
    # Nowhere in plaintext: not the vault file, the journal, the gateway's log, run/...
    assert files_holding(b.root, TOKEN.encode()) == []


def test_openbao_approle_offline_replaces_the_login(bastion: Bastion) -> None:
    b = bastion
    b.stop_daemon()
    r = ok(
        cli(
            b,
            "ca",
            "openbao-login",
            "--approle",
            "bastion-role",
            "--passphrase-stdin",
            stdin=f"{PASSPHRASE}\n{SECRET_ID}\n",
        )
    )
    assert r.stdout == (
        "sealed the OpenBao AppRole bastion-role and its secret id in the vault "
        "(secret bastion-openbao)\n"
    )
    assert sealed_login(b) == {"role_id": "bastion-role", "secret_id": SECRET_ID}
    ok(cli(b, "ca", "openbao-login", "--passphrase-stdin", stdin=f"{PASSPHRASE}\n{TOKEN}\n"))
    assert sealed_login(b) == {"token": TOKEN}  # one login at a time: replaced
    # A wrong passphrase stores nothing and says so in one line.
    before = digest(b)
    refused(
        cli(b, "ca", "openbao-login", "--passphrase-stdin", stdin=f"wrong\n{SECRET_ID}\n"),
        "wrong passphrase",
    )
    assert digest(b) == before
    for needle in (TOKEN.encode(), SECRET_ID.encode()):
        assert files_holding(b.root, needle) == []


def test_openbao_token_prompt_on_a_terminal_does_not_echo(bastion: Bastion) -> None:
    b = bastion
    term = Terminal(cli_argv(b.home.root, "ca", "openbao-login"))
    try:
        term.expect("OpenBao token: ")
        term.type(TOKEN + "\n")
        term.expect("sealed the OpenBao token in the vault")
        assert term.proc.wait(20) == 0
    finally:
        term.close()
    assert TOKEN.encode() not in term.raw  # getpass: nothing typed was echoed
    b.stop_daemon()
    assert sealed_login(b) == {"token": TOKEN}


def test_doctor_fails_certificate_accounts_without_a_ca(bastion: Bastion) -> None:
    """`bastion doctor`: a policy asking for certificates and a vault with no CA is a
    failed policy check naming the account and `bastion ca init` -- unless bastion.toml
    has OpenBao sign; once the CA exists, the policy check passes."""
    b = bastion
    b.stop_daemon()
    b.write_policy(
        policy_toml(b.sshd)
        + '\n[[hosts.web1.accounts]]\nuser = "certuser"\nauth = "certificate"\n'
        + 'source_address = ["127.0.0.1"]\n'
    )

    def policy_check() -> dict[str, str]:
        r = cli(b, "doctor", "--json", "--timeout", "5")
        assert "Traceback" not in r.stderr, r.stderr
        return {c["name"]: c for c in json.loads(r.stdout)["checks"]}["policy"]

    write_bastion_toml(
        b, '[ca]\nbackend = "openbao"\naddress = "https://127.0.0.1:1"\nrole = "bastion"\n'
    )
    assert policy_check()["status"] == "ok"  # OpenBao's CA signs: none needed in the vault
    b.home.config.unlink()

    failed = policy_check()
    assert failed["status"] == "fail", failed
    assert failed["detail"] == 'certuser@web1: auth = "certificate", no CA in the vault'
    assert failed["fix"].startswith("`bastion ca init`"), failed
    human = cli(b, "doctor")
    assert human.returncode == 1
    assert '✗ policy         certuser@web1: auth = "certificate"' in human.stdout, human.stdout
    assert "-- fix: `bastion ca init`, then install `bastion ca public`" in human.stdout

    ok(cli(b, "ca", "init", "--passphrase-stdin", stdin=PASS))
    assert policy_check()["status"] == "ok"
