"""Where the gateway's time goes, by stage, from a py-spy raw profile.

    python bench/load.py --profile gw.txt      # records the last bastion round
    python bench/profile_stages.py gw.txt [--per-command-ms MS]

Each sample is charged to the first stage whose marker appears in its stack
(innermost first), so stages do not double count; "other" is the event loop's
own work and everything unmarked. With --per-command-ms (the gateway's CPU per
command, e.g. from /proc/PID/stat over a run) the shares become milliseconds.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

# (stage, markers): the first stage with a marker in a sample's stack gets the sample.
STAGES = [
    ("journal", ("Journal.append", "Journal.sync", "Recorder.", "_write_head")),
    ("identity walk", ("Resolver.", "identify", "rides_a_master", "serves_control_socket")),
    ("outbound channel open", ("create_session", "SSHClientChannel.create", "Pool.")),
    ("relay", ("_relay", "to_agent", "to_target")),
    ("gate", ("evaluate", "authorize", "final_check", "Service.world")),
    ("local SSH handshake", ("kex", "Kex", "_process_kexinit", "_auth", "userauth", "run_server")),
    ("agent SSH session", ("_AgentSSH", "SSHServerChannel", "_ExactCommandChannel")),
    ("packets (both legs)", ("SSHConnection._send", "_recv_data", "send_packet", "data_received")),
]


def stages(profile: Path) -> dict[str, float]:
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in profile.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        samples = int(n)
        total += samples
        frames = stack.split(";")[::-1]  # innermost first
        for stage, markers in STAGES:
            if any(m in f for f in frames for m in markers):
                counts[stage] += samples
                break
        else:
            counts["other"] += samples
    return {k: v / total for k, v in counts.most_common()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("profile", type=Path)
    ap.add_argument("--per-command-ms", type=float)
    args = ap.parse_args()
    for stage, share in stages(args.profile).items():
        ms = f"  {share * args.per_command_ms:5.1f} ms" if args.per_command_ms else ""
        print(f"{share:6.1%}{ms}  {stage}")


if __name__ == "__main__":
    main()
