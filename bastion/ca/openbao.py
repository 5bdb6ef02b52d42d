"""A team's OpenBao / HashiCorp Vault signs the per-command certificates.

Its SSH secrets engine signs what `core/certs.py` decided, for a fresh key made
here, and its audit device logs each signing. But its role decides what it
signs, and a role can add to a certificate silently (`default_extensions`
apply whenever a request names none, and bastion names none): so what comes
back is read field by field (`certificate_problem`) and refused unless it says
exactly what was asked -- a misconfigured role fails closed. `role_problems`
tells the operator what the role lacks before a request does. The login (a
token, or an AppRole) is a secret sealed in the vault, never a file or the
environment. Every failure is a `Refusal` (`core/refusals.py` chooses its
code): nothing was sent, and the message says what failed and that an
operator must fix OpenBao -- never the token, never the command.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import asyncssh

from bastion.ca import vault_ca
from bastion.ca.vault_ca import OPENBAO_SECRET, Issued
from bastion.config import CaConfig
from bastion.core.certs import CertSpec
from bastion.core.contract import Refusal
from bastion.core.errors import BastionError
from bastion.core.refusals import Fact, refusal
from bastion.vault import VaultError, VaultLocked

try:  # the `openbao` extra: a gateway with the vault's own CA does without it
    import hvac
    import hvac.exceptions
    import requests
except ImportError:  # pragma: no cover - exercised only without the extra
    hvac = None  # type: ignore[assignment]

log = logging.getLogger(__name__)
CRITICAL = ("force-command", "source-address")
CLOCK_SKEW = 60  # seconds OpenBao's clock may run ahead of the gateway's
USER_CERT = 1  # SSH_CERT_TYPE_USER
CERT_ALGORITHM = "ssh-ed25519-cert-v01@openssh.com"  # fresh_key() makes ed25519 keys
NOTHING_SENT = "Nothing was sent."
# Signings in flight at once, in threads of their own: a stalled OpenBao holds these for
# up to `timeout`, never the loop's shared pool (journal syncs, agents' identification).
WORKERS = 8
_REPLY_MAX = 300  # characters of OpenBao's own error words kept in a message


class LoginError(BastionError, ValueError):
    """The sealed OpenBao login is not one of the two shapes; says which fields."""


@dataclass(frozen=True)
class Login:
    """How the gateway logs in to OpenBao: a token, or an AppRole."""

    token: str = field(default="", repr=False)
    role_id: str = field(default="", repr=False)
    secret_id: str = field(default="", repr=False)

    @property
    def approle(self) -> bool:
        return not self.token

    def sealed(self) -> bytes:
        """The bytes `Vault.put_secret(OPENBAO_SECRET, ...)` keeps."""
        return json.dumps({k: v for k, v in asdict(self).items() if v}).encode()


def parse_login(raw: bytes) -> Login:
    """`{"token": T}` or `{"role_id": R, "secret_id": S}`, non-empty strings, nothing else."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        data = None
    if not isinstance(data, dict) or set(data) not in ({"token"}, {"role_id", "secret_id"}):
        raise LoginError('not a JSON object of "token", or of "role_id" and "secret_id"')
    if not all(isinstance(v, str) and v and v.strip() == v for v in data.values()):
        raise LoginError("each field must be a non-empty string without spaces")
    return Login(**data)


# -- reading what OpenBao signed -------------------------------------------------------------


