"""Many agents at once, and a long soak: bastion against direct ssh, side by side.

Run from the repo root (see bench/README.md):

    python bench/load.py                          # 64 agents x 10 commands, both paths
    python bench/load.py --agents 64 --commands 50
    python bench/load.py --soak 10000             # one agent, sequential; RSS and fds
    python bench/load.py --profile gw.txt         # py-spy the gateway during the bastion run
    python bench/load.py --json

Every agent is its own process (`tests/agent_helper.py`) with its own approved
session, so the gateway identifies 64 subjects, not one. A round runs `--commands`
commands in every agent at once, first all direct (`ssh` to the same sshd with the
deploy key), then all through bastion (`ssh -F agent_ssh_config web1`), and the
rounds alternate `--rounds` times, so drift on the machine hits both alike. Per
path: commands/s over the round's wall time, p50/p95 of one command's wall time,
errors. The gateway's peak RSS (VmHWM) and open descriptors come from /proc.

No number is asserted: this is a report, not a test.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bastion.devtools.sshd_fixture import Sshd  # noqa: E402
from tests.harness import Agent, Bastion, cli_argv, make_bastion  # noqa: E402

COMMAND = "true"
# Not /tmp: a `bastion run` sandbox has a /tmp of its own, where the agents' ssh config
# (in the rig's directory) would not be.
TMP = os.environ.get("BASTION_BENCH_TMP", "/var/tmp")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) in kB, and open descriptors, of a process."""
    out = {"fds": len(os.listdir(f"/proc/{pid}/fd"))}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def bench_sshd(root: Path, pub: str, clean_home: bool) -> Sshd:
    """The fixture sshd, by default with an empty HOME for sessions: the target's
    shell reads the user's ~/.bashrc for every command (bash does when sshd runs
    it), and on a machine whose rc files start pyenv that is about 150 ms of CPU per
    command on *both* paths -- it would drown what is measured (`--target-rc`)."""
    return Sshd(root / "sshd", authorized_keys=[pub], session_home=clean_home)


def settled_fds(pid: int, quiet: float = 1.0, timeout: float = 15.0) -> int:
    """The gateway's open descriptors once the agents' last connections have closed on
    its side too (a moment after the clients exit): the count once it has not changed
    for `quiet` seconds, or whatever it is after `timeout`."""
    deadline = time.monotonic() + timeout
    fds, since = proc_status(pid)["fds"], time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet:
        time.sleep(0.1)
        now = proc_status(pid)["fds"]
        if now != fds:
            fds, since = now, time.monotonic()
    return fds


