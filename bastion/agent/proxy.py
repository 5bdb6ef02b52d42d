"""The ProxyCommand helper: `bastion proxy HOST PORT USER`.

Runs once per agent ssh call, so it imports only the standard library and
exits as soon as it can. It connects to the daemon's agent socket, names the
target, and waits for the daemon to say it has read who is connecting -- the
daemon identifies this very process through SO_PEERCRED, so it must still be
alive while /proc is read. Then it hands the connected socket to ssh
(ProxyUseFdpass) and exits; ssh speaks SSH to the daemon directly, with no
byte relayed through Python. Without fd passing it relays stdin/stdout.

The target given here is only a name: address and port come from the
policy, never from the client.

Before it connects it reads the argv of the ssh that started it (`ssh_problem`):
`-N`, `-f`, `-L`, `-R`, `-D`, `-W` and `-w` (and their `-o` spellings) ask for
what bastion does not serve, and each would fail badly later -- `-N` hangs, `-f`
exits 0 and prints the refusal from the background, `-L` reads like the target
refused -- so the agent is told at once, and nothing connects.
"""

# Imports are what this helper's start costs on every agent ssh call: `json`,
# `contextlib` and `socket` (enum, selectors) took 15 of its 27 ms on this machine
# (python -X importtime), more than the interpreter itself. So it imports only
# C modules and `os`: `_socket` rather than `socket`, its header JSON written by
# `json_string`, and `json` and `select` only on the paths that need them.
import _socket
import os
import stat
import struct
import sys

# The wire both sides speak (`wire.py`, beside this file). Started by path with -I -S,
# this file's folder is not on sys.path: it is appended (after the standard library,
# so nothing there can shadow a module this helper loads later).
if __package__:
    import bastion.agent.wire as wire
else:
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
    try:
        import wire  # type: ignore[no-redef]
    except ImportError:  # a copy of this file alone: say so in the agent-facing shape
        where = os.path.dirname(os.path.abspath(__file__))
        sys.stderr.write(
            '{"ok": false, "error": {"code": "INTERNAL", "message": "bastion\'s proxy.py needs'
            f" wire.py beside it, in {where!r}; run `bastion ssh-config` (or `bastion"
            ' isolate setup`) again to install both. Nothing was sent to the target.",'
            ' "request_id": null, "retryable": false}}\n'
        )
        sys.exit(70)


# OpenSSH 9.x's getopt string (ssh.c): a letter followed by ':' takes an argument.
SSH_GETOPT = "1246ab:c:e:fgi:kl:m:no:p:qstvxAB:CD:E:F:GI:J:KL:MNO:PQ:R:S:TVw:W:XYy"
_TAKES_ARGUMENT = {SSH_GETOPT[i - 1] for i, c in enumerate(SSH_GETOPT) if c == ":"}
# What bastion does not serve: an ssh option letter, and the -o keyword (lowercase) with
# the values that ask for it (None: any value), each with the words for it.
NOT_SERVED = {
    "N": ("sessiontype", {"none"}, "-N (a connection without a command)"),
    "f": ("forkafterauthentication", {"yes", "true"}, "-f (a connection in the background)"),
    "L": ("localforward", None, "-L (local port forwarding)"),
    "R": ("remoteforward", None, "-R (remote port forwarding)"),
    "D": ("dynamicforward", None, "-D (dynamic port forwarding)"),
    "W": ("", None, "-W (stdio forwarding)"),
    "w": ("tunnel", {"yes", "point-to-point", "ethernet"}, "-w (a tunnel device)"),
}
# -N and -f of a ControlMaster (-M, -o ControlMaster=yes): a master for later commands,
# which the gateway judges as each comes (a registered run's own processes only).
MASTER_MAY = {"N", "f"}
SERVED = (
    "bastion runs one command per ssh call -- ssh HOST 'COMMAND', and the scp, rsync and "
    "git transfers made over it -- and forwards nothing: no ports (-L, -R, -D), no stdio "
    "(-W), no tunnel (-w); nor does it keep a connection without a command (-N) or in the "
    "background (-f), but for a ControlMaster inside a `bastion run`. Run ssh HOST "
    "'COMMAND' without those options."
)


