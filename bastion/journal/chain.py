"""The audit journal: encrypted, signed, hash-chained, verifiable offline.

Each line of a `*.jsonl` segment is one record:

    {"seq", "boot", "type", "meta", "ct", "hash", "sig"}

* `type` and `meta` are plaintext on purpose, and hold no secret: request
  ids, codes, exit statuses, digests. They let a *locked* gateway find a
  `dispatch_started` with no outcome at start, and let `bastion request` and
  `audit verify` work with no passphrase.
* `ct` is the event itself (commands, subjects, hosts...), encrypted with a
  per-boot key: an ephemeral X25519 key agreed with the journal's public
  encryption key (HKDF), ChaCha20-Poly1305 with the seq as nonce and the
  plaintext fields as associated data. Only the journal identity (in the
  vault) can read it.
* `hash = sha256(prev_hash ‖ seq ‖ canonical(seq, boot, type, meta, ct))` --
  the plaintext fields are chained too, so an outcome cannot be relabelled.
* `sig` signs `hash` with the boot's Ed25519 key, which lives only in the
  gateway's memory. At every unlock the journal identity key *vouches* for
  the boot key *together with the current head hash* (a `vouch` record;
  older gateways typed it `certify`, and readers accept both): one vouch
  covers every record before it, so a chain rebuilt from the public key alone
  fails at the first vouch it cannot reproduce. `vouched` is the one check of
  a vouch, for `verify` and `unvouched_boots` alike.

A head anchor (`head.json`) and `--expect-head` catch truncation; a torn last
line (a crash mid-write) is reported by `verify` and, at the next start, moved
aside into `torn-*.bin` and journaled -- never silently dropped. A last line that
is a whole record and lacks only its newline is a record, not a torn one: the
next start adds the newline. A write the disk refused in part (ENOSPC) is cut
off again at once, so the next record starts on a line of its own; the torn
writes older versions left inside a segment are told apart from edits
(`Line.fragment`). `create` writes a journal's first records (its genesis) with
its identity, so a journal that has an identity and no record was emptied.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from bastion.core.errors import BastionError
from bastion.core.events import EventType, event_type

log = logging.getLogger(__name__)

FORMAT = "bastion-journal-1"
IDENTITY_LABEL = "bastion-journal"  # the vault key that is the journal identity
SEGMENT_MAX = 8 * 1024 * 1024
GENESIS = bytes(32)


class JournalError(BastionError):
    """The journal cannot be used as asked; the message says why."""


# -- keys ---------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    """A binary field of a record or of `identity.json` (strict base64)."""
    return base64.b64decode(text, validate=True)


def raw_key(key: Ed25519PublicKey | X25519PublicKey) -> bytes:
    """A public key as the journal writes it: its 32 raw bytes."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(secret)


def encryption_key(identity: Ed25519PrivateKey) -> X25519PrivateKey:
    """The journal's X25519 key, derived from the identity so the vault holds one secret."""
    seed = identity.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return X25519PrivateKey.from_private_bytes(_hkdf(seed, b"bastion-journal-encryption-v1"))


@dataclass(frozen=True)
class Identity:
    """The journal's public keys, from `identity.json`, checked against each other."""

    signing: Ed25519PublicKey
    encryption: X25519PublicKey


def write_identity(directory: Path, identity: Ed25519PrivateKey) -> Identity:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    signing = identity.public_key()
    enc = raw_key(encryption_key(identity).public_key())
    doc = {
        "format": FORMAT,
        "signing": _b64(raw_key(signing)),
        "encryption": _b64(enc),
        "sig": _b64(identity.sign(b"bastion-journal-identity-v1" + enc)),
    }
    path = directory / "identity.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    os.chmod(path, 0o600)
    return Identity(signing, X25519PublicKey.from_public_bytes(enc))


def create(directory: Path, identity: Ed25519PrivateKey) -> Identity:
    """A new journal: its identity and its genesis -- a boot and the identity's
    vouch for it, the first two records. Every journal has records from the
    moment it exists, so one with an identity and none was emptied (`verify`)."""
    public = write_identity(directory, identity)
    genesis = Journal(directory, public, "boot_" + secrets.token_hex(12))
    genesis.open()
    genesis.vouch(identity)
    genesis.close()
    return public


def read_identity(directory: Path, expect_signing: bytes | None = None) -> Identity:
    """Load and check `identity.json`; `expect_signing` pins it (e.g. from the vault)."""
    path = directory / "identity.json"
    try:
        doc = json.loads(path.read_text())
        signing_raw, enc = unb64(doc["signing"]), unb64(doc["encryption"])
        signing = Ed25519PublicKey.from_public_bytes(signing_raw)
        signing.verify(unb64(doc["sig"]), b"bastion-journal-identity-v1" + enc)
        encryption = X25519PublicKey.from_public_bytes(enc)
    except FileNotFoundError:
        raise JournalError(f"no journal identity at {path}; run `bastion init`") from None
    except (OSError, ValueError, KeyError, TypeError, InvalidSignature) as exc:
        raise JournalError(f"{path} is not a valid journal identity ({exc})") from None
    if expect_signing is not None and signing_raw != expect_signing:
        raise JournalError(f"{path} does not match the journal identity in the vault")
    return Identity(signing, encryption)


