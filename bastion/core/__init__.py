"""The audited core: records, the policy model, the gate, the journal's vocabulary.

Everything here is a pure function or an immutable record. It imports the
standard library and `cryptography` only -- no asyncio, no asyncssh, no
psutil, no sockets, no file I/O (`tests/unit/test_architecture.py` checks the
imports of every module in this package). The gateway, the CLI and the
journal are shells around it; see docs/architecture.md, "Trust boundaries".
"""
