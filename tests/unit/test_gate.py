"""The gate as a pure function, over its whole state space."""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import replace

import pytest

from bastion.core.binding import Binding
from bastion.core.contract import Code, Refusal
from bastion.core.defaults import MAX_HELD_BYTES_PER_TENANT, MAX_PENDING_CARDS_PER_TENANT
from bastion.core.files import FileKind, FileOp
from bastion.core.gate import (
    MAX_COMMAND_BYTES,
    AskCommand,
    AskSession,
    CardEnding,
    CardKind,
    Channel,
    CommandGrant,
    Dispatch,
    EndReason,
    Request,
    Session,
    World,
    after_wait,
    assess,
    evaluate,
    final_check,
    gateway_failed,
    no_slot,
    not_durable,
    rounds_exhausted,
    unanswered,
    unwitnessed,
    validate_command,
)
from bastion.core.grants import BoundedGrant, Pattern
from bastion.core.policy import (
    Policy,
    PolicyError,
    entry_digest,
    host_key_fingerprint,
    parse_policy_text,
)
from bastion.core.stdin import Stdin, StdinEnd
from bastion.core.subject import SubjectKey
from bastion.core.terminal import Terminal

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKwqVd3vMikqXGyJKL6mRiDHH8Ym3yLu2zkTPeUe2xx0"
POLICY_TEXT = f"""
[hosts.web1]
address = "10.0.0.5"
host_key = "{KEY}"

[[hosts.web1.accounts]]
user = "deploy"
credential = "deploy-key"
approval = "session"
deny = ["*rm -rf*"]
allow = ["echo *", "systemctl status *"]

[[hosts.web1.accounts]]
user = "ops"
credential = "ops-key"
approval = "per-command"
preapproved = ["uptime"]

[[hosts.web1.accounts]]
user = "tty"
credential = "tty-key"
approval = "per-command"
pty = true

[[hosts.web1.accounts]]
user = "cert"
auth = "certificate"
source_address = ["10.0.0.1"]
deny = ["*rm -rf*"]

[[hosts.web1.accounts]]
user = "files"
credential = "files-key"
approval = "per-command"
files = {{ read = ["/var/log/**"], write = ["/srv/app/**"] }}

[[hosts.web1.accounts]]
user = "gr"
credential = "gr-key"
approval = "per-command"
deny = ["* halt*"]
grants = true
pty = true
"""
HOSTS = parse_policy_text(POLICY_TEXT, "test.toml")
POLICY = Policy(hosts=HOSTS, digest="d", files=("test.toml",))
SUBJECT = SubjectKey(100, 1.5, "nonce", "image", "exe-sha256")
BOOT, EPOCH, NOW = "boot_a", 7, 1000.0
TERMINAL = Terminal(b"xterm-256color", 80, 24, 0, 0, bytes([53, 0, 0, 0, 1, 0]))  # ECHO on
BAD_TERMINAL = replace(TERMINAL, term_type=b"xterm\x1b]0;owned\x07")


def request(command: bytes = b"echo hi", user: str = "deploy", host: str = "web1") -> Request:
    return Request("req_1", host, user, command, SUBJECT)


def grant(user: str = "deploy", **changes: object) -> Session:
    host = HOSTS["web1"]
    account = host.account(user)
    assert account is not None
    g = Session("ses_1", SUBJECT, "web1", user, BOOT, EPOCH, entry_digest(host, account), 0.0)
    return replace(g, **changes)  # type: ignore[arg-type]


def command_grant(command: bytes, **changes: object) -> CommandGrant:
    """A grant for `command` as ops on web1; `changes` to the grant or its binding."""
    host = HOSTS["web1"]
    binding = Binding(
        host.address,
        host.port,
        host_key_fingerprint(host.host_key),
        "ops",
        "ops-key",
        hashlib.sha256(command).hexdigest(),
    )
    own = {k: changes.pop(k) for k in ("session_id", "expires_at", "used") if k in changes}
    g = CommandGrant("cmd_1", "ses_1", replace(binding, **changes), NOW + 60)  # type: ignore[arg-type]
    return replace(g, **own)  # type: ignore[arg-type]


def world(**changes: object) -> World:
    w = World(
        locked=False,
        vault_epoch=EPOCH,
        boot_id=BOOT,
        policy=POLICY,
        subject_alive=True,
        session=None,
        ended=None,
        command_grant=None,
        now=NOW,
    )
    return replace(w, **changes)  # type: ignore[arg-type]


