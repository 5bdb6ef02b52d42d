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
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client


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
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        tasks: set[asyncio.Task[None]] = set()
        while line := await reader.readline():
            task = asyncio.create_task(serve(session, json.loads(line)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for task in list(tasks):
            await task


if __name__ == "__main__":
    asyncio.run(main())
