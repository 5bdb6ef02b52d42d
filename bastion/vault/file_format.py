"""The vault's file: its format, its parser and its atomic, locked writes.

One JSON file. The passphrase is stretched with Argon2id (scrypt in old vaults); each private
key is its own ChaCha20-Poly1305 record whose associated data binds the format tag, label and
public metadata, so a record cannot be moved to another label or paired with another public
key. Public metadata stays plaintext so `key list` / `key public` work while locked. The
daemon and an offline CLI may both write, so every write takes a flock on `<vault>.lock`
and re-reads the file first.

This module is the format: `VaultFile` (the parsed, validated contents, read and written
whole), its sealed `Record`s and `Secret`s, the `Kdf`, and `write_lock`. `store.py` is the
vault in memory -- the handle that holds the derived key while unlocked -- and uses only
this public API, so the format's insides (the verifier, the associated data, base64) stay here.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import asyncssh
from argon2.exceptions import HashingError
from argon2.low_level import Type, hash_secret_raw
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt
from cryptography.hazmat.primitives.serialization import load_ssh_public_key

from bastion.core.errors import BastionError

log = logging.getLogger(__name__)

FORMAT = "bastion-vault-1"
# Argon2id (t passes, m KiB, p lanes). "strong", the default, took 0.78-0.83 s on 2 cores.
# "test" is for test suites only (BASTION_KDF_PROFILE=test, read at each derivation).
KDF_PROFILES = {"strong": (2, 512 * 1024, 2), "test": (1, 1024, 1)}
KDF_FIELDS = {"scrypt": ("n", "r", "p"), "argon2id": ("t", "m", "p")}
LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
GENERATE: dict[str, dict[str, int]] = {
    "ssh-ed25519": {},
    "ecdsa-sha2-nistp256": {},
    "ssh-rsa": {"key_size": 3072},
}
IMPORTABLE = frozenset(GENERATE) | {"ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521"}
MIN_RSA_BITS = 2048
MAX_KEY_FILE = 1 << 20
_VERIFIER = b"bastion vault passphrase verifier"
_PUBLIC = ("label", "algorithm", "public_key", "created_at")  # a record's plaintext fields
RESERVED_PREFIX = "bastion-"  # labels bastion keeps for itself (the journal identity)


class VaultError(BastionError):
    """A vault failure a person can act on; never carries secret bytes."""


class WrongPassphrase(VaultError): ...


class VaultLocked(VaultError): ...


class KeyFilePassphraseNeeded(VaultError): ...


@dataclass(frozen=True)
class KeyInfo:
    label: str
    algorithm: str
    public_key: str
    fingerprint: str
    created_at: str

    @classmethod
    def of(cls, label: str, public_key: str, created_at: str) -> KeyInfo:
        """The metadata of `public_key` (an OpenSSH public line) under `label`."""
        pub = asyncssh.import_public_key(public_key)
        return cls(
            label, pub.get_algorithm(), public_key, pub.get_fingerprint("sha256"), created_at
        )


@dataclass(frozen=True)
class Record:
    """One private key, sealed under the vault key; its associated data binds the format
    tag, the label and the public metadata, so it cannot move to another label or key."""

    info: KeyInfo
    nonce: bytes
    ciphertext: bytes

    @classmethod
    def seal(cls, info: KeyInfo, key: bytearray, private: bytes) -> Record:
        nonce = os.urandom(12)
        return cls(info, nonce, ChaCha20Poly1305(key).encrypt(nonce, private, _record_ad(info)))

    def open(self, key: bytearray) -> bytes:
        """The private key's bytes (InvalidTag if the AEAD fails)."""
        return ChaCha20Poly1305(key).decrypt(self.nonce, self.ciphertext, _record_ad(self.info))


@dataclass(frozen=True)
class Secret:
    """A small secret the gateway needs (an OpenBao token), sealed like a key."""

    label: str
    created_at: str
    nonce: bytes
    ciphertext: bytes

    @classmethod
    def seal(cls, label: str, key: bytearray, plain: bytes) -> Secret:
        sec = cls(label, now_stamp(), os.urandom(12), b"")
        return replace(sec, ciphertext=ChaCha20Poly1305(key).encrypt(sec.nonce, plain, sec._ad()))

    def open(self, key: bytearray) -> bytes:
        """The secret's bytes (InvalidTag if the AEAD fails)."""
        return ChaCha20Poly1305(key).decrypt(self.nonce, self.ciphertext, self._ad())

    def _ad(self) -> bytes:
        return json.dumps([FORMAT, "secret", self.label, self.created_at]).encode()


