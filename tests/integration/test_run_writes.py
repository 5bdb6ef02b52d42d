"""A run changes only what it was given (issue 44), tried from inside a real `bastion run`
by a non-root operator whose bastion home is where users keep it (`~/.local/share/
bastion`), against that operator's own gateway and the real sshd.

Each attack is the hostile review's, run as the agent inside a default run; the proof is
the real file on the host. Each has a positive control: the same action outside every
run (it works: the attack has teeth), or the same run given the matching `--rw`,
`--rw-git`, `--expose` or `--share-net`. On the tree before the change (f38cdd7) the
attacks reached the disk: the home's parent renamed, start-up files created, the
project's `.git/config` and hooks written, the host's loopback reached.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import FAKE_OPERATOR
from tests.operator_home import Operator, operator


@pytest.fixture(scope="module")
def op(sshd_server: object, client_key: tuple[Path, str]) -> Iterator[Operator]:
    info: SshdInfo = sshd_server.info  # type: ignore[attr-defined]
    with operator(info, client_key[0]) as o:
        yield o


@pytest.fixture
def project(op: Operator, tmp_path: Path) -> Path:
    """A git repository of the operator's, in its home: the project a run works on."""
    d = op.home / f"proj-{tmp_path.name[-12:]}"
    r = op.sh(f"mkdir -p {d} && cd {d} && git init -q . && echo hi > README")
    assert r.returncode == 0, r.stderr
    return d