@dataclass(frozen=True)
class CertFields:
    """An OpenSSH user certificate's fields as signed, read from its bytes: asyncssh
    silently drops extensions it does not know, and a check must see every one."""

    public_key: bytes
    serial: int
    cert_type: int
    key_id: str
    principals: tuple[str, ...]
    valid_after: int
    valid_before: int
    critical: dict[str, bytes]
    extensions: dict[str, bytes]
    signature_key: bytes


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("certificate truncated")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def string(self) -> bytes:
        return self.take(struct.unpack(">I", self.take(4))[0])

    def uint(self, size: int) -> int:
        return int.from_bytes(self.take(size), "big")

    def strings(self) -> list[bytes]:
        """A string holding a list of strings (principals, options and their values)."""
        inner, found = _Reader(self.string()), []
        while inner.pos < len(inner.data):
            found.append(inner.string())
        return found

    def pairs(self) -> dict[str, bytes]:
        items = self.strings()
        names = [n.decode() for n in items[::2]]
        if len(items) % 2 or len(set(names)) != len(names):
            raise ValueError("malformed options")
        return dict(zip(names, items[1::2], strict=True))


def cert_fields(blob: bytes) -> CertFields:
    """The fields of an ed25519 user certificate blob; ValueError if it is another kind."""
    r = _Reader(blob)
    if (algorithm := r.string().decode()) != CERT_ALGORITHM:
        raise ValueError(f"certificate type {algorithm!r}, not {CERT_ALGORITHM}")
    r.string()  # nonce
    key, serial, kind, key_id = r.string(), r.uint(8), r.uint(4), r.string().decode()
    principals = tuple(p.decode() for p in r.strings())
    after, before, critical, extensions = r.uint(8), r.uint(8), r.pairs(), r.pairs()
    r.string()  # reserved
    signer = r.string()
    return CertFields(
        key, serial, kind, key_id, principals, after, before, critical, extensions, signer
    )


def _string(data: bytes) -> bytes:
    """An SSH wire-format string: its length, then its bytes."""
    return struct.pack(">I", len(data)) + data


def certificate_problem(
    cert: asyncssh.SSHCertificate, key: asyncssh.SSHKey, spec: CertSpec, now: float
) -> str | None:
    """Why this certificate must not be used for `spec` (None: it says exactly that).
    The signature itself was checked when asyncssh imported it."""
    try:
        got = cert_fields(cert.public_data)
    except (ValueError, UnicodeDecodeError) as exc:
        return f"it cannot be read ({exc})"
    want_key = key.public_data
    want_critical = {
        "force-command": _string(spec.force_command.encode()),
        "source-address": _string(",".join(spec.source_address).encode()),
    }
    checks = [
        (got.cert_type == USER_CERT, "it is not a user certificate"),
        (_string(b"ssh-ed25519") + _string(got.public_key) == want_key, "another key"),
        (got.signature_key != want_key, "it is signed by its own key, not a CA"),
        (got.principals == (spec.principal,), f"principals {list(got.principals)}"),
        (got.key_id == spec.key_id, f"key id {got.key_id!r}"),
        (  # named without the command text: the command is not for logs
            got.critical.get("force-command") == want_critical["force-command"],
            "another force-command" if "force-command" in got.critical else "no force-command",
        ),
        (
            got.critical.get("source-address") == want_critical["source-address"],
            f"source-address {got.critical.get('source-address')!r}",
        ),
        (set(got.critical) <= set(CRITICAL), f"critical options {sorted(got.critical)}"),
        (not got.extensions, f"extensions {sorted(got.extensions)} (it must have none)"),
        (got.valid_before > now, "it has already expired"),
        (
            got.valid_before <= spec.valid_before + CLOCK_SKEW,
            f"it is valid until {got.valid_before}, past {spec.valid_before}",
        ),
        (got.valid_after <= now + CLOCK_SKEW, "it is not valid yet"),
    ]
    wrong = [what for ok, what in checks if not ok]
    return "; ".join(wrong) if wrong else None


def parse_serial(text: object) -> int:
    """OpenBao's `serial_number`: hex, in OpenBao 2.7 bare ("aa37bcdea4edcdf9"),
    with ':' or '-' between byte pairs in some versions."""
    if not isinstance(text, str):
        raise ValueError("no serial_number")
    return int(text.replace(":", "").replace("-", ""), 16)


# -- what the role must allow ----------------------------------------------------------------