SESSIONS = {
    "none": (None, None),
    "live": ("live", None),
    **{f"ended_{r.value}": (None, r) for r in EndReason},
    "stale_boot": ("stale", EndReason.GATEWAY_RESTARTED),
    "stale_epoch": ("stale", EndReason.VAULT_STATE_CHANGED),
    "stale_policy": ("stale", EndReason.POLICY_CHANGED),
}
COMMANDS = [
    "session_account",
    "pc_none",
    "pc_approved",
    "pc_used",
    "pc_expired",
    "pc_other_command",
    "pc_other_session",
    "pc_preapproved",
    # a bounded grant (`core/grants`) of the session, on the account "gr" (grants = true)
    "gr_match",  # covers the argv; stdin read and empty: dispatch, taking a use
    "gr_match_silent",  # the same, stdin still open but silent: no byte reaches the target
    "gr_unread",  # covers the argv, stdin not read yet: a command card's read first
    "gr_stdin_bytes",  # stdin holds bytes: a grant never covers them
    "gr_terminal",  # it asks for a terminal: never covered
    "gr_shell",  # shell source whose words match: never covered
    "gr_other_argv",  # another program's words
    "gr_longer",  # one word more: a * is one word, never any number
    "gr_used_up",
    "gr_expired",
    "gr_other_session",
    "gr_other_subject",
    "gr_other_epoch",
    "gr_other_boot",
    "gr_other_entry",
    "gr_other_host",
    "gr_other_user",
    "gr_account_off",  # the same grant, on an account without grants = true
    "gr_denied",  # matches the grant, and a deny rule: refused, never covered
]
EMPTY = Stdin.of(b"", StdinEnd.CLOSED)
GRANT_COMMANDS = {
    "gr_shell": b"systemctl restart a; id",
    "gr_other_argv": b"systemctl stop a",
    "gr_longer": b"systemctl restart a b",
    "gr_denied": b"systemctl halt a",
}


def bounded(user: str = "gr", **changes: object) -> BoundedGrant:
    """A live grant `systemctl restart *` of session ses_1, as `user` on web1."""
    host = HOSTS["web1"]
    account = host.account(user)
    assert account is not None
    g = BoundedGrant(
        id="grt_1",
        card_id="cc_1",
        session_id="ses_1",
        subject_key=SUBJECT,
        host="web1",
        user=user,
        boot_id=BOOT,
        vault_epoch=EPOCH,
        entry_digest=entry_digest(host, account),
        pattern=Pattern(("systemctl", None, None)),
        uses_left=2,
        expires_at=NOW + 600,
        made_at=NOW - 1,
    )
    return replace(g, pattern=Pattern(("systemctl", "restart", None)), **changes)  # type: ignore[arg-type]


def grant_case(command: str) -> tuple[bytes, BoundedGrant, Stdin | None, Terminal | None, str]:
    """(command, grant, stdin, terminal, user) of one `gr_` case."""
    other = {
        "gr_used_up": {"uses_left": 0},
        "gr_expired": {"expires_at": NOW},
        "gr_other_session": {"session_id": "ses_other"},
        "gr_other_subject": {"subject_key": replace(SUBJECT, exe="other")},
        "gr_other_epoch": {"vault_epoch": EPOCH - 1},
        "gr_other_boot": {"boot_id": "boot_old"},
        "gr_other_entry": {"entry_digest": "old"},
        "gr_other_host": {"host": "web2"},
        "gr_other_user": {"user": "ops"},
    }.get(command, {})
    stdin: Stdin | None = {
        "gr_unread": None,
        "gr_stdin_bytes": Stdin.of(b"x", StdinEnd.CLOSED),
        "gr_match_silent": Stdin.of(b"", StdinEnd.SILENT),
    }.get(command, EMPTY)
    user = "ops" if command == "gr_account_off" else "gr"
    g = bounded(**other) if user == "gr" else bounded(user="ops")
    terminal = TERMINAL if command == "gr_terminal" else None
    return GRANT_COMMANDS.get(command, b"systemctl restart a"), g, stdin, terminal, user


def build(locked: bool, policy_ok: bool, session: str, command: str) -> tuple[Request, World]:
    user = "deploy" if command == "session_account" else "ops"
    cmd = b"uptime" if command == "pc_preapproved" else b"echo hi"
    grants: tuple[BoundedGrant, ...] = ()
    stdin: Stdin | None = None
    terminal: Terminal | None = None
    if command.startswith("gr_"):
        cmd, g_one, stdin, terminal, user = grant_case(command)
        grants = (g_one,)
    kind, reason = SESSIONS[session]
    g: Session | None = None
    ended = reason if kind is None else None
    if kind == "live":
        g = grant(user)
    elif kind == "stale":
        field = {
            EndReason.GATEWAY_RESTARTED: {"boot_id": "boot_old"},
            EndReason.VAULT_STATE_CHANGED: {"vault_epoch": EPOCH - 2},
            EndReason.POLICY_CHANGED: {"entry_digest": "old"},
        }[reason]  # type: ignore[index]
        g = grant(user, **field)
    cg = {
        "pc_approved": command_grant(cmd),
        "pc_used": command_grant(cmd, used=True),
        "pc_expired": command_grant(cmd, expires_at=NOW - 1),
        "pc_other_command": command_grant(b"echo two"),
        "pc_other_session": command_grant(cmd, session_id="ses_other"),
    }.get(command)
    w = world(
        locked=locked,
        policy=POLICY if policy_ok else PolicyError("broken"),
        session=g,
        ended=ended,
        command_grant=cg,
        grants=grants,
    )
    return replace(request(cmd, user), stdin=stdin, terminal=terminal), w