def ok(r: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


# -- 1. the home's parent --------------------------------------------------------------


def test_renaming_the_homes_parent_in_a_run_changes_nothing_on_the_disk(
    op: Operator, project: Path
) -> None:
    """The review renamed `~/.local/share`, rebuilt the bastion home with a policy of
    its own and a fake operator socket. In a run the rename lands in the run's overlay:
    the real directory, its inode and the real policies are as they were, and the
    gateway still answers by the real policy (a command outside it is denied)."""
    share = op.home / ".local" / "share"
    before = share.stat().st_ino, sorted(p.name for p in (op.bastion_home / "policies").iterdir())
    attack = (
        "mv ~/.local/share ~/.local/share.x 2>/dev/null; "
        "mkdir -p ~/.local/share/bastion/policies ~/.local/share/bastion/operator && "
        "printf '[hosts.evil]\\n' > ~/.local/share/bastion/policies/evil.toml && "
        "ls -d ~/.local/share.x && echo PLANTED"
    )
    r = ok(op.run(attack, cwd=project))
    assert "PLANTED" in r.stdout  # inside the run, the rename and the rebuild happened
    assert not (op.home / ".local" / "share.x").exists()
    assert (
        share.stat().st_ino,
        sorted(p.name for p in (op.bastion_home / "policies").iterdir()),
    ) == before
    # The gateway still reads the real policy: a host the agent "added" is unknown.
    r = op.run(f"ssh -F {op.config} evil true", cwd=project)
    assert r.returncode == 77 and "UNKNOWN_HOST" in r.stderr, r.stderr
    # Control: the operator's uid renames a directory of its home on the disk, outside a run.
    ctl = op.home / ".local" / "ctl"
    ok(op.sh(f"mkdir -p {ctl} && mv {ctl} {ctl}.x"))
    assert (op.home / ".local" / "ctl.x").is_dir()


def test_a_run_given_a_directory_renames_there_for_real(op: Operator, project: Path) -> None:
    """The positive control of the overlay: what a run was given is the disk itself."""
    (project / "sub").mkdir()
    ok(op.run("mv sub sub.renamed && echo made > new-file", cwd=project))
    assert (project / "sub.renamed").is_dir() and (project / "new-file").read_text() == "made\n"


# -- 2. planting what the operator runs next -----------------------------------------

PLANTED = (
    ".bash_profile",
    ".bash_aliases",
    ".zshrc",
    ".inputrc",
    ".config/autostart/evil.desktop",
    ".config/environment.d/evil.conf",
    ".local/bin/git",
    ".gitconfig",
    ".local/lib/python3.11/site-packages/evil.pth",
    ".ssh/config",
    ".ssh/authorized_keys",
    ".config/fish/config.fish",
    ".config/systemd/user/evil.service",
)


def _plant_script() -> str:
    lines = ["mv ~/.config ~/.config.moved 2>/dev/null; mkdir -p ~/.config"]
    for rel in PLANTED:
        lines.append(f"mkdir -p \"$(dirname ~/{rel})\" && echo 'touch /tmp/PWNED' > ~/{rel}")
    lines.append("cat ~/.bash_profile")
    return " && ".join(lines)


def test_start_up_files_planted_in_a_run_never_reach_the_disk(op: Operator, project: Path) -> None:
    """None of these existed at start (the review's point: read-only binds covered only
    what did); in a run each is made and read back, and none is on the disk after."""
    for rel in PLANTED:
        assert not (op.home / rel).exists(), rel
    r = ok(op.run(_plant_script(), cwd=project))
    assert "touch /tmp/PWNED" in r.stdout
    for rel in PLANTED:
        assert not (op.home / rel).exists(), f"{rel} reached the disk"
    assert not (op.home / ".config.moved").exists()
    # Control: the same script outside every run, in a home of the same layout, plants all.
    ctl = op.home / "ctl-home"
    ok(op.sh(f"mkdir -p {ctl} && HOME={ctl} sh -c {_quote(_plant_script())}"))
    for rel in PLANTED:
        assert (ctl / rel).exists(), rel


def test_a_pipx_style_bastion_link_cannot_be_replaced(op: Operator, project: Path) -> None:
    """The review replaced `~/.local/bin/bastion` (a link to the venv's) with a wrapper
    that captured the passphrase at the next unlock."""
    link = op.home / ".local" / "bin" / "bastion"
    ok(op.sh(f"mkdir -p {link.parent} && ln -sf {op.python.parent / 'bastion'} {link}"))
    try:
        ok(op.run(f"rm -f {link} && printf '#!/bin/sh\\ncat > /tmp/pw\\n' > {link}", cwd=project))
        assert link.is_symlink() and str(op.python.parent) in str(link.readlink())
    finally:
        link.unlink()


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


# -- the project: the one door, with git's code read-only ------------------------------


def test_the_projects_git_code_is_read_only_and_commit_still_works(
    op: Operator, project: Path
) -> None:
    git = project / ".git"
    config = (git / "config").read_text()
    r = op.run(
        "git -c user.name=a -c user.email=a@b commit -qm first --allow-empty && "
        "(git config core.fsmonitor 'touch /tmp/M' 2>&1 || echo CONFIG-REFUSED) && "
        "(echo 'touch /tmp/M' > .git/hooks/pre-commit 2>&1 || echo HOOK-REFUSED) && "
        "(mkdir -p .git/info && echo x > .git/info/attributes 2>&1 || echo INFO-REFUSED)",
        cwd=project,
    )
    ok(r)
    assert {"CONFIG-REFUSED", "HOOK-REFUSED", "INFO-REFUSED"} <= set(r.stdout.split())
    assert (git / "config").read_text() == config
    assert not (git / "hooks" / "pre-commit").exists()
    log = ok(op.sh("git log --oneline", cwd=project)).stdout
    assert "first" in log  # the commit reached the real repository
    # Renaming .git away and rebuilding it (the mounts would move with it) is refused;
    # a `commondir` (git would read its config from there) made by the run is moved aside.
    evil = project / "evil"
    r = op.run(
        "(mv .git .git.old 2>&1 || echo RENAME-REFUSED) && mkdir -p evil && "
        "printf '[core]\\n\\tfsmonitor = touch /tmp/M\\n' > evil/config && "
        "echo ../evil > .git/commondir",
        cwd=project,
    )
    ok(r)
    assert "RENAME-REFUSED" in r.stdout and (git / "config").read_text() == config
    assert not (git / "commondir").exists() and "commondir" in r.stderr, r.stderr
    assert "fsmonitor" not in ok(op.sh("git config --list", cwd=project)).stdout
    assert evil.is_dir()
    # Control: --rw-git lets the same run change them, on the disk.
    ok(
        op.run(
            "git config core.fsmonitor false && touch .git/hooks/pre-commit",
            "--rw-git",
            cwd=project,
        )
    )
    assert "fsmonitor" in (git / "config").read_text()
    assert (git / "hooks" / "pre-commit").exists()


def test_the_system_is_read_only_and_rw_gives_a_path_back(op: Operator, project: Path) -> None:
    spare = op.home.parent / f"{op.name}-spare"
    spare.mkdir(exist_ok=True)
    import os

    os.chown(spare, op.uid, op.gid)
    try:
        r = op.run(f"touch {spare}/x 2>&1; touch /var/tmp/bt-{op.name} 2>&1; true", cwd=project)
        assert r.stdout.count("Read-only file system") == 2, r.stdout
        assert not (spare / "x").exists()
        ok(op.run(f"touch {spare}/x", "--rw", str(spare), cwd=project))
        assert (spare / "x").exists()
        # A file of the home given read-write: its writes reach the disk, the rest do not.
        notes = op.write(op.home / "notes.txt", "before\n")
        ok(op.run(f"echo after > {notes}; echo x > ~/other.txt", "--rw", str(notes), cwd=project))
        assert notes.read_text() == "after\n" and not (op.home / "other.txt").exists()
    finally:
        subprocess.run(["rm", "-rf", str(spare)], check=False)


def test_a_door_that_would_hold_the_home_is_refused_with_why(op: Operator) -> None:
    r = op.run("true", "--rw", str(op.home / ".local"))
    assert r.returncode != 0 and "(the bastion home)" in r.stderr, r.stderr
    # A run started in the home itself is given no project: its writes stay in the overlay.
    r = ok(op.run("echo x > ~/in-home && cat ~/in-home", cwd=op.home))
    assert "no project is given" in r.stderr and not (op.home / "in-home").exists()


def test_a_home_with_a_mount_below_it_is_refused_with_the_fix(op: Operator, project: Path) -> None:
    """A mount below the home (sshfs, FUSE, a container's storage) cannot be covered by
    an overlay made in a user namespace: the run refuses before it registers, naming the
    mount; --private-home works. Control: every other test, without the mount."""
    mnt = op.home / "mnt"
    mnt.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "none", str(mnt)], check=True)
    try:
        r = op.run("true", cwd=project)
        assert r.returncode != 0 and f"mounts below it ({mnt})" in r.stderr, r.stderr
        assert "--private-home" in r.stderr and "registered" not in r.stderr
        ok(op.run("echo works", "--private-home", cwd=project))
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# -- what a run must not read -----------------------------------------------------------

