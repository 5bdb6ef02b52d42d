"""The agent socket's wire: what the ProxyCommand helper and the gateway say to each
other before SSH starts, in one place both sides import.

Standard library only, and only C modules at that: `agent/proxy.py` imports it on
every agent ssh call (by path, so from this folder; see its import), and the gateway
(`gateway/agent_ssh.py`) reads the same header and writes the same refusal line.
"""

PROTOCOL = b"BASTION/1 "
MAX_HEADER = 4096
REPLY_TIMEOUT = 30.0
# The agent-facing codes this helper ends with: (code, exit status, retryable), as
# bastion.core.contract's table has them (tests/unit/test_contract.py holds them to it).
INTERNAL = ("INTERNAL", 70, False)
GATEWAY_BUSY = ("GATEWAY_BUSY", 69, True)
UNSUPPORTED_REQUEST = ("UNSUPPORTED_REQUEST", 77, False)
# What a gateway's `ERR [CODE] reason` line may carry; any other is read as INTERNAL.
ENDINGS = {ending[0]: ending for ending in (INTERNAL, GATEWAY_BUSY)}


def refusal_line(code: str, reason: str) -> bytes:
    """The gateway's one-line refusal before SSH: the code core chose, then why."""
    return f"ERR [{code}] {reason}\n".encode()


def read_refusal(reply: bytes) -> tuple[str | None, str]:
    """(code, reason) from an `ERR` line; the code is None where the line has none."""
    text = reply.decode("utf-8", "replace").strip().removeprefix("ERR").strip()
    code, sep, rest = text.partition("] ")
    if text.startswith("[") and sep and code[1:].isupper():
        return code[1:], rest
    return None, text


def json_string(text: str) -> str:
    """`text` as a JSON string that `json.loads` reads back as `text`: ASCII only,
    every character outside printable ASCII escaped (lone surrogates from a
    non-UTF-8 argv too), without importing `json`."""
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code > 0xFFFF:
            code -= 0x10000
            out.append(f"\\u{0xD800 | code >> 10:04x}\\u{0xDC00 | code & 0x3FF:04x}")
        else:
            out.append(f"\\u{code:04x}")
    out.append('"')
    return "".join(out)


def header(host: str, port: str, user: str) -> bytes:
    """The line that names the target to the gateway (`agent_ssh` reads it)."""
    fields = ", ".join(f"{json_string(k)}: {json_string(v)}" for k, v in
                       (("host", host), ("port", port), ("user", user)))  # fmt: skip
    return PROTOCOL + b"{" + fields.encode("ascii") + b"}\n"