def ssh_options(argv: list[str]) -> list[tuple[str, str]]:
    """The options in an OpenSSH client's argv, (letter, argument), as ssh reads them:
    getopt, which stops at the first word that is not an option, then once more after
    the destination up to the command; `--` ends them."""
    found: list[tuple[str, str]] = []
    words, at, destination = argv[1:], 0, False
    while at < len(words):
        word = words[at]
        at += 1
        if word == "--":
            break
        if not word.startswith("-") or word == "-":
            if destination:
                break  # the command
            destination = True
            continue
        for i, letter in enumerate(word[1:], 1):
            if letter in _TAKES_ARGUMENT:
                value = word[i + 1 :]
                if not value and at < len(words):
                    value, at = words[at], at + 1
                found.append((letter, value))
                break
            found.append((letter, ""))
    return found


def ssh_problem(argv: list[str]) -> str | None:
    """What the agent is told when this ssh argv asks for what bastion does not serve,
    or None."""
    asked: list[tuple[str, str]] = []  # (letter, words)
    master = False
    for letter, value in ssh_options(argv):
        if letter == "o":
            key, _, rest = value.replace("=", " ", 1).partition(" ")
            wanted = rest.strip().strip('"').lower()
            master = master or (key.lower() == "controlmaster" and wanted != "no")
            for option, (keyword, values, what) in NOT_SERVED.items():
                if keyword and key.lower() == keyword and (values is None or wanted in values):
                    asked.append((option, f"{what}, as -o {key}"))
        elif letter in NOT_SERVED:
            asked.append((letter, NOT_SERVED[letter][2]))
        master = master or letter == "M"
    asked = [(o, what) for o, what in asked if not (master and o in MASTER_MAY)]
    if not asked:
        return None
    words = ", ".join(dict.fromkeys(what for _, what in asked))
    return f"This ssh was called with {words}. {SERVED}"


def parent_ssh_argv() -> list[str] | None:
    """The argv of the OpenSSH client that ran this proxy, or None: not started by
    ssh (paramiko's ProxyCommand, a test), or its /proc entry cannot be read -- then
    nothing is checked here, and the gateway refuses what reaches it."""
    parent = os.getppid()
    try:
        exe = os.readlink(f"/proc/{parent}/exe")
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if os.path.basename(exe.removesuffix(" (deleted)")) != "ssh":
        return None
    return [w.decode("utf-8", "surrogateescape") for w in raw.split(b"\0")[:-1]]


def fail(message: str, ending: tuple[str, int, bool] = wire.INTERNAL) -> int:
    """Tell the agent, in the agent-facing error shape, why no SSH session could even start."""
    code, status, retryable = ending
    error = {
        "code": code,
        "message": message + " Nothing was sent to the target.",
        "request_id": None,
        "retryable": retryable,
    }
    import json  # a failure's path only (module comment above)

    sys.stderr.write(json.dumps({"ok": False, "error": error}) + "\n")
    return status


def reason(exc: OSError) -> str:
    """What went wrong, in words (a timeout's strerror is None)."""
    return exc.strerror or str(exc) or type(exc).__name__


def connect(sock: _socket.socket, path: str, timeout: float) -> None:
    """Connect within `timeout` seconds and bound each later send and receive the same.
    A blocking connect waits for ever while the listener's queue is full, as a wedged
    gateway's stays: SO_SNDTIMEO bounds that wait (it then fails EAGAIN)."""
    limit = struct.pack("@ll", int(timeout), int(timeout % 1 * 1_000_000))
    sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDTIMEO, limit)
    sock.connect(path)
    sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDTIMEO, bytes(len(limit)))
    sock.settimeout(timeout)