SECRETS = {
    ".config/chromium/Default/Cookies": "chromium-cookie",
    ".mozilla/firefox/p.default/cookies.sqlite": "firefox-cookie",
    ".aws/credentials": "aws-secret",
    ".kube/config": "kube-token",
    ".netrc": "netrc-password",
    ".docker/config.json": "docker-auth",
    ".config/gh/hosts.yml": "gh-token",
    ".git-credentials": "git-credential",
    ".password-store/site.gpg": "pass-entry",
    ".local/share/keyrings/login.keyring": "keyring",
    ".ssh/id_ed25519": "-----BEGIN OPENSSH PRIVATE KEY-----\nssh-key",
    ".gnupg/private-keys-v1.d/k.key": "gpg-key",
    ".vault-token": "vault-token",
}


def test_what_a_run_must_not_read_stays_hidden_and_expose_gives_it_back(
    op: Operator, project: Path
) -> None:
    for rel, text in SECRETS.items():
        op.write(op.home / rel, text + "\n", 0o600)
    try:
        cat = " ; ".join(f"cat ~/{rel} 2>/dev/null" for rel in SECRETS)
        r = op.run(cat + "; true", cwd=project)
        for rel, text in SECRETS.items():
            assert text.splitlines()[-1] not in r.stdout, f"{rel} was read from a run"
        # Control: outside every run the operator reads them all; --expose gives one back.
        out = ok(op.sh(cat + "; true")).stdout
        assert all(text.splitlines()[-1] in out for text in SECRETS.values())
        r = ok(op.run("cat ~/.aws/credentials", "--expose", str(op.home / ".aws"), cwd=project))
        assert "aws-secret" in r.stdout
    finally:
        for rel in SECRETS:
            (op.home / rel).unlink(missing_ok=True)


# -- the network ------------------------------------------------------------------------


