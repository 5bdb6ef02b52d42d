"""The `bastion` command: parse, call, print. Nothing is decided here.

Every read takes `--json`. Operator commands talk to the running gateway over
its operator socket; `init`, `key` (when no gateway runs) and `hostkey` work
on files directly.
"""

from __future__ import annotations

import base64
import getpass
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from bastion.home import Home, default_home

KEYRING_SERVICE = "bastion"
HOST_KEY_ALIAS = "bastion-gateway"


def fail(message: str, status: int = 1) -> NoReturn:
    click.echo(f"bastion: {message}", err=True)
    sys.exit(status)


def emit(data: Any, as_json: bool, human: Callable[[Any], str]) -> None:
    click.echo(json.dumps(data, indent=2) if as_json else human(data))


def home_of(ctx: click.Context) -> Home:
    return Home(ctx.obj["home"])


def op(ctx: click.Context, name: str, timeout: float = 30.0, **args: Any) -> Any:
    from bastion import operator

    try:
        return operator.call(home_of(ctx).operator_socket, name, timeout=timeout, **args)
    except operator.OperatorError as exc:
        fail(str(exc))


def read_passphrase(
    from_stdin: bool, use_keyring: bool, home: Home, confirm: bool = False
) -> bytes:
    if use_keyring:
        import keyring

        try:
            secret = keyring.get_password(KEYRING_SERVICE, str(home.root))
        except keyring.errors.KeyringError as exc:
            fail(f"the OS keyring is not usable here: {exc}")
        if secret is None:
            fail(
                f"no passphrase for {home.root} in the OS keyring (service '{KEYRING_SERVICE}'); "
                "store one with `bastion init --keyring` or `bastion unlock --store-keyring`"
            )
        return secret.encode()
    if from_stdin:
        line = sys.stdin.buffer.readline()
        return line.rstrip(b"\r\n")
    if not sys.stdin.isatty():
        fail("no terminal to ask for the passphrase; use --passphrase-stdin or --keyring")
    first = getpass.getpass("Vault passphrase: ").encode()
    if confirm and getpass.getpass("Again: ").encode() != first:
        fail("the passphrases do not match; nothing was changed")
    return first


def save_to_keyring(home: Home, passphrase: bytes) -> None:
    import keyring
    import keyring.errors

    try:
        keyring.set_password(KEYRING_SERVICE, str(home.root), passphrase.decode())
    except keyring.errors.KeyringError as exc:
        fail(f"could not store the passphrase in the OS keyring: {exc}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--home",
    type=click.Path(path_type=Path),
    default=None,
    help="Bastion home (default: $BASTION_HOME or $XDG_DATA_HOME/bastion).",
)
@click.version_option(package_name="bastion")
@click.pass_context
def main(ctx: click.Context, home: Path | None) -> None:
    """A local SSH bastion: agents run commands on real servers through the
    stock ssh client, and never hold a key."""
    ctx.obj = {"home": (home.expanduser().absolute() if home else default_home())}


# -- setup -------------------------------------------------------------------------------


@main.command()
@click.option("--passphrase-stdin", is_flag=True, help="Read the vault passphrase from stdin.")
@click.option(
    "--keyring",
    "use_keyring",
    is_flag=True,
    help="Also store the passphrase in the OS keyring for `unlock --keyring`.",
)
@click.pass_context
def init(ctx: click.Context, passphrase_stdin: bool, use_keyring: bool) -> None:
    """Create the home: vault, the gateway's SSH host key, policy directory."""
    import asyncssh

    from bastion.vault import Vault, VaultError

    home = home_of(ctx)
    if home.exists():
        fail(f"{home.root} is already initialised (vault at {home.vault}); nothing was changed")
    passphrase = read_passphrase(passphrase_stdin, False, home, confirm=True)
    if not passphrase:
        fail("an empty passphrase is not allowed; nothing was created")
    home.make_dirs()
    from bastion.journal import IDENTITY_LABEL, write_identity

    try:
        vault = Vault.create(home.vault, passphrase)
        vault.generate(IDENTITY_LABEL)  # the journal identity: it signs and reads the audit
        write_identity(home.journal, vault.private_key(IDENTITY_LABEL).pyca_key)
        vault.lock()
    except VaultError as exc:
        fail(str(exc))
    key = asyncssh.generate_private_key("ssh-ed25519", comment="bastion-gateway")
    old = os.umask(0o177)
    try:
        key.write_private_key(str(home.host_key))
    finally:
        os.umask(old)
    public = key.export_public_key().decode().strip()
    home.known_hosts.write_text(f"{HOST_KEY_ALIAS} {public}\n")
    if use_keyring:
        save_to_keyring(home, passphrase)
    click.echo(
        f"Initialised {home.root}\n"
        f"  vault:     {home.vault} (locked)\n"
        f"  policies:  {home.policies}/ (empty: add *.toml files, see policies/example.toml)\n"
        "Next: `bastion key generate LABEL`, write a policy, `bastion daemon`, "
        "`bastion unlock`, `bastion ssh-config > agent_ssh_config`."
    )