@dataclass(frozen=True)
class Kdf:
    name: str  # a key of KDF_FIELDS; scrypt is only ever read
    params: tuple[int, ...]  # in KDF_FIELDS order: scrypt (n, r, p), argon2id (t, m KiB, p)
    salt: bytes

    @staticmethod
    def default() -> Kdf:  # a fresh salt, and the strong profile unless asked for "test"
        test = os.environ.get("BASTION_KDF_PROFILE") == "test"
        return Kdf("argon2id", KDF_PROFILES["test" if test else "strong"], os.urandom(16))

    def weaker_than(self, other: Kdf) -> bool:  # another KDF, fewer passes or less memory
        return self.name != other.name or any(map(int.__lt__, self.params[:2], other.params))

    def verifier_ad(self) -> bytes:
        name = [] if self.name == "scrypt" else [self.name]  # scrypt's shape predates the name
        return json.dumps([FORMAT, "verifier", self.salt.hex(), *name, *self.params]).encode()

    def derive(self, passphrase: bytes) -> bytearray:
        """The 32-byte key, in a bytearray we can wipe (the libraries' own bytes are not)."""
        if not isinstance(passphrase, bytes | bytearray):
            raise TypeError("passphrase must be bytes")
        a, b, p = self.params
        if self.name == "scrypt":
            return bytearray(Scrypt(salt=self.salt, length=32, n=a, r=b, p=p).derive(passphrase))
        try:
            return bytearray(hash_secret_raw(bytes(passphrase), self.salt, a, b, p, 32, Type.ID))
        except HashingError as e:  # e.g. the memory could not be allocated; no secret in it
            log.warning("argon2id with %d KiB failed: %s", b, e)
            raise VaultError(f"cannot derive the vault key (argon2id, {b} KiB): {e}") from None


@dataclass(frozen=True)
class VaultFile:
    """The vault file's contents, parsed and validated whole: `read` never returns a
    half-formed vault, and `write` replaces the file atomically."""

    epoch: int
    kdf: Kdf
    verifier_nonce: bytes
    verifier: bytes
    records: tuple[Record, ...]
    serial: int = 0  # the last certificate serial handed out (or reserved): never reused
    secrets: tuple[Secret, ...] = ()

    @classmethod
    def new(cls, kdf: Kdf, key: bytearray) -> VaultFile:
        """An empty vault at epoch 1 whose verifier `key` (derived under `kdf`) opens."""
        nonce = os.urandom(12)
        return cls(
            1, kdf, nonce, ChaCha20Poly1305(key).encrypt(nonce, _VERIFIER, kdf.verifier_ad()), ()
        )

    @classmethod
    def read(cls, path: Path) -> VaultFile:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise VaultError(f"no vault at {path}; run `bastion init` to create one") from None
        except OSError as e:
            raise VaultError(f"cannot read vault {path}: {e.strerror}") from None
        return _parse(path, raw)

    def write(self, path: Path) -> None:
        """Atomic replace: a crash leaves either the old or the new vault, never a torn one."""
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(_serialize(self))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
            dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            raise VaultError(f"cannot write vault {path}: {e.strerror}") from None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def find(self, label: str) -> Record | None:
        return next((rec for rec in self.records if rec.info.label == label), None)

    def matches(self, key: bytearray) -> bool:
        """Is `key` this file's vault key (does it open the verifier)?"""
        ad = self.kdf.verifier_ad()
        try:
            return (
                ChaCha20Poly1305(key).decrypt(self.verifier_nonce, self.verifier, ad) == _VERIFIER
            )
        except InvalidTag:
            return False

    def rekeyed(self, old: bytearray, kdf: Kdf, new: bytearray) -> VaultFile | None:
        """This file under `kdf` and its key `new`: a new verifier, each record re-sealed
        with its own associated data and a fresh nonce; None if a record fails
        authentication (left as is)."""
        new_aead, records = ChaCha20Poly1305(new), []
        for rec in self.records:
            try:
                plain = rec.open(old)
            except InvalidTag:
                log.warning(
                    "vault KDF not upgraded: record %r fails authentication", rec.info.label
                )
                return None
            records.append(Record.seal(rec.info, new, plain))
        secrets = []
        for sec in self.secrets:
            try:
                plain = sec.open(old)
            except InvalidTag:
                log.warning("vault KDF not upgraded: secret %r fails authentication", sec.label)
                return None
            nonce = os.urandom(12)
            secrets.append(
                replace(sec, nonce=nonce, ciphertext=new_aead.encrypt(nonce, plain, sec._ad()))
            )
        nonce = os.urandom(12)
        verifier = new_aead.encrypt(nonce, _VERIFIER, kdf.verifier_ad())
        return replace(
            self,
            kdf=kdf,
            verifier_nonce=nonce,
            verifier=verifier,
            records=tuple(records),
            secrets=tuple(secrets),
        )


