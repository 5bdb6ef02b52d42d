"""`bastion mcp`: the front door for agents that speak the Model Context Protocol.

An MCP client (a desktop chat app, an agent framework) starts this server as its
own child and talks to it over stdio. Every command still goes through the
stock ssh client, the agent socket, the gate, the cards and the journal, exactly
as an agent's `ssh` does -- so the gateway, not this process, decides. This
process registers itself with the gateway as a *front*: like a shell, it acts
for its parent, and the subject a person approves is the MCP client itself.
Approval happens in the operator's `bastion approve`, never inside the MCP
client: no MCP elicitation, which many clients do not implement and which an
agent could answer itself.

Built on the official `mcp` SDK (an optional dependency: `pip install
'bastion[mcp]'`), so the protocol is theirs and the tools are ours.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp_types import CallToolResult, TextContent
from pydantic import Field, ValidationError

from bastion.agent import client, sftp_wire
from bastion.agent.client import AgentError, Command, Declined, Ran, Unsupported
from bastion.agent.sftp_wire import Get, Moved, Put
from bastion.core.contract import NOT_SENT
from bastion.core.refusals import Observed, agent_error, waited_out

log = logging.getLogger(__name__)

SETTLE = 1.0  # seconds to wait, after a timeout, for the gateway to record how far it got
INSTRUCTIONS = """\
Run commands on servers through bastion. You never hold a key: bastion holds them,
a person approves your process once per host and account (and, on accounts that
ask for it, each command), and every command is journalled. Call ssh_hosts first
to see which hosts and accounts you may use and what their rules allow. When a
result is an error, read its `code`: STATUS_UNKNOWN means the command may or may
not have run -- call request_status and inspect the target before trying again;
`retryable: true` means nothing was sent and the same call may be repeated;
UNSUPPORTED_REQUEST means this call was refused before anything ran: change the
argument its message names. sftp_put and sftp_get move one whole file by its
absolute path (on accounts whose `files` rules allow it); an error with
`target_error` in place of `error` is the target's own answer (no such file,
permission denied there), as a command's non-zero exit status is.
"""


@dataclass(frozen=True)
class Front:
    """Where this server sends commands: the agents' ssh_config and agent socket."""

    ssh_config: Path
    agent_socket: Path
    max_output: int = 256 * 1024  # bytes kept per stream: half its start, half its end

    def ask(self, query: str, **fields: str) -> dict[str, Any]:
        return client.ask(self.agent_socket, {"query": query, **fields})

    def account_of(self, host: str) -> str | None:
        """The host's only account, as the policy says now (what a `User` line in the
        agents' ssh_config says, without a config to go stale). None when the gateway
        cannot say: the request then goes without one, and the gateway answers why."""
        try:
            doc = self.ask("hosts")
        except AgentError:
            return None
        for entry in doc.get("hosts") or []:
            if entry.get("host", "").lower() == host.lower():
                accounts = [a["user"] for a in entry.get("accounts") or []]
                if len(accounts) > 1:
                    raise Unsupported(
                        f"host {host!r} has several accounts ({', '.join(accounts)}): "
                        f"name one with `user`. {NOT_SENT}"
                    )
                return accounts[0] if accounts else None
        return None


def error_result(error: dict[str, Any], extra: dict[str, Any] | None = None) -> CallToolResult:
    """The gateway's error object as an MCP tool error: the model reads `code`,
    `message`, `retryable` and `reauth_reason` exactly as an ssh agent would."""
    doc = {"error": error, **(extra or {})}
    text = json.dumps(doc, ensure_ascii=False)
    return CallToolResult(
        content=[TextContent(type="text", text=text)], structured_content=doc, is_error=True
    )


def failure(observed: Observed, message: str) -> CallToolResult:
    """An error of this server's own (no request behind it), in the gateway's shape:
    this server says what it observed, `core/refusals.py` which code that is."""
    return error_result(agent_error(observed, message))


def internal(message: str) -> CallToolResult:
    return failure(Observed.HELPER_FAILED, message)


def refused(exc: AgentError) -> CallToolResult:
    """An AgentError as the agent is told it: its code, its sentence."""
    return failure(exc.observed, str(exc))


class Server(MCPServer):
    """The SDK's server, whose own refusals (arguments that fail the tools' schema, an
    unknown tool) and crashes come in the same error shape as the gateway's."""

    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context | None = None
    ) -> Any:
        try:
            return await super().call_tool(name, arguments, context)
        except UnexpectedToolError:
            log.exception("tool %r failed", name)
            return internal(
                f"bastion's MCP server failed on this {name} call (its log says why). "
                "If it had started ssh, the gateway records the outcome: do not repeat a "
                "command that changes things before the operator has checked it."
            )
        except ToolError as exc:
            cause = exc.__cause__
            if isinstance(cause, ValidationError):
                wrong = "; ".join(
                    f"`{'.'.join(str(p) for p in e['loc'])}`: {e['msg']}" for e in cause.errors()
                )
                message = f"{wrong}. Send the arguments as the {name} tool's schema says."
            else:  # an unknown tool
                tools = ", ".join(sorted(t.name for t in await self.list_tools()))
                message = f"{str(exc).rstrip('.')}. The tools are {tools}."
            return failure(Observed.ARGUMENT, f"{message} {NOT_SENT}")