@pytest.fixture
def loopback_service() -> Iterator[int]:
    """A service of the operator's on the host's loopback (a console, a database)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.sendall(b"SERVICE-ANSWERED\n")
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield port
    stop.set()
    t.join(5)
    srv.close()


CONNECT = (
    'python3 -c "import socket,sys\n'
    "for h in ('127.0.0.1', '10.0.2.2'):\n"
    "    try:\n"
    "        s = socket.create_connection((h, {port}), timeout=3); print(h, s.recv(64))\n"
    "    except OSError as e:\n"
    "        print(h, 'REFUSED', e)\""
)


def test_the_hosts_loopback_cannot_be_reached_from_a_run(
    op: Operator, project: Path, loopback_service: int
) -> None:
    script = CONNECT.format(port=loopback_service)
    r = ok(op.run(script, cwd=project))
    assert "SERVICE-ANSWERED" not in r.stdout and r.stdout.count("REFUSED") == 2, r.stdout
    # Control: --share-net reaches it (and so does any process outside a run).
    r = ok(op.run(script, "--share-net", cwd=project))
    assert "127.0.0.1 b'SERVICE-ANSWERED" in r.stdout, r.stdout


def test_outbound_network_still_works_from_a_run(op: Operator, project: Path) -> None:
    """Names resolve and a TCP connection out is made (to the package registry this
    machine reaches); skipped, with the reason, where the host itself cannot."""
    probe = (
        "python3 -c \"import socket; s = socket.create_connection(('pypi.org', 443), timeout=10);"
        " print('OUT', s.getpeername()[0])\""
    )
    outside = op.sh(probe)
    if outside.returncode != 0:
        pytest.skip(f"the host reaches no registry here: {outside.stderr.strip()[-200:]}")
    r = ok(op.run(probe, cwd=project))
    assert "OUT " in r.stdout


# -- the overlay: what agents do in a home still works -----------------------------------


def test_pip_install_user_goes_into_the_overlay_and_keep_home_keeps_it(
    op: Operator, project: Path
) -> None:
    import sysconfig

    pkg = project / "tinypkg"
    op.write(
        pkg / "pyproject.toml",
        '[project]\nname = "tinypkg"\nversion = "1"\n[build-system]\n'
        'requires = []\nbuild-backend = "setuptools.build_meta"\n',
    )
    op.write(pkg / "tinypkg.py", "WHERE = 'installed'\n")
    # The system python's pip --user (pip and setuptools from the test venv: Debian's
    # python3 has none of its own), as an agent installs a tool for itself.
    site = sysconfig.get_paths()["purelib"]
    install = (
        f"PYTHONPATH={site} /usr/bin/python3 -m pip install -q --user --break-system-packages "
        "--no-index --no-build-isolation ./tinypkg && "
        "cd / && /usr/bin/python3 -c 'import tinypkg; print(tinypkg.WHERE)'"
    )
    r = ok(op.run(install, cwd=project))
    assert "installed" in r.stdout
    # A language server's cache and a test suite's /tmp work too, and stay the run's.
    cache = "mkdir -p ~/.cache/lsp && echo idx > ~/.cache/lsp/index && echo t > /tmp/suite"
    ok(op.run(cache + " && cat ~/.cache/lsp/index /tmp/suite", cwd=project))
    assert not (op.home / ".cache" / "lsp").exists()
    user_site = op.home / ".local" / "lib"
    assert not any(user_site.rglob("tinypkg*")), "the install reached the disk"
    # A second default run starts from the disk again; --keep-home keeps the label's.
    check = "cd / && /usr/bin/python3 -c 'import tinypkg' 2>/dev/null && echo KEPT || echo GONE"
    assert "GONE" in ok(op.run(check, cwd=project)).stdout
    kept = ["--keep-home", "--label", f"kept-{op.name}"]
    ok(op.bastion("run", *kept, "--", "/bin/sh", "-c", install, cwd=project))
    r = ok(op.bastion("run", *kept, "--", "/bin/sh", "-c", check, cwd=project))
    assert "KEPT" in r.stdout
    assert "GONE" in ok(op.run(check, cwd=project)).stdout
    assert not any(user_site.rglob("tinypkg*"))


def test_npm_install_goes_into_the_overlay(op: Operator, project: Path) -> None:
    """A global install and npm's cache land in the run's home; the project's own
    node_modules, in the door, on the disk. Offline: a package of the project's."""
    import shutil

    if not shutil.which("npm"):
        pytest.skip("npm is not installed")
    op.write(project / "tinynpm" / "package.json", '{"name": "tinynpm", "version": "1.0.0"}\n')
    op.write(project / "tinynpm" / "index.js", "module.exports = 'npm-installed';\n")
    flags = "--offline --no-audit --no-fund --loglevel=error"
    script = (
        f"npm install -g --prefix ~/.npm-global {flags} ./tinynpm && "
        f"npm install {flags} ./tinynpm && "
        "ls ~/.npm-global/lib/node_modules && node -e \"console.log(require('tinynpm'))\""
    )
    r = ok(op.run(script, cwd=project))
    assert "tinynpm" in r.stdout and "npm-installed" in r.stdout
    assert not (op.home / ".npm-global").exists() and not (op.home / ".npm").exists()
    assert (project / "node_modules" / "tinynpm").exists()  # the project's, on the disk