def reset_peak(pid: int) -> None:
    """Start VmHWM afresh (proc(5), clear_refs "5"): what follows is measured alone."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def pyspy() -> str:
    """py-spy on PATH, or beside this interpreter (a venv's bin)."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    return found


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


class Rig:
    """One sshd, one bastion, and agents with approved sessions."""

    def __init__(
        self,
        root: Path,
        clean_home: bool = True,
        bastion_toml: str | None = None,
        agent_env: dict[str, str] | None = None,
        in_run: bool = False,
    ) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.key = root / "id_ed25519"
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "load", "-f", str(self.key)]
        subprocess.run(keygen, check=True, timeout=30)
        pub = self.key.with_suffix(".pub").read_text().strip()
        self.sshd = bench_sshd(root, pub, clean_home)
        self.bastion: Bastion | None = None
        self.bastion_toml = bastion_toml
        self.agent_env = agent_env or {}
        self.in_run = in_run

    def __enter__(self) -> Rig:
        info = self.sshd.start()
        known = self.root / "known_hosts"
        known.write_text(info.known_hosts_line() + "\n")
        self.direct = ["ssh", "-F", "/dev/null", "-i", str(self.key), "-o", "IdentitiesOnly=yes"]
        self.direct += ["-o", f"UserKnownHostsFile={known}", "-o", "StrictHostKeyChecking=yes"]
        self.direct += ["-o", "BatchMode=yes", "-p", str(info.port), f"{info.user}@{info.address}"]
        self.bastion = make_bastion(self.root / "bastion", info, self.key, start=False)
        if self.bastion_toml is not None:
            self.bastion.home.config.write_text(self.bastion_toml)
        self.bastion.start_daemon()
        self.bastion.unlock()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bastion is not None:
            self.bastion.close()
        self.sshd.stop()

    @property
    def gateway_pid(self) -> int:
        assert self.bastion is not None
        return self.bastion.gateway_pid

    def new_agent(self, plain: bool = False) -> Agent:
        """An agent process; with `in_run`, inside a `bastion run --` of its own (each
        run its own sandbox and subject, as an agent started under `bastion run`)."""
        b = self.bastion
        assert b is not None
        if plain:
            return b.agent()
        if not self.in_run:
            return b.agent(**self.agent_env)
        agent = Agent(b.config, self.agent_env, launcher=(*cli_argv(b.home.root, "run", "--"),))
        b.agents.append(agent)
        return agent

    def approved_agents(self, n: int, batch: int = 16, plain: bool = False) -> list[Agent]:
        """n agent processes, each with its session card approved (in batches: one uid
        may have only MAX_PENDING_CARDS_PER_TENANT cards waiting)."""
        b = self.bastion
        assert b is not None
        agents: list[Agent] = []
        while len(agents) < n:
            group = [self.new_agent(plain) for _ in range(min(batch, n - len(agents)))]
            rids = [a.start(COMMAND) for a in group]
            answered = 0
            deadline = time.monotonic() + 120
            while answered < len(group):
                assert time.monotonic() < deadline, f"only {answered} of {len(group)} cards came"
                for card in b.op("pending", wait=5):
                    b.answer(card, True)
                    answered += 1
            for a, rid in zip(group, rids, strict=True):
                r = a.wait(rid)
                if r.rc != 0:
                    raise RuntimeError(f"an approved session failed: {r.stderr.strip()}")
            agents += group
        return agents


@dataclass(frozen=True)
class Setup:
    """What differs between runs, besides their size. `agent_shell` is the SHELL the
    agents' ssh runs the ProxyCommand with: ssh always starts it as `$SHELL -c`, and
    bash given a socket on stdin (ProxyUseFdpass) and no SHLVL reads ~/.bashrc first,
    as if sshd had started it -- a cost direct ssh never pays (docs/files-and-clients.md,
    "Slow commands")."""

    target_rc: bool = False
    inflight: int | None = None
    agent_shell: str = "/bin/sh"
    # The agents work as if inside an ssh login (SHLVL 0, SSH_CLIENT/SSH_CONNECTION set:
    # bash then reads ~/.bashrc for every ProxyCommand) and run under `bastion run --`.
    ssh_login: bool = False

    def rig(self, root: Path) -> Rig:
        toml = None if self.inflight is None else f"[limits]\ninflight = {self.inflight}\n"
        env = {"SHELL": self.agent_shell}
        if self.ssh_login:
            env |= {
                "SHLVL": "0",  # as unset: bash counts itself the first shell
                "SSH_CLIENT": "192.0.2.1 50000 22",
                "SSH_CONNECTION": "192.0.2.1 50000 192.0.2.2 22",
            }
        return Rig(
            root,
            clean_home=not self.target_rc,
            bastion_toml=toml,
            agent_env=env,
            in_run=self.ssh_login,
        )

    @property
    def name(self) -> str:
        target = "rc-reading target" if self.target_rc else "quick target"
        shell = "bash agents in bastion run" if self.ssh_login else f"{self.agent_shell} agents"
        return f"{target}, {shell}"

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "target_rc": self.target_rc,
            "inflight": self.inflight,
            "agent_shell": self.agent_shell,
            "agent_shlvl": "0" if self.ssh_login else os.environ.get("SHLVL"),
            "ssh_login": self.ssh_login,
        }