@main.command()
@click.option(
    "--policies",
    type=click.Path(path_type=Path),
    default=None,
    help="Policy directory (default: HOME/policies).",
)
@click.option(
    "--agent-socket",
    type=click.Path(path_type=Path),
    default=None,
    help="Agent socket path (default: HOME/run/agent.sock).",
)
@click.option(
    "--agent-group",
    default=None,
    help="Group allowed to connect to the agent socket (agents as another user).",
)
@click.option(
    "--approval-timeout",
    type=click.FloatRange(min=0.1),
    default=120.0,
    show_default=True,
    help="Seconds a card waits for an answer.",
)
@click.option(
    "--command-ttl",
    type=click.FloatRange(min=0.1),
    default=60.0,
    show_default=True,
    help="Seconds an approved command may wait to be sent.",
)
@click.option(
    "--keepalive",
    type=click.FloatRange(min=0.1),
    default=15.0,
    show_default=True,
    help="Seconds between keepalives to targets (3 missed = connection lost).",
)
@click.pass_context
def daemon(
    ctx: click.Context,
    policies: Path | None,
    agent_socket: Path | None,
    agent_group: str | None,
    approval_timeout: float,
    command_ttl: float,
    keepalive: float,
) -> None:
    """Run the gateway in the foreground. It starts locked."""
    from bastion.daemon import Settings, run_daemon

    home = home_of(ctx)
    if not home.exists():
        fail(f"{home.root} is not initialised; run `bastion init` first")
    gid = None
    if agent_group is not None:
        import grp

        try:
            gid = grp.getgrnam(agent_group).gr_gid
        except KeyError:
            fail(f"no group named {agent_group!r}")
    run_daemon(
        Settings(
            home=home,
            policies=(policies or home.policies).absolute(),
            agent_socket=(agent_socket or home.agent_socket).absolute(),
            agent_group=gid,
            approval_timeout=approval_timeout,
            command_approval_ttl=command_ttl,
            keepalive_interval=keepalive,
        )
    )


@main.command()
@click.option("--passphrase-stdin", is_flag=True, help="Read the vault passphrase from stdin.")
@click.option("--keyring", "use_keyring", is_flag=True, help="Read it from the OS keyring.")
@click.option("--store-keyring", is_flag=True, help="After unlocking, store it in the keyring.")
@click.pass_context
def unlock(
    ctx: click.Context, passphrase_stdin: bool, use_keyring: bool, store_keyring: bool
) -> None:
    """Unlock the vault in the running gateway (ends every session approval)."""
    home = home_of(ctx)
    passphrase = read_passphrase(passphrase_stdin, use_keyring, home)
    result = op(ctx, "unlock", timeout=60, passphrase=base64.b64encode(passphrase).decode())
    if store_keyring:
        save_to_keyring(home, passphrase)
    click.echo(f"unlocked (vault epoch {result['vault_epoch']})")


