"""Latency and throughput of an agent's ssh call: direct to sshd vs. through bastion.

Run from the repo root: python bench/bench.py [--n 30] [--json]. See bench/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from load import bench_sshd  # noqa: E402  (bench/load.py, beside this file)
from sftp_bench import bench as sftp_bench  # noqa: E402  (bench/sftp_bench.py)

from bastion.ca import vault_ca  # noqa: E402
from bastion.ops import unlocked  # noqa: E402
from bastion.vault import Vault  # noqa: E402
from tests.harness import (  # noqa: E402
    PASSPHRASE,
    Agent,
    Bastion,
    Result,
    cli_argv,
    make_bastion,
    policy_toml,
    write_bastion_toml,
)

BLOB_SIZE = 32 << 20
LOOPBACK = "127.0.0.1"  # where the fixture sshd sees the gateway connect from
THROUGHPUT_RUNS = 3
WARMUP = 2
MAX_TRIES = 5


def timed(
    agent: Agent, command: str, argv: list[str] | None, fails: list[str], **kw: Any
) -> tuple[float, Result]:
    """Wall time of one successful request through the agent helper.

    A failed attempt (rc != 0) is retried, up to MAX_TRIES, and its stderr kept in
    `fails`: it is reported, never counted in the timings.
    """
    for _ in range(MAX_TRIES):
        t0 = time.perf_counter()
        r = agent.run(command, argv=None if argv is None else [*argv, command], **kw)
        dt = time.perf_counter() - t0
        if r.rc == 0:
            return dt, r
        fails.append(r.stderr.strip().splitlines()[0] if r.stderr.strip() else f"rc {r.rc}")
    raise RuntimeError(f"{argv or command!r} failed {MAX_TRIES} times in a row: {fails[-1]}")


def timed_cmd(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=False, timeout=30)
    return time.perf_counter() - t0


def stats(xs: list[float]) -> dict[str, float]:
    p90 = statistics.quantiles(xs, n=10, method="inclusive")[8]
    return {"median_ms": statistics.median(xs) * 1e3, "p90_ms": p90 * 1e3, "min_ms": min(xs) * 1e3}


def bench(
    root: Path, n: int, blob_size: int = BLOB_SIZE, clean: bool = True, witness: bool = False
) -> dict[str, Any]:
    key = root / "id_ed25519"
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "bench", "-f", str(key)]
    subprocess.run(keygen, check=True, timeout=30)
    sshd = bench_sshd(root, key.with_suffix(".pub").read_text().strip(), clean)
    bastion: Bastion | None = None
    try:
        info = sshd.start()
        known = root / "known_hosts"
        known.write_text(info.known_hosts_line() + "\n")
        direct = ["ssh", "-F", "/dev/null", "-i", str(key), "-o", "IdentitiesOnly=yes"]
        direct += ["-o", f"UserKnownHostsFile={known}", "-o", "StrictHostKeyChecking=yes"]
        direct += ["-o", "BatchMode=yes", "-p", str(info.port), f"{info.user}@{info.address}"]
        proxy_path = REPO / "bastion" / "agent" / "proxy.py"
        assert proxy_path.is_file(), proxy_path  # a missing script would "start" in 10 ms
        proxy = [sys.executable, "-I", "-S", str(proxy_path)]
        proxy += ["--socket", "/nonexistent", "h", "22", "u"]

        # web1: the vault key, pooled; cert1: the same sshd, a certificate per command.
        cert1 = policy_toml(info, alias="cert1", auth="certificate", source_address=[LOOPBACK])
        policy = policy_toml(info) + "\n" + cert1
        bastion = make_bastion(root / "bastion", info, key, policy, start=False)
        if witness:  # every dispatch then waits for the file witness to fsync its intent
            (root / "offbox").mkdir()
            write_bastion_toml(bastion, f'[witness]\nfile = "{root / "offbox" / "w.log"}"\n')
        with unlocked(Vault.open(bastion.home.vault), PASSPHRASE.encode()) as vault:
            vault_ca.init(vault)
            sshd.trust_user_cas(vault_ca.public(vault.list_keys())["trusted_user_ca_keys"])
        bastion.start_daemon()
        bastion.unlock()
        agent = bastion.agent()
        # The same helper inside a sandboxed `bastion run` (issue 20): what a run costs
        # per command, against the agent outside, in the same rounds.
        in_run = Agent(bastion.config, launcher=(*cli_argv(bastion.home.root, "run", "--"),))
        bastion.agents.append(in_run)
        certified = ["ssh", "-F", str(bastion.config), "cert1"]
        for who, argv in ((agent, None), (agent, [*certified, "true"]), (in_run, None)):
            rid = who.start("true", argv=argv)
            bastion.approve_next()
            if (r := who.wait(rid)).rc != 0:
                raise RuntimeError(f"approved session failed: {r.stderr.strip()}")

        paths: dict[str, list[str] | None] = {"direct": direct, "bastion": None, "helper": []}
        fails: dict[str, list[str]] = {"direct": [], "bastion": [], "helper": [], "in_run": []}
        lat: dict[str, list[float]] = {k: [] for k in (*paths, "in_run", "proxy")}
        journal_before = bastion.op("status")["journal"]
        for i in range(WARMUP + n):
            # Interleaved A B A B ...; the agent helper's own floor (argv=["true"],
            # no ssh) and the proxy helper's startup ride along in the same rounds.
            sample = {k: timed(agent, "true", argv, fails[k])[0] for k, argv in paths.items()}
            sample["in_run"] = timed(in_run, "true", None, fails["in_run"])[0]
            sample["proxy"] = timed_cmd(proxy)
            if i >= WARMUP:
                for k, v in sample.items():
                    lat[k].append(v)

        # The gateway times its own journal appends (fsyncs included) on the real path.
        journal_after = bastion.op("status")["journal"]
        # A certificate account against direct ssh, interleaved in a loop of its own
        # (so the journal numbers above stay the pooled path's).
        for k in ("cert_direct", "certificate"):
            fails[k], lat[k] = [], []
        cert_paths = {"cert_direct": direct, "certificate": certified}
        for i in range(WARMUP + n):
            sample = {k: timed(agent, "true", argv, fails[k])[0] for k, argv in cert_paths.items()}
            if i >= WARMUP:
                for k, v in sample.items():
                    lat[k].append(v)
        starts = run_start(bastion, min(n, 20))
        blob = root / "blob"
        data = os.urandom(blob_size)
        blob.write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        cat_s: dict[str, list[float]] = {"direct": [], "bastion": []}
        for _ in range(THROUGHPUT_RUNS):
            for k in cat_s:
                dt, r = timed(agent, "cat", paths[k], fails[k], stdin_path=blob)
                if r.stdout_len != blob_size or r.stdout_sha256 != digest:
                    raise RuntimeError(f"{k} cat returned {r.stdout_len} B, not the blob")
                cat_s[k].append(dt)
    finally:
        if bastion is not None:
            bastion.close()
        sshd.stop()

    out: dict[str, Any] = {"n": n, "latency": {k: stats(v) for k, v in lat.items()}}
    out["witness"] = "file" if witness else None
    out["blob_mib"] = blob_size >> 20
    d, b = out["latency"]["direct"], out["latency"]["bastion"]
    out["ratio_median"] = b["median_ms"] / d["median_ms"]
    out["ratio_p90"] = b["p90_ms"] / d["p90_ms"]
    cd, cb = out["latency"]["cert_direct"], out["latency"]["certificate"]
    out["certificate_ratio_median"] = cb["median_ms"] / cd["median_ms"]
    ir = out["latency"]["in_run"]
    out["in_run_ratio_median"] = ir["median_ms"] / b["median_ms"]
    out["in_run_ratio_p90"] = ir["p90_ms"] / b["p90_ms"]
    out["run_start"] = starts
    out["certificate_ratio_p90"] = cb["p90_ms"] / cd["p90_ms"]
    mb = blob_size / 1e6
    cat = {k: statistics.median(v) for k, v in cat_s.items()}
    out["throughput_MBps"] = {k: mb / t for k, t in cat.items()}
    # Streaming alone (estimate): the median cat minus the median `true` of that path.
    out["throughput_net_MBps"] = {k: mb / (t - statistics.median(lat[k])) for k, t in cat.items()}
    out["throughput_ratio"] = out["throughput_MBps"]["bastion"] / out["throughput_MBps"]["direct"]
    # Every request the gateway served in that loop: the agent's and the run's, each
    # round, and each failed attempt of either.
    commands = 2 * (WARMUP + n) + len(fails["bastion"]) + len(fails["in_run"])
    spent = journal_after["append_seconds"] - journal_before["append_seconds"]
    per_command_ms = spent / commands * 1e3
    out["journal"] = {
        "records_per_command": (journal_after["appends"] - journal_before["appends"]) / commands,
        "fsyncs_per_command": (journal_after["fsyncs"] - journal_before["fsyncs"]) / commands,
        "ms_per_command": per_command_ms,
        "share_of_latency": per_command_ms / b["median_ms"],
    }
    out["failed_attempts"] = {k: len(v) for k, v in fails.items()}
    out["failure_messages"] = sorted({m for v in fails.values() for m in v})
    out["reader"] = reader_speed()
    return out


def run_start(bastion: Bastion, rounds: int) -> dict[str, Any]:
    """What `bastion run` adds before the agent's first instruction: `/bin/true` alone,
    under `bastion run --no-sandbox` (interpreter, registration, supervision), under the
    default sandboxed run (the same plus the preflight, the layer's probe and mounts,
    bwrap and the run's own network), and under the sandbox without its home overlay
    (`--private-home`) and without its own network (`--share-net`), interleaved: the
    differences are what the overlay and the network stack cost."""
    run = ("run", "--")
    argv = {
        "true": ["/bin/true"],
        "run_no_sandbox": cli_argv(bastion.home.root, "run", "--no-sandbox", "--", "/bin/true"),
        "run_sandboxed": cli_argv(bastion.home.root, *run, "/bin/true"),
        "run_private_home": cli_argv(bastion.home.root, "run", "--private-home", "--", "/bin/true"),
        "run_share_net": cli_argv(bastion.home.root, "run", "--share-net", "--", "/bin/true"),
    }
    times: dict[str, list[float]] = {k: [] for k in argv}
    for i in range(WARMUP + rounds):
        for k, a in argv.items():
            t0 = time.perf_counter()
            subprocess.run(a, capture_output=True, check=True, timeout=60)
            if i >= WARMUP:
                times[k].append(time.perf_counter() - t0)
    out: dict[str, Any] = {k: stats(v) for k, v in times.items()}
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["sandbox_adds_ms"] = med["run_sandboxed"] - med["run_no_sandbox"]
    out["run_adds_ms"] = med["run_sandboxed"] - med["true"]
    out["overlay_adds_ms"] = med["run_sandboxed"] - med["run_private_home"]
    out["network_adds_ms"] = med["run_sandboxed"] - med["run_share_net"]
    return out


def reader_speed(rounds: int = 20) -> dict[str, float]:
    """The command reader (core/command.py) on the longest command the gate accepts:
    microseconds per KiB, best of `rounds`, for a plain command and for shell source."""
    from bastion.core.command import read_command
    from bastion.core.defaults import MAX_COMMAND_BYTES

    words = "systemctl status 'nginx service' --no-pager -n 20 "
    plain = (words * (MAX_COMMAND_BYTES // len(words) + 1))[: MAX_COMMAND_BYTES - 1].rstrip()
    source = plain[: len(plain) // 2] + "; " + plain[len(plain) // 2 :][:-2]
    out = {}
    for name, command in (("plain", plain), ("shell_source", source)):
        best = min(_time_read(read_command, command) for _ in range(rounds))
        out[f"{name}_us_per_KiB"] = best * 1e6 / (len(command.encode()) / 1024)
    return out


def _time_read(read: Any, command: str) -> float:
    t0 = time.perf_counter()
    read(command)
    return time.perf_counter() - t0


def report(r: dict[str, Any]) -> str:
    labels = {
        "direct": "direct ssh (new TCP+SSH each)",
        "bastion": "ssh -F bastion.config web1",
        "helper": "agent helper floor (true, no ssh)",
        "proxy": "proxy.py startup (fails fast)",
        "cert_direct": "direct ssh (certificate loop)",
        "certificate": "ssh -F bastion.config cert1",
        "in_run": "the same, inside a sandboxed run",
    }
    lines = [f"witness: {r['witness'] or 'none'}"]
    lines.append(f"latency, n={r['n']}      {'median':>8} {'p90':>8} {'min':>8}  (ms)")
    for k, label in labels.items():
        s = r["latency"][k]
        lines.append(f"{label:34} {s['median_ms']:8.1f} {s['p90_ms']:8.1f} {s['min_ms']:8.1f}")
    lines.append(f"bastion/direct: median {r['ratio_median']:.2f}x, p90 {r['ratio_p90']:.2f}x")
    lines.append(
        f"certificate account/direct: median {r['certificate_ratio_median']:.2f}x, "
        f"p90 {r['certificate_ratio_p90']:.2f}x"
    )
    lines.append(
        f"inside a sandboxed run/outside: median {r['in_run_ratio_median']:.2f}x, "
        f"p90 {r['in_run_ratio_p90']:.2f}x"
    )
    rs = r["run_start"]
    lines.append(
        f"bastion run -- /bin/true, median ms: true alone {rs['true']['median_ms']:.1f}, "
        f"--no-sandbox {rs['run_no_sandbox']['median_ms']:.1f}, "
        f"sandboxed {rs['run_sandboxed']['median_ms']:.1f}; the sandbox adds "
        f"{rs['sandbox_adds_ms']:.1f} ms, the whole run {rs['run_adds_ms']:.1f} ms; of it "
        f"the home overlay {rs['overlay_adds_ms']:.1f} ms, the run's own network "
        f"{rs['network_adds_ms']:.1f} ms"
    )
    t, net = r["throughput_MBps"], r["throughput_net_MBps"]
    lines.append(
        f"cat {r['blob_mib']} MiB in+out, MB/s (median of {THROUGHPUT_RUNS}): "
        f"direct {t['direct']:.0f}, bastion {t['bastion']:.0f}, ratio {r['throughput_ratio']:.2f}"
    )
    lines.append(
        f"  same, minus connection setup (median true): direct {net['direct']:.0f}, "
        f"bastion {net['bastion']:.0f}"
    )
    j = r["journal"]
    lines.append(
        f"journal per command: {j['records_per_command']:.1f} records, "
        f"{j['fsyncs_per_command']:.1f} fsyncs, {j['ms_per_command']:.2f} ms = "
        f"{j['share_of_latency']:.1%} of the median bastion latency"
    )
    f = r["failed_attempts"]
    lines.append(
        f"failed attempts (retried, not timed): direct {f['direct'] + f['cert_direct']}, "
        f"bastion {f['bastion']}, certificate {f['certificate']}, in a run {f['in_run']}"
    )
    lines += [f"  {m}" for m in r["failure_messages"]]
    rd = r["reader"]
    lines.append(
        f"command reader on a 64 KiB command: plain {rd['plain_us_per_KiB']:.0f} us/KiB, "
        f"shell source {rd['shell_source_us_per_KiB']:.0f} us/KiB"
    )
    if (sf := r.get("sftp")) is not None:
        lines.append(
            f"sftp {sf['mb']} MB (median of {sf['runs']}), MB/s: up direct "
            f"{sf['direct_up_mb_s']:.0f}, bastion {sf['bastion_up_mb_s']:.0f} "
            f"({sf['ratio_up']:.2f}x); down direct {sf['direct_down_mb_s']:.0f}, bastion "
            f"{sf['bastion_down_mb_s']:.0f} ({sf['ratio_down']:.2f}x)"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=30, help="latency samples per path (>= 2)")
    ap.add_argument("--blob-mb", type=int, default=BLOB_SIZE >> 20, help="cat's input, MiB")
    ap.add_argument(
        "--target-rc",
        action="store_true",
        help="let the target's shell read the user's real ~/.bashrc (default: an empty HOME)",
    )
    ap.add_argument(
        "--witness",
        action="store_true",
        help="give the gateway a file witness: each intent waits for its head's fsync",
    )
    ap.add_argument(
        "--sftp-mb",
        type=int,
        default=32,
        help="the sftp row: stock sftp puts and gets this many MB, direct and through bastion "
        "(bench/sftp_bench.py, 3 runs); 0 leaves it out",
    )
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()
    # Not in /tmp: a sandboxed run has a /tmp of its own, and its agent reads the config here.
    with tempfile.TemporaryDirectory(prefix="bastion-bench-", dir="/var/tmp") as tmp:
        result = bench(
            Path(tmp), max(args.n, 2), args.blob_mb << 20, not args.target_rc, args.witness
        )
        if args.sftp_mb > 0:
            (Path(tmp) / "sftp").mkdir()
            result["sftp"] = sftp_bench(Path(tmp) / "sftp", args.sftp_mb, 3)
    print(json.dumps(result, indent=2) if args.json else report(result))


if __name__ == "__main__":
    main()
