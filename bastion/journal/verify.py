"""Checking a journal from its files alone: `verify` (order, chain, signatures,
vouches, head.json) and `unvouched_boots` (records no vouch of the journal identity
covers). Needs the public identity only -- no passphrase, no gateway. The format
itself (records, chain, writer, what a vouch is: `journal.vouched`) is `chain.py`'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from bastion.core import presence
from bastion.core.events import EventType, event_type
from bastion.journal import (
    GENESIS,
    Identity,
    Line,
    Record,
    chain_hash,
    raw_key,
    read_lines,
    unb64,
    vouched,
)


def unvouched_boots(recs: Iterable[Record], identity: Identity) -> dict[str, list[int]]:
    """Boots with records whose own key no vouch by the journal identity covers:
    boot -> [first seq, last seq, records]. What a new lifetime reports as
    `foreign_records` at unlock (full checking is `verify`'s job)."""
    spans: dict[str, list[int]] = {}
    vouched_for: set[str] = set()
    for r in recs:
        span = spans.setdefault(r.boot, [r.seq, r.seq, 0])
        span[1], span[2] = r.seq, span[2] + 1
        if vouched(r, identity) is not None:
            vouched_for.add(r.boot)
    return {boot: span for boot, span in spans.items() if boot not in vouched_for}


@dataclass
class VerifyReport:
    ok: bool
    records: int = 0
    problem: str | None = None  # the first bad record, named, and why
    notes: list[str] = field(default_factory=list)
    unvouched: list[dict[str, Any]] = field(default_factory=list)  # boots never vouched for
    # what `presence.audit` says of the presence-signed approvals and logins
    presence: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "records": self.records,
            "problem": self.problem,
            "notes": self.notes,
            "unvouched": self.unvouched,
            "presence": self.presence,
        }