@main.command()
@click.option(
    "--terminate", is_flag=True, help="Also end every command in flight (each outcome is recorded)."
)
@click.pass_context
def lock(ctx: click.Context, terminate: bool) -> None:
    """Lock the vault: deny everything at once, end every approval, queue nothing."""
    result = op(ctx, "lock", timeout=60, terminate=terminate)
    ended = result.get("terminated") or []
    click.echo(
        f"locked (vault epoch {result['vault_epoch']})"
        + (f"; ended {len(ended)} command(s) in flight: {' '.join(ended)}" if ended else "")
    )


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Gateway state: vault, policy, isolation."""
    s = op(ctx, "status")

    def human(s: dict[str, Any]) -> str:
        policy = "ok" if s["policy"]["ok"] else f"UNAVAILABLE: {s['policy']['error']}"
        return (
            f"vault:     {'locked' if s['locked'] else 'unlocked'} (epoch {s['vault_epoch']})\n"
            f"policy:    {policy}\n"
            f"hosts:     {', '.join(s['policy']['hosts']) or '-'}\n"
            f"isolation: {s['isolation']}\n"
            f"pending:   {s['pending']} card(s), sessions: {s['sessions']}\n"
            f"boot:      {s['boot_id']}"
        )

    emit(s, as_json, human)


# -- keys --------------------------------------------------------------------------------


@main.group()
def key() -> None:
    """Manage the keys in the vault (they never leave it)."""


def _key_call(ctx: click.Context, name: str, passphrase_stdin: bool, **args: Any) -> Any:
    """Through the running gateway if there is one, else on the vault file."""
    from bastion import operator
    from bastion.vault import Vault, VaultError, load_private_key_file

    home = home_of(ctx)
    from bastion.vault import RESERVED_PREFIX

    if str(args.get("label", "")).startswith(RESERVED_PREFIX) and name != "key_public":
        fail(f"labels starting with {RESERVED_PREFIX!r} are bastion's own; choose another")
    try:
        return operator.call(home.operator_socket, name, **args)
    except operator.GatewayNotRunning:
        pass
    except operator.OperatorError as exc:
        fail(str(exc))
    try:
        vault = Vault.open(home.vault)
        if name == "key_list":
            return [k.__dict__ for k in vault]
        if name == "key_public":
            return vault.key_info(args["label"]).__dict__
        vault.unlock(read_passphrase(passphrase_stdin, False, home))
        try:
            if name == "key_generate":
                return vault.generate(args["label"], args["algorithm"]).__dict__
            if name == "key_import":
                private = load_private_key_file(args["private_key"].encode(), None)
                return vault.add(args["label"], private).__dict__
            vault.remove(args["label"])
            return {"removed": args["label"]}
        finally:
            vault.lock()
    except VaultError as exc:
        fail(str(exc))


def _key_line(k: dict[str, Any]) -> str:
    return f"{k['label']}\t{k['algorithm']}\t{k['fingerprint']}"


@key.command("generate")
@click.argument("label")
@click.option(
    "--type",
    "algorithm",
    default="ssh-ed25519",
    show_default=True,
    type=click.Choice(["ssh-ed25519", "ecdsa-sha2-nistp256", "ssh-rsa"]),
)
@click.option("--passphrase-stdin", is_flag=True, help="Vault passphrase (no gateway running).")
@click.pass_context
def key_generate(ctx: click.Context, label: str, algorithm: str, passphrase_stdin: bool) -> None:
    """Create a key in the vault and print its public half."""
    k = _key_call(ctx, "key_generate", passphrase_stdin, label=label, algorithm=algorithm)
    click.echo(k["public_key"])


@key.command("import")
@click.argument("label")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--passphrase-stdin",
    is_flag=True,
    help="Vault passphrase on stdin's first line (no gateway running).",
)
@click.option(
    "--key-passphrase-stdin",
    is_flag=True,
    help="The key file's passphrase on stdin (after the vault passphrase, if both).",
)
@click.pass_context
def key_import(
    ctx: click.Context, label: str, file: Path, passphrase_stdin: bool, key_passphrase_stdin: bool
) -> None:
    """Import an OpenSSH or PEM private key (ed25519, ecdsa, rsa)."""
    from bastion.vault import KeyFilePassphraseNeeded, VaultError, load_private_key_file

    data = file.read_bytes()
    vault_pass = sys.stdin.buffer.readline() if passphrase_stdin and key_passphrase_stdin else None
    try:
        try:
            private = load_private_key_file(data, None)
        except KeyFilePassphraseNeeded:
            if key_passphrase_stdin:
                secret = sys.stdin.buffer.readline().rstrip(b"\r\n")
            elif sys.stdin.isatty():
                secret = getpass.getpass(f"Passphrase for {file}: ").encode()
            else:
                fail(f"{file} is encrypted; give its passphrase with --key-passphrase-stdin")
            private = load_private_key_file(data, secret)
    except VaultError as exc:
        fail(f"{file}: {exc}; nothing was imported")
    text = private.export_private_key("openssh").decode()
    if vault_pass is not None:  # put the vault passphrase back for _key_call to read
        sys.stdin = _LineStdin(vault_pass)  # type: ignore[assignment]
    k = _key_call(ctx, "key_import", passphrase_stdin, label=label, private_key=text)
    click.echo(f"imported {_key_line(k)}")


class _LineStdin:
    def __init__(self, line: bytes) -> None:
        import io

        self.buffer = io.BytesIO(line)

    def isatty(self) -> bool:
        return False


@key.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def key_list(ctx: click.Context, as_json: bool) -> None:
    """Labels, algorithms and fingerprints (never key material)."""
    keys = _key_call(ctx, "key_list", False)
    emit(keys, as_json, lambda ks: "\n".join(_key_line(k) for k in ks) or "(no keys)")


@key.command("public")
@click.argument("label")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def key_public(ctx: click.Context, label: str, as_json: bool) -> None:
    """Print a key's public half, to install in a target's authorized_keys."""
    k = _key_call(ctx, "key_public", False, label=label)
    emit(k, as_json, lambda k: k["public_key"])


@key.command("remove")
@click.argument("label")
@click.option("--passphrase-stdin", is_flag=True, help="Vault passphrase (no gateway running).")
@click.pass_context
def key_remove(ctx: click.Context, label: str, passphrase_stdin: bool) -> None:
    """Delete a key from the vault."""
    _key_call(ctx, "key_remove", passphrase_stdin, label=label)
    click.echo(f"removed {label}")


# -- targets and agents --------------------------------------------------------------------


@main.command()
@click.argument("host")
@click.option("--port", type=click.IntRange(1, 65535), default=22, show_default=True)
@click.option("--timeout", type=float, default=10.0, show_default=True)
def hostkey(host: str, port: int, timeout: float) -> None:
    """Fetch HOST's SSH host key, to pin in a policy. Trust on first use:
    compare the fingerprint with one obtained out of band."""
    import asyncio

    import asyncssh

    async def fetch() -> asyncssh.SSHKey | None:
        return await asyncio.wait_for(asyncssh.get_server_host_key(host, port), timeout)

    try:
        k = asyncio.run(fetch())
    except (OSError, TimeoutError, asyncssh.Error) as exc:
        fail(f"could not fetch the host key of {host}:{port}: {exc}")
    if k is None:
        fail(f"{host}:{port} offered no host key")
    line = k.export_public_key().decode().strip().split()
    click.echo(
        f"# {host}:{port} {k.get_fingerprint('sha256')} -- trust on first use: "
        "verify this fingerprint out of band before pinning it"
    )
    click.echo(f'host_key = "{line[0]} {line[1]}"')


@main.command("ssh-config")
@click.option("--policies", type=click.Path(path_type=Path), default=None)
@click.option("--agent-socket", type=click.Path(path_type=Path), default=None)
@click.option(
    "--python",
    "python",
    default=None,
    help="Interpreter for the proxy (default: this one); agents running as another "
    "user need one they can execute, e.g. /usr/bin/python3.",
)
@click.option(
    "--proxy",
    "proxy_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Path of bastion's proxy.py as the agent sees it (default: this install's).",
)
@click.pass_context
def ssh_config(
    ctx: click.Context,
    policies: Path | None,
    agent_socket: Path | None,
    python: str | None,
    proxy_path: Path | None,
) -> None:
    """Print an ssh_config for `ssh -F FILE HOST 'COMMAND'`, one entry per policy host.

    The file is self-contained: the gateway's host key is pinned inline, so an
    agent running as another user needs nothing from the bastion home."""
    from bastion import proxy
    from bastion.policy import PolicyError, load_policy_dir

    home = home_of(ctx)
    try:
        policy = load_policy_dir((policies or home.policies).absolute())
    except PolicyError as exc:
        fail(f"the policy cannot be loaded: {exc}")
    try:
        pinned = home.known_hosts.read_text().split()[:3]  # alias, key type, key
    except OSError as exc:
        fail(f"cannot read the gateway's host key ({exc.strerror}); run `bastion init`")
    sock = (agent_socket or home.agent_socket).absolute()
    script = (proxy_path or Path(proxy.__file__)).absolute()
    argv = (python or sys.executable, "-I", "-S", str(script), "--socket", str(sock))
    proxy_cmd = " ".join(shlex.quote(p) for p in argv) + " %h %p %r"
    lines = [
        "# Generated by `bastion ssh-config`. Use: ssh -F THIS_FILE [USER@]HOST 'COMMAND'",
        "# The agent holds no key: bastion decides, connects and relays.",
    ]
    for alias in sorted(policy.hosts):
        accounts = policy.hosts[alias].accounts
        if len(accounts) == 1:
            lines += [f"Host {alias}", f"    User {accounts[0].user}"]
    # Every destination goes through bastion: a name missing from the policy
    # gets UNKNOWN_HOST from the gateway instead of a direct connection.
    lines += [
        "Host *",
        f"    ProxyCommand {proxy_cmd}",
        "    ProxyUseFdpass yes",
        f"    HostKeyAlias {HOST_KEY_ALIAS}",
        f"    KnownHostsCommand /bin/echo {' '.join(pinned)}",
        "    UserKnownHostsFile /dev/null",
        "    GlobalKnownHostsFile /dev/null",
        "    StrictHostKeyChecking yes",
        "    UpdateHostKeys no",
        "    CheckHostIP no",
        "    BatchMode yes",
        "    IdentitiesOnly yes",
        "    IdentityAgent none",
        "    PubkeyAuthentication no",
        "    PasswordAuthentication no",
        "    KbdInteractiveAuthentication no",
        "    GSSAPIAuthentication no",
        "    ForwardAgent no",
        "    ForwardX11 no",
        "    ClearAllForwardings yes",
        "    RequestTTY no",
        "    ControlMaster no",
        "    ControlPath none",
        "    ServerAliveInterval 30",
    ]
    click.echo("\n".join(lines))


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def proxy(ctx: click.Context, args: tuple[str, ...]) -> None:
    """The ProxyCommand helper: bastion proxy [--socket PATH] HOST PORT USER."""
    from bastion import proxy as proxy_mod

    argv = list(args)
    if "--socket" not in argv:
        argv = ["--socket", str(home_of(ctx).agent_socket), *argv]
    sys.exit(proxy_mod.main(argv))


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--label", default="", help="Shown on the operator's cards.")
@click.option("--agent-socket", type=click.Path(path_type=Path), default=None)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def run(
    ctx: click.Context, label: str, agent_socket: Path | None, command: tuple[str, ...]
) -> None:
    """Start an agent as a registered run: every ssh anywhere in its process
    tree is attributed to this one run (read from the live process tree by the
    gateway, never from an environment variable)."""
    import signal
    import socket
    import subprocess

    from bastion.proxy import PROTOCOL, read_reply

    path = (agent_socket or home_of(ctx).agent_socket).absolute()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        sock.sendall(PROTOCOL + json.dumps({"register": "run", "label": label}).encode() + b"\n")
        reply = read_reply(sock).decode("utf-8", "replace").strip()
    except OSError as exc:
        fail(f"cannot reach the gateway at {path} ({exc.strerror}); is `bastion daemon` running?")
    finally:
        sock.close()
    if not reply.startswith("OK "):
        fail(f"the gateway refused to register the run: {reply or 'no reply'}")
    click.echo(
        f"bastion: registered {reply[3:]} (pid {os.getpid()}); starting {command[0]}", err=True
    )
    try:
        child = subprocess.Popen(list(command))
    except OSError as exc:
        fail(f"cannot start {command[0]}: {exc.strerror}", 127)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda n, _f: child.send_signal(n))
    code = child.wait()
    sys.exit(code if code >= 0 else 128 - code)


# -- the operator ---------------------------------------------------------------------------


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--wait",
    type=click.FloatRange(0, 600),
    default=0.0,
    help="Wait up to this many seconds for a card to arrive.",
)
@click.pass_context
def pending(ctx: click.Context, as_json: bool, wait: float) -> None:
    """Cards waiting for an operator's answer."""
    from bastion.operator import render_card

    cards = op(ctx, "pending", timeout=wait + 30, wait=wait)
    emit(
        cards,
        as_json,
        lambda cs: (
            "\n\n".join(
                render_card(c) + f"\n  decide:   bastion decide {c['id']} approve|deny" for c in cs
            )
            or "(no pending cards)"
        ),
    )


