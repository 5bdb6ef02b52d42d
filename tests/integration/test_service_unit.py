"""`bastion service install`, and the gateway under systemd.

Acceptance: "`systemd-analyze verify` accepts the generated unit". Three rings:

1. The unit `bastion service install` writes, for the system manager and for
   `--user`, is accepted by `systemd-analyze verify` (which needs no running
   systemd, and checks that the ExecStart binary exists), and a broken copy is
   not -- so the check can fail.
2. The real gateway speaks systemd's notify protocol to a datagram socket the
   test binds where `$NOTIFY_SOCKET` says (a path, and the abstract `@` form):
   `READY=1` once the agent socket accepts connections, `WATCHDOG=1` again and
   again, `STATUS=` following the vault, `STOPPING=1` on SIGTERM.
3. Opt-in (`BASTION_SYSTEMD_MANAGER=1`), where PID 1 is not systemd and the
   test runs as root, the generated units run under a real systemd: a user
   manager (`systemd --user`) the test starts in a mount namespace and cgroups
   of its own, with
   everything PID 1 would have set up for it (`/run/systemd/system`, the
   `inaccessible` nodes, `/run` a mount point). A user manager running as root
   sets up namespaces itself, as the system manager does, so the *system*
   unit's options apply for real too. The gateway starts (`systemctl start`
   returns on READY=1), unlocks with Argon2id at full strength, relays an
   agent's command to the real sshd, shows its state in `StatusText`, and is
   restarted by the watchdog when frozen -- every hardening option on. A probe
   under the same options is refused W+X memory, so MemoryDenyWriteExecute is
   really enforced, and a probe ExecStart shows systemd reads back exactly the
   argv the unit meant (spaces, quotes, `%`, `$` in the paths).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import psutil
import pytest

from bastion.devtools.sshd_fixture import Sshd
from bastion.ops import service_unit
from bastion.ops.service_unit import Mode, UnitInputs
from tests.harness import PASSPHRASE, bastion_cli, make_bastion, wait_for

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze is not installed (apt-get install systemd)"
)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    root = tmp_path / "home"
    r = bastion_cli(root, "init", "--passphrase-stdin", stdin=PASSPHRASE + "\n")
    assert r.returncode == 0, r.stderr
    return root


def install(
    home: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bastion.cli", "--home", str(home), "service", "install", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def verify(unit: Path, mode: Mode, runtime: Path) -> list[str]:
    """What `systemd-analyze verify` says about this unit (nothing when it accepts it).
    It exits 0 on warnings (an unknown key, a bad value), so its words are the verdict;
    lines about other units (none expected) are not this unit's problem."""
    assert ANALYZE is not None
    runtime.mkdir(mode=0o700, exist_ok=True)
    r = subprocess.run(
        [
            ANALYZE,
            *(["--user"] if mode is Mode.USER else []),
            "verify",
            "--man=no",
            "--recursive-errors=no",
            str(unit),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},  # a user manager wants one
    )
    said = [line for line in (r.stdout + r.stderr).splitlines() if unit.name in line]
    if r.returncode != 0:
        said.append(f"exit {r.returncode}: {r.stderr.strip()}")
    return said


# -- 1. the unit file ---------------------------------------------------------------------


@needs_analyze
@pytest.mark.parametrize("mode", [Mode.SYSTEM, Mode.USER], ids=lambda m: m.value)
def test_systemd_analyze_verify_accepts_the_generated_unit(
    home: Path, tmp_path: Path, mode: Mode
) -> None:
    unit = tmp_path / "units" / "bastion.service"
    r = install(home, "--output", str(unit), *(["--user"] if mode is Mode.USER else []))
    assert r.returncode == 0, r.stderr
    text = unit.read_text()
    assert f"--home {home} daemon" in text and "Type=notify" in text
    assert verify(unit, mode, tmp_path / "xdg") == []
    # The check can fail: a typo in a directive, a binary that does not exist.
    broken = tmp_path / "broken" / "bastion.service"
    broken.parent.mkdir()
    broken.write_text(
        text.replace("NoNewPrivileges=", "NoNewPrivilege=").replace(
            f"ExecStart={sys.executable}", "ExecStart=/nonexistent/python3"
        )
    )
    said = "\n".join(verify(broken, mode, tmp_path / "xdg"))
    assert "Unknown key 'NoNewPrivilege'" in said and "/nonexistent/python3" in said, said


