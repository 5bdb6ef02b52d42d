"""Policy parsing, file safety, matching, entry digests and the reloading store."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from bastion import policy_files as policy_mod
from bastion.core.policy import (
    Account,
    ApprovalMode,
    Policy,
    PolicyError,
    ShellMode,
    _account_doc,
    check_command,
    entry_digest,
    host_key_fingerprint,
    is_preapproved,
    needs_command_card,
    parse_policy_text,
    preapproval,
)
from bastion.data import EXAMPLE_POLICY
from bastion.policy_files import PolicyStore, load_policy_dir

KEY1 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGTn3rMnQ4caK5KXXDWfLOi0KRSSxWda2/bv8ow7cg06 root@web1"
KEY2 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID/S3ghEp/P2hE0Hj28lsUaWTDSfIg4C/2VA1mNVQ4MM"
FP1 = "SHA256:bhfQdHUaZKgLtjf0k3vpIq8VoLkzU/z1Sa9MldJ5Tbw"  # ssh-keygen -lf of KEY1

WEB1 = f"""
[hosts.web1]
address = "10.0.0.5"
host_key = "{KEY1}"

[[hosts.web1.accounts]]
user = "deploy"
credential = "deploy-key"
approval = "per-command"
allow = ["systemctl status *", "journalctl -u *"]
deny = ["*rm -rf*"]
preapproved = ["systemctl status *"]
"""

DB1 = f"""
[hosts.db1]
address = "db1.internal"
port = 2222
host_key = "{KEY2}"
connect_timeout = 2.5

[[hosts.db1.accounts]]
user = "postgres"
credential = "db-key"
"""


def write(directory: Path, name: str, text: str, mode: int = 0o600) -> Path:
    path = directory / name
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.fixture
def pdir(tmp_path: Path) -> Path:
    d = tmp_path / "policies"
    d.mkdir(mode=0o700)
    d.chmod(0o700)
    return d


def age(path: Path, seconds: int = 3600) -> None:
    """Move mtime out of the store's racy window, as for a file written long ago."""
    ns = time.time_ns() - seconds * 1_000_000_000
    os.utime(path, ns=(ns, ns))


def one_error(text: str, source: str = "policies/prod.toml") -> str:
    with pytest.raises(PolicyError) as info:
        parse_policy_text(text, source)
    return str(info.value)


# --- loading -------------------------------------------------------------------------------


def test_valid_policy_loads(pdir: Path) -> None:
    write(pdir, "a.toml", WEB1)
    write(pdir, "b.toml", DB1)
    write(pdir, "notes.txt", "ignored: not *.toml")
    pol = load_policy_dir(pdir)
    assert pol.files == (str(pdir / "a.toml"), str(pdir / "b.toml"))
    web1, db1 = pol.host("web1"), pol.host("db1")
    assert web1 is not None and db1 is not None
    assert (web1.address, web1.port, web1.connect_timeout) == ("10.0.0.5", 22, 10.0)
    assert (db1.port, db1.connect_timeout, db1.source) == (2222, 2.5, str(pdir / "b.toml"))
    deploy = web1.account("deploy")
    assert deploy is not None and web1.account("root") is None
    assert deploy.approval is ApprovalMode.PER_COMMAND
    assert deploy.allow is not None
    assert [r.text for r in deploy.allow] == ["systemctl status *", "journalctl -u *"]
    assert [r.text for r in deploy.deny] == ["*rm -rf*"] and deploy.label == "deploy@web1"
    assert deploy.shell is ShellMode.DENY  # an allow list admits plain commands only
    pg = db1.accounts[0]
    assert (pg.approval, pg.allow, pg.deny, pg.preapproved) == (ApprovalMode.SESSION, None, (), ())
    assert (pg.shell, pg.login_shell) == (ShellMode.ALLOW, "posix")
    assert pol.host("WEB1") is web1  # OpenSSH lowercases %h; lookup tolerates case
    assert pol.host("nope") is None
    assert len(pol.digest) == 64
    with pytest.raises(TypeError):
        pol.hosts["x"] = web1  # type: ignore[index]
    assert host_key_fingerprint(web1.host_key) == FP1


def test_shipped_example_is_valid(pdir: Path) -> None:
    # Copied (not edited) so a checkout's umask cannot make the file look unsafe.
    write(pdir, "example.toml", EXAMPLE_POLICY.read_text())
    pol = load_policy_dir(pdir)
    assert pol.hosts and all(h.accounts for h in pol.hosts.values())