@main.command()
@click.pass_context
def approve(ctx: click.Context) -> None:
    """Interactive approvals: each card as it arrives; y approve, n deny,
    d details (process chain, digests), q quit. Survives gateway restarts."""
    from bastion.operator import approve as run_prompt

    sys.exit(run_prompt(home_of(ctx).operator_socket))


@main.command()
@click.argument("card_id")
@click.argument("answer", type=click.Choice(["approve", "deny"]))
@click.pass_context
def decide(ctx: click.Context, card_id: str, answer: str) -> None:
    """Answer one card."""
    op(ctx, "decide", card=card_id, approve=answer == "approve")
    click.echo(f"{card_id}: {'approved' if answer == 'approve' else 'denied'}")


def _session_line(r: dict[str, Any]) -> str:
    s = r["subject"]
    return f"{r['id']}  {r['user']}@{r['host']}  pid {s['pid']} {s['exe']}"


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def sessions(ctx: click.Context, as_json: bool) -> None:
    """Live session approvals."""
    rows = op(ctx, "sessions")
    emit(rows, as_json, lambda rs: "\n".join(map(_session_line, rs)) or "(no live sessions)")


@main.command()
@click.argument("session_id")
@click.pass_context
def revoke(ctx: click.Context, session_id: str) -> None:
    """End one session approval now."""
    op(ctx, "revoke", session=session_id)
    click.echo(f"revoked {session_id}")