def test_status_names_what_each_live_run_was_given(op: Operator, project: Path) -> None:
    import json
    import time

    ready = project / "ready"
    argv = op.cli("run", "--label", "given", "--share-net", "--rw-git", "--", "/bin/sh", "-c",
                  f"touch {ready}; sleep 60")  # fmt: skip
    run = subprocess.Popen(op.argv(*argv), env=op.env(), cwd=project,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert run.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.05)
        runs = json.loads(ok(op.bastion("status", "--json")).stdout)["runs"]
        mine = [r for r in runs if r["label"] == "given"]
        assert mine and mine[0]["given"] == [f"project {project}", "--rw-git", "--share-net"]
        human = ok(op.bastion("status")).stdout
        assert f"given (pid {run.pid}): project {project}, --rw-git, --share-net" in human
        assert "what a default run can read, write and reach:" in human
    finally:
        run.kill()
        run.wait(30)


def test_the_cli_sends_no_passphrase_to_a_server_in_a_run(op: Operator, project: Path) -> None:
    """The review's fake operator socket, served from inside a real run (the socket in
    a directory the run was given, a home whose operator/ leads there, a record that
    names the fake as the gateway): `bastion unlock` refuses it and sends nothing.
    Control: the same unlock, at the real home, reaches the real gateway."""
    import json
    import time

    import psutil

    from bastion.ops import opsock

    door = project / "fake-operator"
    door.mkdir()
    os.chown(door, op.uid, op.gid)
    sock, got = door / "operator.sock", door / "received"
    argv = op.cli("run", "--label", "fake", "--rw", str(door), "--",
                  "/usr/bin/python3", "-c", FAKE_OPERATOR, str(sock), str(got))  # fmt: skip
    run = subprocess.Popen(op.argv(*argv), env=op.env(), cwd=project,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert run.poll() is None and time.monotonic() < deadline, run.stderr
            time.sleep(0.05)
        fake = next(p for p in psutil.Process(run.pid).children(recursive=True)
                    if p.name().startswith("python") and str(sock) in p.cmdline())  # fmt: skip
        ticks = int(Path(f"/proc/{fake.pid}/stat").read_text().rsplit(")")[1].split()[19])
        links = {ns: os.readlink(f"/proc/{fake.pid}/ns/{ns}") for ns in opsock.NAMESPACES}
        record = {**opsock.own_record(), "uid": op.uid, "pid": fake.pid, "start_ticks": ticks,
                  "namespaces": links}  # fmt: skip
        op.write(door / "gateway.json", json.dumps(record))
        rebuilt = op.home / "rebuilt-home"
        ok(op.sh(f"mkdir -p {rebuilt} && ln -s {door} {rebuilt}/operator"))
        r = op.bastion("--home", str(rebuilt), "unlock", "--passphrase-stdin", stdin="pw\n")
        assert r.returncode == 1 and "unlocked" not in r.stdout, r
        assert f"is answered by pid {fake.pid}" in r.stderr and "nothing was sent" in r.stderr
        run.wait(60)
        assert got.read_bytes() == b"", "the passphrase reached the fake server"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(30)
    ok(op.bastion("lock"))
    from tests.harness import PASSPHRASE

    r = ok(op.bastion("unlock", "--passphrase-stdin", stdin=PASSPHRASE + "\n"))
    assert r.stdout.startswith("unlocked")


# -- ssh through bastion from a default run ----------------------------------------------


def test_ssh_and_scp_through_bastion_work_in_a_default_run(op: Operator, project: Path) -> None:
    (project / "up.txt").write_text("payload\n")
    import os

    os.chown(project / "up.txt", op.uid, op.gid)
    script = (
        f"ssh -F {op.config} web1 'echo through-bastion' && "
        f"scp -q -F {op.config} up.txt web1:/tmp/bt-up-{op.name}.txt && "
        f"ssh -F {op.config} web1 'cat /tmp/bt-up-{op.name}.txt; rm -f /tmp/bt-up-{op.name}.txt'"
    )
    proc = subprocess.Popen(
        op.argv(*op.cli("run", "--label", "ssh", "--", "/bin/sh", "-c", script)),
        env=op.env(), cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        op.approve_next()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "through-bastion" in out and "payload" in out