def test_empty_dir_is_empty_policy(pdir: Path) -> None:
    pol = load_policy_dir(pdir)
    assert dict(pol.hosts) == {} and pol.files == ()
    write(pdir, "empty.toml", "# nothing yet\n")
    assert dict(load_policy_dir(pdir).hosts) == {}


def test_missing_dir_says_how_to_create(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"does not exist.*mkdir -p -m 700 .*nope"):
        load_policy_dir(tmp_path / "nope")


# --- validation: every message names file, host and field --------------------------------


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('credential = "deploy-key"\n', "", 'accounts[0]: missing required field "credential"'),
        ('address = "10.0.0.5"\n', "", 'hosts.web1: missing required field "address"'),
        (f'host_key = "{KEY1}"\n', "", 'hosts.web1: missing required field "host_key"'),
        ("address =", "adress =", 'hosts.web1: unknown field "adress" (did you mean "address"?)'),
        ('user = "deploy"', 'user = "deploy"\nalow = []', 'accounts[0]: unknown field "alow"'),
        ('address = "10.0.0.5"', "address = 10", 'hosts.web1: field "address"'),
        ('address = "10.0.0.5"', 'address = "10.0.0.5"\nport = "22"', 'hosts.web1: field "port"'),
        ('address = "10.0.0.5"', 'address = "10.0.0.5"\nport = 70000', 'hosts.web1: field "port"'),
        ('address = "10.0.0.5"', 'address = "10.0.0.5"\nport = true', 'hosts.web1: field "port"'),
        ('address = "10.0.0.5"', 'address = "1"\nconnect_timeout = 0', 'field "connect_timeout"'),
        ('address = "10.0.0.5"', 'address = "1"\nconnect_timeout = inf', 'field "connect_timeout"'),
        (KEY1, "ssh-ed25519 AAAAnotakey", 'hosts.web1: field "host_key" is not a valid'),
        (KEY1, f"web1 {KEY1}", 'hosts.web1: field "host_key"'),
        ('approval = "per-command"', 'approval = "always"', 'accounts[0]: field "approval" must'),
        ('credential = "deploy-key"', 'credential = "../etc"', 'accounts[0]: field "credential"'),
        ('user = "deploy"', 'user = "de ploy"', 'accounts[0]: field "user"'),
        ('user = "deploy"', "user = 7", 'accounts[0]: field "user"'),
        ('deny = ["*rm -rf*"]', 'deny = "*rm -rf*"', 'accounts[0]: field "deny" must be a list'),
        ('deny = ["*rm -rf*"]', 'deny = ["*rm -rf*", 3]', 'accounts[0]: field "deny"[1]'),
        ("[hosts.web1]", "[hosts.web1]\n[hosts.web1.x]", 'hosts.web1: unknown field "x"'),
        ("[hosts.web1]", '[hosts."-bad"]\n[hosts.web1]', 'hosts."-bad": host alias must match'),
        ("[hosts.web1]", "[host.x]\n[hosts.web1]", 'prod.toml: unknown field "host"'),
    ],
)
def test_validation_errors_name_file_host_field(old: str, new: str, expected: str) -> None:
    assert old in WEB1
    message = one_error(WEB1.replace(old, new, 1))
    assert message.startswith("policies/prod.toml: ")
    assert expected in message


def test_multiline_or_private_host_key_refused() -> None:
    # import_public_key would accept a private key block; the one-line rule must stop it.
    text = WEB1.replace(f'"{KEY1}"', '"""\n-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n"""')
    assert 'hosts.web1: field "host_key" must be one OpenSSH public key line' in one_error(text)


def test_duplicate_user_and_accountless_host() -> None:
    dup = WEB1 + '\n[[hosts.web1.accounts]]\nuser = "deploy"\ncredential = "other"\n'
    assert 'hosts.web1.accounts[1]: duplicate "user" "deploy"' in one_error(dup)
    bare = f'[hosts.web1]\naddress = "a"\nhost_key = "{KEY1}"\n'
    assert 'policies/prod.toml: hosts.web1: field "accounts"' in one_error(bare)
    assert 'field "accounts"' in one_error(bare + "accounts = []\n")
    twin = WEB1 + WEB1.replace("hosts.web1", "hosts.Web1")
    assert "hosts.Web1: alias differs from another only by case" in one_error(twin)