@needs_analyze
def test_verify_reads_a_quoted_interpreter_path_and_a_user_line(tmp_path: Path) -> None:
    """A venv in a directory with a space: systemd finds the interpreter only if the
    path is quoted its way (the unquoted line names a binary that does not exist)."""
    venv = tmp_path / "my venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python3").symlink_to(sys.executable)
    inputs = UnitInputs(
        PurePosixPath(venv / "python3"),
        PurePosixPath(tmp_path / "a home"),
        Mode.SYSTEM,
        run_as="daemon",
    )
    unit = tmp_path / "units" / "bastion.service"
    unit.parent.mkdir()
    text = service_unit.render(inputs)
    assert f'ExecStart="{venv}/python3" -P' in text and "User=daemon" in text
    unit.write_text(text)
    assert verify(unit, Mode.SYSTEM, tmp_path / "xdg") == []
    unit.write_text(text.replace(f'"{venv}/python3"', f"{venv}/python3"))
    assert any("is not executable" in line for line in verify(unit, Mode.SYSTEM, tmp_path / "xdg"))


def test_install_writes_once_refuses_a_different_file_and_replaces_it_with_force(
    home: Path, tmp_path: Path
) -> None:
    unit = tmp_path / "bastion.service"
    first = install(home, "--output", str(unit))
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0] == f"wrote {unit}"
    assert "  systemctl daemon-reload && systemctl enable --now bastion" in lines
    assert any("the gateway starts locked" in x and f"--home {home} unlock" in x for x in lines)
    assert f"copy it to {service_unit.SYSTEM_UNIT_DIR}/bastion.service" in first.stdout
    assert oct(unit.stat().st_mode & 0o777) == "0o644"
    stdout = install(home, "--stdout")
    assert stdout.returncode == 0 and stdout.stdout == unit.read_text()  # one rendering

    again = install(home, "--output", str(unit))
    assert again.returncode == 0 and again.stdout.startswith(f"unchanged {unit}\n")

    unit.write_text(unit.read_text() + "# the operator's own line\n")
    refused = install(home, "--output", str(unit))
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == (
        f"bastion: {unit} exists and differs from this unit; compare with `--stdout`, "
        "then replace it with --force\n"
    )
    assert unit.read_text().endswith("# the operator's own line\n")  # untouched

    forced = install(home, "--output", str(unit), "--force")
    assert forced.returncode == 0 and forced.stdout.startswith(f"replaced {unit}\n")
    assert unit.read_text() == stdout.stdout


def test_a_user_unit_goes_where_the_user_manager_looks(home: Path, tmp_path: Path) -> None:
    config = tmp_path / "config"
    r = install(home, "--user", env={"XDG_CONFIG_HOME": str(config)})
    assert r.returncode == 0, r.stderr
    unit = config / "systemd" / "user" / "bastion.service"
    assert r.stdout.splitlines()[0] == f"wrote {unit}"
    assert "  systemctl --user daemon-reload && systemctl --user enable --now bastion" in r.stdout
    assert "journalctl --user -u bastion" in r.stdout and "loginctl enable-linger" in r.stdout
    assert "WantedBy=default.target" in unit.read_text()


def test_daemon_options_are_checked_and_kept(home: Path, tmp_path: Path) -> None:
    ok = install(home, "--stdout", "--", "--approval-timeout", "45", "--policies", "/etc/b")
    assert ok.returncode == 0, ok.stderr
    assert f"--home {home} daemon --approval-timeout 45 --policies /etc/b\n" in ok.stdout
    typo = install(home, "--stdout", "--", "--aproval-timeout", "45")
    assert typo.returncode == 1 and typo.stdout == ""
    assert typo.stderr.startswith("bastion: not an option of `bastion daemon`: No such option")
    relative = install(home, "--stdout", "--", "--policies", "pol")
    assert relative.returncode == 1
    assert relative.stderr == (
        "bastion: --policies pol: give an absolute path "
        "(systemd starts the gateway in another directory)\n"
    )
    fresh = install(tmp_path / "nothing-here", "--stdout")
    assert fresh.returncode == 1
    assert (
        fresh.stderr
        == f"bastion: {tmp_path}/nothing-here is not initialised; run `bastion init` first\n"
    )


# -- 2. the notify protocol, spoken by the real gateway -------------------------------------