def role_command(mount: str, role: str, principals: Iterable[str], ttl: int = 60) -> str:
    """The one `bao write` that makes the role bastion needs. A write replaces the
    whole role (OpenBao's SSH roles have no patch), so this names every field."""
    return (
        f"bao write {mount}/roles/{role} key_type=ca allow_user_certificates=true "
        f"allowed_users={','.join(sorted(set(principals)))} "
        'allowed_critical_options=force-command,source-address allowed_extensions="" '
        f"allow_user_key_ids=true ttl={ttl}s max_ttl=1h"
    )


def role_problems(
    role: dict[str, Any], principals: Iterable[str], mount: str, name: str
) -> list[str]:
    """What in the role `MOUNT/roles/NAME` (as `bao read` shows it) stops bastion's
    certificates, or lets the role sign more than bastion would; each with the fix."""
    wanted = sorted(set(principals))
    allowed_users = {u.strip() for u in str(role.get("allowed_users", "")).split(",") if u.strip()}
    missing = [p for p in wanted if "*" not in allowed_users and p not in allowed_users]
    critical = {c.strip() for c in str(role.get("allowed_critical_options", "")).split(",")}
    critical.discard("")
    users, extensions = role.get("allowed_users", ""), role.get("allowed_extensions", "")
    checks = [
        (role.get("key_type") != "ca", f'key_type is {role.get("key_type")!r}, not "ca"'),
        (not role.get("allow_user_certificates"), "allow_user_certificates is false"),
        (role.get("allow_host_certificates"), "allow_host_certificates is true"),
        (
            not role.get("allow_user_key_ids"),
            "allow_user_key_ids is false: the key id cannot be the request id",
        ),
        (
            critical != set(CRITICAL),
            f"allowed_critical_options is {role.get('allowed_critical_options', '')!r}, "
            'not exactly "force-command,source-address" (empty allows any)',
        ),
        (
            bool(role.get("default_extensions")),
            f"default_extensions {sorted(role.get('default_extensions') or {})}: OpenBao adds "
            "them to every certificate bastion asks for, and the gateway refuses those",
        ),
        (
            bool(extensions),
            f"allowed_extensions is {extensions!r}: the gateway's login could sign "
            "certificates with a PTY or forwarding",
        ),
        (role.get("allowed_users_template"), "allowed_users_template is true"),
        (bool(missing), f"allowed_users {users!r} lacks {missing}"),
    ]
    found = [what for bad, what in checks if bad]
    if not found:
        return []
    fix = role_command(mount, name, (allowed_users - {"*"}) | set(wanted))
    return [f"OpenBao role {mount}/roles/{name}: {p}. Fix: {fix}" for p in found]


# -- the issuer ------------------------------------------------------------------------------


def _refused(detail: str) -> Refusal:
    """OpenBao did not sign (or signed something else): `detail` says what and the fix."""
    return refusal(Fact.SIGNER_FAILED, detail=detail)