def stream(rig: Rig, mb: int) -> dict[str, Any]:
    """One approved agent (plain: its shell does not matter here) streams `mb` MB from
    the target (`cat` of a random file) and the same to it (`sha256sum` of its stdin),
    both checked by length and sha256; the gateway's RSS before and after."""
    (agent,) = rig.approved_agents(1, plain=True)
    blob = rig.root / "stream.bin"
    digest = hashlib.sha256()
    with blob.open("wb") as f:
        for _ in range(mb):
            block = os.urandom(1 << 20)
            digest.update(block)
            f.write(block)
    sha, size = digest.hexdigest(), mb << 20
    pid = rig.gateway_pid
    before = proc_status(pid)["VmRSS"] / 1024
    t0 = time.perf_counter()
    down = agent.run(f"cat {blob}")
    t_down = time.perf_counter() - t0
    after_down = proc_status(pid)["VmRSS"] / 1024
    t0 = time.perf_counter()
    up = agent.run("sha256sum", stdin_path=blob)
    t_up = time.perf_counter() - t0
    after = proc_status(pid)["VmRSS"] / 1024
    agent.close()
    blob.unlink()
    ok_down = down.rc == 0 and (down.stdout_len, down.stdout_sha256) == (size, sha)
    ok_up = up.rc == 0 and up.stdout.split()[:1] == [sha.encode()]
    return {
        "mb": mb,
        "ok": ok_down and ok_up,
        "errors": [r.stderr.strip()[-200:] for r, ok in ((down, ok_down), (up, ok_up)) if not ok],
        "mb_per_s": {"down": mb / t_down, "up": mb / t_up},
        "rss_mb": {"before": before, "after_down": after_down, "after": after},
    }