def read_reply(sock: _socket.socket) -> bytes:
    """Read the daemon's one-line answer and not one byte more: the SSH
    banner follows at once on the same socket, and it belongs to ssh."""
    sock.settimeout(wire.REPLY_TIMEOUT)
    data = bytearray()
    while len(data) < wire.MAX_HEADER:
        byte = sock.recv(1)
        if not byte:
            break
        data += byte
        if byte == b"\n":
            break
    return bytes(data)


def relay(sock: _socket.socket) -> int:
    """Copy bytes both ways until the daemon closes (no ProxyUseFdpass)."""
    import select  # this path only (module comment above)

    sock.setblocking(True)
    sock.settimeout(None)
    stdin_open = True
    while True:
        watch = [sock, 0] if stdin_open else [sock]
        readable, _, _ = select.select(watch, [], [])
        if 0 in readable:
            data = os.read(0, 65536)
            if data:
                sock.sendall(data)
            else:
                stdin_open = False
                sock.shutdown(_socket.SHUT_WR)
        if sock in readable:
            data = sock.recv(65536)
            if not data:
                return 0
            view = memoryview(data)
            while view:
                view = view[os.write(1, view) :]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    sock_path = os.environ.get("BASTION_AGENT_SOCKET", "")
    if len(args) >= 2 and args[0] == "--socket":
        sock_path = args[1]
        args = args[2:]
    if len(args) != 3 or not sock_path:
        sys.stderr.write("usage: bastion proxy [--socket PATH] HOST PORT USER\n")
        return 2
    host, port, user = args
    argv = parent_ssh_argv()
    problem = ssh_problem(argv) if argv is not None else None
    if problem is not None:
        return fail(problem, wire.UNSUPPORTED_REQUEST)
    line = wire.header(host, port, user)
    if len(line) > wire.MAX_HEADER:
        return fail("The host or user name is too long.")
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        connect(sock, sock_path, wire.REPLY_TIMEOUT)
        # The gateway may refuse before reading (a per-uid cap): its ERR line still waits.
        try:  # noqa: SIM105 (contextlib: an import this helper does without)
            sock.sendall(line)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = read_reply(sock)
    except FileNotFoundError:
        return fail(
            f"The bastion gateway is not running (no socket at {sock_path}); "
            "ask the operator to start `bastion daemon`."
        )
    except ConnectionRefusedError:
        return fail(
            f"The bastion gateway is not accepting connections at {sock_path}; "
            "ask the operator to start `bastion daemon`."
        )
    except (TimeoutError, BlockingIOError):  # no answer, or a queue full as long (EAGAIN)
        return fail(
            f"The bastion gateway at {sock_path} did not answer within {wire.REPLY_TIMEOUT:g} s "
            "(it is overloaded or stuck); retry in a moment, and if it persists ask the "
            "operator to check `bastion status`.",
            wire.GATEWAY_BUSY,
        )
    except OSError as exc:
        return fail(
            f"Could not talk to the bastion gateway at {sock_path}: {reason(exc)}; "
            "ask the operator to check `bastion status`."
        )
    if not reply.startswith(b"OK"):
        code, text = wire.read_refusal(reply)
        ending = wire.ENDINGS.get(code or "", wire.INTERNAL)
        return fail(f"The bastion gateway refused the connection: {text or 'no reply'}.", ending)
    if stat.S_ISSOCK(os.fstat(1).st_mode):
        # ProxyUseFdpass (ssh gives us a socketpair, not pipes): hand ssh the
        # connected socket itself and get out of the way.
        out = _socket.socket(fileno=1)
        try:
            rights = struct.pack("i", sock.fileno())
            out.sendmsg([b"\0"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
        except OSError as exc:
            return fail(f"Could not pass the connection to ssh: {reason(exc)}.")
        finally:
            out.detach()
        return 0
    try:
        return relay(sock)
    except OSError as exc:  # SSH had started: what became of the command is the gateway's to say
        sys.stderr.write(f"bastion proxy: the connection to the gateway broke: {reason(exc)}.\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