class OpenBaoCA:
    """Asks OpenBao's SSH secrets engine to sign each certificate; checks what comes back."""

    name = "openbao"

    def __init__(self, config: CaConfig, credentials: Callable[[], bytes]) -> None:
        self.config = config
        self.credentials = credentials
        self._pool = concurrent.futures.ThreadPoolExecutor(WORKERS, "openbao")
        self._local = threading.local()  # one hvac client (one HTTP session) per thread
        self._lock = threading.Lock()
        self._token: tuple[Login, str] | None = None  # an AppRole's cached client token
        self.where = f"OpenBao at {config.address}"
        self.sign_path = f"{config.mount}/sign/{config.role}"

    def problem(self) -> str | None:
        """Only a missing hvac: whether OpenBao signs is known by asking it, per request."""
        if hvac is not None:
            return None
        return '[ca] backend = "openbao" needs hvac: install bastion[openbao], restart'

    async def issue(self, spec: CertSpec) -> Issued:
        key = vault_ca.fresh_key()
        try:
            return await self._bounded(self._issue, spec, key)
        except Refusal:
            raise
        except TimeoutError:
            raise _refused(
                f"{self.where} did not sign the command's certificate within "
                f"{self.config.timeout:g} s. {NOTHING_SENT} An operator must check that "
                "OpenBao is up and reachable from the gateway; a later retry may work.",
            ) from None
        except Exception as exc:  # fail closed on anything unforeseen, e.g. a new hvac
            log.error("signing with %s failed: %s", self.where, type(exc).__name__)
            raise _refused(
                f"Signing with {self.where} failed ({type(exc).__name__}). {NOTHING_SENT} "
                "An operator must read the gateway log and fix OpenBao.",
            ) from exc

    async def check(self, principals: Iterable[str]) -> list[str]:
        """What stops or weakens signing for these principals, each with its fix: the
        role's settings, or why they cannot be read. For the gateway's start-up log."""
        try:
            role = await self._bounded(
                self._call, "read", f"{self.config.mount}/roles/{self.config.role}"
            )
        except Refusal as exc:
            return [f"cannot check the OpenBao role: {exc.message}"]
        except Exception as exc:  # a timeout (TimeoutError), or anything unforeseen
            return [f"cannot check the OpenBao role: {self.where}: {type(exc).__name__}"]
        if not isinstance(role, dict) or not isinstance(role.get("data"), dict):
            return [
                f"OpenBao has no role {self.config.mount}/roles/{self.config.role}. Fix: "
                + role_command(self.config.mount, self.config.role, principals)
            ]
        return role_problems(role["data"], principals, self.config.mount, self.config.role)

    def _bounded(self, call: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        """`call` in this backend's own threads, given up after `[ca] timeout`."""
        future = asyncio.get_running_loop().run_in_executor(self._pool, call, *args)
        return asyncio.wait_for(future, self.config.timeout)

    # -- worker threads ----------------------------------------------------------------------

    def _issue(self, spec: CertSpec, key: asyncssh.SSHKey) -> Issued:
        now = time.time()
        ttl = max(1, spec.valid_before - int(now))
        reply = self._call(
            "write",
            self.sign_path,
            {
                "public_key": key.export_public_key().decode(),
                "valid_principals": spec.principal,
                "cert_type": "user",
                "key_id": spec.key_id,
                "critical_options": spec.critical_options,
                "extensions": {},
                "ttl": f"{ttl}s",
            },
            spec.force_command,
        )
        try:
            data = reply["data"]
            cert = asyncssh.import_certificate(str(data["signed_key"]))
            serial = parse_serial(data.get("serial_number"))
        except (KeyError, TypeError, AttributeError, ValueError, asyncssh.KeyImportError) as exc:
            raise self._bad_certificate(f"its reply holds no valid certificate ({exc})") from None
        wrong = certificate_problem(cert, key, spec, time.time())
        fields = cert_fields(cert.public_data) if wrong is None else None
        if fields is not None and serial != fields.serial:
            wrong = "its serial_number differs from the certificate's serial"
        if wrong is not None or fields is None:
            raise self._bad_certificate(wrong or "unreadable")
        fingerprint, until = cert.signing_key.get_fingerprint("sha256"), spec.valid_before
        return Issued(key, cert, fields.serial, spec.key_id, fingerprint, self.name, until)

    def _bad_certificate(self, what: str) -> Refusal:
        return _refused(
            f"{self.where} signed a certificate that does not say what was approved ({what}), "
            f"so the gateway did not use it. {NOTHING_SENT} An operator must fix the role "
            f"{self.config.mount}/roles/{self.config.role} (the gateway log names what it lacks)."
        )

    def _client(self) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            if hvac is None:
                raise _refused(self.problem() or "no hvac")
            session = requests.Session()
            session.trust_env = False  # no proxy, netrc or CA bundle from the environment
            tls = str(self.config.tls_ca) if self.config.tls_ca else True
            client = hvac.Client(  # token="": never hvac's VAULT_TOKEN or ~/.vault-token
                url=self.config.address,
                token="",
                verify=tls,
                timeout=self.config.timeout,
                session=session,
            )
            self._local.client = client
        return client

    def _login(self) -> Login:
        try:
            return parse_login(self.credentials())
        except VaultLocked:
            raise refusal(Fact.SIGNER_LOCKED) from None
        except VaultError as exc:
            raise _refused(
                f"The gateway could not read its OpenBao login from the vault ({exc}). "
                f"{NOTHING_SENT} An operator must store one: `bastion ca openbao-login`."
            ) from None
        except LoginError as exc:
            raise _refused(
                f"The OpenBao login sealed in the vault ({OPENBAO_SECRET}) is unusable: {exc}. "
                f"{NOTHING_SENT} An operator must store it again: `bastion ca openbao-login`."
            ) from None

    def _client_token(self, client: Any, login: Login, fresh: bool) -> str:
        if not login.approle:
            return login.token
        with self._lock:
            cached = self._token
        if cached is not None and cached[0] == login and not fresh:
            return cached[1]
        mount = self.config.approle_mount
        try:
            reply = client.auth.approle.login(
                role_id=login.role_id, secret_id=login.secret_id, mount_point=mount
            )
            token = str(reply["auth"]["client_token"])
        except (hvac.exceptions.Forbidden, hvac.exceptions.InvalidRequest) as exc:
            raise _refused(
                f"{self.where} refused the gateway's AppRole login at auth/{mount} "
                f"({self._words(exc)}). {NOTHING_SENT} An operator must issue a new secret id "
                "and store it: `bastion ca openbao-login`."
            ) from None
        except (KeyError, TypeError):
            raise _refused(f"{self.where} answered the AppRole login without a token.") from None
        with self._lock:
            self._token = (login, token)
        return token

    def _call(self, op: str, path: str, body: dict[str, Any] | None = None, hide: str = "") -> Any:
        """One read or write with the sealed login: an AppRole logs in (again, once, on a
        403). Every failure is a `Refusal`, worded without the token or `hide`."""
        client = self._client()
        login = self._login()
        for attempt in (0, 1):
            try:
                client.token = self._client_token(client, login, fresh=attempt == 1)
                if op == "read":
                    return client.read(path)
                return client.write_data(path, data=body)
            except hvac.exceptions.Forbidden as exc:
                if login.approle and attempt == 0:
                    continue
                raise _refused(
                    f"{self.where} refused the gateway's login for {path} "
                    f"({self._words(exc, hide)}). {NOTHING_SENT} An operator must renew the "
                    f"login (`bastion ca openbao-login`) or grant its policy "
                    f'`path "{path}"` the capability it needs.'
                ) from None
            except hvac.exceptions.VaultError as exc:
                raise _refused(
                    f"{self.where} answered {path} with an error: {self._words(exc, hide)}. "
                    f"{NOTHING_SENT} An operator must fix OpenBao or the role "
                    "(the gateway log at start names what the role lacks)."
                ) from None
            except requests.exceptions.RequestException as exc:
                late = isinstance(exc, requests.exceptions.Timeout)
                what = (
                    "did not answer in time"
                    if late
                    else f"was unreachable ({exc.__class__.__name__})"
                )
                raise _refused(
                    f"{self.where} {what}. {NOTHING_SENT} An operator must check that OpenBao "
                    "is up and reachable from the gateway (address, TLS, [ca] tls_ca); a later "
                    "retry may work."
                ) from None
        raise AssertionError("unreachable")

    @staticmethod
    def _words(exc: Exception, hide: str = "") -> str:
        """OpenBao's own error words, short, without the command if it echoed it."""
        errors = getattr(exc, "errors", None)
        text = "; ".join(str(e) for e in errors) if errors else type(exc).__name__
        if hide:
            text = text.replace(hide, "<the command>")
        return text[:_REPLY_MAX].replace("\n", " ")