def check_label(label: str) -> None:
    if not isinstance(label, str) or not LABEL_RE.fullmatch(label):
        raise VaultError(
            f"invalid key label {label!r}: use 1-64 characters from A-Z a-z 0-9 . _ -"
            ", starting with a letter or digit"
        )


def check_key_type(key: asyncssh.SSHKey) -> str:
    """Refuse key types the dispatcher cannot use safely (DSA, security-key handles, weak RSA)."""
    alg = key.get_algorithm()
    if alg not in IMPORTABLE:
        raise VaultError(f"unsupported key type {alg}: use ed25519, ecdsa or rsa")
    if alg == "ssh-rsa":
        bits = load_ssh_public_key(key.export_public_key()).key_size
        if bits < MIN_RSA_BITS:
            raise VaultError(f"RSA key of {bits} bits is too weak: at least {MIN_RSA_BITS} needed")
    return alg


def now_stamp() -> str:
    """UTC now, to the second, as the vault's records write it."""
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _record_ad(info: KeyInfo) -> bytes:
    return json.dumps(
        [FORMAT, "key", info.label, info.algorithm, info.public_key, info.created_at]
    ).encode()


def wipe(*keys: bytearray | None) -> None:
    """Zero derived keys in place (the one copy Python lets us wipe)."""
    for key in filter(None, keys):
        key[:] = bytes(len(key))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def _parse(path: Path, raw: bytes) -> VaultFile:
    """Validate everything up front, so later code never meets a half-formed vault."""
    try:
        obj = json.loads(raw)
        if obj.get("format") != FORMAT:
            raise ValueError("unknown format")
        kdf, ver, epoch = obj["kdf"], obj["verifier"], obj["epoch"]
        kdf = Kdf(kdf["name"], tuple(kdf[f] for f in KDF_FIELDS[kdf["name"]]), _unb64(kdf["salt"]))
        if any(type(v) is not int for v in (epoch, *kdf.params)) or epoch < 0:
            raise ValueError("bad header")
        a, b, p = kdf.params  # bounds first: a hostile file must not hang us or eat memory
        scrypt_ok = a > 1 and not a & (a - 1) and 0 < b <= 16 and a * b <= 2**21 and 0 < p <= 4
        argon2_ok = 0 < a <= 20 and 0 < p <= 16 and 8 * p <= b <= 4 * 2**20  # 20 passes, 4 GiB
        if not (scrypt_ok if kdf.name == "scrypt" else argon2_ok):
            raise ValueError("kdf parameters out of range")
        records = []
        for item in obj["keys"]:
            if not all(isinstance(item[f], str) for f in (*_PUBLIC, "nonce", "ciphertext")):
                raise ValueError("bad record")
            check_label(item["label"])
            info = KeyInfo.of(item["label"], item["public_key"], item["created_at"])
            if info.algorithm != item["algorithm"] or info.algorithm not in IMPORTABLE:
                raise ValueError("algorithm mismatch")
            rec = Record(info, _unb64(item["nonce"]), _unb64(item["ciphertext"]))
            if len(rec.nonce) != 12 or any(o.info.label == info.label for o in records):
                raise ValueError("bad record")
            records.append(rec)
        secrets: list[Secret] = []
        for item in obj.get("secrets", []):
            if not all(
                isinstance(item[f], str) for f in ("label", "created_at", "nonce", "ciphertext")
            ):
                raise ValueError("bad secret")
            check_label(item["label"])
            sec = Secret(
                item["label"], item["created_at"], _unb64(item["nonce"]), _unb64(item["ciphertext"])
            )
            if len(sec.nonce) != 12 or any(o.label == sec.label for o in secrets):
                raise ValueError("bad secret")
            secrets.append(sec)
        serial = obj.get("cert_serial", 0)
        if type(serial) is not int or not 0 <= serial < 2**64:
            raise ValueError("bad certificate serial")
        doc = VaultFile(
            epoch,
            kdf,
            _unb64(ver["nonce"]),
            _unb64(ver["ciphertext"]),
            tuple(records),
            serial,
            tuple(secrets),
        )
        if len(kdf.salt) != 16 or len(doc.verifier_nonce) != 12:
            raise ValueError("bad salt or nonce")
        return doc
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error, VaultError) as e:
        reason = type(e).__name__ if isinstance(e, KeyError | TypeError) else str(e)[:80]
        raise VaultError(
            f"vault file {path} is corrupt or not a bastion vault ({reason}); "
            "restore it from a backup, or move it aside and run `bastion init`"
        ) from None