# -- records ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    seq: int
    boot: str
    type: str
    meta: dict[str, Any]
    ct: str
    hash: str
    sig: str

    def _doc(self, *names: str) -> bytes:
        return _canonical({n: getattr(self, n) for n in names})

    @property
    def header(self) -> bytes:
        """What the AEAD binds and the chain covers besides the ciphertext."""
        return self._doc("seq", "boot", "type", "meta")

    def body(self) -> bytes:
        """What the chain hash covers."""
        return self._doc("seq", "boot", "type", "meta", "ct")

    def line(self) -> bytes:
        return self._doc("seq", "boot", "type", "meta", "ct", "hash", "sig") + b"\n"


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def chain_hash(prev: bytes, seq: int, body: bytes) -> bytes:
    return hashlib.sha256(prev + seq.to_bytes(8, "big") + body).digest()


def _nonce(seq: int) -> bytes:
    return seq.to_bytes(12, "big")


def _boot_key(shared: bytes, boot: str) -> bytes:
    return _hkdf(shared, b"bastion-journal-record-v1" + boot.encode())


def _vouch_message(boot: str, boot_key: bytes, head: bytes) -> bytes:
    """What the identity signs; its tag predates the word "vouch" and is the format's."""
    return b"bastion-journal-cert-v1\0" + boot.encode() + b"\0" + boot_key + head


@dataclass(frozen=True)
class Vouch:
    """What the journal identity signed in a vouch record: this boot's key, at this head
    (the chain's hash just before the record), so it covers every record before it."""

    boot: str
    boot_key: bytes  # raw Ed25519
    head: bytes


def vouched(record: Record, identity: Identity) -> Vouch | None:
    """The vouch `record` carries: a vouch record (`vouch`, or `certify` as older gateways
    wrote it) whose signature the journal identity made; None for any other record.
    `verify` and `unvouched_boots` both ask this, so they cannot disagree on which boots
    were vouched for (`verify` also checks the vouch's place: its boot's key, its head)."""
    if event_type(record) is not EventType.VOUCH:
        return None
    try:
        boot_key, head = unb64(record.meta["boot_key"]), bytes.fromhex(record.meta["head"])
        message = _vouch_message(record.boot, boot_key, head)
        identity.signing.verify(unb64(record.meta["cert"]), message)
    except (KeyError, ValueError, TypeError, InvalidSignature):
        return None
    return Vouch(record.boot, boot_key, head)


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.jsonl"))


@dataclass
class Line:
    """One raw line of a segment, parsed if it could be."""

    path: Path
    number: int
    raw: bytes
    record: Record | None
    torn: bool = False  # the last line, cut short by a crash: no newline, not a record
    unterminated: bool = False  # the last line is a whole record that lacks its newline
    # A torn write inside a segment: the first bytes of a record that was never finished
    # (a write the disk refused in part), followed on the same line by the next record.
    fragment: bytes = b""


_RECORD_START = b'{"boot":"'  # every canonical record line begins so (its keys are sorted)


def _split_fragment(raw: bytes) -> tuple[bytes, Record] | None:
    """A line that is an unfinished record's first bytes and then a whole record, as a
    short write followed by the next append leaves it; None when it is not that."""
    if not raw.startswith(_RECORD_START):
        return None
    at = raw.rfind(_RECORD_START)
    while at > 0:
        record = parse_record(raw[at:])
        if record is not None:
            return raw[:at], record
        at = raw.rfind(_RECORD_START, 0, at)
    return None


def read_lines(directory: Path) -> Iterator[Line]:
    segs = segments(directory)
    for si, path in enumerate(segs):
        data = path.read_bytes()
        parts = data.split(b"\n")
        last_has_newline = data.endswith(b"\n") or not data
        if last_has_newline:
            parts = parts[:-1]
        for i, raw in enumerate(parts):
            record = parse_record(raw)
            last = si == len(segs) - 1 and i == len(parts) - 1 and not last_has_newline
            if last:
                yield Line(path, i + 1, raw, record, torn=record is None, unterminated=True)
                continue
            split = _split_fragment(raw) if record is None else None
            if split is not None:
                yield Line(path, i + 1, raw, split[1], fragment=split[0])
                continue
            yield Line(path, i + 1, raw, record)