class NotifyListener:
    """The service manager's end: a datagram socket, bound where $NOTIFY_SOCKET says."""

    def __init__(self, where: str, tmp_path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if where == "path":
            path = tmp_path / "notify.sock"
            self.sock.bind(str(path))
            self.env = str(path)
        else:
            name = f"bastion-test-{secrets.token_hex(8)}"
            self.sock.bind(b"\0" + name.encode())
            self.env = "@" + name

    def next(self, timeout: float = 20.0) -> dict[str, str]:
        ready, _, _ = select.select([self.sock], [], [], timeout)
        assert ready, f"no notification within {timeout} s"
        data = self.sock.recv(4096).decode()
        return dict(line.split("=", 1) for line in data.split("\n"))

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("where", ["path", "abstract"])
def test_the_gateway_tells_systemd_ready_watchdog_status_and_stopping(
    home: Path, tmp_path: Path, where: str
) -> None:
    listener = NotifyListener(where, tmp_path)
    log = (tmp_path / "gateway.log").open("wb")
    env = {**os.environ, "NOTIFY_SOCKET": listener.env, "WATCHDOG_USEC": "400000"}
    env.pop("WATCHDOG_PID", None)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "bastion.cli", "--home", str(home), "daemon"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # The process systemd started hands the main pid to the gateway's child first
        # (`bastion.memory`: the gateway runs in a child forked after PR_SET_DUMPABLE).
        handed = listener.next()
        child = int(handed["MAINPID"])
        assert handed == {"MAINPID": str(child)} and psutil.Process(child).ppid() == daemon.pid
        ready = listener.next()
        assert ready == {"READY": "1", "STATUS": "locked: run `bastion unlock`"}
        # READY came after the sockets listen: an agent's connection is accepted now.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as agent:
            agent.settimeout(5)
            agent.connect(str(home / "run" / "agent.sock"))
        status = bastion_cli(home, "status", "--json")
        assert json.loads(status.stdout)["locked"] is True

        pings = [time.monotonic()]
        while len(pings) < 5:
            assert listener.next(timeout=5) == {"WATCHDOG": "1"}
            pings.append(time.monotonic())
        gaps = [b - a for a, b in itertools.pairwise(pings[1:])]
        assert all(g < 0.4 for g in gaps), gaps  # half of WATCHDOG_USEC, well within it

        r = bastion_cli(home, "unlock", "--passphrase-stdin", stdin=PASSPHRASE + "\n")
        assert r.returncode == 0, r.stderr
        while (msg := listener.next(timeout=10)).get("STATUS") is None:
            assert msg == {"WATCHDOG": "1"}
        assert msg["STATUS"] == "unlocked, 0 sessions"

        daemon.send_signal(signal.SIGTERM)
        while (msg := listener.next(timeout=20)) == {"WATCHDOG": "1"}:
            pass
        assert msg == {"STOPPING": "1", "STATUS": "stopping"}
        assert daemon.wait(20) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(10)
        log.close()
        listener.close()
    assert "could not notify" not in (tmp_path / "gateway.log").read_text()


# -- 3. under a real systemd ------------------------------------------------------------------


def pid1_is_systemd() -> bool:
    """As sd_booted(3) asks, and by PID 1's name."""
    comm = Path("/proc/1/comm").read_text().strip() if Path("/proc/1/comm").exists() else ""
    return os.path.exists("/run/systemd/system") or comm == "systemd"


SYSTEMD = "/lib/systemd/systemd"
manager_missing = (
    # Opt-in: the test moves itself into a cgroup of its own and starts a manager, which
    # a CI machine shared with other jobs should not have done to it unasked.
    "set BASTION_SYSTEMD_MANAGER=1 to start a private systemd manager (root, cgroups)"
    if os.environ.get("BASTION_SYSTEMD_MANAGER") != "1"
    else "starting a systemd manager of our own needs root (a mount namespace, cgroups)"
    if os.geteuid() != 0
    else "PID 1 is systemd here: this test starts a manager only where none runs"
    if pid1_is_systemd()
    else f"{SYSTEMD} is not installed (apt-get install systemd)"
    if not os.access(SYSTEMD, os.X_OK) or not shutil.which("systemctl")
    else "unshare is not installed (util-linux)"
    if not shutil.which("unshare")
    else None
)


def cgroup_dirs(name: str) -> list[Path]:
    """A child of this process's cgroup, in each hierarchy systemd tracks processes
    in (cgroup2, and the v1 `name=systemd` one on hybrid hosts): the manager takes
    the cgroup it starts in as its whole tree, so it must start in one of its own."""
    mounts = {}
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, where, kind, opts, *_ = line.split()
        if kind == "cgroup2":
            mounts[""] = where
        elif kind == "cgroup" and "name=systemd" in opts.split(","):
            mounts["name=systemd"] = where
    out = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers in mounts:
            out.append(Path(mounts[controllers] + path.rstrip("/")) / name)
    return out


class PrivateManager:
    """A `systemd --user` of the test's own, as root, talking over its private socket."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runtime = root / "runtime"
        self.units = root / "config" / "systemd" / "user"
        self.cgroups = cgroup_dirs(f"bastion-test-{secrets.token_hex(6)}")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.runtime.mkdir(mode=0o700, parents=True)
        self.units.mkdir(parents=True)
        (self.units / "idle.target").write_text("[Unit]\nDescription=nothing to start\n")
        nodes = "import socket; socket.socket(socket.AF_UNIX).bind('sock')"
        script = "\n".join(
            [
                "set -e",
                *(f"mkdir {d}; echo $$ > {d}/cgroup.procs" for d in self.cgroups),
                # What PID 1 sets up at boot, here inside this mount namespace only.
                "mountpoint -q /run || mount --bind /run /run",
                "mount -t tmpfs -o mode=755 tmpfs /run/systemd",
                "mkdir /run/systemd/system /run/systemd/inaccessible",
                "cd /run/systemd/inaccessible",
                "touch reg; mkdir dir; mkfifo fifo; mknod chr c 0 0; mknod blk b 0 0",
                f'{sys.executable} -c "{nodes}"',
                "chmod 0000 reg dir fifo chr blk sock; cd /",
                f"exec {SYSTEMD} --user --unit=idle.target",
            ]
        )
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root),
            "XDG_RUNTIME_DIR": str(self.runtime),
            "XDG_CONFIG_HOME": str(self.root / "config"),
        }
        with open(self.root / "manager.log", "wb") as log:
            self.proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        # Its private socket answers once it has loaded its units.
        wait_for(lambda: self.ctl("show", "-p", "Version", check=False).returncode == 0, 20)

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        assert self.proc is not None and self.proc.poll() is None, self.log()
        r = subprocess.run(
            ["systemctl", "--user", *args],
            env={**os.environ, "XDG_RUNTIME_DIR": str(self.runtime)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert not check or r.returncode == 0, f"systemctl {args}: {r.stderr}"
        return r

    def show(self, unit: str) -> dict[str, str]:
        keys = "ActiveState,SubState,StatusText,MainPID,NRestarts,ExecMainStatus,Result"
        out = self.ctl("show", unit, "-p", keys).stdout
        return dict(line.split("=", 1) for line in out.splitlines())

    def install(self, name: str, text: str, log: Path | None = None) -> None:
        (self.units / name).write_text(text)
        if log is not None:  # no journald here: the unit's output goes to a file
            drop_in = self.units / f"{name}.d"
            drop_in.mkdir(exist_ok=True)
            (drop_in / "log.conf").write_text(
                f"[Service]\nStandardOutput=append:{log}\nStandardError=inherit\n"
            )
        self.ctl("daemon-reload")

    def log(self) -> str:
        return (self.root / "manager.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # a user manager exits: stops its units
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for top in self.cgroups:  # every cgroup it made is below ours: remove bottom-up
            if top.is_dir():
                for d, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
                    with contextlib.suppress(OSError):
                        os.rmdir(d)


def probe_unit(unit_text: str, exec_start: str) -> str:
    """The gateway's unit with another program: same hardening, run once."""
    lines = []
    for line in unit_text.splitlines():
        if line.startswith("ExecStart="):
            line = f"ExecStart={exec_start}"
        elif line == "Type=notify":
            line = "Type=oneshot"
        elif line.startswith(("WatchdogSec=", "Restart", "NotifyAccess=")):
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"


WX_PROBE = """\
import mmap, sys
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
except PermissionError:
    sys.exit(3)
"""


def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, v in (line.split(":", 1) for line in lines)}