@pytest.mark.parametrize(
    "locked,policy_ok,session,command",
    list(itertools.product([True, False], [True, False], list(SESSIONS), COMMANDS)),
)
def test_state_space(locked: bool, policy_ok: bool, session: str, command: str) -> None:
    req, w = build(locked, policy_ok, session, command)
    verdict = evaluate(req, w)
    kind, reason = SESSIONS[session]
    if locked:
        assert isinstance(verdict, Refusal) and verdict.code is Code.VAULT_LOCKED
    elif not policy_ok:
        assert isinstance(verdict, Refusal) and verdict.code is Code.POLICY_UNAVAILABLE
    elif command == "gr_denied":  # the account's rules first: a grant never widens them
        assert isinstance(verdict, Refusal) and verdict.code is Code.POLICY_DENIED
    elif kind != "live":
        assert isinstance(verdict, AskSession) and verdict.reason is reason
    elif command in ("session_account", "pc_preapproved"):
        assert isinstance(verdict, Dispatch) and verdict.command_grant is None
    elif command == "pc_approved":
        assert isinstance(verdict, Dispatch) and verdict.command_grant == w.command_grant
    elif command in ("gr_match", "gr_match_silent"):
        assert isinstance(verdict, Dispatch) and verdict.command_grant is None
        assert verdict.bounded == w.grants[0]
    else:
        assert isinstance(verdict, AskCommand) and verdict.session == w.session


def test_policy_checks_come_before_approvals() -> None:
    w = world(session=grant())
    assert evaluate(request(host="db9"), w).code is Code.UNKNOWN_HOST  # type: ignore[union-attr]
    assert evaluate(request(user="root"), w).code is Code.POLICY_DENIED  # type: ignore[union-attr]
    denied = evaluate(request(b"echo x; rm -rf /"), w)
    assert isinstance(denied, Refusal) and denied.code is Code.POLICY_DENIED
    missed = evaluate(request(b"cat /etc/shadow"), w)
    assert isinstance(missed, Refusal) and "allow" in missed.message


def test_a_dead_subject_is_never_dispatched() -> None:
    verdict = evaluate(request(), world(session=grant(), subject_alive=False))
    assert isinstance(verdict, Refusal) and verdict.code is Code.SESSION_DENIED
    assert verdict.reauth_reason is EndReason.PROCESS_CHANGED


def test_command_grant_binds_host_address_port_and_key() -> None:
    cmd = b"echo hi"
    w = world(session=grant("ops"))
    for change in (
        {"address": "10.0.0.6"},
        {"port": 2222},
        {"host_key_fingerprint": "SHA256:x"},
        {"user": "deploy"},
        {"credential": "other"},
    ):
        v = evaluate(request(cmd, "ops"), replace(w, command_grant=command_grant(cmd, **change)))
        assert isinstance(v, AskCommand), change


@pytest.mark.parametrize(
    "command,fragment",
    [
        (b"", "empty"),
        (b"   ", "empty"),
        (b"echo a\0b", "NUL"),
        (b"echo \xff", "UTF-8"),
        (b"x" * (MAX_COMMAND_BYTES + 1), "limit"),
    ],
)
def test_malformed_commands_are_refused_before_policy(command: bytes, fragment: str) -> None:
    assert fragment in (validate_command(command) or "")
    verdict = evaluate(request(command), world(policy=PolicyError("broken")))
    assert isinstance(verdict, Refusal) and verdict.code is Code.UNSUPPORTED_REQUEST