def parse_record(raw: bytes) -> Record | None:
    """One segment line as a record: well-formed and canonical, or None."""
    try:
        d = json.loads(raw)
        r = Record(
            int(d["seq"]),
            str(d["boot"]),
            str(d["type"]),
            dict(d["meta"]),
            str(d["ct"]),
            str(d["hash"]),
            str(d["sig"]),
        )
    except (ValueError, KeyError, TypeError):
        return None
    return r if r.line() == raw + b"\n" else None  # only the canonical form is a record


def records(directory: Path) -> Iterator[Record]:
    """Every well-formed record, in file order (views tolerate damage; verify does not)."""
    for line in read_lines(directory):
        if line.record is not None:
            yield line.record


# -- the writer ---------------------------------------------------------------------------


class Journal:
    """Appends records for one gateway lifetime. Works while the vault is
    locked: encryption needs only the public key, signing only the boot key."""

    def __init__(self, directory: Path, identity: Identity, boot: str) -> None:
        self.directory = directory
        self.identity = identity
        self.boot = boot
        self._boot_signing = Ed25519PrivateKey.generate()
        ephemeral = X25519PrivateKey.generate()
        self._epk = raw_key(ephemeral.public_key())
        self._aead = ChaCha20Poly1305(_boot_key(ephemeral.exchange(identity.encryption), boot))
        self.seq = 0
        self.head = GENESIS
        self._fd: int | None = None
        self._path: Path | None = None
        self._size = 0  # the open segment's length: where a failed write is cut back to
        self._damaged: str | None = None  # why a failed write's bytes are still there
        # Group commit: `append(sync=False)` writes and returns; `sync()` (from any
        # thread) makes everything written so far durable with one fdatasync.
        self._lock = threading.Lock()  # seq/head/fd as one, for `sync` in a thread
        self._head_lock = threading.Lock()  # head.json's writers
        self.synced_seq = 0
        self._head_written = 0
        self.fsyncs = 0
        self.appends = 0
        self.append_seconds = 0.0  # time spent appending, fsyncs included (see bench/)

    # opening -------------------------------------------------------------------------

    def open(self) -> list[Record]:
        """Find the head, set a torn tail aside, start this boot. Returns the
        records found (for recovery: outcomes, action keys)."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        found: list[Record] = []
        torn: Line | None = None
        unterminated: Line | None = None
        damaged = 0
        for line in read_lines(self.directory):
            if line.torn:
                torn = line
            elif line.record is None:
                damaged += 1
            else:
                unterminated = line if line.unterminated else unterminated
                found.append(line.record)
        if damaged:
            log.error("journal: %d line(s) are not records: see `bastion audit verify`", damaged)
        if found:
            self.seq, self.head = found[-1].seq, bytes.fromhex(found[-1].hash)
        if torn is not None:
            self._set_aside(torn)
        if unterminated is not None:  # a whole record: it only lacks its newline
            with open(unterminated.path, "ab") as f:
                f.write(b"\n")
                os.fsync(f.fileno())
        segs = segments(self.directory)
        self._open_segment(segs[-1] if segs else None)
        self.append(
            EventType.BOOT,
            {
                "boot_key": _b64(raw_key(self._boot_signing.public_key())),
                "epk": _b64(self._epk),
            },
            {"pid": os.getpid()},
        )
        if torn is not None:
            self.append(
                EventType.TORN_TAIL,
                {
                    "bytes": len(torn.raw),
                    "file": torn.path.name,
                    "sha256": hashlib.sha256(torn.raw).hexdigest(),
                },
                {},
            )
        return found

    def _set_aside(self, torn: Line) -> None:
        """A crash cut the last line short: keep its bytes, cut it from the segment."""
        aside = self.directory / f"torn-{int(time.time())}-{secrets.token_hex(3)}.bin"
        aside.write_bytes(torn.raw)
        size = torn.path.stat().st_size
        with open(torn.path, "r+b") as f:
            f.truncate(size - len(torn.raw))
            os.fsync(f.fileno())

    def _open_segment(self, path: Path | None) -> None:
        if self._fd is not None:
            os.fdatasync(self._fd)  # what it holds is durable before it is let go
            os.close(self._fd)
        if path is None or path.stat().st_size >= SEGMENT_MAX:
            path = self.directory / f"{self.seq + 1:012d}.jsonl"
        self._path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._size = os.fstat(self._fd).st_size

    # appending -----------------------------------------------------------------------

    def append(
        self, kind: EventType, meta: dict[str, Any], event: dict[str, Any], sync: bool = True
    ) -> Record:
        """Write one record. With `sync` it (and all before it) is on disk
        (fdatasync) when this returns; without, it is written (a killed gateway
        loses nothing) and durable at the next `sync` -- a power cut before that
        loses it and what follows, never an earlier record."""
        if self._fd is None:
            raise JournalError("the journal is not open")
        began = time.perf_counter()
        seq = self.seq + 1
        unsigned = Record(seq, self.boot, kind.value, meta, "", "", "")
        event = event if "t" in event else {"t": time.time(), **event}
        ct = _b64(self._aead.encrypt(_nonce(seq), _canonical(event), unsigned.header))
        unsigned = replace(unsigned, ct=ct)
        digest = chain_hash(self.head, seq, unsigned.body())
        record = replace(unsigned, hash=digest.hex(), sig=_b64(self._boot_signing.sign(digest)))
        line = record.line()
        self._write(line)
        with self._lock:
            self.seq, self.head = seq, digest
            if self._path is not None and os.fstat(self._fd).st_size >= SEGMENT_MAX:
                self._open_segment(None)
                self.synced_seq = seq  # rotation synced the old segment
        if sync:
            self.sync()
        self.appends += 1
        self.append_seconds += time.perf_counter() - began
        return record

    def _write(self, line: bytes) -> None:
        """Append one whole line, or nothing: what a short write left (a full disk) is
        cut off again at once, so no part of a record that failed is ever followed by
        the next one (which would read as an edit). If even that fails, nothing more
        is written until it succeeds. (A write that fails outright wrote nothing.)"""
        assert self._fd is not None
        if self._damaged is not None:
            self._cut_back()
        try:
            written = os.write(self._fd, line)
        except OSError as exc:  # a write that fails writes nothing
            raise JournalError(f"could not write to the journal: {exc.strerror or exc}") from None
        if written == len(line):
            self._size += written
            return
        why = self._damaged = f"short write ({written} of {len(line)} bytes; disk full?)"
        self._cut_back()
        raise JournalError(f"could not write to the journal: {why}; nothing of it was kept")

    def _cut_back(self) -> None:
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as exc:
            raise JournalError(
                f"the journal holds part of a record that failed ({self._damaged}) and it "
                f"could not be cut off ({exc.strerror or exc}); nothing more is written"
            ) from None
        self._damaged = None

    def sync(self) -> int:
        """Make every record written so far durable; returns the last durable seq.
        Safe from another thread than the writer's: it syncs a duplicate of the
        descriptor, so a segment rotation meanwhile cannot pull it away."""
        with self._lock:
            seq, head = self.seq, self.head
            if seq <= self.synced_seq or self._fd is None:
                return self.synced_seq
            fd = os.dup(self._fd)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
        with self._lock:
            self.synced_seq = max(self.synced_seq, seq)
            self.fsyncs += 1
        self._write_head(seq, head)
        return seq

    def _write_head(self, seq: int, head: bytes) -> None:
        """head.json names a durable record, never one a power cut could take back."""
        with self._head_lock:
            if seq <= self._head_written:
                return
            tmp = self.directory / "head.json.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({"seq": seq, "hash": head.hex()}))
            os.replace(tmp, self.directory / "head.json")
            self._head_written = seq

    def vouch(self, identity: Ed25519PrivateKey) -> Record:
        """The journal identity vouches for this boot's key and, through the chain, for
        everything so far. (The meta key `cert` is the format's, older than the word.)"""
        boot_key = raw_key(self._boot_signing.public_key())
        cert = identity.sign(_vouch_message(self.boot, boot_key, self.head))
        meta = {"boot_key": _b64(boot_key), "head": self.head.hex(), "cert": _b64(cert)}
        return self.append(EventType.VOUCH, meta, {})

    def close(self) -> None:
        if self._fd is not None:
            self.sync()
            with self._lock:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None


def head(directory: Path) -> tuple[int, str]:
    """The last record's (seq, hash), as read from the records themselves."""
    last = None
    for last in records(directory):  # noqa: B007 - the last one is the head
        pass
    return (last.seq, last.hash) if last else (0, GENESIS.hex())


# -- views (need the journal identity's private key) -----------------------------------------


def decrypt(
    recs: Iterable[Record], identity: Ed25519PrivateKey
) -> Iterator[tuple[Record, dict[str, Any]]]:
    """Each record with its event, readable only with the identity key."""
    enc = encryption_key(identity)
    aeads: dict[str, ChaCha20Poly1305] = {}
    for r in recs:
        if r.type == EventType.BOOT.value:
            with contextlib.suppress(KeyError, ValueError):
                epk = X25519PublicKey.from_public_bytes(unb64(r.meta["epk"]))
                aeads[r.boot] = ChaCha20Poly1305(_boot_key(enc.exchange(epk), r.boot))
        aead = aeads.get(r.boot)
        event: dict[str, Any] = {}
        if aead is not None:
            with contextlib.suppress(InvalidTag, ValueError):
                event = json.loads(aead.decrypt(_nonce(r.seq), unb64(r.ct), r.header))
        yield r, event