@main.command()
@click.argument("request_id")
@click.pass_context
def kill(ctx: click.Context, request_id: str) -> None:
    """End a command in flight: signal it, then close its channel. Its outcome
    is recorded as the target reports it (or `unknown` if it does not)."""
    op(ctx, "kill", timeout=60, request=request_id)
    click.echo(f"{request_id}: ended; see `bastion request {request_id}`")


@main.command()
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def request(ctx: click.Context, request_id: str, as_json: bool) -> None:
    """What became of one request: completed, denied, retry_safe,
    status_unknown or in_flight (from the journal; no passphrase needed)."""
    from bastion import journal, operator

    home = home_of(ctx)
    try:
        live = operator.call(home.operator_socket, "status", timeout=5)["boot_id"]
    except operator.OperatorError:
        live = None
    state = journal.request_state(journal.records(home.journal), request_id, live)
    if state is None:
        fail(f"no request {request_id} in the journal at {home.journal}")
    emit(
        state,
        as_json,
        lambda s: (
            f"{s['request_id']}: {s['state']}"
            + (f" (exit {s['exit_status']})" if s.get("exit_status") is not None else "")
            + (f" ({s['code']})" if s.get("code") else "")
        ),
    )


@main.group()
def audit() -> None:
    """The journal: verify it offline, or read its views."""


