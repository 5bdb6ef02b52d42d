"""A stand-in AI agent: one long-lived process that runs ssh when told to.

The gateway approves *processes*, so tests need agents that are real,
separate, long-lived processes -- and never the test process itself, which
plays the operator (an operator inside an agent's tree is refused).

Protocol: one JSON object per line on stdin -> one per line on stdout.
  {"id": N, "argv": [...], "stdin_path": str|null, "env": {...}|null}
  -> {"id": N, "rc": int, "stdout": b64, "stderr": str, "stdout_sha256": str}
Each request runs in its own thread, so one agent can have several ssh
calls in flight at once. {"exec": [...]} replaces the process image (exec),
keeping its pid and start time. {"id": N, "rename": NAME} sets the process
name (comm) with prctl(PR_SET_NAME), as any process can for itself.
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import threading

_lock = threading.Lock()


def _run(req: dict) -> None:
    env = dict(os.environ)
    env.update(req.get("env") or {})
    stdin = open(req["stdin_path"], "rb") if req.get("stdin_path") else subprocess.DEVNULL  # noqa: SIM115
    try:
        r = subprocess.run(
            req["argv"], stdin=stdin, capture_output=True, env=env, timeout=req.get("timeout", 120)
        )
        reply = {
            "id": req["id"],
            "rc": r.returncode,
            "stdout": base64.b64encode(r.stdout[: 1 << 16]).decode(),
            "stdout_len": len(r.stdout),
            "stdout_sha256": hashlib.sha256(r.stdout).hexdigest(),
            "stderr": r.stderr.decode("utf-8", "replace"),
        }
    except subprocess.TimeoutExpired:
        reply = {
            "id": req["id"],
            "rc": None,
            "stdout": "",
            "stdout_len": 0,
            "stdout_sha256": "",
            "stderr": "agent_helper: timeout",
        }
    finally:
        if stdin is not subprocess.DEVNULL:
            stdin.close()
    with _lock:
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def main() -> None:
    with _lock:  # announce every start, including after an exec
        sys.stdout.write(json.dumps({"id": 0, "ready": os.getpid()}) + "\n")
        sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if "rename" in req:  # set our own process name (comm), as any process may
            libc = ctypes.CDLL(None)
            libc.prctl(15, req["rename"].encode(), 0, 0, 0)  # PR_SET_NAME
            with _lock:
                sys.stdout.write(json.dumps({"id": req["id"], "renamed": True}) + "\n")
                sys.stdout.flush()
            continue
        if "exec" in req:  # become another program: same pid, same start time (the
            # caller sends nothing more until the new image says it is ready)
            sys.stdout.flush()
            os.execv(req["exec"][0], req["exec"])
        threading.Thread(target=_run, args=(req,), daemon=True).start()


if __name__ == "__main__":
    main()
