"""A stand-in MCP client (a desktop app, an agent framework): one long-lived
process that starts `bastion mcp` as its child with the official SDK's stdio
client, and calls tools when told to.

The gateway approves the MCP client process, so it must be a real process of its
own, separate from the test (which plays the operator).

Usage: python mcp_client_helper.py SERVER_ARGV...
Protocol: one JSON object per line on stdin -> one per line on stdout.
  {"id": N, "op": "list_tools"}                 -> {"id": N, "tools": [names]}
  {"id": N, "op": "call", "name": T, "arguments": {...}}
      -> {"id": N, "is_error": bool, "structured": {...}|null, "text": str, "progress": [str]}
Calls run concurrently. Line 0 is {"id": 0, "ready": PID, "server_pid": PID}.

Tests drive it through `McpClient` below (the test side of the same protocol).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

if TYPE_CHECKING:
    from tests.harness import Bastion


def say(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


async def serve(session: ClientSession, req: dict[str, Any]) -> None:
    try:
        if req["op"] == "list_tools":
            tools = await session.list_tools()
            say({"id": req["id"], "tools": [t.name for t in tools.tools]})
            return
        progress: list[str] = []

        async def on_progress(value: float, total: float | None, message: str | None) -> None:
            progress.append(message or str(value))

        r = await session.call_tool(
            req["name"], req.get("arguments") or {}, progress_callback=on_progress
        )
        text = "\n".join(c.text for c in r.content if getattr(c, "type", "") == "text")
        say(
            {
                "id": req["id"],
                "is_error": bool(r.is_error),
                "structured": r.structured_content,
                "text": text,
                "progress": progress,
            }
        )
    except Exception as exc:  # the test reads what went wrong
        say({"id": req["id"], "exception": f"{type(exc).__name__}: {exc}"})


async def main() -> None:
    argv = sys.argv[1:]
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=dict(os.environ))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        me = os.getpid()
        children = Path(f"/proc/{me}/task/{me}/children").read_text().split()
        say({"id": 0, "ready": os.getpid(), "server_pid": int(children[0]) if children else None})
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 28)  # a file tool's content is one line
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        tasks: set[asyncio.Task[None]] = set()
        while line := await reader.readline():
            task = asyncio.create_task(serve(session, json.loads(line)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for task in list(tasks):
            await task


class McpClient:
    """An MCP client process (the agent program) with `bastion mcp` as its child."""

    def __init__(self, b: Bastion, *server_args: str) -> None:
        from tests.harness import cli_argv

        argv = cli_argv(b.home.root, "mcp", *server_args)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {0: queue.Queue()}
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._replies[0].get(timeout=60)
        self.pid, self.server_pid = ready["ready"], ready["server_pid"]
        b.agents.append(self)  # type: ignore[arg-type]  (closed with the bastion)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            doc = json.loads(line)
            self._replies.setdefault(doc["id"], queue.Queue()).put(doc)

    def start(self, op: str, **fields: Any) -> int:
        rid = next(self._ids)
        self._replies.setdefault(rid, queue.Queue())
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": rid, "op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return rid

    def finished(self, rid: int) -> bool:
        """Has the call `rid` been answered (its reply is waiting)?"""
        return self._replies[rid].qsize() > 0

    def wait(self, rid: int, timeout: float = 90) -> dict[str, Any]:
        doc = self._replies[rid].get(timeout=timeout)
        assert "exception" not in doc, doc["exception"]
        return doc

    def call(self, name: str, timeout: float = 90, **arguments: Any) -> dict[str, Any]:
        return self.wait(self.start("call", name=name, arguments=arguments), timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def error_of(r: dict[str, Any]) -> dict[str, Any]:
    """The agent-facing error object of a tool error."""
    assert r["is_error"], r
    return r["structured"]["error"]


if __name__ == "__main__":
    asyncio.run(main())