# Every refusal fact of a request and its world, in the contract's order (the gate's
# docstring, docs/architecture.md "The gate"): its code, and words only its message has.
# `refused` sets each on a request that would otherwise ask a certificate account's
# session card.
REFUSALS: list[tuple[str, Code, str]] = [
    ("locked", Code.VAULT_LOCKED, "vault is locked"),
    ("channel", Code.UNSUPPORTED_REQUEST, ""),  # the words: CHANNEL_WORDS
    ("bad_terminal", Code.UNSUPPORTED_REQUEST, "terminal that cannot be made as asked"),
    ("ssh_user", Code.UNSUPPORTED_REQUEST, "does not match the user"),
    ("shared_connection", Code.UNSUPPORTED_REQUEST, "This ssh connection can be shared"),
    ("bad_command", Code.UNSUPPORTED_REQUEST, "NUL byte"),
    ("stdin_too_large", Code.UNSUPPORTED_REQUEST, "file transfer through bastion"),
    ("not_journaled", Code.INTERNAL, "could not write this request to its journal (disk"),
    ("records_lost", Code.INTERNAL, "could not journal every record"),
    ("witness_refusing", Code.GATEWAY_BUSY, "the witness is behind"),
    ("policy_error", Code.POLICY_UNAVAILABLE, "policy could not be loaded"),
    ("unknown_host", Code.UNKNOWN_HOST, "is not in the gateway policy"),
    ("denied_account", Code.POLICY_DENIED, "is not allowed on host"),
    ("denied_command", Code.POLICY_DENIED, "Policy denies this command"),
    ("terminal", Code.UNSUPPORTED_REQUEST, "runs commands without one"),
    ("certify_problem", Code.POLICY_UNAVAILABLE, "per-command certificates"),
    ("action_unknown", Code.ACTION_OUTCOME_UNKNOWN, "ended with an unknown outcome"),
    ("subject_dead", Code.SESSION_DENIED, "has exited"),
    ("held_over", Code.GATEWAY_BUSY, "waiting for their file cards already hold"),
    ("cards_at_cap", Code.GATEWAY_BUSY, "approval cards from uid 1000"),
]
CHANNELS = [c for c in Channel if c is not Channel.EXEC]
CHANNEL_WORDS = {
    Channel.SHELL: "does not open an interactive shell",
    Channel.SUBSYSTEM: "does not open a subsystem",
    Channel.SHARED: "this connection already carried one",
    Channel.SFTP: "an sftp request without a file operation",
}


# Who the subject of a shared connection is, and what was seen of its ControlMaster's
# clients: (subject_is_run, mux_clients_in_run, the words a shared connection gets then,
# or None where a run's shared connection carries the request, own_connection: whether
# only the connection's own client can send through it -- a later channel then passes,
# unless the connection is also seen to be shared).
SHARING: dict[str, tuple[bool, bool | None, str | None, bool | None]] = {
    "process": (False, None, "", None),  # the words of the fact itself (REFUSALS, ...)
    "process_own": (False, None, "", True),
    "process_not_own": (False, None, "", False),
    "run_all_in_run": (True, True, None, None),
    "run_outsider": (True, False, "never those of a process outside the run", None),
    "run_outsider_own": (True, False, "never those of a process outside the run", True),
    "run_unseen": (True, None, "could not see which processes are connected", None),
}


# A file operation's request meets the same facts in the same order; its own two
# stand where the command's stood (a path that cannot be carried, a path no rule
# admits), and a certificate account has no file access, so `certify_problem` is not
# one of its facts, nor are stdin and a terminal (a file operation has neither: a file
# card shows its bytes).
FILE_FACTS = {
    "bad_command": ("bad_path", Code.UNSUPPORTED_REQUEST, "a path with a NUL byte"),
    "denied_command": ("denied_file", Code.POLICY_DENIED, "matches no files.read rule"),
}


def file_refusals() -> list[tuple[str, Code, str]]:
    return [
        FILE_FACTS.get(name, (name, code, words))
        for name, code, words in REFUSALS
        if name not in ("certify_problem", "stdin_too_large", "bad_terminal", "terminal")
    ]


def refused(
    facts: dict[str, object], sharing: str = "process", file: bool = False
) -> tuple[Request, World]:
    """The request and world with these facts failing (`channel`: which non-exec one),
    for a subject and ControlMaster as `sharing` names them (`SHARING`); `file`: the
    request is one sftp read on a session account with `files` rules."""
    if file:
        path = "/etc/shadow" if facts.get("denied_file") else "/var/log/syslog"
        if facts.get("bad_path"):
            path = "/var/log/a\0b"
        req = Request(
            "req_1",
            "db9" if facts.get("unknown_host") else "web1",
            "root" if facts.get("denied_account") else "files",
            b"",
            SUBJECT,
            channel=facts.get("channel") or Channel.SFTP,  # type: ignore[arg-type]
            ssh_user="other" if facts.get("ssh_user") else None,
            file=FileOp(FileKind.READ, path),
        )
        return req, refused_world(facts, sharing)
    user = "root" if facts.get("denied_account") else "cert"
    command = b"echo hi"
    if facts.get("denied_command"):
        command = b"echo x; rm -rf /"
    if facts.get("bad_command"):
        command = b"echo a\0b"
    req = Request(
        "req_1",
        "db9" if facts.get("unknown_host") else "web1",
        user,
        command,
        SUBJECT,
        channel=facts.get("channel") or Channel.EXEC,  # type: ignore[arg-type]
        ssh_user="other" if facts.get("ssh_user") else user,
        stdin=Stdin.of(b"x" * 9, StdinEnd.TOO_LARGE) if facts.get("stdin_too_large") else None,
        terminal=(
            BAD_TERMINAL
            if facts.get("bad_terminal")
            else TERMINAL
            if facts.get("terminal")
            else None
        ),
    )
    return req, refused_world(facts, sharing)