@pytest.fixture
def scratch() -> Iterator[Path]:
    """Outside /tmp, so the system unit keeps PrivateTmp= and the manager's notify socket
    stays visible inside it (real managers live in /run too)."""
    path = Path(f"/run/bastion-test-{secrets.token_hex(6)}")
    path.mkdir(mode=0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(manager_missing is not None, reason=manager_missing or "")
@pytest.mark.parametrize("mode", [Mode.SYSTEM, Mode.USER], ids=lambda m: m.value)
def test_the_gateway_runs_under_systemd_with_its_hardening(
    scratch: Path, sshd_server: Sshd, client_key: tuple[Path, str], mode: Mode
) -> None:
    assert sshd_server.info is not None
    b = make_bastion(scratch / "b", sshd_server.info, client_key[0], start=False)
    manager = PrivateManager(scratch / "manager")
    gateway_log = scratch / "gateway.log"
    try:
        manager.start()
        unit = manager.units / "bastion.service"
        out = b.cli(
            "service", "install", "--output", str(unit), *(["--user"] if mode is Mode.USER else [])
        )
        assert "enable --now bastion" in out.stdout
        text = unit.read_text()
        assert ("PrivateTmp=yes" in text) is (mode is Mode.SYSTEM)
        manager.install("bastion.service", text, log=gateway_log)

        # Type=notify: `start` returns once the gateway said READY=1, its sockets listening.
        manager.ctl("start", "bastion")
        state = manager.show("bastion")
        assert (state["ActiveState"], state["SubState"]) == ("active", "running"), state
        assert state["StatusText"] == "locked: run `bastion unlock`"
        assert b.op("status")["locked"] is True
        main = int(state["MainPID"])
        kernel = proc_status(main)
        assert kernel["NoNewPrivs"] == "1" and kernel["Seccomp"] == "2", kernel

        # Argon2id at full strength (the unit's environment has no test profile), then a
        # command: the identity walk, the journal, outbound TCP to the real sshd.
        b.unlock()
        wait_for(lambda: manager.show("bastion")["StatusText"] == "unlocked, 0 sessions", 15)
        agent = b.agent()
        rid = agent.start("echo through-systemd")
        b.approve_next()
        result = agent.wait(rid)
        assert (result.rc, result.stdout) == (0, b"through-systemd\n"), result.stderr
        wait_for(lambda: manager.show("bastion")["StatusText"] == "unlocked, 1 session", 15)
        assert int(manager.show("bastion")["MainPID"]) == main

        # The same options refuse W+X memory: MemoryDenyWriteExecute is enforced here,
        # and the gateway above needed none.
        probe = scratch / "wx_probe.py"
        probe.write_text(WX_PROBE)
        manager.install("wx-probe.service", probe_unit(text, f"{sys.executable} {probe}"))
        manager.ctl("start", "wx-probe", check=False)
        assert manager.show("wx-probe")["ExecMainStatus"] == "3"

        # The pings keep a turning loop alive; one that stops turning is restarted.
        drop_in = manager.units / "bastion.service.d" / "watchdog.conf"
        drop_in.write_text("[Service]\nWatchdogSec=1s\n")
        manager.ctl("daemon-reload")
        manager.ctl("restart", "bastion")
        before = manager.show("bastion")
        time.sleep(3)  # three watchdog intervals, and no event to wait for: nothing happens
        after = manager.show("bastion")
        assert (after["MainPID"], after["NRestarts"]) == (before["MainPID"], before["NRestarts"])
        frozen = int(after["MainPID"])
        os.kill(frozen, signal.SIGSTOP)

        def restarted() -> bool:
            s = manager.show("bastion")
            return s["ActiveState"] == "active" and s["MainPID"] not in ("0", str(frozen))

        wait_for(restarted, 60)
        assert int(manager.show("bastion")["NRestarts"]) > int(before["NRestarts"])
        assert manager.show("bastion")["StatusText"] == "locked: run `bastion unlock`"

        manager.ctl("stop", "bastion")
        assert manager.show("bastion")["ActiveState"] == "inactive"
        logged = gateway_log.read_text()
        assert "gateway stopped" in logged and "could not notify" not in logged, logged
        assert "intact" in b.cli("audit", "verify").stdout
    finally:
        for a in b.agents:
            a.close()
        manager.stop()


@pytest.mark.skipif(manager_missing is not None, reason=manager_missing or "")
def test_systemd_reads_back_the_exact_command_line(scratch: Path) -> None:
    """Spaces, quotes, a backslash, `%` and `$` in the interpreter's and the home's paths:
    systemd hands the program exactly the argv the unit meant."""
    where = scratch / "an interpreter"
    where.mkdir()
    record = scratch / "argv.json"
    fake_python = where / "py thon"
    fake_python.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    fake_python.chmod(0o755)
    inputs = UnitInputs(
        PurePosixPath(fake_python),
        PurePosixPath(scratch / 'home 100% $HOME "q" \\b'),
        Mode.SYSTEM,
        daemon_args=("--wrapper", "my tool"),
    )
    text = service_unit.render(inputs)
    manager = PrivateManager(scratch / "manager")
    try:
        manager.start()
        exec_start = re.search(r"^ExecStart=(.*)$", text, re.M)
        assert exec_start is not None
        manager.install("argv-probe.service", probe_unit(text, exec_start[1]))
        manager.ctl("start", "argv-probe")
        assert json.loads(record.read_text()) == list(service_unit.exec_argv(inputs)[1:])
        description = manager.ctl("show", "argv-probe", "-p", "Description").stdout
        assert f"({inputs.home})" in description
    finally:
        manager.stop()