def one_round(agents: list[Agent], commands: int, argv: list[str] | None) -> dict[str, Any]:
    """Every agent runs `commands` commands back to back, all agents at once."""
    lat: list[float] = []
    done: list[float] = []  # the commands that ran (rc 0): a failure is often quick
    errors: list[str] = []
    lock = threading.Lock()

    def work(agent: Agent) -> None:
        for _ in range(commands):
            t0 = time.perf_counter()
            r = agent.run(COMMAND, argv=None if argv is None else [*argv, COMMAND])
            dt = time.perf_counter() - t0
            with lock:
                lat.append(dt)
                if r.rc == 0:
                    done.append(dt)
                else:
                    why = r.error["message"] if r.error else r.stderr.strip() or f"rc {r.rc}"
                    errors.append(f"{r.code or r.rc}: {why.splitlines()[-1][:200]}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(agents)) as pool:
        list(pool.map(work, agents))
    wall = time.perf_counter() - t0
    return {"wall": wall, "lat": lat, "done": done, "errors": errors}


def concurrency(
    root: Path,
    n_agents: int,
    commands: int,
    rounds: int,
    profile: Path | None,
    setup: Setup,
    stream_mb: int = 0,
) -> dict[str, Any]:
    with setup.rig(root) as rig:
        agents = rig.approved_agents(n_agents)
        one_round(agents, 1, rig.direct)  # warm both paths: sshd's caches, the pool
        one_round(agents, 1, None)
        base = proc_status(rig.gateway_pid)
        base["fds"] = settled_fds(rig.gateway_pid)  # the warm-up's connections closed
        reset_peak(rig.gateway_pid)  # the peak so far is the unlock's Argon2id (512 MiB)
        streamed = stream(rig, stream_mb) if stream_mb else None
        runs: dict[str, list[dict[str, Any]]] = {"direct": [], "bastion": []}
        spy = None
        rss_by_round: list[float] = []
        for i in range(rounds):
            runs["direct"].append(one_round(agents, commands, rig.direct))
            if profile is not None and i == rounds - 1:
                spy = subprocess.Popen(
                    [pyspy(), "record", "--nonblocking", "--format", "raw", "--rate",
                     "100", "-o", str(profile), "--pid", str(rig.gateway_pid)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                time.sleep(1)  # py-spy attaches
            runs["bastion"].append(one_round(agents, commands, None))
            rss_by_round.append(proc_status(rig.gateway_pid)["VmRSS"] / 1024)
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(60)
        end = proc_status(rig.gateway_pid)
        load = rig.bastion.op("status")["load"] if rig.bastion else {}
        for a in agents:
            a.close()
        settled = settled_fds(rig.gateway_pid)
        time.sleep(2)  # the gateway hands memory back once quiet (gateway/trim.py)
        rss_after_run = proc_status(rig.gateway_pid)["VmRSS"] / 1024
        # Every request the gateway saw has exactly one ending in the journal.
        assert rig.bastion is not None
        rows = json.loads(rig.bastion.cli("audit", "activity", "--json").stdout)
    endings = collections.Counter("/".join(filter(None, (r["outcome"], r["code"]))) for r in rows)
    out: dict[str, Any] = {"agents": n_agents, "commands": commands, "rounds": rounds}
    out["journal"] = {"requests": len(rows), "endings": dict(endings)}
    out["load"] = load
    for path, rs in runs.items():
        lat = [x for r in rs for x in r["lat"]]
        out[path] = {
            "commands_per_s": sum(len(r["lat"]) for r in rs) / sum(r["wall"] for r in rs),
            "p50_ms": statistics.median(lat) * 1e3,
            "p95_ms": pct(lat, 95) * 1e3,
            "errors": sum(len(r["errors"]) for r in rs),
            "error_lines": sorted({e for r in rs for e in r["errors"]})[:5],
        }
        # What ran, alone: sshd's MaxStartups drops direct handshakes past 10 at once,
        # and those failures come back fast (counted above, they flatter direct).
        done = [x for r in rs for x in r["done"]]
        out[path]["completed_per_s"] = len(done) / sum(r["wall"] for r in rs)
        out[path]["p95_completed_ms"] = pct(done, 95) * 1e3 if done else None
    out["ratio_throughput"] = out["bastion"]["commands_per_s"] / out["direct"]["commands_per_s"]
    out["ratio_p95"] = out["bastion"]["p95_ms"] / out["direct"]["p95_ms"]
    d, b = out["direct"], out["bastion"]
    if d["completed_per_s"] and d["p95_completed_ms"] and b["p95_completed_ms"]:
        out["ratio_completed"] = b["completed_per_s"] / d["completed_per_s"]
        out["ratio_p95_completed"] = b["p95_completed_ms"] / d["p95_completed_ms"]
    out["gateway"] = {"peak_rss_mb": end["VmHWM"] / 1024, "rss_mb": end["VmRSS"] / 1024,
                      "fds_before": base["fds"], "fds_after": end["fds"],
                      "fds_settled": settled, "rss_mb_by_round": rss_by_round,
                      "rss_mb_start": base["VmRSS"] / 1024,
                      "rss_mb_after_run": rss_after_run}  # fmt: skip
    out["stream"] = streamed
    return out


def soak(root: Path, total: int, setup: Setup) -> dict[str, Any]:
    """One agent, `total` sequential commands; RSS after the first 1,000 and at the end."""
    with setup.rig(root) as rig:
        (agent,) = rig.approved_agents(1)
        base = proc_status(rig.gateway_pid)
        reset_peak(rig.gateway_pid)
        marks: dict[str, Any] = {}
        errors = 0
        t0 = time.perf_counter()
        for i in range(1, total + 1):
            errors += agent.run(COMMAND).rc != 0
            if i == min(1000, total):
                marks["after_1000"] = proc_status(rig.gateway_pid)
        wall = time.perf_counter() - t0
        agent.close()
        time.sleep(0.5)  # the gateway's side of the last connection closes
        end = proc_status(rig.gateway_pid)
    first = marks["after_1000"]
    return {
        "commands": total,
        "errors": errors,
        "commands_per_s": total / wall,
        "rss_mb": {"after_1000": first["VmRSS"] / 1024, "end": end["VmRSS"] / 1024},
        "rss_growth": end["VmRSS"] / first["VmRSS"] - 1,
        "peak_rss_mb": end["VmHWM"] / 1024,
        "fds": {"baseline": base["fds"], "end": end["fds"]},
    }


def report(r: dict[str, Any]) -> str:
    st = r["setup"]
    lines = [
        f"setup: agents' SHELL {st['agent_shell']} (SHLVL {st['agent_shlvl']}), target rc files "
        f"{'read' if st['target_rc'] else 'not read (empty HOME)'}"
    ]
    if "direct" in r:
        lines.append(f"{r['agents']} agents x {r['commands']} commands x {r['rounds']} round(s):")
        for path in ("direct", "bastion"):
            p = r[path]
            lines.append(
                f"  {path:8} {p['commands_per_s']:6.2f} commands/s  p50 {p['p50_ms']:7.0f} ms  "
                f"p95 {p['p95_ms']:7.0f} ms  errors {p['errors']}"
                + (f" ({'; '.join(p['error_lines'])})" if p["error_lines"] else "")
            )
        g = r["gateway"]
        lines.append(
            f"  bastion/direct: throughput {r['ratio_throughput']:.2f}x, p95 {r['ratio_p95']:.2f}x;"
            f" gateway peak RSS {g['peak_rss_mb']:.0f} MB, fds {g['fds_before']} after the "
            f"warm-up, {g['fds_after']} in the last round, {g['fds_settled']} after the agents "
            "left; RSS after each "
            "bastion round " + ", ".join(f"{x:.0f}" for x in g["rss_mb_by_round"]) + " MB"
        )
        j = r["journal"]
        lines.append(
            f"  journal: {j['requests']} requests, endings "
            + ", ".join(f"{k} {v}" for k, v in sorted(j["endings"].items()))
            + f"; in-flight limit {r['load'].get('limit')}, busy refusals "
            f"{r['load'].get('busy_refused')}"
        )
    if r.get("stream"):
        lines.append("  " + stream_line(r["stream"], r["gateway"]))
    if "soak" in r:
        s = r["soak"]
        lines.append(
            f"soak {s['commands']} commands: {s['commands_per_s']:.1f}/s, errors {s['errors']}, "
            f"RSS {s['rss_mb']['after_1000']:.1f} MB after 1000 -> {s['rss_mb']['end']:.1f} MB "
            f"({s['rss_growth']:+.1%}), peak {s['peak_rss_mb']:.1f} MB, fds "
            f"{s['fds']['baseline']} -> {s['fds']['end']}"
        )
    return "\n".join(lines)


def stream_line(st: dict[str, Any], g: dict[str, Any]) -> str:
    rss = st["rss_mb"]
    ok = "ok" if st["ok"] else "FAILED: " + "; ".join(st["errors"])
    return (
        f"stream {st['mb']} MB each way ({ok}"
        f", {st['mb_per_s']['down']:.0f}/{st['mb_per_s']['up']:.0f} MB/s down/up): gateway RSS "
        f"{rss['before']:.0f} MB before, {rss['after_down']:.0f} after the download, "
        f"{rss['after']:.0f} after both; peak over stream + rounds {g['peak_rss_mb']:.0f} MB; "
        f"after the run {g['rss_mb_after_run']:.0f} MB "
        f"({g['rss_mb_after_run'] / rss['before'] - 1:+.0%} of before the stream)"
    )


def matrix_report(results: list[dict[str, Any]]) -> str:
    """Every setup side by side: one row each."""
    head = (
        f"{'setup':44} {'agents':>9} {'direct/s':>8} {'bastion/s':>9} {'ratio':>5} "
        f"{'p95 d ms':>8} {'p95 b ms':>8} {'ratio':>5} {'err d/b':>7} "
        f"{'RSS start/peak/after MB':>23}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        d, b, g = r["direct"], r["bastion"], r["gateway"]
        start = r["stream"]["rss_mb"]["before"] if r.get("stream") else g["rss_mb_start"]
        lines.append(
            f"{r['setup']['name']:44} {r['agents']:>4}x{r['commands']:<4} "
            f"{d['commands_per_s']:8.1f} {b['commands_per_s']:9.1f} {r['ratio_throughput']:5.2f} "
            f"{d['p95_ms']:8.0f} {b['p95_ms']:8.0f} {r['ratio_p95']:5.2f} "
            f"{d['errors']:>3}/{b['errors']:<3} "
            f"{start:7.0f}/{g['peak_rss_mb']:5.0f}/{g['rss_mb_after_run']:5.0f}"
        )
    for r in results:
        if r.get("stream"):
            lines.append(f"{r['setup']['name']}: " + stream_line(r["stream"], r["gateway"]))
        d, b = r["direct"], r["bastion"]
        if (d["errors"] or b["errors"]) and "ratio_completed" in r:
            lines.append(
                f"{r['setup']['name']} {r['agents']}x{r['commands']}, completed commands "
                f"only: direct {d['completed_per_s']:.1f}/s p95 {d['p95_completed_ms']:.0f} ms, "
                f"bastion {b['completed_per_s']:.1f}/s p95 {b['p95_completed_ms']:.0f} ms: "
                f"{r['ratio_completed']:.2f}x, p95 {r['ratio_p95_completed']:.2f}x"
            )
        errs = d["error_lines"] + b["error_lines"]
        if errs:
            lines.append(f"{r['setup']['name']}: errors: " + "; ".join(errs))
    return "\n".join(lines)


def run_matrix(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Target kind (quick, rc-reading) x agents (/bin/sh; bash inside an ssh login,
    under `bastion run`), each with the stream first; then 256 x 5 against the quick
    target with --big."""
    setups = [
        Setup(target_rc=rc, inflight=args.inflight, agent_shell=shell, ssh_login=login)
        for rc in (False, True)
        for shell, login in (("/bin/sh", False), ("/bin/bash", True))
    ]
    sizes = [(s, args.agents, args.commands) for s in setups]
    if args.big:
        sizes.append((Setup(inflight=args.inflight), 256, 5))
    results = []
    for i, (setup, agents, commands) in enumerate(sizes):
        print(f"[{time.strftime('%H:%M:%S')}] {setup.name}, {agents} x {commands} ...",
              file=sys.stderr, flush=True)  # fmt: skip
        r = concurrency(tmp / f"m{i}", agents, commands, args.rounds, None, setup, args.stream_mb)
        r["setup"] = setup.describe()
        results.append(r)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--commands", type=int, default=10, help="per agent per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--soak", type=int, default=0, help="also a sequential soak of N commands")
    ap.add_argument("--no-concurrency", action="store_true", help="the soak only")
    ap.add_argument("--inflight", type=int, help="bastion.toml [limits] inflight for the run")
    ap.add_argument("--profile", type=Path, help="py-spy raw profile of the last bastion round")
    ap.add_argument(
        "--target-rc",
        action="store_true",
        help="let the target's shell read the user's real ~/.bashrc (default: an empty HOME)",
    )
    ap.add_argument(
        "--agent-shell",
        default="/bin/sh",
        help="SHELL for the agents' ssh, which runs the ProxyCommand with it (/bin/bash with "
        "SHLVL=0 reads ~/.bashrc first)",
    )
    ap.add_argument(
        "--ssh-login",
        action="store_true",
        help="agents as if inside an ssh login (SHLVL 0, SSH_CLIENT set), under bastion run",
    )
    ap.add_argument(
        "--stream-mb",
        type=int,
        help="first stream N MB each way through one agent (default: 0; 200 with --matrix)",
    )
    ap.add_argument(
        "--matrix",
        action="store_true",
        help="every target kind x agent shell, side by side, one table",
    )
    ap.add_argument("--big", action="store_true", help="with --matrix: also 256 x 5, quick")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.stream_mb is None:
        args.stream_mb = 200 if args.matrix else 0
    if args.matrix:
        with tempfile.TemporaryDirectory(prefix="bastion-load-", dir=TMP) as tmp:
            results = run_matrix(args, Path(tmp))
        load_avg = Path("/proc/loadavg").read_text().strip()
        if args.json:
            print(json.dumps({"matrix": results, "loadavg_end": load_avg}, indent=2))
        else:
            print(matrix_report(results) + f"\nload average at the end: {load_avg}")
        return
    setup = Setup(args.target_rc, args.inflight, args.agent_shell, args.ssh_login)
    out: dict[str, Any] = {"setup": setup.describe()}
    with tempfile.TemporaryDirectory(prefix="bastion-load-", dir=TMP) as tmp:
        if not args.no_concurrency:
            out.update(
                concurrency(
                    Path(tmp) / "c",
                    args.agents,
                    args.commands,
                    args.rounds,
                    args.profile,
                    setup,
                    args.stream_mb,
                )
            )
        if args.soak:
            out["soak"] = soak(Path(tmp) / "s", args.soak, setup)
    print(json.dumps(out, indent=2) if args.json else report(out))


if __name__ == "__main__":
    main()