def refused_world(facts: dict[str, object], sharing: str) -> World:
    return world(
        locked=bool(facts.get("locked")),
        shared_connection=bool(facts.get("shared_connection")),
        not_journaled="disk full" if facts.get("not_journaled") else None,
        records_lost=bool(facts.get("records_lost")),
        witness_refusing="the witness is behind" if facts.get("witness_refusing") else None,
        policy=PolicyError("broken") if facts.get("policy_error") else POLICY,
        certify_problem="the vault holds no user CA" if facts.get("certify_problem") else None,
        action_unknown="req_9" if facts.get("action_unknown") else None,
        subject_alive=not facts.get("subject_dead"),
        cards_waiting=MAX_PENDING_CARDS_PER_TENANT if facts.get("cards_at_cap") else 0,
        held_bytes=MAX_HELD_BYTES_PER_TENANT + 1 if facts.get("held_over") else 0,
        tenant="uid 1000",
        subject_is_run=SHARING[sharing][0],
        mux_clients_in_run=SHARING[sharing][1],
        mux_seen="a process outside the run (or of another run) is connected",
        own_connection=SHARING[sharing][3],
    )


def order_for(
    sharing: str, channel: Channel | None, file: bool = False
) -> list[tuple[str, Code, str]]:
    """REFUSALS as they stand for this subject and ControlMaster: a run whose master
    only its own processes use drops the shared-connection refusals; another run's
    words are the run's."""
    words = SHARING[sharing][2]
    out = []
    for name, code, fact_words in file_refusals() if file else REFUSALS:
        if name == "channel" and channel is not None:
            fact_words = CHANNEL_WORDS[channel]
        shared = name == "shared_connection" or (name == "channel" and channel is Channel.SHARED)
        if shared and words is None:
            continue
        out.append((name, code, words if shared and words else fact_words))
    return out


def fact_sets(names: list[str], samples: int = 400) -> list[tuple[str, ...]]:
    """Which facts fail together: every set of at most three (so every pair and triple
    of facts meets, each order between them is seen), every set lacking at most two,
    and a seeded sample of the rest. The whole power set grew with each new fact
    (2^16 and more per case); the first-failing rule is about order, which pairs and
    triples decide."""
    sets = {c for k in range(4) for c in itertools.combinations(names, k)}
    sets |= {
        tuple(n for n in names if n not in c)
        for k in range(3)
        for c in itertools.combinations(names, k)
    }
    rng = random.Random(21)
    sets |= {tuple(n for n in names if rng.random() < 0.5) for _ in range(samples)}
    return sorted(sets)


def test_with_no_refusal_fact_the_request_asks_a_card() -> None:
    assert isinstance(evaluate(*refused({})), AskSession)


@pytest.mark.parametrize("fact,code,words", REFUSALS)
def test_each_refusal_fact_alone_is_refused_with_its_code(
    fact: str, code: Code, words: str
) -> None:
    for value in CHANNELS if fact == "channel" else [True]:
        verdict = evaluate(*refused({fact: value}))
        assert isinstance(verdict, Refusal) and verdict.code is code, (fact, value)
        assert (CHANNEL_WORDS[value] if fact == "channel" else words) in verdict.message


@pytest.mark.parametrize("fact,code,words", file_refusals())
def test_each_refusal_fact_alone_refuses_a_file_operation_with_its_code(
    fact: str, code: Code, words: str
) -> None:
    channels = [c for c in CHANNELS if c is not Channel.SFTP]
    for value in channels if fact == "channel" else [True]:
        verdict = evaluate(*refused({fact: value}, file=True))
        assert isinstance(verdict, Refusal) and verdict.code is code, (fact, value)
        assert (CHANNEL_WORDS[value] if fact == "channel" else words) in verdict.message


@pytest.mark.parametrize("file", [False, True], ids=["exec", "file"])
@pytest.mark.parametrize("sharing", SHARING)
@pytest.mark.parametrize("channel", [None, *CHANNELS])
def test_the_first_failing_check_in_contract_order_decides(
    channel: Channel | None, sharing: str, file: bool
) -> None:
    """Over the sets of refusal facts `fact_sets` draws (and each channel, and each kind of
    subject and ControlMaster), the verdict is exactly the refusal of the first fact
    that fails, in the contract's order: in particular VAULT_LOCKED whenever the vault
    is locked, and a run's shared connection refused unless every process on its
    master was seen to be of the run; a later channel of a connection only its own
    client can send through is carried, unless that connection is also seen shared."""
    if file and channel is Channel.SFTP:
        channel = None  # a file operation's own channel: no channel fact
    if not file and channel is Channel.SFTP:
        pytest.skip("an sftp channel without a file operation: the exec case's channel fact")
    order = order_for(sharing, channel, file)
    names = [name for name, _, _ in (file_refusals() if file else REFUSALS) if name != "channel"]
    own = SHARING[sharing][3] is True and channel is Channel.SHARED
    for chosen in fact_sets(names):
        facts: dict[str, object] = dict.fromkeys(chosen, True)
        if channel is not None:
            facts["channel"] = channel
        verdict = evaluate(*refused(facts, sharing, file))
        carried = own and "shared_connection" not in facts  # the later channel is its own
        fails = [f for f in order if f[0] in facts and not (carried and f[0] == "channel")]
        first = next(iter(fails), None)
        if first is None:
            assert isinstance(verdict, AskSession)
            continue
        name, code, words = first
        assert isinstance(verdict, Refusal), (sorted(facts), name)
        assert verdict.code is code and words in verdict.message, (sorted(facts), name)
        if "locked" in facts:
            assert verdict.code is Code.VAULT_LOCKED


