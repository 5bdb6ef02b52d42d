"""The browser console: the operator's screen over HTTP, on loopback, signed by presence.

It is another face of the operator table (`control.py`): it shows what `bastion
approve` shows -- pending cards whole, sessions with their grants, activity with
`audit activity`'s filters -- and answers with the same calls. What it adds is
the one answer a process cannot give: a WebAuthn assertion over a presence
card's digest (`core/presence`), made by an enrolled authenticator with a
person present.

What it trusts, and why each check is here:

* Only a peer outside every run: before any HTTP is read, `console_door` finds
  the process at the other end of the TCP connection and refuses one inside a
  `bastion run` (or a sandbox, or an agent's tree) or one it cannot find, as the
  operator socket refuses such a peer; each peer holds a few connections, idle
  ones are closed, and a taken port leaves the gateway running without a console.
* Only `localhost:PORT` in the Host header (a DNS-rebinding page names its own
  host), and only the console's own origin in every state-changing request's
  Origin header (another loopback port is another origin).
* A login is itself an assertion; its cookie is HttpOnly, SameSite=Strict and
  host-only, and it ends when the vault changes state or its signer is
  removed. Each state-changing request carries the login's CSRF token in a
  header, which a page of another origin cannot read.
* A stolen cookie and token still cannot approve a presence card: that takes a
  fresh signature over that card (`Authority.sign`).
* The page is the package's own files (`bastion/data/console/`), served with a
  policy that runs no script but them: no CDN, no inline script.

aiohttp does the HTTP; nothing here parses a request by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

from aiohttp import web
from webauthn import generate_authentication_options, options_to_json
from webauthn.helpers.structs import UserVerificationRequirement

from bastion.config import ConsoleConfig
from bastion.core.errors import BastionError
from bastion.core.events import ActivityFilter, EventType
from bastion.core.grants import GrantError
from bastion.core.presence import (
    NONCE_BYTES,
    Checked,
    PresenceError,
    Proof,
    b64url,
    login_challenge,
    unb64url,
)
from bastion.gateway import descriptors
from bastion.gateway.approvals import CardError
from bastion.gateway.console_door import RETRY, ConsoleDoor
from bastion.gateway.control import Control, GatewayView, grant_arg
from bastion.gateway.signers import Signers, SignersError
from bastion.ops.opsock import OperatorError

log = logging.getLogger(__name__)

COOKIE = "bastion_console"
CSRF_HEADER = "X-CSRF-Token"
LOGIN_TTL = 120.0  # seconds a login challenge lives
MAX_LOGIN_ASKS = 32
MAX_BODY = 256 * 1024
ACTIVITY_ROWS = 200
PING = 15.0  # seconds between keep-alive comments on an event stream
ACTIVITY_EVERY = 2.0  # seconds between two `activity` events on one stream, at most
SHUTDOWN = 2.0  # seconds a stopping gateway waits for the console's requests in flight
UV = {True: UserVerificationRequirement.REQUIRED, False: UserVerificationRequirement.PREFERRED}
ASSETS = {
    "console.js": "text/javascript",
    "console.css": "text/css",
}
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
# Records after which an open page's view of cards and sessions is out of date.
CHANGES = frozenset(
    {
        EventType.CARD_RAISED,
        EventType.CARD_CLOSED,
        EventType.SESSION_APPROVED,
        EventType.SESSION_ENDED,
        EventType.GRANT_MADE,
        EventType.GRANT_USED,
        EventType.GRANT_ENDED,
        EventType.VAULT_LOCKED,
        EventType.VAULT_UNLOCKED,
        EventType.PRESENCE_SIGNED,
        EventType.OPERATOR_ENROLLED,
        EventType.OPERATOR_REMOVED,
    }
)
# Records after which the activity view is (records that end or start a request).
ACTIVITY = frozenset(
    {
        EventType.REQUEST_RECEIVED,
        EventType.DENIED,
        EventType.DISPATCH_STARTED,
        EventType.COMPLETED,
        EventType.SIGNALLED,
        EventType.REMOTE_REJECTED,
        EventType.UNKNOWN,
        EventType.NOT_STARTED,
    }
)

_CHANGES = frozenset(e.value for e in CHANGES)  # as a record's `type` spells them
_ACTIVITY = frozenset(e.value for e in ACTIVITY)


def asset(name: str) -> bytes:
    return resources.files("bastion.data").joinpath("console", name).read_bytes()


@dataclass
class Login:
    signer_id: str
    name: str
    csrf: str
    vault_epoch: int
    expires_at: float


class ConsoleError(BastionError):
    """A request the console refuses; `status` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Console:
    """The console's routes over one gateway; `start` serves them on 127.0.0.1:PORT."""

    def __init__(self, gw: GatewayView, signers: Signers, config: ConsoleConfig) -> None:
        self.gw = gw
        self.control = Control(gw)
        self.signers = signers
        self.config = config
        self.origin = config.origin
        self.host = f"localhost:{config.port}"
        self._logins: dict[str, Login] = {}
        self._login_asks: dict[str, float] = {}  # nonce -> expiry
        self._changed = asyncio.Event()  # set, and replaced, at each change (`_wake`)
        self._activity = asyncio.Event()  # the same for requests starting and ending
        self._version = 0  # of what a snapshot shows; `_wake` moves it
        self._snapshot: tuple[int, bytes] | None = None
        self._runner: web.AppRunner | None = None
        self._door: ConsoleDoor | None = None
        self._closing = False
        self.streams = 0  # open event streams (tabs), for status and the bench

    # -- serving ---------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_BODY)
        r = app.router
        r.add_get("/", self._page)
        r.add_get("/enroll", self._page)
        r.add_get("/static/{name}", self._asset)
        r.add_get("/api/state", self._state)
        r.add_post("/api/login/begin", self._login_begin)
        r.add_post("/api/login/finish", self._login_finish)
        r.add_post("/api/logout", self._logout)
        r.add_get("/api/events", self._events)
        r.add_get("/api/activity", self._activity_rows)
        r.add_post("/api/cards/{card}/challenge", self._challenge)
        r.add_post("/api/cards/{card}/sign", self._sign)
        r.add_post("/api/cards/{card}/approve", self._approve)
        r.add_post("/api/cards/{card}/deny", self._deny)
        r.add_post("/api/lock", self._lock)
        r.add_post("/api/sessions/{session}/revoke", self._revoke)
        r.add_post("/api/enroll/options", self._enroll_options)
        r.add_post("/api/enroll/register", self._enroll_register)
        return app

    @property
    def serving(self) -> bool:
        return self._door is not None and self._door.serving

    async def start(self) -> None:
        """Serve through `console_door`: both loopback addresses, who is at the other
        end, how many each may hold; aiohttp's keep-alive timer closes idle connections.
        If the port is taken, the gateway goes on without its console (`status` says
        why) and the door tries again until it is free."""
        self._runner = web.AppRunner(
            self.app(),
            access_log=None,
            handle_signals=False,
            shutdown_timeout=SHUTDOWN,
            keepalive_timeout=self.config.idle_seconds,
        )
        await self._runner.setup()
        assert self._runner.server is not None
        budget = descriptors.budget().console
        self._door = ConsoleDoor(self._runner.server, self.gw.agent_processes, budget)
        self._door.start(self.config.port, self._started)

    def _started(self) -> None:
        self.gw.recorder.sinks.append(self._sink)
        self.gw.recorder.record(
            EventType.CONSOLE_STARTED, {"origin": self.origin, "rp_id": self.signers.rp_id}
        )
        log.info("console at %s/", self.origin)

    async def close(self) -> None:
        with contextlib.suppress(ValueError):
            self.gw.recorder.sinks.remove(self._sink)
        self._closing = True
        self._wake()  # every stream sees the end, and ends
        if self._door is not None:
            await self._door.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def status(self) -> dict[str, Any]:
        """For `bastion status`: served or not (and why), its connections and refusals."""
        door = self._door
        if door is None or not door.serving:
            failure = door.failure if door is not None else "not started yet"
            return {"started": False, "url": None, "error": failure, "retry_seconds": RETRY}
        return {
            "started": True,
            "url": f"{self.origin}/",
            "error": None,
            "streams": self.streams,
            "idle_seconds": self.config.idle_seconds,
            **door.status(),
        }

    def _sink(self, record: Any, _event: dict[str, Any]) -> None:
        """Told of every record on disk: a set lookup on its type, nothing more, since a
        busy gateway writes several records a command."""
        kind = getattr(record, "type", None)
        if kind in _CHANGES:
            self._wake()
        elif kind in _ACTIVITY and self.streams:
            self._activity.set()
            self._activity = asyncio.Event()

    def _wake(self) -> None:
        self._version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    # -- the guard: host, origin, login, CSRF ----------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            if request.host != self.host:
                raise ConsoleError(421, f"open the console at {self.origin}/")
            if request.method != "GET" and request.headers.get("Origin") != self.origin:
                raise ConsoleError(403, "this request does not come from the console's page")
            response = await handler(request)
        except ConsoleError as exc:
            response = web.json_response({"error": str(exc)}, status=exc.status)
        except (CardError, GrantError, OperatorError, SignersError, PresenceError) as exc:
            response = web.json_response({"error": str(exc)}, status=409)
        except web.HTTPException as exc:
            response = web.json_response({"error": exc.reason}, status=exc.status)
        for key, value in SECURITY_HEADERS.items():
            response.headers.setdefault(key, value)
        return response

    def _login(self, request: web.Request, changing: bool = True) -> Login:
        """The request's login, or 401; a state-changing one also needs its CSRF token."""
        token = request.cookies.get(COOKIE, "")
        login = self._logins.get(token)
        vault = self.gw.vault
        if login is not None and (
            login.expires_at <= time.time()
            or login.vault_epoch != vault.epoch
            or vault.locked
            or self.signers.get(login.signer_id) is None  # removed since
        ):
            del self._logins[token]
            login = None
        if login is None:
            raise ConsoleError(401, "log in with your authenticator")
        if changing and not secrets.compare_digest(
            request.headers.get(CSRF_HEADER, ""), login.csrf
        ):
            raise ConsoleError(403, "this request lacks the console's CSRF token")
        return login

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConsoleError(400, "the request body must be JSON") from None
        if not isinstance(body, dict):
            raise ConsoleError(400, "the request body must be a JSON object")
        return body

    # -- the page --------------------------------------------------------------------

    async def _page(self, _: web.Request) -> web.Response:
        return web.Response(body=asset("index.html"), content_type="text/html")

    async def _asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in ASSETS:
            raise ConsoleError(404, "no such file")
        return web.Response(body=asset(name), content_type=ASSETS[name])

    async def _state(self, request: web.Request) -> web.Response:
        """What the page needs before a login: is the vault open, is anyone enrolled,
        and is this browser logged in."""
        vault = self.gw.vault
        try:
            login: Login | None = self._login(request, changing=False)
        except ConsoleError:
            login = None
        return web.json_response(
            {
                "locked": vault.locked,
                "enrolled": len(self.signers.listed()),
                "login": None if login is None else {"name": login.name, "csrf": login.csrf},
                "origin": self.origin,
            }
        )

    # -- logging in --------------------------------------------------------------------

    async def _login_begin(self, _: web.Request) -> web.Response:
        if self.gw.vault.locked:
            raise ConsoleError(409, "the vault is locked: run `bastion unlock`, then log in")
        if not self.signers.listed():
            raise ConsoleError(409, "no authenticator is enrolled: run `bastion operator enroll`")
        now = time.time()
        self._login_asks = {n: t for n, t in self._login_asks.items() if t > now}
        while len(self._login_asks) >= MAX_LOGIN_ASKS:
            del self._login_asks[next(iter(self._login_asks))]
        nonce = b64url(secrets.token_bytes(NONCE_BYTES))
        self._login_asks[nonce] = now + LOGIN_TTL
        return web.json_response(
            {"nonce": nonce, "options": self._assertion_options(login_challenge_of(nonce), False)}
        )

    def _assertion_options(self, challenge: bytes, uv: bool) -> dict[str, Any]:
        options = generate_authentication_options(
            rp_id=self.signers.rp_id,
            challenge=challenge,
            allow_credentials=self.signers.descriptors(),
            user_verification=UV[uv],
            timeout=int(LOGIN_TTL * 1000),
        )
        return json.loads(options_to_json(options))

    async def _login_finish(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        nonce = str(body.get("nonce", ""))
        if self._login_asks.pop(nonce, 0.0) <= time.time():
            raise ConsoleError(409, "this login challenge is unknown, used or expired: try again")
        proof = Proof.from_browser(body.get("assertion"))
        got = self.signers.verify(proof, login_challenge_of(nonce), False)
        if not isinstance(got, Checked):
            self.gw.recorder.record(
                EventType.PRESENCE_REFUSED,
                {"login": True, "signer": proof.signer_id, "flaw": got.value},
            )
            raise ConsoleError(403, f"login refused: {got.words}")
        cred = self.signers.get(got.signer_id)
        assert cred is not None
        token, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        minutes = self.config.session_minutes
        self._logins[token] = Login(
            cred.id, cred.name, csrf, self.gw.vault.epoch, time.time() + 60.0 * minutes
        )
        self.gw.recorder.record(
            EventType.CONSOLE_LOGIN,
            {"signer": cred.id, "name": cred.name, "nonce": nonce, "proof": proof.as_json()},
        )
        response = web.json_response({"name": cred.name, "csrf": csrf})
        response.set_cookie(
            COOKIE, token, httponly=True, samesite="Strict", path="/", max_age=60 * minutes
        )
        return response

    async def _logout(self, request: web.Request) -> web.Response:
        self._login(request)
        self._logins.pop(request.cookies.get(COOKIE, ""), None)
        response = web.json_response({"logged_out": True})
        response.del_cookie(COOKIE, path="/")
        return response

    # -- what the page shows -----------------------------------------------------------

    async def snapshot(self) -> dict[str, Any]:
        book = self.gw.book
        book.note_operator()  # a console open is an operator looking
        cards = []
        for card in book.pending():
            shown = card.as_json()
            shown["signed"] = [s.as_json() for s in book.signed(card.id)]
            cards.append(shown)
        return {
            "locked": self.gw.vault.locked,
            "vault_epoch": self.gw.vault.epoch,
            "boot_id": self.gw.boot_id,
            "cards": cards,
            "sessions": await self.control.sessions({}),
            "signers": [{"id": c["id"], "name": c["name"]} for c in self.signers.listed()],
        }

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: a snapshot now and after each change to cards, sessions,
        signers or the vault (built once, shared by every stream), and an `activity`
        event, at most every ACTIVITY_EVERY seconds, while requests start and end (the
        page fetches rows only while it shows them). A busy gateway's commands wake no
        snapshot: they change neither cards nor sessions."""
        self._login(request, changing=False)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"}
        )
        for key, value in SECURITY_HEADERS.items():
            response.headers.setdefault(key, value)
        await response.prepare(request)
        idle = self.config.idle_seconds

        async def write(data: bytes) -> None:
            """A write that must drain within the idle time: a stream is not idle while
            it sends, and one whose reader stopped is."""
            await asyncio.wait_for(response.write(data), idle)

        self.streams += 1
        sent, told, owed = -1, 0.0, False  # snapshot version sent; activity told, owed
        try:
            while not self._closing:
                if sent != self._version:
                    sent = self._version
                    data = await self._snapshot_json()
                    await write(b"event: snapshot\ndata: " + data + b"\n\n")
                now = time.monotonic()
                if owed and now - told >= ACTIVITY_EVERY:
                    owed, told = False, now
                    await write(b"event: activity\ndata: {}\n\n")
                changed, activity = self._changed, self._activity
                waits = [asyncio.ensure_future(changed.wait())]
                if not owed:
                    waits.append(asyncio.ensure_future(activity.wait()))
                timeout = PING if not owed else max(0.0, ACTIVITY_EVERY - (now - told))
                done, _ = await asyncio.wait(
                    waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                for task in waits:
                    task.cancel()
                owed = owed or activity.is_set()
                self._login(request, changing=False)  # a lock ends the stream's login too
                if not done and not owed:
                    await write(b": ping\n\n")
        except TimeoutError:  # a reader that stopped reading: the stream is idle, not sending
            if request.transport is not None:
                request.transport.abort()
        except (ConsoleError, ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.streams -= 1
        return response

    async def _snapshot_json(self) -> bytes:
        """The snapshot of this version, made once for every stream that sends it."""
        version = self._version
        if self._snapshot is None or self._snapshot[0] != version:
            self._snapshot = (version, json.dumps(await self.snapshot()).encode())
        return self._snapshot[1]

    async def _activity_rows(self, request: web.Request) -> web.Response:
        """`audit activity`'s rows and filters: host, run, since, until (seconds since
        the epoch), outcome (repeatable), grep; the last ACTIVITY_ROWS that match."""
        self._login(request, changing=False)
        q = request.query
        try:
            keep = ActivityFilter(
                hosts=frozenset(h.strip().lower() for h in q.getall("host", []) if h.strip()),
                run=q.get("run") or None,
                since=float(q["since"]) if q.get("since") else None,
                until=float(q["until"]) if q.get("until") else None,
                outcomes=frozenset(q.getall("outcome", [])),
                grep=q.get("grep") or None,
            )
        except ValueError:
            raise ConsoleError(400, "since and until are seconds since the epoch") from None
        rows = await self.control.audit({"view": "activity"})
        return web.json_response(keep.select(rows)[-ACTIVITY_ROWS:])

    # -- answers -------------------------------------------------------------------------

    async def _challenge(self, request: web.Request) -> web.Response:
        """A fresh challenge over one presence card (and the grant asked with the yes)."""
        self._login(request)
        body = await self._body(request)
        ask = self.gw.authority.presence_ask(request.match_info["card"], grant_arg(body))
        assert ask.card.presence is not None
        options = self._assertion_options(ask.challenge, ask.card.presence.user_verification)
        return web.json_response({"nonce": ask.nonce, "options": options})

    async def _sign(self, request: web.Request) -> web.Response:
        self._login(request)
        body = await self._body(request)
        proof = Proof.from_browser(body.get("assertion"))
        card, done = self.gw.authority.sign(
            request.match_info["card"], str(body.get("nonce", "")), proof
        )
        signed = [s.as_json() for s in self.gw.book.signed(card.id)]
        return web.json_response({"card": card.id, "approved": done, "signed": signed})

    async def _approve(self, request: web.Request) -> web.Response:
        """A yes to a card whose account does not ask presence (one that does is told to
        sign: `Authority.answer` refuses it)."""
        self._login(request)
        body = await self._body(request)
        return web.json_response(
            await self.control.answer(
                {"card": request.match_info["card"], "approve": True} | _grant_of(body)
            )
        )

    async def _deny(self, request: web.Request) -> web.Response:
        self._login(request)
        return web.json_response(
            await self.control.answer({"card": request.match_info["card"], "approve": False})
        )

    async def _lock(self, request: web.Request) -> web.Response:
        self._login(request)
        body = await self._body(request)
        return web.json_response(
            await self.control.lock({"terminate": bool(body.get("terminate", False))})
        )

    async def _revoke(self, request: web.Request) -> web.Response:
        self._login(request)
        return web.json_response(
            await self.control.revoke({"session": request.match_info["session"]})
        )

    # -- enrolling (the token from `bastion operator enroll` is the authority) ----------

    async def _enroll_options(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        return web.json_response(self.signers.options(str(body.get("token", ""))))

    async def _enroll_register(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        registration = body.get("registration")
        if not isinstance(registration, dict):
            raise ConsoleError(400, "registration must be the authenticator's JSON")
        code = self.signers.register(str(body.get("token", "")), registration)
        return web.json_response({"code": f"{code[:3]}-{code[3:]}"})


def login_challenge_of(nonce: str) -> bytes:
    """A login's challenge from the nonce the page was given (base64url)."""
    return login_challenge(unb64url(nonce))


def _grant_of(body: dict[str, Any]) -> dict[str, Any]:
    return {"grant": body["grant"]} if body.get("grant") is not None else {}