def verify(
    directory: Path, identity: Identity, expect_head: str | None = None, strict: bool = False
) -> VerifyReport:
    """Check every record: order, chain, signatures, vouches, head.

    Needs no passphrase and no gateway: only public keys are involved.
    """
    v = VerifyReport(ok=True)

    def bad(line: Line | None, why: str) -> VerifyReport:
        where = f"{line.path.name}:{line.number}" if line else "journal"
        seq = f" (seq {line.record.seq})" if line and line.record else ""
        v.ok, v.problem = False, f"{where}{seq}: {why}"
        return v

    boot_keys: dict[str, Ed25519PublicKey] = {}
    spans: dict[str, list[int]] = {}  # boot -> [first seq, last seq, records]
    vouched_for: set[str] = set()  # boots whose own key the journal identity vouched for
    prev, expected, vouched_to = GENESIS, 1, 0
    found_head = expect_head is None
    last_line: Line | None = None
    lines = list(read_lines(directory))
    present = {line.record.seq for line in lines if line.record is not None}
    # Every presence signature checked again against the enrolled keys, whatever the
    # chain says: an approval that does not hold is named even in a broken journal.
    found = presence.audit(line.record for line in lines if line.record is not None)
    v.presence = [f.as_json() for f in found]
    v.notes.extend(f"seq {f.seq}: {f.words}" for f in found if not f.problem)
    torn_writes: list[str] = []
    for line in lines:
        last_line = line
        if line.torn:
            return bad(line, "torn: the last line is incomplete (the gateway stopped mid-write)")
        r = line.record
        if r is None:
            return bad(line, "edited: not a well-formed record")
        if line.fragment:
            torn_writes.append(
                f"{line.path.name}:{line.number}: a torn write, not an edit: {len(line.fragment)} "
                f"byte(s) of a record the gateway failed to write (it logged the failure) "
                f"precede seq {r.seq} on the same line; the chain goes on unbroken"
            )
        if line.unterminated:
            v.notes.append(
                f"{line.path.name}:{line.number} (seq {r.seq}) is a whole record that lacks its "
                "final newline (the gateway stopped just after writing it); the next start adds it"
            )
        if r.seq < expected:
            return bad(line, f"reordered: seq {r.seq} after {expected - 1}")
        if r.seq > expected and expected in present:
            return bad(line, f"reordered: seq {r.seq} where {expected} belongs")
        if r.seq > expected:
            return bad(line, f"deleted: seq {expected}..{r.seq - 1} missing")
        digest = chain_hash(prev, r.seq, r.body())
        if digest.hex() != r.hash:
            return bad(line, "edited: its content or its place in the chain changed")
        if r.type == EventType.BOOT.value:
            if r.boot in boot_keys:
                return bad(line, f"edited: boot {r.boot} announced a key twice")
            try:
                boot_keys[r.boot] = Ed25519PublicKey.from_public_bytes(unb64(r.meta["boot_key"]))
            except (KeyError, ValueError):
                return bad(line, "edited: malformed boot record")
        key = boot_keys.get(r.boot)
        if key is None:
            return bad(line, f"unsigned: boot {r.boot} never announced its key")
        try:
            key.verify(unb64(r.sig), digest)
        except (InvalidSignature, ValueError):
            return bad(line, "bad signature")
        if event_type(r) is EventType.VOUCH:
            vouch = vouched(r, identity)
            if vouch is None or vouch.boot_key != raw_key(key) or vouch.head != prev:
                return bad(
                    line,
                    "bad signature: the vouch does not verify with the "
                    "journal identity (a rebuilt or re-signed chain)",
                )
            vouched_to = r.seq
            vouched_for.add(r.boot)
        span = spans.setdefault(r.boot, [r.seq, r.seq, 0])
        span[1], span[2] = r.seq, span[2] + 1
        if expect_head is not None and r.hash == expect_head:
            found_head = True
        prev, expected = digest, expected + 1
        v.records += 1
    if not v.records:
        return bad(
            None,
            "emptied: the journal has an identity but no record, and a journal is created with "
            "its first records (`bastion init` writes a boot and its vouch): every "
            "segment was deleted (or the home was made before bastion wrote these first "
            "records and no gateway has run since: start one once)",
        )
    v.notes.extend(torn_writes)
    if strict and torn_writes:
        return bad(last_line, f"torn write: {torn_writes[0]} (--strict)")
    if vouched_to == 0:
        return bad(
            last_line,
            "unsigned: the journal identity never vouched for any record "
            "(unlock the gateway once to vouch for its journal)",
        )
    anchor = directory / "head.json"
    if anchor.exists():
        try:
            h = json.loads(anchor.read_text())
            if int(h["seq"]) > v.records:
                return bad(
                    last_line,
                    f"truncated: head.json names seq {h['seq']}, the journal ends at {v.records}",
                )
        except (ValueError, KeyError, TypeError):
            v.notes.append("head.json is unreadable")
    if not found_head:
        return bad(last_line, f"truncated: no record has the expected head hash {expect_head}")
    # A vouch covers the boot key that wrote it, never another's records: a boot
    # whose key was never vouched for stays unvouched for good.
    v.unvouched = [
        {"boot": boot, "first": a, "last": z, "records": n}
        for boot, (a, z, n) in spans.items()
        if boot not in vouched_for
    ]
    for u in v.unvouched:
        v.notes.append(
            f"{u['records']} record(s), seq {u['first']}..{u['last']}, are signed by boot key "
            f"{u['boot']}, which the journal identity never vouched for: written by a gateway "
            "that was never unlocked, or by someone else (`audit verify --witness` tells)"
        )
    if strict and v.unvouched:
        return bad(
            last_line,
            f"unvouched: seq {v.unvouched[0]['first']}..{v.unvouched[0]['last']} are "
            f"signed by boot key {v.unvouched[0]['boot']}, never vouched for (--strict)",
        )
    flawed = [f for f in found if f.problem]
    if flawed:
        return bad(
            next((ln for ln in lines if ln.record and ln.record.seq == flawed[0].seq), None),
            f"presence: {flawed[0].words}"
            + (f" (and {len(flawed) - 1} more)" if len(flawed) > 1 else ""),
        )
    uncovered = v.records - vouched_to
    if uncovered:
        v.notes.append(
            f"{uncovered} record(s) after seq {vouched_to} are signed by their "
            "boot key but not yet vouched for (vouched for at the next unlock)"
        )
        if strict:
            return bad(last_line, "unsigned: unvouched records at the end (--strict)")
    return v