def test_a_locked_vault_wins_over_everything() -> None:
    """Every other refusal fact at once, from the policy's and from the edges'."""
    facts: dict[str, object] = {name: True for name, _, _ in REFUSALS}
    for channel in CHANNELS:
        verdict = evaluate(*refused({**facts, "channel": channel}))
        assert isinstance(verdict, Refusal) and verdict.code is Code.VAULT_LOCKED
    verdict = evaluate(request(b"echo \xff", host="db9"), world(locked=True))
    assert isinstance(verdict, Refusal) and verdict.code is Code.VAULT_LOCKED


def test_an_action_with_an_unknown_outcome_is_refused_before_any_card() -> None:
    verdict = evaluate(request(), world(action_unknown="req_9"))
    assert isinstance(verdict, Refusal) and verdict.code is Code.ACTION_OUTCOME_UNKNOWN
    assert "req_9" in verdict.message and "BASTION_ACK_UNKNOWN=1" in verdict.message
    locked = evaluate(request(), world(action_unknown="req_9", locked=True))
    assert isinstance(locked, Refusal) and locked.code is Code.VAULT_LOCKED


def test_shell_source_never_passes_an_allow_list() -> None:
    verdict = evaluate(request(b"echo hi; id"), world(session=grant()))
    assert isinstance(verdict, Refusal) and verdict.code is Code.POLICY_DENIED
    assert "';' at byte 7 (command separator)" in verdict.message


def test_shell_source_on_a_per_command_account_asks_a_card_that_says_so() -> None:
    w = world(session=grant("ops"))
    verdict = evaluate(request(b"uptime; id", "ops"), w)  # preapproved "uptime" does not apply
    assert isinstance(verdict, AskCommand)
    assert verdict.check.reading.argv is None
    assert [c.text for c in verdict.check.reading.constructs] == [";"]
    plain = evaluate(request(b"uptime", "ops"), w)
    assert isinstance(plain, Dispatch) and plain.command_grant is None


def test_assess_is_the_gates_policy_step() -> None:
    judged = assess(POLICY, "web1", "ops", b"uptime")
    assert (judged.deny, judged.command_card, judged.preapproved) == (None, False, "uptime")
    assert assess(POLICY, "web1", "ops", b"ls | head").command_card
    assert assess(POLICY, "nope", "ops", b"ls").deny.code is Code.UNKNOWN_HOST  # type: ignore[union-attr]


def test_the_card_cap_applies_only_before_a_card() -> None:
    at_cap = world(cards_waiting=MAX_PENDING_CARDS_PER_TENANT, tenant="run r1")
    assert isinstance(evaluate(request(), replace(at_cap, session=grant())), Dispatch)
    for req, w in [
        (request(), at_cap),  # a session card
        (request(b"echo hi", "ops"), replace(at_cap, session=grant("ops"))),  # a command card
    ]:
        verdict = evaluate(req, w)
        assert isinstance(verdict, Refusal) and verdict.code is Code.GATEWAY_BUSY
        assert verdict.message.startswith(
            f"{MAX_PENDING_CARDS_PER_TENANT} approval cards from run r1"
        )
    below = replace(at_cap, cards_waiting=MAX_PENDING_CARDS_PER_TENANT - 1)
    assert isinstance(evaluate(request(), below), AskSession)


def test_the_final_check_allows_only_the_decided_grants_and_asks_no_card() -> None:
    w = world(session=grant())
    decided = evaluate(request(), w)
    assert isinstance(decided, Dispatch)
    crowded = replace(w, cards_waiting=MAX_PENDING_CARDS_PER_TENANT)
    assert final_check(request(), crowded, decided) is None
    locked = final_check(request(), replace(w, locked=True), decided)
    assert locked is not None and locked.code is Code.VAULT_LOCKED
    ended = final_check(request(), replace(crowded, session=None), decided)  # revoked meanwhile
    assert ended is not None and ended.code is Code.SESSION_DENIED
    assert ended.message.startswith("The approval ended while the gateway was connecting")
    lost = final_check(request(), replace(w, records_lost=True), decided)
    assert lost is not None and lost.code is Code.INTERNAL and "every record" in lost.message


