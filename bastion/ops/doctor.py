"""`bastion doctor`: the checks an operator would make before trusting a setup, one verdict each.

Every fact doctor looks at already has an owner (the home's layout in `home`, the
policy loader's refusals in `policy_files`, bastion.toml in `config`, the guarantees
in `isolation`, the gateway's own `status`); doctor says what they say, never a second
opinion that could drift. Each check is a small function over a `Context` gathered
once; where it needs the outside world (the ssh client, the keyring, a target's sshd)
the I/O is one call and the judgement a pure `judge_*` function, unit-tested alone.

FAIL: a promise does not hold, or requests would be refused because of it (gateway
down, vault locked, a policy the gateway refuses, a pin the target does not match,
advisory isolation -- which `bastion isolate check` fails on too). WARN: an optional
part is missing (no OS keyring). SKIP: nothing to judge (no gateway to ask).
"""

from __future__ import annotations

import asyncio
import enum
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bastion import sandbox
from bastion.config import Config, ConfigError, load_config
from bastion.core.certs import CA_LABEL_PREFIX, Auth
from bastion.core.policy import Host, Policy, PolicyError
from bastion.data import EXAMPLE_POLICY
from bastion.home import Home
from bastion.ops import opsock
from bastion.policy_files import load_policy_dir
from bastion.sandbox import isolation

HOST_TIMEOUT = 5.0  # seconds for each policy host's sshd to show its host key
GATEWAY_TIMEOUT = 5.0  # seconds for the gateway to answer `status`
# KnownHostsCommand (the generated ssh config pins the gateway's key with it) came in
# OpenSSH 8.5; ProxyUseFdpass, which hands the proxy's socket to ssh, in 6.5.
MIN_OPENSSH = (8, 5)


class Status(enum.Enum):
    OK = "ok"
    FAIL = "fail"
    WARN = "warn"
    SKIP = "skip"


@dataclass(frozen=True)
class Check:
    """One verdict: `fix` says what to do (None when there is nothing to do)."""

    name: str
    status: Status
    detail: str
    fix: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status.value}


@dataclass(frozen=True)
class Context:
    """What the checks look at, gathered once (`gather`)."""

    home: Home
    gateway: Mapping[str, Any] | None  # the `status` reply, None when it did not answer
    gateway_error: str | None
    policy_dir: Path
    policy: Policy | None
    policy_error: str | None
    config: Config | None
    config_error: str | None
    ssh_config: str  # the ssh config bastion generates for agents, for the client to parse
    euid: int
    host_timeout: float = HOST_TIMEOUT


def _q(path: Path | str) -> str:
    return shlex.quote(str(path))


def _setup(home: Home) -> str:
    return f"sudo bastion --home {_q(home.root)} isolate setup"


