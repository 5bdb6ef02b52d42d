"""One gateway lifetime: boot, sockets, signals, process watches, shutdown.

A `Gateway` is one lifetime. Its `boot_id` lives in memory only, so a
restarted gateway cannot honour anything the previous one granted; the vault
starts locked. This module builds the parts from the home directory and
wires them: the request path (`service.py`) and the operator's state changes
(`authority.py`) through `assembly.build_service` (the tests' fakes call it
too), the agent listener (`agent_ssh.py`) and the operator socket
(`control.py`). `control` and `agent_doors` each read the `Gateway` through a
`GatewayView` of their own: one object, two narrow views. It owns what
touches the operating system around them: pidfds that say when an approved
process exits, `lifetime.json` for the next lifetime's cards, `runs.json` for
the next lifetime's runs (a run outlives a gateway restart), the journal's
vouch, the two sockets, and the witness bastion.toml asks for
(`journal/witness.py`; a bad bastion.toml stops the start).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import secrets
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import asyncssh
import uvloop

from bastion.ca.issuer import Issuer, VaultCA
from bastion.ca.vault_ca import OPENBAO_SECRET
from bastion.config import Config, ConfigError, load_config
from bastion.core.certs import Auth
from bastion.core.defaults import (
    APPROVAL_TIMEOUT,
    COMMAND_TTL,
    KEEPALIVE_COUNT_MAX,
    KEEPALIVE_INTERVAL,
)
from bastion.core.events import EventType, recover
from bastion.core.policy import Policy, PolicyError
from bastion.core.subject import Peer, ProcessInfo, ProcessKey, Run, Subject
from bastion.gateway import logfmt, mux, opserver, sdnotify
from bastion.gateway.admission import Admission
from bastion.gateway.agent_doors import AgentDoors, run_subject
from bastion.gateway.agent_ssh import AgentListener
from bastion.gateway.approvals import ApprovalBook
from bastion.gateway.assembly import build_service
from bastion.gateway.certify import Certifier
from bastion.gateway.console import Console
from bastion.gateway.control import Control
from bastion.gateway.export import export_stream
from bastion.gateway.outbound import Dispatcher
from bastion.gateway.recorder import ForeignRecords, PolicyWatch, Recorder
from bastion.gateway.requests import IndexedJournal, RequestIndex
from bastion.gateway.senders import own_connection
from bastion.gateway.service import Edges
from bastion.gateway.signers import Signers
from bastion.gateway.tenants import Tenants
from bastion.gateway.trim import TRIMMER, settle
from bastion.home import Held, Home
from bastion.identity import (
    DEFAULT_TERMINAL_HOSTS,
    DEFAULT_WRAPPERS,
    IdentityError,
    Resolver,
    alive,
    children,
    procs,
    serves_control_socket,
    ssh_client_of,
)
from bastion.journal import (
    IDENTITY_LABEL,
    Journal,
    JournalError,
    read_identity,
)
from bastion.journal.witness import Witness, journal_id
from bastion.ops import identity_pin, opsock
from bastion.policy_files import PolicyStore
from bastion.sandbox import memory
from bastion.vault import RESERVED_PREFIX, Vault, VaultError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    home: Home
    policies: Path
    agent_socket: Path
    agent_group: int | None = None  # gid allowed to reach the agent socket (strong mode)
    approval_timeout: float = APPROVAL_TIMEOUT
    command_approval_ttl: float = COMMAND_TTL
    keepalive_interval: float = KEEPALIVE_INTERVAL
    keepalive_count_max: int = KEEPALIVE_COUNT_MAX
    wrappers: frozenset[str] = frozenset()  # added to identity.DEFAULT_WRAPPERS
    terminal_hosts: frozenset[str] = frozenset()  # added to identity.DEFAULT_TERMINAL_HOSTS
    # The policy directory held open by itself, when it is not under the home (`hold_home`).
    policies_held: Held | None = None


def gateway_config(home: Home) -> Config:
    """bastion.toml, or no start: the gateway must not run without the witness the
    operator asked for, nor guess what a typo meant."""
    try:
        return load_config(home.config)
    except ConfigError as exc:
        raise SystemExit(f"bastion: {home.shown(str(exc))}; the gateway does not start") from None


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.home = settings.home
        self._moved_told: set[str] = set()  # the held directories journaled as moved
        self.config = gateway_config(self.home)
        self.boot_id = "boot_" + secrets.token_hex(12)
        self.vault = Vault.open(self.home.vault)  # opened locked: a new lifetime starts locked
        self.resolver = Resolver(
            DEFAULT_WRAPPERS | settings.wrappers,
            DEFAULT_TERMINAL_HOSTS | settings.terminal_hosts,
            procs.in_other_namespaces,
        )
        identity = read_identity(self.home.journal, identity_pin(self.vault))
        self.journal = Journal(self.home.journal, identity, self.boot_id)
        # The agent socket's `request` answers, told of every record as it is written.
        self.requests = RequestIndex()
        self.recorder = Recorder(IndexedJournal(self.journal, self.requests))
        self.recorder.on_received.append(self.requests.received)
        self.tenants = Tenants()  # who each agent-socket share counts: runs, else uids
        # Told of every record once it is on disk (vouches included); sends the
        # heads and the requests' summaries off the box without blocking anything.
        self.witness: Witness | None = None
        if self.config.witness.enabled:
            self.witness = Witness(
                self.config.witness,
                self.home.witness_spool,
                journal_id(identity),
                self.config.export_with_commands,
            )
            self.recorder.sinks.append(self.witness.sink)
        self.book = ApprovalBook(
            self.boot_id,
            command_ttl=settings.command_approval_ttl,
            presence_where=self.config.console.approve_where,
        )
        # Who can sign presence cards: sealed in the vault, read at unlock (gateway/signers).
        self.signers = Signers(self.vault, self.recorder, RP_ID, self.config.console.origin)
        self.console: Console | None = None
        self.issuer = self._issuer()
        self._checks: set[asyncio.Task[None]] = set()
        self.dispatcher = Dispatcher(
            self._credential, settings.keepalive_interval, settings.keepalive_count_max
        )
        assembly = build_service(
            boot_id=self.boot_id,
            vault=self.vault,
            policy=PolicyWatch(
                HomeWatch(
                    PolicyStore(settings.policies, self.shown_path(settings.policies)),
                    self.home_moved,
                ),
                self.recorder,
            ),
            book=self.book,
            outbound=self.dispatcher,
            recorder=self.recorder,
            edges=Edges(
                alive=alive,
                watch=self.watch,
                refresh=self.resolver.refresh,
                rides_a_master=rides_a_master,
                mux_clients=mux.observe,
                own_connection=own_connection,
                refusing=self.witness.refusing if self.witness is not None else lambda: None,
            ),
            admission=Admission(self.config.limits.inflight, self.config.limits.queue_wait),
            approval_timeout=settings.approval_timeout,
            on_sessions_changed=self._save_lifetime,
            certifier=Certifier(self.issuer, self.recorder),
            witnessed=self.witness.intent if self.witness is not None else None,
            vouch=self.vouch,
            unlocked=self._unlocked,
            signers=self.signers,
        )
        self.service = assembly.service
        self.authority = assembly.authority
        self.foreign = ForeignRecords(self.recorder)
        self.host_key = asyncssh.read_private_key(str(self.home.host_key))
        self.same_uid_agent_seen = False
        self._watches: dict[ProcessKey, int] = {}
        # Every process that asked for a card in this lifetime: an operator request
        # from below one of them is refused even after its card is gone.
        self._asked: set[tuple[int, float]] = set()
        self._stop = asyncio.Event()
        self._agent_listener: AgentListener | None = None
        self._operator_server: opserver.OperatorServer | None = None

    def _issuer(self) -> Issuer:
        """Who signs certificate accounts' logins: the vault's CA, or OpenBao."""
        if self.config.ca.backend == "openbao":
            from bastion.ca.openbao import OpenBaoCA  # hvac: an optional extra

            return OpenBaoCA(self.config.ca, lambda: self.vault.secret(OPENBAO_SECRET))
        return VaultCA(self.vault)

    def _unlocked(self) -> None:
        self.foreign.report()
        check = getattr(self.issuer, "check", None)  # OpenBao: is its role fit to sign?
        if check is not None:
            task = asyncio.get_running_loop().create_task(self._check_ca(check))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)

    async def _check_ca(self, check: Callable[[list[str]], Awaitable[list[str]]]) -> None:
        """At each unlock (the login is in the vault), say what the CA's role lacks for
        the certificate accounts the policy has -- to the log and the approve prompts."""
        policy = self.service.policy.current()
        if isinstance(policy, PolicyError):
            return
        users = {
            a.user for h in policy.hosts.values() for a in h.accounts if a.auth is Auth.CERTIFICATE
        }
        for problem in await check(sorted(users)) if users else []:
            log.warning("certificate CA: %s", problem)
            self.recorder.notice(f"certificate CA: {problem}")

    def _credential(self, label: str) -> asyncssh.SSHKey:
        """A key for an outbound connection -- never one of bastion's own."""
        if label.startswith(RESERVED_PREFIX):
            raise VaultError(f"{label!r} is reserved for bastion and cannot be a credential")
        return self.vault.private_key(label)

    def vouch(self) -> None:
        """Have the journal identity vouch for everything written so far. Only
        possible while unlocked: at unlock, before a lock, before stopping."""
        if self.vault.locked:
            return
        try:
            self.recorder.flush()  # the sinks hear of every earlier record first
            record = self.journal.vouch(self.vault.private_key(IDENTITY_LABEL).pyca_key)
            self.recorder.note(record, {})
        except (VaultError, OSError, JournalError) as exc:
            log.error("could not vouch for this lifetime's journal: %s", exc)

    @property
    def console_url(self) -> str | None:
        """The console's page (with its slash), or None when bastion.toml keeps it off
        or it could not start (its port taken: `console_status` says why)."""
        console = self.console
        return f"{self.config.console.origin}/" if console and console.serving else None

    def console_status(self) -> dict[str, Any] | None:
        return self.console.status() if self.console is not None else None

    def listeners_health(self) -> dict[str, Any]:
        """The agent and operator sockets' health, for `bastion status`."""
        agent, operator = self._agent_listener, self._operator_server
        return {
            "agent": agent.health() if agent is not None else None,
            "operator": operator.health() if operator is not None else None,
        }

    def keys_held(self) -> dict[str, int]:
        """What in this process still references key material: decrypted keys the
        vault caches, and outbound connections (which hold the key they used).
        Both are 0 once the vault is locked and commands in flight have ended."""
        return {"vault_keys": self.vault.cached_keys(), "connections": self.dispatcher.held()}

    def isolation(self) -> str:
        strong = self.settings.agent_group is not None and not self.same_uid_agent_seen
        return "strong" if strong else "advisory"

    # -- the home, held open (home.Held) ---------------------------------------------------

    def shown(self, text: str) -> str:
        """`text` with each held directory's /proc/self/fd name replaced by its path."""
        held = self.settings.policies_held
        return self.home.shown(held.shown(text) if held is not None else text)

    def shown_path(self, path: Path) -> Path:
        return Path(self.shown(str(path)))

    def home_moved(self) -> list[str]:
        """One sentence for each held directory (the home; the policy directory when it
        is held by itself) whose path no longer leads to it. The gateway goes on with the
        directories it holds and reads nothing at the path. Journaled (`home_moved`),
        logged and told to watching operators the first time each is seen moved."""
        out = []
        directories = ((self.home.held, "home"), (self.settings.policies_held, "policy directory"))
        for held, what in directories:
            sentence = held.moved(what) if held is not None else None
            if held is None or sentence is None:
                continue
            out.append(sentence)
            if what not in self._moved_told:
                self._moved_told.add(what)
                log.error("%s", sentence)
                meta = {"what": what, "path": str(held.path)}
                self.recorder.record(EventType.HOME_MOVED, meta, {"said": sentence})
                self.recorder.notice(sentence)
        return out

    def home_status(self) -> dict[str, Any]:
        """For `bastion status`: the home's path, and whether it still leads to the
        directory this gateway holds (`moved`: the sentences, else [])."""
        held = self.home.held
        return {
            "path": str(self.home.path),
            "held": held is not None,
            "device_inode": [held.dev, held.ino] if held is not None else None,
            "moved": self.home_moved(),
        }

    # -- who connects ----------------------------------------------------------------------

    def agent_processes(self) -> set[tuple[int, float]]:
        """Every process the gateway knows as an agent -- approved, asking,
        connected or registered as a run: operator requests from below any of
        them are refused."""
        subjects = [
            *self.book.subjects(),
            *(c.subject for c in self.book.pending()),
            *(c.peer.subject for c in self.service.connections),
        ]
        known = {(s.pid, s.start_time) for s in subjects} | set(self.resolver.runs)
        return known | self._asked

    # -- process lifetimes -----------------------------------------------------------------

    def watch(self, subject: Subject) -> None:
        """End grants and withdraw cards the moment a subject exits (not only
        when it next asks): a pidfd becomes readable at exit, and the event loop
        (epoll) watches it whatever its number -- past 1023 too, where select()
        fails. Called for every card and every registered run, so it also
        remembers who ever asked (`agent_processes`) and gives a run's share back."""
        self._asked.add((subject.pid, subject.start_time))
        if subject.process_key in self._watches:
            return
        try:
            fd = os.pidfd_open(subject.pid)
        except OSError:
            self._subject_exited(subject)
            return
        if not alive(subject.pid, subject.start_time):  # pid reused before we pinned it
            os.close(fd)
            self._subject_exited(subject)
            return
        self._watches[subject.process_key] = fd
        asyncio.get_running_loop().add_reader(fd, self._subject_exited, subject)

    def _subject_exited(self, subject: Subject) -> None:
        fd = self._watches.pop(subject.process_key, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        self.authority.subject_exited(subject)
        was_run = (subject.pid, subject.start_time) in self.resolver.runs
        self.resolver.forget(subject.pid, subject.start_time)
        self.tenants.forget(subject.pid, subject.start_time)  # a run's share goes back
        if was_run:
            self.save_runs()

    def live_runs(self) -> list[dict[str, Any]]:
        """The registered runs that live, each with what its sandbox was given (the
        project, each `--rw`, `--expose`, `--share-net` ...; None: not sandboxed), for
        `bastion status`: the run's claim, as its registration said it."""
        return [
            {
                "pid": pid,
                "label": run.label,
                "given": list(run.given) if run.given is not None else None,
                "registered_at": run.registered_at,
            }
            for (pid, _), run in sorted(self.resolver.runs.items())
        ]

    # -- runs that outlive a lifetime ------------------------------------------------------

    @property
    def runs_file(self) -> Path:
        """The live registered runs, so the next lifetime knows them (never a grant)."""
        return self.home.operator_dir / "runs.json"

    def save_runs(self) -> None:
        """Write every live run (atomic replace): what `restore_runs` reads next time."""
        entries = []
        for (pid, start), run in self.resolver.runs.items():
            boot, _, ticks = run.lasting.rsplit(":", 2)
            entries.append(
                {
                    "boot": boot,
                    "pid": pid,
                    "start_ticks": int(ticks),
                    "start_time": start,
                    "uid": run.uid,
                    "label": run.label,
                    "given": list(run.given) if run.given is not None else None,
                    "registered_at": run.registered_at,
                }
            )
        _write_private(self.runs_file, {"runs": entries}, "the live runs")

    def restore_runs(self) -> int:
        """Re-register each run an earlier lifetime saved that is still the same
        process (this kernel boot, same pid and start ticks, same uid): a new nonce
        (its approvals ended with that lifetime: `gateway_restarted`), a watch, its
        tenant. A run that outlived a gateway SIGKILL stays a run: its ssh is still
        the run's subject, its processes still refused at the operator socket."""
        try:
            doc = json.loads(self.runs_file.read_text())
            entries = [e for e in doc["runs"] if isinstance(e, dict)]
        except (OSError, ValueError, KeyError, TypeError):
            return 0
        restored = 0
        for e in entries:
            try:
                info = self._same_run(e)
            except (IdentityError, KeyError, TypeError, ValueError):
                info = None
            if info is None:
                continue
            given = e["given"]
            run = Run(
                str(e["label"]),
                tuple(str(w) for w in given) if isinstance(given, list) else None,
                procs.Lasting(procs.kernel_boot(), info.pid, int(e["start_ticks"])).text(),
                float(e["registered_at"]),
                info.uid,
            )
            self.resolver.restore_run(info, run)
            subject = run_subject(info, run, self.resolver)
            self.tenants.add((info.pid, int(e["start_ticks"])), subject)
            self.watch(subject)
            self.recorder.record(
                EventType.RUN_REGISTERED, {}, {"subject": subject.as_json(), "restored": True}
            )
            log.info("run restored: pid %d %r (%s)", info.pid, run.label, info.exe)
            restored += 1
        self.save_runs()
        return restored

    def _same_run(self, e: dict[str, Any]) -> ProcessInfo | None:
        """The saved run's process as it is now, if it is still that very process."""
        pid, ticks = int(e["pid"]), int(e["start_ticks"])
        if e["boot"] != procs.kernel_boot():
            return None
        now = procs.stat(pid)
        if now is None or now.start_ticks != ticks:
            return None
        info = self.resolver.read_process(pid)
        st = procs.stat(pid)
        if st is None or st.start_ticks != ticks or info.uid != int(e["uid"]):
            return None
        return info

    # -- what the next lifetime may know ---------------------------------------------------

    def _load_previous_lifetime(self) -> None:
        try:
            doc = json.loads(self.home.lifetime.read_text())
            keys = [k for k in doc["live_match_keys"] if isinstance(k, str)]
        except (OSError, ValueError, KeyError, TypeError):
            return
        if doc.get("boot_id") != self.boot_id:
            self.book.previous_lifetime(keys)

    def _save_lifetime(self) -> None:
        doc = {"boot_id": self.boot_id, "live_match_keys": self.book.live_match_keys()}
        _write_private(self.home.lifetime, doc, "live approvals")

    # -- the lifetime ------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        home = self.home
        home.make_dirs()
        _copy_pin(home)
        self._loop = asyncio.get_running_loop()
        self._load_previous_lifetime()
        with contextlib.suppress(opsock.OperatorError):  # whoever answers: do not start
            opsock.call(home.operator_socket, "status", timeout=2, verify=False)
            raise SystemExit(f"bastion: a gateway is already running for {home.path}")
        self._start_witness()
        found = self.journal.open()
        self.requests.load(found)  # before recovery closes what they left open
        self.service.recover(recover(found))
        self.foreign.found(found, self.journal.identity)
        self.restore_runs()  # before either socket: a restored run is known from the start
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self.stop)
        control = Control(self)
        _record_self(home)  # before the socket: the CLI checks who answers against it
        op_server = self._operator_server = await opserver.serve(
            home.operator_socket,
            control.handlers(),
            {"watch": control.watch, "export": lambda args: export_stream(self, args)},
            os.getuid(),
            self.agent_processes,
        )
        if self.config.console.enabled:
            self.console = Console(self, self.signers, self.config.console)
            await self.console.start()
        doors = AgentDoors(self, self.service.policy.current, self.requests, self.tenants)
        listener = self._agent_listener = AgentListener(
            self.service,
            agent_listen_socket(self.settings),
            self.host_key,
            doors.doors(),
            self.tenants,
        )
        accept_task = asyncio.create_task(listener.serve())
        trim_task = asyncio.create_task(TRIMMER.idle())  # memory back after a burst
        policy = self.service.policy.current()
        log.info(
            "gateway started: boot %s, vault locked (epoch %d), policy %s, isolation %s",
            self.boot_id,
            self.vault.epoch,
            "ok" if not isinstance(policy, PolicyError) else "UNAVAILABLE",
            self.isolation(),
        )
        if self.isolation() == "advisory":
            log.warning(
                "isolation is advisory: agents that run as this user (uid %d) could read "
                "this home; run agents as another user for strong isolation",
                os.getuid(),
            )
        settle()  # what start-up made lives as long as the gateway: no collection walks it
        systemd = sdnotify.start(self.vault, self.book)  # READY=1, watchdog, status
        try:
            await self._stop.wait()
        finally:
            systemd.stopping()
            log.info("gateway stopping")
            accept_task.cancel()
            trim_task.cancel()
            await listener.close()
            doors.close()
            op_server.close()
            if self.console is not None:
                await self.console.close()
            self.dispatcher.close_all()
            self.recorder.record(EventType.GATEWAY_STOPPED, {})
            self.vouch()
            self.vault.lock()
            self.recorder.flush()
            self.journal.close()
            if self.witness is not None:
                self.witness.close()  # a bounded wait; what is left stays in the spool
            for path in (home.operator_socket, self.settings.agent_socket):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            log.info("gateway stopped")

    def _start_witness(self) -> None:
        """Open the witness spool (entries an earlier lifetime left go first) and start
        sending, before recovery writes anything."""
        if self.witness is None:
            return
        try:
            self.witness.start()
        except OSError as exc:
            raise SystemExit(
                f"bastion: cannot open the witness spool {self.home.witness_spool}: {exc}; "
                "the gateway does not start"
            ) from None
        w = self.config.witness
        log.info(
            "witness: %s; heads after %s; buffer_max %d, when_full %s",
            ", ".join(c.target.address for c in self.witness.couriers),
            "each request" if w.every is None else f"every {w.every} records",
            w.buffer_max,
            w.when_full,
        )


