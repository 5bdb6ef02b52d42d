"""Reading a witness back: `bastion audit verify --witness FILE|DIR`.

The gateway's witness (`witness.py`) sends heads off the box; a collector may
write them in any line format. `parse_line` finds the JSON after a fixed marker,
`read_entries` collects them from files or directories of rotated logs, and
`check` asks whether the journal still holds every head the witness saw, with
the same hash and the signature of the boot that wrote it. Needs neither the
gateway nor the passphrase: only the journal's files and public identity.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from bastion import journal
from bastion.core.events import EventType
from bastion.journal.courier import AUDIT, HEAD
from bastion.journal.witness import journal_id

_JSON = json.JSONDecoder()


def parse_line(text: str) -> tuple[str, dict[str, Any]] | None:
    """The entry in one line of any file a witness or a collector wrote: the JSON
    object after the line's first marker. A marker quoted inside JSON is never
    first (its own entry's marker comes before it) and never parses."""
    found = [(i, m) for m in (HEAD, AUDIT) if (i := text.find(m + " {")) >= 0]
    if not found:
        return None
    at, marker = min(found)
    try:
        doc, _ = _JSON.raw_decode(text, at + len(marker) + 1)
    except ValueError:
        return None
    return (marker, doc) if isinstance(doc, dict) else None


def read_entries(paths: Iterable[Path], kind: str = HEAD) -> list[dict[str, Any]]:
    """Every entry of one kind in these files, in file order (a directory: every
    file in it, by name -- a witness directory, or a collector's rotated logs)."""
    out = []
    files = (
        f
        for p in paths
        for f in (sorted(x for x in p.iterdir() if x.is_file()) if p.is_dir() else [p])
    )
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                parsed = parse_line(line)
                if parsed is not None and parsed[0] == kind:
                    out.append(parsed[1])
    return out


@dataclass
class WitnessCheck:
    ok: bool
    problem: str | None = None  # the first witnessed head the journal does not hold, and why
    heads: int = 0  # distinct witnessed heads of this journal
    last: int | None = None  # the highest witnessed seq
    other_journals: int = 0  # heads of other journals, ignored
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _boot_keys(recs: Iterable[journal.Record]) -> dict[str, Ed25519PublicKey]:
    """Each boot's signing key, as its boot record announces it."""
    keys: dict[str, Ed25519PublicKey] = {}
    for r in recs:
        if r.type == EventType.BOOT.value and r.boot not in keys:
            with contextlib.suppress(KeyError, ValueError, TypeError):
                keys[r.boot] = Ed25519PublicKey.from_public_bytes(
                    base64.b64decode(r.meta["boot_key"], validate=True)
                )
    return keys


def _forged(head: dict[str, Any], boot_keys: dict[str, Ed25519PublicKey]) -> bool:
    """A head whose boot the journal still announces, but whose signature that boot's key
    did not make. (A head of a boot the journal lost cannot be checked: the truncation
    it proves is reported by `check` itself.)"""
    key = boot_keys.get(str(head.get("boot")))
    if key is None:
        return False
    try:
        key.verify(
            base64.b64decode(str(head.get("sig")), validate=True), bytes.fromhex(head["hash"])
        )
    except (InvalidSignature, ValueError, TypeError):
        return True
    return False


def check(directory: Path, identity: journal.Identity, heads: list[dict[str, Any]]) -> WitnessCheck:
    """Does the journal hold every head the witness saw, with the same hash? A
    journal that ends before one was truncated; another hash at its seq was
    rolled back or rebuilt. Nothing witnessed proves nothing, and fails too."""
    jid = journal_id(identity)
    seen: dict[int, str] = {}
    c = WitnessCheck(ok=False)
    recs = list(journal.records(directory))
    boot_keys = _boot_keys(recs)
    for h in heads:
        seq, digest = h.get("seq"), h.get("hash")
        if h.get("journal") != jid or type(seq) is not int or not isinstance(digest, str):
            c.other_journals += h.get("journal") != jid
            continue
        if _forged(h, boot_keys):
            c.problem = (
                f"forged: the witness holds a head for seq {seq} (boot {h.get('boot')}) that "
                "this boot's key did not sign: someone other than the gateway wrote to the "
                "witness. Its other heads are not proof until the witness is checked"
            )
            return c
        if seen.setdefault(seq, digest) != digest:
            c.problem = (
                f"seq {seq}: the witness saw two hashes ({seen[seq][:16]}... and "
                f"{digest[:16]}...): the journal was rolled back or rebuilt while a gateway ran"
            )
            return c
    c.heads, c.last = len(seen), max(seen, default=None)
    if not seen:
        c.problem = (
            f"no witnessed head of this journal (journal {jid}); "
            f"{c.other_journals} head(s) of other journals. Nothing witnessed is not proof"
        )
        return c
    local = {r.seq: r.hash for r in recs}
    end = max(local, default=0)
    for seq in sorted(seen):
        witnessed = seen[seq][:16]
        if seq > end:
            c.problem = (
                f"truncated: the witness saw seq {seq} (hash {witnessed}...), "
                f"the journal ends at seq {end}"
            )
        elif seq not in local:
            c.problem = f"deleted: the witness saw seq {seq} (hash {witnessed}...), it is missing"
        elif local[seq] != seen[seq]:
            c.problem = (
                f"forked: seq {seq} has hash {local[seq][:16]}... here, the witness saw "
                f"{witnessed}... (rolled back, rebuilt or laundered)"
            )
        if c.problem:
            return c
    c.ok = True
    if end > c.last:
        c.notes.append(f"{end - c.last} record(s) after seq {c.last} are not witnessed yet")
    return c
