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
from tests.harness import Agent, Bastion, make_bastion  # noqa: E402

COMMAND = "true"


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

    def approved_agents(self, n: int, batch: int = 16) -> list[Agent]:
        """n agent processes, each with its session card approved (in batches: one uid
        may have only MAX_PENDING_CARDS_PER_TENANT cards waiting)."""
        b = self.bastion
        assert b is not None
        agents: list[Agent] = []
        while len(agents) < n:
            group = [b.agent(**self.agent_env) for _ in range(min(batch, n - len(agents)))]
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
    as if sshd had started it -- a cost direct ssh never pays (README, "Slow
    commands")."""

    target_rc: bool = False
    inflight: int | None = None
    agent_shell: str = "/bin/sh"

    def rig(self, root: Path) -> Rig:
        toml = None if self.inflight is None else f"[limits]\ninflight = {self.inflight}\n"
        env = {"SHELL": self.agent_shell}
        return Rig(root, clean_home=not self.target_rc, bastion_toml=toml, agent_env=env)

    def describe(self) -> dict[str, Any]:
        return {
            "target_rc": self.target_rc,
            "inflight": self.inflight,
            "agent_shell": self.agent_shell,
            "agent_shlvl": os.environ.get("SHLVL"),
        }


def one_round(agents: list[Agent], commands: int, argv: list[str] | None) -> dict[str, Any]:
    """Every agent runs `commands` commands back to back, all agents at once."""
    lat: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def work(agent: Agent) -> None:
        for _ in range(commands):
            t0 = time.perf_counter()
            r = agent.run(COMMAND, argv=None if argv is None else [*argv, COMMAND])
            dt = time.perf_counter() - t0
            with lock:
                lat.append(dt)
                if r.rc != 0:
                    why = r.error["message"] if r.error else r.stderr.strip() or f"rc {r.rc}"
                    errors.append(f"{r.code or r.rc}: {why.splitlines()[-1][:200]}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(agents)) as pool:
        list(pool.map(work, agents))
    wall = time.perf_counter() - t0
    return {"wall": wall, "lat": lat, "errors": errors}


def concurrency(
    root: Path,
    n_agents: int,
    commands: int,
    rounds: int,
    profile: Path | None,
    setup: Setup,
) -> dict[str, Any]:
    with setup.rig(root) as rig:
        agents = rig.approved_agents(n_agents)
        one_round(agents, 1, rig.direct)  # warm both paths: sshd's caches, the pool
        one_round(agents, 1, None)
        base = proc_status(rig.gateway_pid)
        base["fds"] = settled_fds(rig.gateway_pid)  # the warm-up's connections closed
        reset_peak(rig.gateway_pid)  # the peak so far is the unlock's Argon2id (512 MiB)
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
    out["ratio_throughput"] = out["bastion"]["commands_per_s"] / out["direct"]["commands_per_s"]
    out["ratio_p95"] = out["bastion"]["p95_ms"] / out["direct"]["p95_ms"]
    out["gateway"] = {"peak_rss_mb": end["VmHWM"] / 1024, "rss_mb": end["VmRSS"] / 1024,
                      "fds_before": base["fds"], "fds_after": end["fds"],
                      "fds_settled": settled, "rss_mb_by_round": rss_by_round}  # fmt: skip
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
    if "soak" in r:
        s = r["soak"]
        lines.append(
            f"soak {s['commands']} commands: {s['commands_per_s']:.1f}/s, errors {s['errors']}, "
            f"RSS {s['rss_mb']['after_1000']:.1f} MB after 1000 -> {s['rss_mb']['end']:.1f} MB "
            f"({s['rss_growth']:+.1%}), peak {s['peak_rss_mb']:.1f} MB, fds "
            f"{s['fds']['baseline']} -> {s['fds']['end']}"
        )
    return "\n".join(lines)


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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    setup = Setup(args.target_rc, args.inflight, args.agent_shell)
    out: dict[str, Any] = {"setup": setup.describe()}
    with tempfile.TemporaryDirectory(prefix="bastion-load-") as tmp:
        if not args.no_concurrency:
            out.update(
                concurrency(
                    Path(tmp) / "c",
                    args.agents,
                    args.commands,
                    args.rounds,
                    args.profile,
                    setup,
                )
            )
        if args.soak:
            out["soak"] = soak(Path(tmp) / "s", args.soak, setup)
    print(json.dumps(out, indent=2) if args.json else report(out))


if __name__ == "__main__":
    main()
