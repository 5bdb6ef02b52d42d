"""The journal room: what happened, kept so that it can be checked without bastion.

- `chain`: the journal itself -- encrypted, signed, hash-chained segments; this face
  names its public names, so `from bastion import journal` reads as it always did.
- `verify`: checking a journal from its files alone (`bastion audit verify`).
- `witness`: the head and one summary per request, sent off the box.
- `witness_reading`: reading a witness back against a journal.
- `courier`: delivering witness entries: the spool on disk, one courier a witness.
"""

from bastion.journal.chain import (
    FORMAT,
    GENESIS,
    IDENTITY_LABEL,
    SEGMENT_MAX,
    Identity,
    Journal,
    JournalError,
    Line,
    Record,
    Vouch,
    chain_hash,
    create,
    decrypt,
    encryption_key,
    head,
    parse_record,
    raw_key,
    read_identity,
    read_lines,
    records,
    segments,
    unb64,
    vouched,
    write_identity,
)

__all__ = [
    "FORMAT",
    "GENESIS",
    "IDENTITY_LABEL",
    "SEGMENT_MAX",
    "Identity",
    "Journal",
    "JournalError",
    "Line",
    "Record",
    "Vouch",
    "chain_hash",
    "create",
    "decrypt",
    "encryption_key",
    "head",
    "parse_record",
    "raw_key",
    "read_identity",
    "read_lines",
    "records",
    "segments",
    "unb64",
    "vouched",
    "write_identity",
]