def test_invalid_toml_names_file() -> None:
    assert one_error("[hosts.web1\n").startswith("policies/prod.toml: invalid TOML")


def test_duplicate_host_across_files(pdir: Path) -> None:
    write(pdir, "a.toml", WEB1)
    write(
        pdir,
        "b.toml",
        DB1
        + WEB1.replace("[hosts.web1]", "[hosts.WEB1]", 1).replace(
            "hosts.web1.accounts", "hosts.WEB1.accounts"
        ),
    )
    with pytest.raises(PolicyError) as info:
        load_policy_dir(pdir)
    assert str(info.value) == (
        f"{pdir / 'b.toml'}: hosts.WEB1: host alias already defined in {pdir / 'a.toml'}"
    )


# --- file safety ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_writable_file_refused(pdir: Path, mode: int) -> None:
    write(pdir, "a.toml", WEB1, mode=mode)
    with pytest.raises(PolicyError, match=r"a\.toml: refusing policy file writable by group"):
        load_policy_dir(pdir)


def test_writable_dir_refused(pdir: Path) -> None:
    write(pdir, "a.toml", WEB1)
    pdir.chmod(0o770)
    with pytest.raises(PolicyError, match="refusing policy directory writable"):
        load_policy_dir(pdir)


def test_symlink_target_checked(pdir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    target = write(elsewhere, "real.toml", WEB1)
    (pdir / "link.toml").symlink_to(target)
    assert load_policy_dir(pdir).host("web1") is not None
    target.chmod(0o664)
    with pytest.raises(PolicyError, match="writable by group"):
        load_policy_dir(pdir)
    target.chmod(0o600)
    elsewhere.chmod(0o777)
    with pytest.raises(PolicyError, match="refusing directory of policy file"):
        load_policy_dir(pdir)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_foreign_owner_refused(pdir: Path) -> None:
    os.chown(write(pdir, "a.toml", WEB1), 12345, -1)
    with pytest.raises(PolicyError, match="owned by uid 12345"):
        load_policy_dir(pdir)


def test_fifo_does_not_hang(pdir: Path) -> None:
    os.mkfifo(pdir / "pipe.toml", 0o600)
    with pytest.raises(PolicyError, match="not a regular file"):
        load_policy_dir(pdir)


# --- matching ------------------------------------------------------------------------------


def deploy() -> Account:
    account = parse_policy_text(WEB1, "x.toml")["web1"].account("deploy")
    assert account is not None
    return account


def test_deny_wins_over_allow() -> None:
    check = check_command(deploy(), "systemctl status x; rm -rf /")
    assert (check.allowed, check.rule) == (False, "*rm -rf*")
    assert check.reason == 'command matches deny rule "*rm -rf*" for deploy@web1'


def test_allow_present_and_no_match_denied() -> None:
    check = check_command(deploy(), "cat /etc/shadow")
    assert (check.allowed, check.rule) == (False, None)
    assert check.reason.startswith("command matches no allow rule for deploy@web1")
    assert check.reason.endswith('allowed: "systemctl status *", "journalctl -u *"')
    ok = check_command(deploy(), "journalctl -u nginx")
    assert (ok.allowed, ok.rule) == (True, "journalctl -u *")


def test_no_allow_list_allows_all_not_denied() -> None:
    pg = parse_policy_text(DB1.replace('"db-key"', '"db-key"\ndeny = ["*drop*"]'), "x")["db1"]
    account = pg.accounts[0]
    assert check_command(account, "psql -c 'select 1'").allowed
    assert check_command(account, "psql -c 'select 1'").rule is None
    assert not check_command(account, "dropdb prod").allowed


def test_empty_allow_allows_nothing() -> None:
    account = parse_policy_text(DB1.replace('"db-key"', '"db-key"\nallow = []'), "x")["db1"]
    check = check_command(account.accounts[0], "true")
    assert not check.allowed and "allows no commands" in check.reason


def test_rules_match_whole_words_of_the_argv() -> None:
    account = deploy()
    assert check_command(account, "systemctl status nginx").allowed
    assert check_command(account, "  systemctl  status 'nginx'").allowed  # the same argv
    assert check_command(account, "systemctl status /a/b").allowed  # * spans / in a word
    assert not check_command(account, "systemctl status nginx --no-pager").allowed  # a word more
    assert not check_command(account, "systemctl status").allowed  # a word less
    assert not check_command(account, "SYSTEMCTL STATUS nginx").allowed  # case-sensitive
    shell = check_command(account, "systemctl status x; id")
    assert not shell.allowed and "';' at byte 18 (command separator)" in shell.reason


def test_preapproved() -> None:
    account = deploy()
    assert is_preapproved(account, "systemctl status nginx")
    assert not is_preapproved(account, "journalctl -u nginx")
    assert not is_preapproved(account, "systemctl status x; rm -rf /")  # deny still wins


# --- entry digest --------------------------------------------------------------------------


def digest_of(text: str, alias: str = "web1", user: str = "deploy") -> str:
    host = {**parse_policy_text(text, "x.toml")}[alias]
    account = host.account(user)
    assert account is not None
    return entry_digest(host, account)


def test_entry_digest_tracks_only_its_entry() -> None:
    base = digest_of(WEB1 + DB1)
    assert base == digest_of(WEB1 + DB1)
    assert base == digest_of(WEB1 + DB1.replace("2222", "2223"))  # another host changed
    assert base == digest_of(DB1 + WEB1)  # order and source do not matter
    other_account = WEB1 + '\n[[hosts.web1.accounts]]\nuser = "ro"\ncredential = "ro-key"\n'
    assert base == digest_of(other_account)  # another account on the same host
    for old, new in [
        ("10.0.0.5", "10.0.0.6"),
        ('address = "10.0.0.5"', 'address = "10.0.0.5"\nport = 2200'),
        ('address = "10.0.0.5"', 'address = "10.0.0.5"\nconnect_timeout = 11'),
        (KEY1, KEY2),
        ('"deploy-key"', '"other-key"'),
        ('"per-command"', '"session"'),
        ('"journalctl -u *"', '"journalctl *"'),
        ('deny = ["*rm -rf*"]', "deny = []"),
        ('preapproved = ["systemctl status *"]', ""),
    ]:
        assert old in WEB1
        assert digest_of(WEB1.replace(old, new) + DB1) != base, (old, new)
    no_allow = WEB1.replace('allow = ["systemctl status *", "journalctl -u *"]', "")
    assert digest_of(no_allow) != digest_of(no_allow.replace("deny =", "allow = []\ndeny ="))


def test_policy_digest_changes_with_any_file(pdir: Path) -> None:
    write(pdir, "a.toml", WEB1)
    before = load_policy_dir(pdir).digest
    assert load_policy_dir(pdir).digest == before
    write(pdir, "b.toml", DB1)
    assert load_policy_dir(pdir).digest != before


# --- PolicyStore ---------------------------------------------------------------------------


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = policy_mod.load_policy_dir

    def spy(directory: Path, shown: Path | None = None) -> Policy:
        calls.append(directory)
        return real(directory, shown)

    monkeypatch.setattr(policy_mod, "load_policy_dir", spy)
    return calls


def test_store_caches_when_unchanged(pdir: Path, loads: list[Path]) -> None:
    age(write(pdir, "a.toml", WEB1))
    age(pdir)
    store = PolicyStore(pdir)
    first = store.current()
    assert isinstance(first, Policy)
    assert store.current() is first and store.current() is first
    assert len(loads) == 1


def test_store_does_not_trust_fresh_files(pdir: Path, loads: list[Path]) -> None:
    write(pdir, "a.toml", WEB1)  # mtime is "now": an edit in the same tick would be invisible
    store = PolicyStore(pdir)
    store.current()
    store.current()
    assert len(loads) == 2


def test_store_picks_up_same_size_edit(pdir: Path, loads: list[Path]) -> None:
    path = write(pdir, "a.toml", WEB1)
    age(path, 7200)
    age(pdir)
    store = PolicyStore(pdir)
    first = store.current()
    assert isinstance(first, Policy)
    assert first.host("web1").address == "10.0.0.5"  # type: ignore[union-attr]
    edited = WEB1.replace("10.0.0.5", "10.0.0.9")
    assert len(edited) == len(WEB1)
    path.write_text(edited)
    age(path, 3600)  # a different but still old mtime: no racy-window help
    second = store.current()
    assert isinstance(second, Policy)
    assert second.host("web1").address == "10.0.0.9"  # type: ignore[union-attr]
    assert second.digest != first.digest and len(loads) == 2


def test_store_new_file_and_error_then_recovery(pdir: Path, loads: list[Path]) -> None:
    age(write(pdir, "a.toml", WEB1))
    store = PolicyStore(pdir)
    assert isinstance(store.current(), Policy)
    bad = write(pdir, "b.toml", DB1.replace("address", "adress"))
    age(bad)
    age(pdir)
    err = store.current()
    assert isinstance(err, PolicyError) and 'hosts.db1: unknown field "adress"' in str(err)
    assert store.current() is err  # a cached error stays until files change
    calls = len(loads)
    bad.write_text(DB1)
    age(bad, 60)
    fixed = store.current()
    assert isinstance(fixed, Policy) and fixed.host("db1") is not None
    assert len(loads) == calls + 1


def test_store_reacts_to_chmod_and_missing_dir(tmp_path: Path) -> None:
    pdir = tmp_path / "p"
    store = PolicyStore(pdir)
    assert "does not exist" in str(store.current())
    pdir.mkdir(mode=0o700)
    path = write(pdir, "a.toml", WEB1)
    assert isinstance(store.current(), Policy)
    path.chmod(0o666)
    assert isinstance(store.current(), PolicyError)


# --- shell source and the account's shell mode ---------------------------------------------


def account_of(extra: str, approval: str = "session", allow: str | None = None) -> Account:
    lines = [
        '[hosts.h]\naddress = "a"',
        f'host_key = "{KEY1}"',
        "[[hosts.h.accounts]]",
        'user = "u"\ncredential = "k"',
        f'approval = "{approval}"',
    ]
    if allow is not None:
        lines.append(f"allow = {allow}")
    account = parse_policy_text("\n".join([*lines, extra]) + "\n", "x.toml")["h"].accounts[0]
    return account


@pytest.mark.parametrize(
    "approval,allow,default,refused",
    [
        ("session", None, ShellMode.ALLOW, []),
        ("per-command", None, ShellMode.CARD, ["allow"]),
        ("session", '["ls"]', ShellMode.DENY, ["card", "allow"]),
        ("per-command", '["ls"]', ShellMode.DENY, ["card", "allow"]),
    ],
)
def test_shell_mode_defaults_are_safe_and_contradictions_refused(
    approval: str, allow: str | None, default: ShellMode, refused: list[str]
) -> None:
    assert account_of("", approval, allow).shell is default
    for value in refused:
        with pytest.raises(PolicyError, match='field "shell" cannot be'):
            account_of(f'shell = "{value}"', approval, allow)
    with pytest.raises(PolicyError, match='field "shell" must be one of'):
        account_of('shell = "maybe"', approval, allow)


def test_shell_source_per_mode() -> None:
    source = "ls | head"
    refused = check_command(account_of('shell = "deny"'), source)
    assert not refused.allowed and "'|' at byte 3 (pipe or or-list)" in refused.reason
    carded = account_of('shell = "card"')
    check = check_command(carded, source)
    assert check.allowed and needs_command_card(carded, check)
    assert not needs_command_card(carded, check_command(carded, "ls -l"))
    allowed = account_of("")
    assert not needs_command_card(allowed, check_command(allowed, source))
    per_command = account_of('preapproved = ["ls -l ..."]', "per-command")
    assert needs_command_card(per_command, check_command(per_command, source))
    assert preapproval(per_command, check_command(per_command, "ls -l")) == "ls -l ..."
    assert preapproval(per_command, check_command(per_command, "ls -l | head")) is None


def test_deny_matches_the_string_and_the_argv() -> None:
    account = account_of('deny = ["*rm -rf*", "rm ..."]')
    assert not check_command(account, "echo x; rm -rf /").allowed  # the string
    assert not check_command(account, "r''m -r -f /tmp/x").allowed  # the argv
    assert check_command(account, "echo rm").allowed


# --- options: admitted only where spelled; deny keeps catching them -------------------------


def test_allow_and_preapproved_admit_an_option_only_where_spelled() -> None:
    account = account_of(
        'preapproved = ["journalctl -u * ...", "journalctl -u * --since *"]',
        "per-command",
        allow='["journalctl -u * ...", "journalctl -u * --since *", "git log -* ..."]',
    )
    assert preapproval(account, check_command(account, "journalctl -u app")) is not None
    spelled = check_command(account, "journalctl -u app --since today")
    assert spelled.rule == "journalctl -u * --since *"
    assert preapproval(account, spelled) == "journalctl -u * --since *"
    assert check_command(account, "git log --oneline").rule == "git log -* ..."
    refused = check_command(account, "journalctl -u app --vacuum-time=1s")
    assert not refused.allowed
    assert [(u.rule, u.word, u.pattern) for u in refused.unspelled] == [
        ("journalctl -u * ...", "--vacuum-time=1s", "..."),
    ]
    assert "'--vacuum-time=1s' (word 4) is an option" in refused.reason
    assert refused.reason.count("allowed: ") == 1


def test_a_deny_rule_keeps_matching_options() -> None:
    account = account_of('deny = ["rm * ...", "systemctl * --host=*"]')
    for command in ("rm -rf /", "rm -- -x", "systemctl status --host=a x"):
        check = check_command(account, command)
        assert not check.allowed and check.rule is not None and "deny rule" in check.reason
    assert check_command(account, "ls -la").allowed


@pytest.mark.parametrize("shell", ["fish", "csh", "tcsh", "nu", "powershell"])
def test_a_login_shell_that_is_not_posix_is_refused(shell: str) -> None:
    with pytest.raises(PolicyError, match="not POSIX-compatible"):
        account_of(f'login_shell = "{shell}"')
    assert account_of('login_shell = "zsh"').login_shell == "zsh"


def test_a_rule_with_shell_syntax_is_a_policy_error_naming_the_field() -> None:
    with pytest.raises(PolicyError, match=r'field "allow"\[1\]: rule .*uses shell syntax'):
        account_of("", allow='["ls", "systemctl status *; *"]')


def test_pty_is_off_by_default_and_only_a_pty_account_digests_it() -> None:
    """An account that never said `pty` keeps the entry digest it had (its session
    approvals survive the upgrade); `pty = true` is a different entry."""
    plain, off, on = account_of(""), account_of("pty = false"), account_of("pty = true")
    assert (plain.pty, off.pty, on.pty) == (False, False, True)
    assert "pty" not in _account_doc(plain) and "pty" not in _account_doc(off)
    assert _account_doc(on)["pty"] is True
    host = parse_policy_text(
        f'[hosts.h]\naddress = "a"\nhost_key = "{KEY1}"\n'
        '[[hosts.h.accounts]]\nuser = "u"\ncredential = "k"\napproval = "session"\n',
        "x.toml",
    )["h"]
    assert entry_digest(host, plain) == entry_digest(host, off) != entry_digest(host, on)
    with pytest.raises(PolicyError, match='field "pty" must be true or false'):
        account_of('pty = "yes"')


# --- builtins that run shell code (issue 32, item 3) ----------------------------------------


@pytest.mark.parametrize(
    "command", ["trap 'touch a; touch b' EXIT", ". ./f", "'source' f", "fc -e vi"]
)
def test_a_plain_only_account_refuses_a_code_builtin_and_says_what_to_send(command: str) -> None:
    check = check_command(account_of('shell = "deny"'), command)
    assert not check.allowed and check.reading.argv is None
    first = check.reading.constructs[0]
    assert first.offset == 0 and first.what.startswith("a builtin that ")
    assert f"{first.text!r} makes a command shell source however plain its words are" in (
        check.reason
    )
    assert "Send the program it would run" in check.reason
    assert check_command(account_of('shell = "allow"'), command).allowed  # the control


def test_other_shell_source_keeps_the_plain_advice() -> None:
    check = check_command(account_of('shell = "deny"'), "ls; id")
    assert check.reason.endswith("without ; | & $ ` < > or newlines")


@pytest.mark.parametrize(
    "rule", ["trap *", "source ...", ". *", "eval ...", "exec ls", "time make"]
)
@pytest.mark.parametrize("field", ["allow", "preapproved"])
def test_an_admitting_rule_that_begins_with_shell_source_is_refused(rule: str, field: str) -> None:
    approval = "per-command" if field == "preapproved" else "session"
    extra = f"{field} = {json.dumps([rule])}"
    with pytest.raises(PolicyError) as info:
        account_of(extra, approval=approval)
    message = str(info.value)
    assert f"rule {rule!r} could never match" in message, message
    assert "shell source, which an allow or preapproved rule never admits" in message
    assert "Write a rule for the program it would run instead" in message


def test_a_deny_rule_may_name_a_code_builtin() -> None:
    account = account_of('deny = ["trap *"]')  # a guardrail: one glob over the text
    assert not check_command(account, "trap x EXIT").allowed
    assert check_command(account, "true").allowed
