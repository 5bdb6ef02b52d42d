"""File transfer: 100 MB up and down with the stock `sftp`, direct to sshd vs. through bastion.

Run from the repo root: python bench/sftp_bench.py [--mb 100] [--runs 3] [--json].
See bench/README.md ("sftp").
"""

from __future__ import annotations

import argparse
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
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from load import bench_sshd  # noqa: E402  (bench/load.py, beside this file)

from bastion.ops.opsock import OperatorError  # noqa: E402
from tests.harness import Bastion, make_bastion, policy_toml  # noqa: E402


def _approve_all(bastion: Bastion, stop: threading.Event) -> None:
    """Each `sftp` is a new process, so each asks a session card: answered at once."""
    while not stop.is_set():
        try:
            for card in bastion.op("pending", wait=0.5) or []:
                bastion.answer(card, True)
        except OperatorError:
            return  # the gateway is stopping


def _cpu(pid: int | None) -> float:
    """CPU seconds (user + system) the gateway has used so far; 0 for a direct run."""
    if pid is None:
        return 0.0
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _transfer(
    argv: list[str], batch: Path, gateway: int | None = None
) -> tuple[float, float, float, float]:
    """(seconds up, seconds down, gateway CPU seconds up, down) of one `sftp -b` session:
    put, then get, each timed by the wall clock around a batch of its own (so the session
    setup is in both). The CPU seconds hold under load, where the wall time does not."""
    times, cpu = [], []
    for line in batch.read_text().splitlines():
        one = batch.with_suffix(".one")
        one.write_text(line + "\n")
        t0, c0 = time.perf_counter(), _cpu(gateway)
        cmd = [*argv[:-1], "-b", str(one), argv[-1]]
        r = subprocess.run(cmd, capture_output=True, timeout=600)
        times.append(time.perf_counter() - t0)
        cpu.append(_cpu(gateway) - c0)
        if r.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {r.stderr.decode(errors='replace')[-500:]}")
    return times[0], times[1], cpu[0], cpu[1]


def _spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy (`pip install py-spy`) on the gateway, in its raw format (flamegraph.pl's)."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    argv = [
        found,
        "record",
        *(["--native"] if os.environ.get("SPY_NATIVE") else ["--nonblocking"]),
        "--format",
        "raw",
        "--rate",
        "200",
    ]
    return subprocess.Popen(
        [*argv, "-o", str(out), "--pid", str(pid)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def bench(root: Path, mb: int, runs: int, profile: Path | None = None) -> dict[str, Any]:
    key = root / "id_ed25519"
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "bench", "-f", str(key)]
    subprocess.run(keygen, check=True, timeout=30)
    sshd = bench_sshd(root, key.with_suffix(".pub").read_text().strip(), True)
    bastion: Bastion | None = None
    stop = threading.Event()
    try:
        info = sshd.start()
        known = root / "known_hosts"
        known.write_text(info.known_hosts_line() + "\n")
        direct = ["sftp", "-F", "/dev/null", "-i", str(key), "-o", "IdentitiesOnly=yes"]
        direct += ["-o", f"UserKnownHostsFile={known}", "-o", "StrictHostKeyChecking=yes"]
        direct += ["-o", "BatchMode=yes", "-P", str(info.port), f"{info.user}@{info.address}"]
        # A session account without `allow` rules: every path (core/files defaults).
        bastion = make_bastion(root / "bastion", info, key, policy_toml(info))
        through = ["sftp", "-F", str(bastion.config), "web1"]
        approver = threading.Thread(target=_approve_all, args=(bastion, stop), daemon=True)
        approver.start()
        blob = root / "blob"
        blob.write_bytes(os.urandom(mb * 1_000_000))
        want = hashlib.sha256(blob.read_bytes()).hexdigest()
        remote = root / "remote"
        remote.mkdir()
        got = root / "got"
        rows: dict[str, dict[str, list[float]]] = {
            "direct": {"up": [], "down": []},
            "bastion": {"up": [], "down": []},
        }
        cpu: dict[str, list[float]] = {"up": [], "down": []}
        for i in range(runs):
            for name, argv in (("direct", direct), ("bastion", through)):
                batch = root / f"{name}.batch"
                batch.write_text(f"put {blob} {remote}/{name}\nget {remote}/{name} {got}\n")
                spy = None
                if profile is not None and name == "bastion" and i == runs - 1:
                    spy = _spy(bastion.gateway_pid, profile)
                    time.sleep(1)  # py-spy attaches
                gateway = bastion.gateway_pid if name == "bastion" else None
                up, down, cpu_up, cpu_down = _transfer(argv, batch, gateway)
                if spy is not None:
                    spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                    spy.wait(60)
                for path in (remote / name, got):
                    if hashlib.sha256(path.read_bytes()).hexdigest() != want:
                        raise RuntimeError(f"{name}: {path} is not the bytes sent")
                got.unlink()
                (remote / name).unlink()
                rows[name]["up"].append(up)
                rows[name]["down"].append(down)
                if gateway is not None:
                    cpu["up"].append(cpu_up)
                    cpu["down"].append(cpu_down)
        out: dict[str, Any] = {"mb": mb, "runs": runs}
        for name, row in rows.items():
            for way, xs in row.items():
                out[f"{name}_{way}_mb_s"] = mb / statistics.median(xs)
        for way in ("up", "down"):
            out[f"ratio_{way}"] = out[f"bastion_{way}_mb_s"] / out[f"direct_{way}_mb_s"]
            out[f"gateway_cpu_{way}_s_per_100mb"] = statistics.median(cpu[way]) * 100 / mb
        return out
    finally:
        stop.set()
        if bastion is not None:
            bastion.close()
        sshd.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", type=Path, help="py-spy raw profile of the last bastion run")
    args = parser.parse_args()
    base = Path(os.environ.get("TMPDIR", "/var/tmp"))
    with tempfile.TemporaryDirectory(prefix="bastion-sftp-bench-", dir=base) as tmp:
        r = bench(Path(tmp), args.mb, args.runs, args.profile)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    print(f"sftp {r['mb']} MB, median of {r['runs']} runs (session setup included):")
    for way in ("up", "down"):
        print(
            f"  {way:<4}  direct {r[f'direct_{way}_mb_s']:6.1f} MB/s   "
            f"bastion {r[f'bastion_{way}_mb_s']:6.1f} MB/s   ratio {r[f'ratio_{way}']:.2f}x   "
            f"gateway CPU {r[f'gateway_cpu_{way}_s_per_100mb']:.2f} s/100 MB"
        )


if __name__ == "__main__":
    main()