def outputs(ran: Ran) -> dict[str, Any]:
    return {**ran.stdout.as_json("stdout"), **ran.stderr.as_json("stderr")}


async def settle(front: Front, action_key: str) -> dict[str, Any] | None:
    """What the gateway recorded for the request `action_key` named, once it is
    more than in flight (or SETTLE seconds have passed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE
    state: dict[str, Any] | None = None
    while True:
        try:
            state = await asyncio.to_thread(front.ask, "request", action_key=action_key)
        except AgentError:
            state = None
        if (state and state.get("state") != "in_flight") or loop.time() >= deadline:
            return state
        await asyncio.sleep(0.1)


async def timed_out(front: Front, cmd: Command, ran: Ran) -> CallToolResult:
    """timeout_s ran out and ssh was ended: say what the journal says of it."""
    state = await settle(front, ran.action_key)
    rid = state.get("request_id") if state else None
    where = (
        f"`timeout_s` ({cmd.timeout_s:g} s) ran out and bastion's MCP server ended the ssh call."
    )
    if state and state.get("state") in ("retry_safe", "denied"):
        retry = state.get("state") == "retry_safe"
        again = (
            "the same call may be repeated, with a longer timeout_s if needed."
            if retry
            else "it needs a person's answer: call again only with a longer timeout_s, so "
            "that they have time to give it."
        )
        return error_result(
            {
                "code": waited_out(state.get("code")),
                "message": f"{where} The command was not sent (it was still waiting for an "
                f"approval or a free slot); {again}",
                "request_id": rid,
                "retryable": retry,
            },
            outputs(ran),
        )
    if state and state.get("state") == "completed":
        return ok_result(ran, state.get("exit_status"), rid, note=f"{where} It had completed.")
    # In flight: the gateway keeps a command whose agent left running to its end, to
    # record its real outcome -- this call just stops waiting for it.
    message = (
        f"{where} bastion still holds the command (running on the target, or waiting for an "
        "approval) and records how it ends: call request_status with this request_id for its "
        "outcome, and do not repeat it before then."
        + ("" if rid else " bastion did not name the request in time.")
    )
    return error_result(agent_error(Observed.STILL_HELD, message, rid), outputs(ran))


def ok_result(
    ran: Ran, exit_status: int | None, request_id: str | None, note: str | None = None
) -> CallToolResult:
    doc = {**outputs(ran), "exit_status": exit_status, "request_id": request_id}
    if note:
        doc["note"] = note
    summary = f"exit status {exit_status}" + (f" ({request_id})" if request_id else "")
    parts = [summary]
    for name in ("stdout", "stderr"):
        if doc.get(name):
            parts.append(f"--- {name} ---\n{doc[name]}")
        elif doc.get(f"{name}_base64"):
            parts.append(f"--- {name} (not UTF-8; base64 in structured content) ---")
    text = "\n".join(parts)
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=doc)


async def account(front: Front, host: str, user: str | None) -> str | None:
    """The account a call names, or the host's only one; this process registered as a
    front first (the subject a person approves is the MCP client)."""
    if user is None:
        user = await asyncio.to_thread(front.account_of, host)
    await asyncio.to_thread(client.register_front, front.agent_socket)
    return user


def target_error(moved: Moved) -> CallToolResult:
    """The target answered the file operation with an SFTP failure: it ran there, and
    failed there (not a refusal of bastion's, which has its error object)."""
    assert moved.status is not None
    name = sftp_wire.STATUS_NAMES.get(moved.status.code, f"status {moved.status.code}")
    doc = {
        "target_error": {
            "sftp_status": moved.status.code,
            "status": name,
            "message": moved.status.message,
        }
    }
    text = f"the target answered: {name} ({moved.status.message}). " + json.dumps(doc)
    return CallToolResult(
        content=[TextContent(type="text", text=text)], structured_content=doc, is_error=True
    )


def moved_failure(moved: Moved, req: Put | Get) -> CallToolResult | None:
    """The tool error for a transfer that did not complete, or None when it did."""
    if moved.timed_out:
        where = f"`timeout_s` ({req.timeout_s:g} s) ran out and bastion's MCP server ended it."
        if not moved.opened:
            return error_result(
                {
                    "code": waited_out(None),
                    "message": f"{where} Nothing of the file was sent (it was waiting for an "
                    "approval or the gateway); call again only with a longer timeout_s.",
                    "request_id": None,
                    "retryable": False,
                }
            )
        if isinstance(req, Get):
            message = (
                f"{where} A read changes nothing on the target: call again with a longer "
                "timeout_s or a smaller max_bytes."
            )
        else:
            message = (
                f"{where} The file may or may not have been written (wholly or in part, or "
                "still waiting for its file card): read it with sftp_get, or ask the "
                "operator, before writing it again."
            )
        return error_result(agent_error(Observed.STILL_HELD, message))
    if moved.error is not None:
        return error_result(moved.error)
    if moved.status is not None:
        return target_error(moved)
    if moved.broken is not None:
        tail = moved.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        said = " | ".join(tail) or moved.broken
        gone = NOT_SENT if not moved.opened else "The file operation's outcome is unknown."
        return internal(f"the sftp channel through ssh ended without an answer: {said}. {gone}")
    return None


def build(front: Front) -> MCPServer:
    """The server and its five tools."""
    server = Server(name="bastion", instructions=INSTRUCTIONS, version="1")

    @server.tool(
        description="Run one command on a host through bastion and return its stdout, stderr "
        "and exit status. The first command from this agent to a host raises an approval "
        "card for a person, so the call may wait until they answer."
    )
    async def ssh_exec(
        host: Annotated[str, Field(description="Host alias, as ssh_hosts lists it.")],
        command: Annotated[str, Field(description="The command, as you would give to ssh.")],
        ctx: Context,
        user: Annotated[
            str | None, Field(description="Account on the host (default: its only one).")
        ] = None,
        stdin: Annotated[str | None, Field(description="Text sent to the command's stdin.")] = None,
        timeout_s: Annotated[
            float, Field(description="Seconds before the call is cut off.", gt=0, le=86400)
        ] = 600,
        action_key: Annotated[
            str | None,
            Field(
                description="Your name for this logical action: if its last attempt ended "
                "STATUS_UNKNOWN, bastion refuses to repeat it until you set ack_unknown."
            ),
        ] = None,
        ack_unknown: Annotated[
            bool, Field(description="You inspected the target after STATUS_UNKNOWN.")
        ] = False,
    ) -> CallToolResult:
        cmd = Command(
            host, command, user, (stdin or "").encode(), timeout_s, action_key, ack_unknown
        )
        try:
            cmd = cmd.checked()
            cmd = replace(cmd, user=await account(front, host, cmd.user)).checked()
        except AgentError as exc:
            return refused(exc)

        async def progress(out: int, err: int, elapsed: float) -> None:
            message = f"running {elapsed:.0f} s; {out} bytes of stdout, {err} of stderr so far"
            await ctx.report_progress(elapsed, None, message)

        ran = await client.run(front.ssh_config, cmd, front.max_output, progress)
        if ran.timed_out:
            return await timed_out(front, cmd, ran)
        if ran.error is not None:
            return error_result(ran.error, outputs(ran))
        try:
            state = await asyncio.to_thread(
                front.ask, "request", action_key=ran.action_key, only="id"
            )
        except AgentError:
            state = {}
        if ran.exit_status == 255 and not state.get("request_id"):
            # ssh's own failure (the remote command's 255 has a request behind it).
            tail = ran.stderr.data.decode("utf-8", "replace").strip().splitlines()[-3:]
            return internal(
                "ssh failed before reaching the gateway: " + " | ".join(tail) + f" {NOT_SENT}"
            )
        return ok_result(ran, ran.exit_status, state.get("request_id"))

    @server.tool(
        description="The hosts and accounts you may use through bastion, how each account "
        "is approved (session: once per agent process; per-command: every command, except "
        "those matching `preapproved`), which commands its `allow` rules let through "
        "(null: anything the policy does not deny) and which paths sftp_get and sftp_put "
        "may read and write (`files`; null: no file access)."
    )
    async def ssh_hosts() -> CallToolResult:
        try:
            doc = await asyncio.to_thread(front.ask, "hosts")
        except AgentError as exc:
            return refused(exc)
        if doc.get("ok") is False:
            return error_result(doc["error"])
        text = json.dumps(doc, indent=1)
        return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=doc)

    @server.tool(
        description="What became of one request: completed (with its exit status), denied, "
        "retry_safe (nothing was sent), status_unknown (it may or may not have run) or "
        "in_flight. Use it to reconcile a STATUS_UNKNOWN before trying again."
    )
    async def request_status(
        request_id: Annotated[str, Field(description="The request id, e.g. req_0123abcd.")],
    ) -> CallToolResult:
        if not client.ACTION_KEY.fullmatch(request_id):
            return failure(
                Observed.ARGUMENT,
                f"`request_id` {client.shown(request_id)} is not a request id: send one "
                "an ssh_exec result gave (req_...).",
            )
        try:
            doc = await asyncio.to_thread(front.ask, "request", request_id=request_id)
        except Declined as exc:  # the gateway knows no such request
            return failure(Observed.ARGUMENT, f"{exc}: send a request_id ssh_exec gave.")
        except AgentError as exc:
            return refused(exc)
        return CallToolResult(
            content=[TextContent(type="text", text=json.dumps(doc))], structured_content=doc
        )

    @server.tool(
        description="Write one whole file on a host through bastion (replaced if it exists) "
        "and return its size and sha256. `path` is absolute; the account's `files` rules "
        "(see ssh_hosts) decide, and on a per-command account a person approves the exact "
        "bytes on a file card, so the call may wait until they answer."
    )
    async def sftp_put(
        host: Annotated[str, Field(description="Host alias, as ssh_hosts lists it.")],
        path: Annotated[str, Field(description="The file's absolute path on the host.")],
        ctx: Context,
        content: Annotated[
            str | None, Field(description="The file's content as text (written as UTF-8).")
        ] = None,
        content_base64: Annotated[
            str | None, Field(description="The file's content as base64 (any bytes).")
        ] = None,
        user: Annotated[
            str | None, Field(description="Account on the host (default: its only one).")
        ] = None,
        mode: Annotated[
            str | None, Field(description='Permission bits in octal, e.g. "0644".')
        ] = None,
        timeout_s: Annotated[
            float, Field(description="Seconds before the call is cut off.", gt=0, le=86400)
        ] = 600,
    ) -> CallToolResult:
        try:
            req = Put.of(host, path, content, content_base64, user, mode, timeout_s)
            req = replace(req, user=await account(front, host, req.user)).checked()
        except AgentError as exc:
            return refused(exc)
        total = len(req.data)

        async def progress(sent: int, elapsed: float) -> None:
            doing = "waiting for the gateway" if sent >= total else "sending"
            message = f"{doing}, {elapsed:.0f} s; {sent} of {total} bytes sent"
            await ctx.report_progress(elapsed, None, message)

        moved = await sftp_wire.transfer(front.ssh_config, req, progress)
        if (failed := moved_failure(moved, req)) is not None:
            return failed
        doc = {"path": req.path, "size": total, "sha256": sftp_wire.sha256(req.data)}
        text = f"wrote {total} bytes to {req.path} (sha256 {doc['sha256']})"
        return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=doc)

    @server.tool(
        description="Read one file on a host through bastion: its content (text as `content`, "
        "other bytes as `content_base64`), size and sha256. `path` is absolute; the "
        "account's `files` rules (see ssh_hosts) decide. At most max_bytes come back, from "
        "the file's start; `truncated` says there was more (`sha256` is of what came back)."
    )
    async def sftp_get(
        host: Annotated[str, Field(description="Host alias, as ssh_hosts lists it.")],
        path: Annotated[str, Field(description="The file's absolute path on the host.")],
        ctx: Context,
        user: Annotated[
            str | None, Field(description="Account on the host (default: its only one).")
        ] = None,
        max_bytes: Annotated[
            int | None,
            Field(description="Most bytes to return (default: the server's --max-output).", gt=0),
        ] = None,
        timeout_s: Annotated[
            float, Field(description="Seconds before the call is cut off.", gt=0, le=86400)
        ] = 600,
    ) -> CallToolResult:
        try:
            req = Get(host, path, user, max_bytes or front.max_output, timeout_s).checked()
            req = replace(req, user=await account(front, host, req.user)).checked()
        except AgentError as exc:
            return refused(exc)

        async def progress(sent: int, elapsed: float) -> None:
            await ctx.report_progress(elapsed, None, f"reading, {elapsed:.0f} s")

        moved = await sftp_wire.transfer(front.ssh_config, req, progress)
        if (failed := moved_failure(moved, req)) is not None:
            return failed
        doc: dict[str, Any] = {"path": req.path}
        try:
            doc["content"] = moved.data.decode("utf-8")
            shown_text = doc["content"]
        except UnicodeDecodeError:
            doc["content"] = None
            doc["content_base64"] = base64.b64encode(moved.data).decode()
            shown_text = "(not UTF-8; base64 in structured content)"
        doc |= {
            "size": moved.size,
            "bytes": len(moved.data),
            "sha256": sftp_wire.sha256(moved.data),
            "truncated": moved.truncated,
        }
        cut = f", the first {len(moved.data)} of {moved.size} bytes" if moved.truncated else ""
        text = f"{req.path}: {moved.size} bytes{cut}\n{shown_text}"
        return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=doc)

    # Registered; the names stay the tools'.
    del ssh_exec, ssh_hosts, request_status, sftp_put, sftp_get
    return server