def test_after_a_wait_the_world_as_it_is_now_refuses_first() -> None:
    busy = no_slot("2 commands are in flight (the limit) and 1 wait; none finished within 5s")
    assert busy.code is Code.GATEWAY_BUSY and busy.message == (
        "The gateway is at its limit of commands at once: 2 commands are in flight (the "
        "limit) and 1 wait; none finished within 5s. Nothing was sent; retry this command "
        "in a few seconds."
    )
    w = world(session=grant(), cards_waiting=MAX_PENDING_CARDS_PER_TENANT)
    assert after_wait(request(), w, busy) is busy  # the gate still says dispatch
    assert after_wait(request(), replace(w, session=None), busy) is busy  # it would ask a card
    locked = after_wait(request(), replace(w, locked=True), busy)
    assert locked.code is Code.VAULT_LOCKED
    witness = unwitnessed("the audit witness did not confirm")
    assert after_wait(request(), replace(w, locked=True), witness).code is Code.VAULT_LOCKED
    assert (witness.code, witness.message) == (
        Code.GATEWAY_BUSY,
        "the audit witness did not confirm",
    )


def test_the_endings_after_the_decision_keep_their_words() -> None:
    assert not_durable().code is Code.INTERNAL
    assert not_durable().message.startswith("The gateway could not record its intent durably")
    failed = gateway_failed("req_1")
    assert (failed.code, failed.request_id) == (Code.INTERNAL, "req_1")
    assert "Inspect the target before retrying" in failed.message
    exhausted = rounds_exhausted().failure("req_1")
    assert exhausted.code is Code.APPROVAL_TIMEOUT and exhausted.reauth_reason is None


@pytest.mark.parametrize(
    "answer,kind,code",
    [
        (CardEnding.DECLINED, CardKind.SESSION, Code.SESSION_DENIED),
        (CardEnding.DECLINED, CardKind.COMMAND, Code.CALL_DENIED),
        (CardEnding.WITHDRAWN_LOCKED, CardKind.SESSION, Code.VAULT_LOCKED),
        (CardEnding.UNSEEN, CardKind.COMMAND, Code.NO_APPROVER),
        (CardEnding.TIMEOUT, CardKind.SESSION, Code.APPROVAL_TIMEOUT),
        (CardEnding.WITHDRAWN_GONE, CardKind.COMMAND, Code.SESSION_DENIED),
    ],
)
def test_a_card_without_a_yes_is_a_refusal_that_keeps_why_the_card_was_asked(
    answer: CardEnding, kind: CardKind, code: Code
) -> None:
    refused = unanswered(kind, answer, "deploy@web1", EndReason.POLICY_CHANGED, 30.0)
    failure = refused.failure("req_1")
    assert (failure.code, failure.reauth_reason) == (code, "policy_changed")
    assert "Nothing was sent" in failure.message or "not queued or sent" in failure.message


def test_a_runs_shared_connection_carries_only_what_its_own_processes_send() -> None:
    """A later channel (or a ControlMaster's first) of a registered run: dispatched under
    the run's grant when every process on the master is the run's; refused, not
    retryable, with words to act on, when one is not or none could be seen; and a
    subject that is not a run is refused as before, told where sharing works."""
    live = grant()
    shared = replace(request(), channel=Channel.SHARED)
    run = world(session=live, subject_is_run=True)
    for req, w in [(shared, run), (request(), replace(run, shared_connection=True))]:
        ok = evaluate(req, replace(w, mux_clients_in_run=True, mux_seen="2 connected"))
        assert isinstance(ok, Dispatch) and ok.session == live
        out = evaluate(req, replace(w, mux_clients_in_run=False, mux_seen="pid 7 is outside"))
        assert isinstance(out, Refusal) and out.code is Code.UNSUPPORTED_REQUEST
        assert not out.code.retryable and "pid 7 is outside" in out.message
        assert "Nothing was sent" in out.message and "ControlMaster=no" in out.message
        unseen = evaluate(req, replace(w, mux_seen="uid 1002 cannot be read"))
        assert isinstance(unseen, Refusal) and unseen.code is Code.UNSUPPORTED_REQUEST
        assert "could not see" in unseen.message and "uid 1002" in unseen.message
        assert "--isolated" in unseen.message
        plain = evaluate(req, replace(w, subject_is_run=False, mux_clients_in_run=True))
        assert isinstance(plain, Refusal) and "Inside one `bastion run`" in plain.message
    # A later channel that is not an exec is refused as what it is, run or not.
    sub = evaluate(
        replace(request(), channel=Channel.SUBSYSTEM), replace(run, mux_clients_in_run=True)
    )
    assert isinstance(sub, Refusal) and "does not open a subsystem" in sub.message