def _serialize(doc: VaultFile) -> bytes:
    keys = [
        {f: getattr(rec.info, f) for f in _PUBLIC}
        | {"nonce": _b64(rec.nonce), "ciphertext": _b64(rec.ciphertext)}
        for rec in doc.records
    ]
    kdf = doc.kdf
    params = dict(zip(KDF_FIELDS[kdf.name], kdf.params, strict=True))
    obj = {
        "format": FORMAT,
        "epoch": doc.epoch,
        "kdf": {"name": kdf.name, **params, "salt": _b64(kdf.salt)},
        "verifier": {"nonce": _b64(doc.verifier_nonce), "ciphertext": _b64(doc.verifier)},
        "keys": keys,
        "cert_serial": doc.serial,
        "secrets": [
            {"label": s.label, "created_at": s.created_at}
            | {"nonce": _b64(s.nonce), "ciphertext": _b64(s.ciphertext)}
            for s in doc.secrets
        ],
    }
    return json.dumps(obj, indent=2).encode() + b"\n"


@contextlib.contextmanager
def write_lock(path: Path) -> Iterator[None]:
    """The flock on `<vault>.lock` every read-modify-write holds: the daemon and an
    offline CLI may both write, and each re-reads the file under it."""
    try:
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise VaultError(f"cannot lock vault {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


# What asyncssh says of an encrypted key file imported without a passphrase.
_NEEDS_PASSPHRASE = "Passphrase must be specified"


def _encrypted(data: bytes) -> bool:
    """Whether the key file needs a passphrase. A wrong one does not always say so: the
    legacy PEM encryption checks only the padding, which about one wrong passphrase in 250
    gets right, and the garbage then fails to parse as the key (or as text)."""
    try:
        asyncssh.import_private_key(data, None)
    except Exception as e:  # as in load_private_key_file: only the fixed phrase is read
        return isinstance(e, ValueError) and str(e).startswith(_NEEDS_PASSPHRASE)
    return False


def load_private_key_file(data: bytes, passphrase: bytes | None) -> asyncssh.SSHKey:
    """Import a user's key file; errors are fixed phrases so no file bytes leak into them."""
    if len(data) > MAX_KEY_FILE:
        raise VaultError("not a private key: file too large")
    try:
        key = asyncssh.import_private_key(data, passphrase)
    except Exception as e:  # asyncssh parsers raise many types; never chain (may hold bytes)
        msg = str(e) if isinstance(e, ValueError) else ""
        if msg.startswith(_NEEDS_PASSPHRASE):
            raise KeyFilePassphraseNeeded(
                "the key file is encrypted; a passphrase is needed"
            ) from None
        if "requires bcrypt" in msg:  # asyncssh needs bcrypt for OpenSSH's own encryption
            raise VaultError(
                "cannot decrypt an OpenSSH-encrypted key file: the Python "
                "package bcrypt is not installed"
            ) from None
        if msg.startswith(("Incorrect passphrase", "Unable to decrypt")) or (
            passphrase is not None and _encrypted(data)
        ):
            raise VaultError("wrong passphrase for key file") from None
        head = msg.split(":")[0].strip()
        reason = head if re.fullmatch(r"[A-Za-z0-9#, ]{1,60}", head) else "malformed key data"
        raise VaultError(f"not a private key: {reason}") from None
    check_key_type(key)
    return key