RP_ID = "localhost"  # the console's WebAuthn relying party: its loopback name


def _write_private(path: Path, doc: dict[str, Any], what: str) -> None:
    """`doc` as JSON at `path` (0600), replaced whole: a reader sees the old or the new."""
    tmp = path.with_suffix(".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not record %s for the next lifetime: %s", what, exc)


class HomeWatch:
    """The policy store, read from the directory the gateway holds; each read first
    looks whether the home's path still leads there (`Gateway.home_moved`, which
    journals a move once), so a home moved away is noticed by the first request after."""

    def __init__(self, store: PolicyStore, look: Callable[[], object]) -> None:
        self.store = store
        self.look = look

    def current(self) -> Policy | PolicyError:
        self.look()
        return self.store.current()


def _record_self(home: Home) -> None:
    """`gateway.json`: this process (pid, start, namespaces), which the CLI checks the
    operator socket's server against before it sends anything (`opsock.check_server`)."""
    tmp = home.gateway_record.with_suffix(".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(opsock.own_record(), f)
        os.replace(tmp, home.gateway_record)
    except OSError as exc:
        where = home.shown(str(home.gateway_record))
        raise SystemExit(
            f"bastion: cannot write {where} ({exc.strerror}): the CLI would talk to no "
            "gateway; the gateway does not start"
        ) from None


def hold_home(settings: Settings) -> Settings:
    """The settings acted on through descriptors opened now (home.Held): the home, and
    the policy directory by itself when it is not under the home. Every file the gateway
    reads or writes there, and both sockets under the home, are then named through
    /proc/self/fd, so a rename of the home or of a directory above it changes nothing
    the gateway does; `Gateway.home_moved` says when the path no longer leads there."""
    try:
        home = settings.home.hold()
    except OSError as exc:
        raise SystemExit(
            f"bastion: cannot open the home {settings.home.root} ({exc.strerror}); "
            "the gateway does not start"
        ) from None
    assert home.held is not None
    policies, policies_held = home.held.under(settings.policies), None
    if policies is None:
        try:
            policies_held = Held.open(settings.policies)
            policies = policies_held.root
        except OSError:  # missing or unreadable: the policy loader says so, by its path
            policies = settings.policies
    agent_socket = home.held.under(settings.agent_socket) or settings.agent_socket
    return replace(
        settings,
        home=home,
        policies=policies,
        agent_socket=agent_socket,
        policies_held=policies_held,
    )


def _copy_pin(home: Home) -> None:
    """The gateway's public host key line, where a sandboxed run can read it."""
    with contextlib.suppress(OSError):
        line = home.known_hosts.read_bytes()
        if not home.agent_known_hosts.exists() or home.agent_known_hosts.read_bytes() != line:
            tmp = home.agent_known_hosts.with_suffix(".tmp")
            tmp.write_bytes(line)
            os.chmod(tmp, 0o644)
            os.replace(tmp, home.agent_known_hosts)


def agent_listen_socket(settings: Settings) -> socket.socket:
    """The agent socket: the operator's alone (0600), or its group's too (strong mode)."""
    path = settings.agent_socket
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    if settings.agent_group is not None:
        os.chown(path, -1, settings.agent_group)
        os.chmod(path, 0o660)
    else:
        os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def rides_a_master(peer: Peer) -> bool:
    """Could other processes send commands through this agent connection? True when
    the ssh client that opened it has gone to the background (`-f`, ControlPersist:
    the pid that connected is gone) or it, or a child of it, listens on a unix
    socket (a ControlMaster's control socket). An ssh process the gateway cannot
    read (another uid, a gateway that is not root) is not known to be one.

    An observation of /proc, nothing more: it returns the fact and refuses
    nothing. The service reads it for each request; what a shared connection
    means for the request (its code, its words) is decided with the request's
    other refusals, not here."""
    ssh = ssh_client_of(peer)
    if ssh is None:
        return False
    if not alive(ssh.pid, ssh.start_time):
        return True
    if serves_control_socket(ssh.pid, holds_our_connection=True) is True:
        return True
    return any(serves_control_socket(pid) is True for pid in children(ssh.pid))


def harden_process() -> list[str]:
    """As many descriptors as the hard limit allows, so a flood of connections meets
    the per-tenant caps first. (The memory is closed by `run_daemon`: `bastion.memory`.)"""
    notes = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            notes.append(f"could not raise the descriptor limit to {hard}: {exc}")
    return notes


def run_daemon(settings: Settings) -> None:
    logfmt.setup(logging.INFO)  # every line of the log escaped (logfmt.py)
    for note in harden_process():
        log.warning("%s", note)
    settings = hold_home(settings)  # before the fork below: the child inherits the descriptors
    # A /proc/PID/mem opened before the prctl still reads this process: the gateway goes
    # on in a child whose memory nobody could open, and this process only waits for it.
    first = os.getpid()
    try:
        memory.close(sdnotify.hand_over)
    except memory.NotClosed as exc:
        raise SystemExit(f"bastion: {exc}; the gateway does not start") from None
    sdnotify.taken_over(first)
    # asyncssh logs every exec'd command at INFO; commands may carry secrets.
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    # uvloop: the event loop and its transports in C. Every byte of a file transfer
    # crosses two SSH legs in this process, and asyncio's Python transports (a bytearray
    # grown and sliced per write) were a fifth of its CPU per byte (bench/README.md, sftp).
    uvloop.run(Gateway(settings).run())