def test_a_later_channel_is_carried_only_where_its_client_alone_can_send() -> None:
    """paramiko and fabric run each command on a channel of one connection: a later
    channel is dispatched under the same grant when the gateway saw that only the client
    that connected can send through it; seen otherwise, or not seen, or on a connection
    that is also seen to be shared (a ControlMaster), it is refused as before."""
    live = grant()
    shared = replace(request(), channel=Channel.SHARED)
    w = world(session=live)
    ok = evaluate(shared, replace(w, own_connection=True))
    assert isinstance(ok, Dispatch) and ok.session == live
    for own in (False, None):
        out = evaluate(shared, replace(w, own_connection=own))
        assert isinstance(out, Refusal) and out.code is Code.UNSUPPORTED_REQUEST
        assert "this connection already carried one" in out.message
    master = evaluate(shared, replace(w, own_connection=True, shared_connection=True))
    assert isinstance(master, Refusal) and master.code is Code.UNSUPPORTED_REQUEST
    # It carries a later channel only: the first exec of a shared connection is refused.
    first = evaluate(request(), replace(w, own_connection=True, shared_connection=True))
    assert isinstance(first, Refusal) and "can be shared" in first.message


def later_sftp(**changes: object) -> tuple[Request, World]:
    """A file read that came on a later channel of its connection (fabric's `put` after
    a `run`), in a world where only its own client can send through it, or as changed."""
    req = Request(
        "req_1", "web1", "files", b"", SUBJECT, channel=Channel.SFTP,
        file=FileOp(FileKind.READ, "/var/log/syslog"), later=True,
    )  # fmt: skip
    return req, world(**{"own_connection": True, **changes})


def test_an_sftp_channel_after_a_command_is_the_clients_own_or_refused() -> None:
    """A later sftp channel is decided as a later exec channel is: carried when only its
    own client can send through the connection (or a run's master has only the run's
    processes), refused with ControlMaster words when another process could."""
    assert isinstance(evaluate(*later_sftp()), AskSession)
    for seen in (False, None):
        verdict = evaluate(*later_sftp(own_connection=seen))
        assert isinstance(verdict, Refusal) and verdict.code is Code.UNSUPPORTED_REQUEST
        assert "this connection already carried one" in verdict.message
    shared = evaluate(*later_sftp(shared_connection=True))
    assert isinstance(shared, Refusal) and shared.code is Code.UNSUPPORTED_REQUEST
    in_run = later_sftp(own_connection=None, subject_is_run=True, mux_clients_in_run=True)
    assert isinstance(evaluate(*in_run), AskSession)


def test_a_terminal_runs_only_on_an_account_with_pty_and_a_yes_is_bound_to_it() -> None:
    """`pty = true`: a request with a terminal asks its command card like any other; a
    grant given for the command without a terminal does not let it run with one (nor
    the other way round). Without `pty` the account refuses it, naming the field."""
    with_tty = replace(request(b"tty", "tty"), terminal=TERMINAL)
    w = world(session=grant("tty"))
    assert isinstance(evaluate(with_tty, w), AskCommand)
    host = HOSTS["web1"]
    account = host.account("tty")
    assert account is not None
    sha = hashlib.sha256(b"tty").hexdigest()
    for terminal, req in ((True, with_tty), (False, request(b"tty", "tty"))):
        bound = CommandGrant(
            "cmd_1", "ses_1", Binding.of(host, account, sha, terminal=terminal), NOW + 60
        )
        other = replace(bound, binding=replace(bound.binding, terminal=not terminal))
        assert isinstance(evaluate(req, replace(w, command_grant=bound)), Dispatch)
        assert isinstance(evaluate(req, replace(w, command_grant=other)), AskCommand)
    refused = evaluate(replace(request(), terminal=TERMINAL), world(session=grant()))
    assert isinstance(refused, Refusal) and refused.code is Code.UNSUPPORTED_REQUEST
    assert "deploy@web1 runs commands without one" in refused.message
    assert "`pty = true`" in refused.message and "pipelining" in refused.message


@pytest.mark.parametrize(
    "change,words",
    [
        ({"term_type": b"x" * 65}, "terminal type"),
        ({"term_type": b"vt100 x"}, "terminal type"),
        ({"columns": 10_001}, "terminal size"),
        ({"height": 100_001}, "terminal size"),
        ({"modes": bytes([53, 0, 0])}, "modes"),
    ],
)
def test_a_terminal_that_cannot_be_made_as_asked_is_refused_first(
    change: dict[str, object], words: str
) -> None:
    req = replace(request(b"tty", "tty"), terminal=replace(TERMINAL, **change))  # type: ignore[arg-type]
    verdict = evaluate(req, world(session=grant("tty")))
    assert isinstance(verdict, Refusal) and verdict.code is Code.UNSUPPORTED_REQUEST
    assert words in verdict.message, verdict.message
    empty = replace(TERMINAL, term_type=b"", columns=0, rows=0, modes=b"")  # ssh -tt, no tty
    assert isinstance(
        evaluate(replace(req, terminal=empty), world(session=grant("tty"))), AskCommand
    )