def _attempt(fn: Callable[[], Any], *errors: type[Exception]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except errors as exc:
        return None, str(exc) or type(exc).__name__


def gather(
    home: Home, ssh_config: str, host_timeout: float = HOST_TIMEOUT, policies: Path | None = None
) -> Context:
    """Ask the gateway, load the policy (from `policies`, else the directory the running
    gateway uses, else the home's) and bastion.toml. Never raises for what a check reports."""
    status, error = _attempt(
        lambda: opsock.call(home.operator_socket, "status", timeout=GATEWAY_TIMEOUT),
        opsock.OperatorError,
        OSError,  # a gateway that hangs: the socket's timeout
    )
    directory = Path(
        policies or ((status or {}).get("policy") or {}).get("directory") or home.policies
    )
    policy, policy_error = _attempt(lambda: load_policy_dir(directory), PolicyError)
    config, config_error = _attempt(lambda: load_config(home.config), ConfigError)
    return Context(
        home, status, error, directory, policy, policy_error, config, config_error, ssh_config,
        os.geteuid(), host_timeout,
    )  # fmt: skip


def judge_ssh_client(version: str | None, parsed_rc: int, parsed: str) -> Check:
    """`ssh -V`'s banner, and what `ssh -G -F CONFIG` made of the config bastion generates."""
    name = "ssh client"
    fix = "install OpenSSH 8.5 or later (Debian: apt-get install openssh-client)"
    if version is None:
        return Check(name, Status.FAIL, "no `ssh` on PATH: agents run the stock ssh client", fix)
    found = re.search(r"OpenSSH_(\d+)\.(\d+)", version)
    banner = version.strip().splitlines()[0] if version.strip() else "(no banner)"
    if found is None:
        return Check(name, Status.FAIL, f"not OpenSSH: {banner}", fix)
    if (int(found[1]), int(found[2])) < MIN_OPENSSH:
        detail = f"{banner}: too old for KnownHostsCommand (8.5) in bastion's ssh config"
        return Check(name, Status.FAIL, detail, fix)
    options = {line.partition(" ")[0]: line.partition(" ")[2] for line in parsed.splitlines()}
    if parsed_rc != 0 or options.get("proxyusefdpass") != "yes":
        why = parsed.strip().splitlines()[-1] if parsed.strip() else f"exit {parsed_rc}"
        detail = f"{banner} refuses the ssh config bastion generates: {why}"
        return Check(name, Status.FAIL, detail, fix)
    detail = f"{banner}; accepts bastion's ssh config (ProxyUseFdpass yes, KnownHostsCommand)"
    return Check(name, Status.OK, detail)


def check_ssh_client(ctx: Context) -> list[Check]:
    ssh = shutil.which("ssh")
    if ssh is None:
        return [judge_ssh_client(None, 0, "")]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        kw: dict[str, Any] = {"stdin": subprocess.DEVNULL, "timeout": 10}
        return subprocess.run([ssh, *args], capture_output=True, text=True, **kw)

    banner = run("-V")
    with tempfile.NamedTemporaryFile("w", prefix="bastion-doctor-", suffix=".conf") as f:
        f.write(ctx.ssh_config)
        f.flush()
        # -G prints the configuration it would use and exits: nothing is connected or run.
        r = run("-G", "-F", f.name, "bastion-doctor-probe")
    return [judge_ssh_client(banner.stderr + banner.stdout, r.returncode, r.stdout + r.stderr)]


# -- isolation ------------------------------------------------------------------------------

ADVISORY = (
    "agents run as the operator's own uid: a process of that uid outside every "
    "`bastion run` tree can answer cards, copy vault.json and edit the policies"
)


def judge_isolation(
    home: Home, status: Mapping[str, Any] | None, iso: isolation.Isolation | None,
    file_checks: Mapping[str, bool], door_problem: str | None = None,
) -> Check:  # fmt: skip
    """The mode the gateway runs in (or, with none running, the mode it would start
    in) and whether its guarantees hold: the same sentences `status` prints.
    `file_checks` are `isolation.permission_checks` (offline only)."""
    name, setup = "isolation", _setup(home)
    restart = "restart `bastion daemon`"
    run = f"start agents with `sudo bastion --home {_q(home.root)} run --isolated -- CMD`"
    if status is not None:
        if status.get("isolation") == "strong":
            bad = [text for text, held in status.get("guarantees") or [] if not held]
            if bad:
                more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                detail = f"strong, but NOT HELD: {bad[0]}{more}"
                return Check(name, Status.FAIL, detail, f"`bastion isolate check`; then {setup}")
            who = f"uid {iso.uid} ({iso.user})" if iso else "another uid"
            return Check(name, Status.OK, f"strong: agents run as {who}; every guarantee holds")
        if iso is not None and status.get("agent_socket") != str(iso.agent_socket):
            fix = f"{restart}: it was started without {home.isolation}"
        elif iso is not None:
            fix = f"{run}; then {restart} (an agent connected as the operator's uid)"
        else:
            fix = f"{setup}; then {restart} and {run}"
        return Check(name, Status.FAIL, f"advisory: {ADVISORY}", fix)
    if iso is None:
        detail = f"advisory (no {home.isolation}: the gateway starts so): {ADVISORY}"
        return Check(name, Status.FAIL, detail, f"{setup}; then {run}")
    if door_problem is not None:
        return Check(name, Status.FAIL, f"strong, but {door_problem}", f"{setup} again")
    bad_keys = sorted(k for k, held in file_checks.items() if not held)
    if bad_keys:
        detail = f"strong, but by file modes the agent user {iso.user} could reach: {bad_keys}"
        check = f"sudo bastion --home {_q(home.root)} isolate check"
        return Check(name, Status.FAIL, detail, f"`{check}` names each; then {setup}")
    detail = f"strong: agents run as uid {iso.uid} ({iso.user}); memory checked once it runs"
    return Check(name, Status.OK, detail)


def judge_sandbox(machine: sandbox.Machine) -> list[Check]:
    """Can a default `bastion run` make its sandbox here, and does the kernel scope it?"""
    if machine.unavailable is not None:
        told = machine.unavailable
        checks = [Check("sandbox", Status.FAIL, f"`bastion run` cannot: {told.reason}", told.fix)]
    else:
        detail = "a default `bastion run` gets a sandbox of its own (bubblewrap, namespaces)"
        checks = [Check("sandbox", Status.OK, detail)]
    if machine.landlock >= sandbox.LANDLOCK_SCOPES_ABI:
        detail = f"Landlock ABI {machine.landlock}: abstract sockets and signals scoped to a run"
        checks.append(Check("landlock", Status.OK, detail))
    else:
        detail = (
            f"Landlock ABI {machine.landlock}: a run can reach abstract unix sockets made "
            "outside it (an X11 display); scopes need ABI 6 (Linux 6.12)"
        )
        checks.append(Check("landlock", Status.WARN, detail, "a newer kernel"))
    return checks


def check_sandbox(_ctx: Context) -> list[Check]:
    return judge_sandbox(sandbox.machine())


def check_isolation(ctx: Context) -> list[Check]:
    try:
        iso = isolation.load(ctx.home)
    except isolation.IsolationError as exc:
        return [Check("isolation", Status.FAIL, str(exc), f"{_setup(ctx.home)} again")]
    door, checks = None, {}
    if ctx.gateway is None and iso is not None:
        try:
            st = os.lstat(iso.socket_dir)
            if not stat.S_ISDIR(st.st_mode) or st.st_gid != iso.gid:
                door = f"{iso.socket_dir} is not the agents' directory (group {iso.group})"
        except OSError:
            door = f"{iso.socket_dir} is gone (/run is emptied at boot)"
        if door is None:
            checks = isolation.permission_checks(ctx.home, iso, None)
    return [judge_isolation(ctx.home, ctx.gateway, iso, checks, door)]


def judge_mode(name: str, path: Path, st: os.stat_result | None, euid: int, secret: bool) -> Check:
    """Owned by the operator; nobody else may write it; a secret nobody else may read."""
    if st is None:
        return Check(name, Status.FAIL, f"{path} is missing", "`bastion init` creates the home")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != euid:
        detail = f"{path} is owned by uid {st.st_uid}, not by the operator (uid {euid})"
        fix = f"chown {euid} {_q(path)} (or run doctor as uid {st.st_uid} if that is the operator)"
        return Check(name, Status.FAIL, detail, fix)
    if mode & (0o077 if secret else 0o022):
        who = "readable or writable" if secret else "writable"
        detail = f"{path} is {who} by group or others (mode {mode:o})"
        fix = f"chmod {'go-rwx' if secret else 'go-w'} {_q(path)}"
        return Check(name, Status.FAIL, detail, fix)
    return Check(name, Status.OK, f"{path}: mode {mode:o}, owner uid {st.st_uid}")


def check_modes(ctx: Context) -> list[Check]:
    """The home, the vault, the gateway's host key and the journal. The policies'
    modes are the policy loader's to judge (`check_policy`): it is what refuses them."""
    h = ctx.home

    def _stat(path: Path) -> os.stat_result | None:
        return _attempt(lambda: os.stat(path), OSError)[0]

    out = [
        judge_mode("mode.home", h.root, _stat(h.root), ctx.euid, False),
        judge_mode("mode.vault", h.vault, _stat(h.vault), ctx.euid, True),
        judge_mode("mode.host_key", h.host_key, _stat(h.host_key), ctx.euid, True),
    ]
    segments = _attempt(lambda: sorted(p for p in h.journal.iterdir() if p.is_file()), OSError)[0]
    journal = [
        judge_mode("mode.journal", p, _stat(p), ctx.euid, False)
        for p in [h.journal, *(segments or [])]
    ]
    return [*out, next((v for v in journal if v.status is not Status.OK), journal[0])]


def check_config(ctx: Context) -> list[Check]:
    path = ctx.home.config
    if ctx.config_error is not None:
        detail = f"{ctx.config_error}: the gateway refuses to start with it"
        return [
            Check("config", Status.FAIL, detail, f"edit {_q(path)} (docs/audit.md: The witness)")
        ]
    if not path.exists():
        return [Check("config", Status.OK, f"no {path}: the defaults (no witness)")]
    return [Check("config", Status.OK, f"{path} is valid")]


def judge_policy(
    directory: Path, policy: Policy | None, error: str | None, labels: Iterable[str] | None,
    gateway_error: str | None = None, no_ca: bool = False,
) -> Check:  # fmt: skip
    """The loader's verdict (the same function the gateway runs: modes, owners, syntax,
    rules), the running gateway's, whether every credential it names is in the vault
    (`labels`; None when the vault file cannot be read), and a CA for certificate accounts."""
    name = "policy"
    if policy is None:
        detail, _, fix = (error or "not loaded").partition("; fix with: ")
        fix = fix or f"correct the file named above (see {EXAMPLE_POLICY}) in {directory}"
        return Check(name, Status.FAIL, f"{detail}: the gateway refuses all positive work", fix)
    if gateway_error is not None:
        fix = "correct it; the gateway reloads the policy before each request"
        return Check(name, Status.FAIL, f"the running gateway refuses it: {gateway_error}", fix)
    if not policy.hosts:
        fix = f"add a *.toml file to {directory} (see {EXAMPLE_POLICY})"
        return Check(name, Status.WARN, f"no hosts in {directory}: agents can reach nothing", fix)
    have, accounts = set(labels or ()), [(h, a) for h in policy.hosts.values() for a in h.accounts]
    for host, a in accounts:
        if labels is not None and a.credential and a.credential not in have:
            detail = f"{a.label} uses credential {a.credential!r}, not in the vault"
            fix = f"bastion key generate {a.credential} (or import it); or edit {host.source}"
            return Check(name, Status.FAIL, detail, fix)
    certs = ", ".join(a.label for _, a in accounts if a.auth is Auth.CERTIFICATE)
    if certs and no_ca:
        fix = "`bastion ca init`, then install `bastion ca public` on each target"
        return Check(name, Status.FAIL, f'{certs}: auth = "certificate", no CA in the vault', fix)
    hosts = ", ".join(sorted(policy.hosts))
    found = "" if labels is None else "; every credential is in the vault"
    return Check(name, Status.OK, f"{len(policy.hosts)} host(s) from {directory}: {hosts}{found}")


def check_policy(ctx: Context) -> list[Check]:
    if home_moved(ctx):  # what is at the path now is not what the gateway reads
        detail = f"not read from {ctx.policy_dir}: the home moved (see home), the gateway reads on"
        return [Check("policy", Status.SKIP, detail + " from the directory it holds")]
    labels: list[str] | None = None
    if ctx.policy is not None:
        from bastion.vault import Vault, VaultError

        try:  # labels are readable without the passphrase
            labels = [k.label for k in Vault.open(ctx.home.vault).list_keys()]
        except (VaultError, OSError):
            labels = None
    gw_policy = (ctx.gateway or {}).get("policy") or {}
    gw_error = gw_policy.get("error") if gw_policy.get("ok") is False else None
    signs = ctx.config is not None and ctx.config.ca.backend == "vault"  # not OpenBao's CA
    no_ca = signs and labels is not None and not any(k.startswith(CA_LABEL_PREFIX) for k in labels)
    return [judge_policy(ctx.policy_dir, ctx.policy, ctx.policy_error, labels, gw_error, no_ca)]


def judge_keyring(backend: object | None, error: str | None = None) -> Check:
    """Which backend `keyring` would use for `unlock --keyring`, and whether it is one
    that keeps a secret at all. Optional: without one, only the passphrase unlocks."""
    name = "keyring"
    fix = "unlock with the passphrase, or run a Secret Service (gnome-keyring, KeePassXC)"
    if backend is None:
        return Check(name, Status.WARN, f"the keyring library fails: {error}", fix)
    cls = type(backend)
    label = f"{cls.__module__}.{cls.__qualname__}"
    inner = getattr(backend, "backends", None)
    if cls.__module__ in ("keyring.backends.fail", "keyring.backends.null") or inner == []:
        detail = f"no OS keyring ({label}): `unlock --keyring` cannot work here"
        return Check(name, Status.WARN, detail, fix)
    if "plaintext" in cls.__name__.lower():
        detail = f"{label} keeps the passphrase in plain text"
        return Check(name, Status.WARN, detail, "use an encrypted backend (Secret Service)")
    return Check(name, Status.OK, f"{label} (for `unlock --keyring`)")


def check_keyring(ctx: Context) -> list[Check]:
    try:
        import keyring

        return [judge_keyring(keyring.get_keyring())]
    except Exception as exc:  # a misconfigured PYTHON_KEYRING_BACKEND raises anything
        return [judge_keyring(None, f"{type(exc).__name__}: {exc}")]


# -- the gateway, the vault, the witness ------------------------------------------------------


def check_gateway(ctx: Context) -> list[Check]:
    s = ctx.gateway
    if s is None:
        fix = "start the gateway: `bastion daemon` (or its systemd unit)"
        if ctx.gateway_error and "not running" not in ctx.gateway_error:
            fix = "see the gateway's log; restart `bastion daemon`"
        detail = (ctx.gateway_error or "no answer").partition("; start it with")[0]
        return [Check("gateway", Status.FAIL, detail, fix)]
    for which, health in sorted((s.get("listeners") or {}).items()):
        if health and not health.get("serving", True):
            detail = f"the {which} socket is NOT SERVING: {health.get('last_error')}"
            return [Check("gateway", Status.FAIL, detail, "restart `bastion daemon`")]
    detail = (
        f"answering (pid {s.get('pid')}, boot {s.get('boot_id')}) at {ctx.home.operator_socket}"
    )
    return [Check("gateway", Status.OK, detail)]


def judge_home(home: Home, status: Mapping[str, Any] | None) -> Check:
    """Does the home's path still lead to the directory the running gateway holds open
    (home.Held)? The gateway's own sentence when it does not."""
    name, restart = "home", "restart `bastion daemon`"
    if status is None:
        return Check(name, Status.SKIP, "the gateway is not running: it holds no directory")
    held = status.get("home")
    if not isinstance(held, Mapping) or not held.get("held"):
        detail = "the running gateway does not hold its home open (a gateway older than this)"
        return Check(name, Status.FAIL, detail, restart)
    moved = [str(m) for m in held.get("moved") or []]
    if moved:
        more = f" (and {len(moved) - 1} more)" if len(moved) > 1 else ""
        fix = f"put the home back at {_q(held.get('path') or home.root)}, then {restart}"
        return Check(name, Status.FAIL, moved[0] + more, fix)
    detail = f"{held.get('path')} leads to the directory the gateway holds open"
    return Check(name, Status.OK, detail)


def check_home(ctx: Context) -> list[Check]:
    return [judge_home(ctx.home, ctx.gateway)]


def home_moved(ctx: Context) -> bool:
    return bool(((ctx.gateway or {}).get("home") or {}).get("moved"))


def check_vault(ctx: Context) -> list[Check]:
    s = ctx.gateway
    if s is None:
        return [Check("vault", Status.SKIP, "the gateway is not running: nothing is unlocked")]
    if s.get("locked"):
        detail = f"locked (epoch {s.get('vault_epoch')}): every request is denied VAULT_LOCKED"
        return [Check("vault", Status.FAIL, detail, "bastion unlock")]
    held = (s.get("keys_held") or {}).get("vault_keys", "?")
    detail = f"unlocked (epoch {s.get('vault_epoch')}), {held} key(s) in memory"
    return [Check("vault", Status.OK, detail)]


def judge_witness(config: Config | None, health: Mapping[str, Any] | None, running: bool) -> Check:
    """bastion.toml's [witness] and, from a running gateway, how its delivery goes."""
    name = "witness"
    if config is None:
        return Check(name, Status.SKIP, "bastion.toml cannot be read (see config)")
    if not config.witness.enabled:
        return Check(name, Status.SKIP, "none configured ([witness] in bastion.toml)")
    if not running:
        return Check(name, Status.SKIP, "the gateway is not running: nothing to ask about delivery")
    if health is None:
        detail = "bastion.toml names a witness the running gateway does not use"
        return Check(name, Status.FAIL, detail, "restart `bastion daemon`")
    waiting = f"{health.get('waiting', 0)} waiting"
    for target, t in sorted((health.get("targets") or {}).items()):
        if t.get("failing"):
            detail = f"{target} {t.get('address')} FAILING: {t.get('last_error')}; {waiting}"
            fix = f"bring {t.get('address')} back: waiting entries are delivered once it answers"
            return Check(name, Status.FAIL, detail, fix)
    trouble = [k for k in ("spool_error", "refusing", "full") if health.get(k)]
    if trouble:
        detail = f"{', '.join(trouble)}: {waiting} (buffer_max {health.get('buffer_max')})"
        detail += f"; {health['spool_error']}" if health.get("spool_error") else ""
        return Check(name, Status.FAIL, detail, "see `bastion status`; bring the witness back")
    targets = ", ".join(
        f"{n} {t.get('address')}" for n, t in sorted((health.get("targets") or {}).items())
    )
    return Check(name, Status.OK, f"delivering to {targets}; {waiting}")


def check_witness(ctx: Context) -> list[Check]:
    health = (ctx.gateway or {}).get("witness")
    return [judge_witness(ctx.config, health, ctx.gateway is not None)]


# -- the policy's hosts ------------------------------------------------------------------------


def judge_host(host: Host, presented: str | None, error: str | None) -> Check:
    """`presented`: the host key line the sshd showed (None when it could not be had)."""
    from bastion.core.policy import host_key_fingerprint as fp

    name, where = f"host.{host.alias}", f"{host.address}:{host.port}"
    if presented is None:
        fix = f"start the sshd at {where}, or correct address/port in {host.source}"
        return Check(name, Status.FAIL, f"{where} unreachable: {error}", fix)
    shown, pinned = presented.split()[:2], host.host_key.split()[:2]
    if shown != pinned:
        detail = (
            f"{where} presents {shown[0]} {fp(presented)}, the policy pins {pinned[0]} "
            f"{fp(host.host_key)}: every request gets HOST_KEY_MISMATCH"
        )
        fix = f"if the host was re-keyed: `bastion hostkey {host.address} --port {host.port}`, "
        fix += f"verify it out of band, pin it in {host.source}; if not, do not use the host"
        return Check(name, Status.FAIL, detail, fix)
    return Check(name, Status.OK, f"{where} presents the pinned key {fp(host.host_key)}")


async def _presented(host: Host, timeout: float) -> tuple[str | None, str | None]:
    """The key exchange only, closed before any authentication is tried: the host key
    the sshd shows when asked for the pinned type, else (it has none) the one it has."""
    import asyncssh

    pinned: asyncssh.SSHKey = asyncssh.import_public_key(host.host_key)
    kinds = [a.decode() for a in pinned.sig_algorithms]
    try:
        async with asyncio.timeout(timeout):
            try:
                key = await asyncssh.get_server_host_key(
                    host.address, host.port, server_host_key_algs=kinds, config=None
                )
            except asyncssh.Error:  # no key of the pinned type: which one does it have?
                key = await asyncssh.get_server_host_key(host.address, host.port, config=None)
    except TimeoutError:
        return None, f"no SSH handshake within {timeout:g} s"
    except (OSError, asyncssh.Error) as exc:
        return None, str(exc) or type(exc).__name__
    if key is None:
        return None, "no host key shown"
    return key.export_public_key().decode().strip(), None


def check_hosts(ctx: Context) -> list[Check]:
    if ctx.policy is None:
        return [Check("host", Status.SKIP, "no policy loaded (see policy)")]
    hosts = [ctx.policy.hosts[a] for a in sorted(ctx.policy.hosts)]

    async def probe_all() -> list[tuple[str | None, str | None]]:
        return list(await asyncio.gather(*(_presented(h, ctx.host_timeout) for h in hosts)))

    found = asyncio.run(probe_all()) if hosts else []
    return [judge_host(h, key, err) for h, (key, err) in zip(hosts, found, strict=True)]


# -- all of them ------------------------------------------------------------------------------

CheckFn = Callable[[Context], list[Check]]
CHECKS: tuple[CheckFn, ...] = (
    check_ssh_client, check_gateway, check_home, check_vault, check_sandbox, check_isolation,
    check_modes, check_config, check_policy, check_hosts, check_witness, check_keyring,
)  # fmt: skip


def run_checks(ctx: Context, checks: Iterable[CheckFn] = CHECKS) -> list[Check]:
    """Every check, in order; one that breaks is a failed check, never a traceback."""
    out: list[Check] = []
    for fn in checks:
        try:
            out += fn(ctx)
        except Exception as exc:
            label = fn.__name__.removeprefix("check_")
            detail = f"doctor could not check this: {type(exc).__name__}: {exc}"
            out.append(Check(label, Status.FAIL, detail, "report this as a bug in bastion doctor"))
    return out


def summary(checks: Iterable[Check]) -> int:
    """The exit status: 1 when any check failed; warnings and skips do not fail."""
    return 1 if any(c.status is Status.FAIL for c in checks) else 0