@audit.command("verify")
@click.option(
    "--journal",
    "path",
    type=click.Path(path_type=Path),
    default=None,
    help="A journal directory (default: HOME/journal).",
)
@click.option(
    "--expect-head", default=None, help="A head hash recorded earlier (catches truncation)."
)
@click.option("--strict", is_flag=True, help="Fail on records not yet certified.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def audit_verify(
    ctx: click.Context, path: Path | None, expect_head: str | None, strict: bool, as_json: bool
) -> None:
    """Check order, chain, signatures and certifications. Needs neither the
    passphrase nor the gateway. Exit 0 intact, 1 with the first bad record."""
    from bastion import journal

    home = home_of(ctx)
    directory = path or home.journal
    try:
        identity = journal.read_identity(directory, None if path else _identity_pin(home))
    except journal.JournalError as exc:
        fail(str(exc))
    verdict = journal.verify(directory, identity, expect_head, strict)

    def human(v: dict[str, Any]) -> str:
        head = "intact" if v["ok"] else f"BROKEN at {v['problem']}"
        return "\n".join(
            [
                f"journal {directory}: {head} ({v['records']} record(s) checked)",
                *(f"  note: {n}" for n in v["notes"]),
            ]
        )

    emit(verdict.as_json(), as_json, human)
    sys.exit(0 if verdict.ok else 1)


def _identity_pin(home: Home) -> bytes | None:
    """The journal identity as the vault records it (its public half is
    readable without the passphrase), so a swapped identity.json is caught."""
    import asyncssh
    from cryptography.hazmat.primitives import serialization

    from bastion.journal import IDENTITY_LABEL
    from bastion.vault import Vault, VaultError

    try:
        line = Vault.open(home.vault).key_info(IDENTITY_LABEL).public_key
    except VaultError:
        return None
    raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
    return asyncssh.import_public_key(line).pyca_key.public_bytes(*raw)


@audit.command("head")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def audit_head(ctx: click.Context, as_json: bool) -> None:
    """The journal's last (seq, hash): record it elsewhere, verify against it later."""
    from bastion import journal

    seq, digest = journal.head(home_of(ctx).journal)
    emit({"seq": seq, "hash": digest}, as_json, lambda h: f"{h['seq']} {h['hash']}")


def _audit_view(ctx: click.Context, view: str, passphrase_stdin: bool, use_keyring: bool) -> Any:
    """Through an unlocked gateway, or offline with the passphrase."""
    from bastion import journal, operator
    from bastion.vault import Vault, VaultError

    home = home_of(ctx)
    if not (passphrase_stdin or use_keyring):
        try:
            return operator.call(home.operator_socket, "audit", timeout=120, view=view)
        except operator.OperatorError as exc:
            if not isinstance(exc, operator.GatewayNotRunning) and "locked" not in str(exc):
                fail(str(exc))
    passphrase = read_passphrase(passphrase_stdin, use_keyring, home)
    try:
        identity = Vault.open(home.vault).read_private_key(passphrase, journal.IDENTITY_LABEL)
    except VaultError as exc:
        fail(str(exc))
    fn = journal.activity if view == "activity" else journal.sessions
    return fn(journal.decrypt(journal.records(home.journal), identity.pyca_key))


def _activity_line(a: dict[str, Any]) -> str:
    end = a["outcome"] + (f" {a['code']}" if a.get("code") else "")
    if a.get("exit_status") is not None:
        end += f" exit {a['exit_status']}"
    return f"{a['request_id']}  {a['user']}@{a['host']}  {end:<28} {a['command']!r}"


@audit.command("activity")
@click.option("--json", "as_json", is_flag=True)
@click.option("--passphrase-stdin", is_flag=True, help="Read the journal without a gateway.")
@click.option("--keyring", "use_keyring", is_flag=True)
@click.pass_context
def audit_activity(
    ctx: click.Context, as_json: bool, passphrase_stdin: bool, use_keyring: bool
) -> None:
    """One row per request: what was asked, by whom, and how it ended."""
    rows = _audit_view(ctx, "activity", passphrase_stdin, use_keyring)
    emit(rows, as_json, lambda rs: "\n".join(map(_activity_line, rs)) or "(no requests)")


@audit.command("sessions")
@click.option("--json", "as_json", is_flag=True)
@click.option("--passphrase-stdin", is_flag=True, help="Read the journal without a gateway.")
@click.option("--keyring", "use_keyring", is_flag=True)
@click.pass_context
def audit_sessions(
    ctx: click.Context, as_json: bool, passphrase_stdin: bool, use_keyring: bool
) -> None:
    """One row per session approval: who, what, when, and why it ended."""
    rows = _audit_view(ctx, "sessions", passphrase_stdin, use_keyring)
    emit(rows, as_json, lambda rs: "\n".join(map(_session_row, rs)) or "(no sessions)")


def _session_row(r: dict[str, Any]) -> str:
    pid = (r["subject"] or {}).get("pid")
    return (
        f"{r['session_id']}  {r['user']}@{r['host']}  pid {pid}  ended: {r['end_reason'] or 'live'}"
    )


@main.command()
@click.option("--keep", is_flag=True, help="Keep the throwaway directory for inspection.")
def demo(keep: bool) -> None:
    """Throwaway sshd + bastion + one agent command, end to end."""
    from bastion.demo import run_demo

    sys.exit(run_demo(keep=keep))


if __name__ == "__main__":
    main()
