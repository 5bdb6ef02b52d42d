"""The console in a real browser (issue 34, acceptance 4): how long a card takes from
being raised to its command running when the operator approves it in the page, and what
open console tabs cost the gateway's commands/s.

Run from the repo root (see bench/README.md):

    python bench/console.py                       # 20 cards; 64 agents x 10 x 2 rounds each way
    python bench/console.py --cards 10 --agents 16 --commands 5 --rounds 2
    python bench/console.py --no-tabs             # the cards only
    python bench/console.py --json

Cards: a gateway whose one account asks a command card for every command, with presence
(`approval = "per-command"`, `presence = "required"`); one enrolled credential in Debian's
headless Chromium's virtual authenticator, logged in to the console; one agent. After a
first command (its session card and its command card, approved in the page, not counted),
each of `--cards` commands (`true`) raises a command card; the bench waits until the page
shows it and clicks its Approve button (the page asks for a challenge, the authenticator
signs at once, the page posts the signature). Timed from the card's `created_at` (the
gateway's clock): the card in the page's DOM, the click, the page's answer to the signature,
and the agent's result (the command ran, `true` and ssh's exit included).

Tabs: the rig of `bench/load.py` (`--agents` processes with approved sessions, `true`
back to back through bastion), with the console on and a credential enrolled. Rounds
alternate with no console page open and with `--tabs` tabs, each logged in, on the Cards
view, its event stream open (`/api/events`). Chromium opens at most 6 connections to one
host and each stream holds one, so the tabs are spread over browsers of
`--tabs-per-browser` tabs (the credential copied into each virtual authenticator). Between
rounds the tabs go to about:blank (the browsers keep running) or back to the console.

No number is asserted: this is a report, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402
from load import TMP, Rig, bench_sshd, one_round, pct  # noqa: E402  (bench/load.py)
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from tests.browser_helper import (  # noqa: E402
    WAIT,
    Browser,
    browser_missing,
    enable_console,
    enroll,
    free_port,
    log_in,
)
from tests.harness import Agent, Bastion, make_bastion, policy_toml  # noqa: E402

COMMAND = "true"
# What is timed of each card, from its created_at: the page's clock for the first and
# the middle three, the bench's for the click's call and the agent's result.
STAGES = {
    "shown": "card in the page's DOM",
    "clicked": "the bench sent the click",
    "click": "the click reached the page",
    "challenge": "the page asked for a challenge",
    "signed": "the signature's answer in the page",
    "ran": "the command ran",
}
MAX_PER_BROWSER = 5  # Chromium's 6 connections per host, one left for the page's fetches

# Installed once in a logged-in page: when each card first entered the DOM (epoch ms).
SEEN_JS = """
window.__benchSeen = {};
window.__benchClick = {};
document.addEventListener("click", (e) => {
  const card = e.target.closest && e.target.closest("[data-card]");
  if (card) window.__benchClick[card.dataset.card] = performance.timeOrigin + e.timeStamp;
}, true);
performance.setResourceTimingBufferSize(100000);
const note = () => {
  for (const el of document.querySelectorAll("[data-card]")) {
    if (!(el.dataset.card in window.__benchSeen)) {
      window.__benchSeen[el.dataset.card] = performance.timeOrigin + performance.now();
    }
  }
};
new MutationObserver(note).observe(document.body, {childList: true, subtree: true});
note();
"""
# Async: once the card's Approve button is displayed, scrolled into view, when the card
# was seen and where the button's middle is.
BUTTON_JS = """
const [id, done] = arguments;
const sel = `[data-card="${CSS.escape(id)}"] .approve`;
const ready = () => {
  const b = document.querySelector(sel);
  if (!b || b.offsetParent === null) return false;
  b.scrollIntoView({block: "center"});
  const r = b.getBoundingClientRect();
  const seen = window.__benchSeen[id] || performance.timeOrigin + performance.now();
  done([seen, r.left + r.width / 2, r.top + r.height / 2]);
  return true;
};
if (!ready()) {
  const obs = new MutationObserver(() => { if (ready()) obs.disconnect(); });
  obs.observe(document.body, {childList: true, subtree: true, attributes: true});
}
"""
# When the click on a card reached the page, the page's challenge request for it left and
# its signature's answer came back.
TIMING_JS = """
const tail = `/api/cards/${encodeURIComponent(arguments[0])}/`;
const entries = performance.getEntriesByType("resource");
const entry = (n) => entries.find((r) => r.name.endsWith(tail + n));
const c = entry("challenge"), s = entry("sign");
return {
  click: window.__benchClick[arguments[0]] || null,
  challenge: c ? performance.timeOrigin + c.startTime : null,
  signed: s && s.responseEnd > 0 ? performance.timeOrigin + s.responseEnd : null,
};
"""
# A tab that is logged in, shows the Cards view and holds its event stream open
# (`state` is console.js's own, a global of the page).
READY_JS = """
const app = document.querySelector("#app"), cards = document.querySelector("#tab-cards");
return !!(app && !app.hidden && cards && !cards.hidden && typeof state === "object"
          && state.stream && state.stream.readyState === 1 && state.snapshot);
"""
# Count the snapshots the tab's stream brings from now on.
COUNT_JS = """
window.__benchSnaps = 0;
window.__benchStream = state.stream;
state.stream.addEventListener("snapshot", () => { window.__benchSnaps += 1; });
"""
# A console tab's state: ready, and the snapshots its stream brought (null for a blank
# tab; `same`: the stream is the one counted, not one reopened since).
STATE_JS = (
    """
if (location.protocol === "about:") return null;
const ready = (() => {"""
    + READY_JS
    + """})();
return {ready, snapshots: window.__benchSnaps ?? null,
        same: typeof state === "object" && state.stream === window.__benchStream};
"""
)


def keygen(root: Path) -> tuple[Path, str]:
    key = root / "id_ed25519"
    argv = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "console", "-f", str(key)]
    subprocess.run(argv, check=True, timeout=30)
    return key, key.with_suffix(".pub").read_text().strip()


def summary(xs: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(xs), "p95_ms": pct(xs, 95), "min_ms": min(xs)}


@contextlib.contextmanager
def entered(rig: Rig) -> Iterator[Rig]:
    """`with rig`, but closed also when its start fails half-way (its sshd running, its
    gateway maybe), which `Rig.__enter__` leaves to its caller."""
    try:
        yield rig.__enter__()
    finally:
        rig.__exit__(None, None, None)


@contextlib.contextmanager
def browsers() -> Iterator[list[Browser]]:
    """Browsers made into the list are all closed at the end, whatever happens."""
    made: list[Browser] = []
    try:
        yield made
    finally:
        for web in made:
            web.close()


# -- cards ---------------------------------------------------------------------------------


@contextlib.contextmanager
def presence_rig(root: Path) -> Iterator[tuple[Bastion, str]]:
    """sshd, and a gateway whose one account asks presence for every command, its
    console on; and the console's origin."""
    root.mkdir(parents=True)
    key, pub = keygen(root)
    sshd = bench_sshd(root, pub, clean_home=True)
    info = sshd.start()
    try:
        policy = policy_toml(info, approval="per-command", presence="required")
        b = make_bastion(root / "bastion", info, key, policy=policy, start=False)
        try:
            origin = enable_console(b)
            b.daemon_args = ("--approval-timeout", "60")
            b.start_daemon()
            b.unlock()
            yield b, origin
        finally:
            b.close()
    finally:
        sshd.stop()


def wait_card(
    b: Bastion, kind: str, seen: set[str], web: Browser, timeout: float = WAIT
) -> dict[str, Any]:
    """The first pending card of `kind` not in `seen` (a card just answered may still be
    listed for a moment); if none comes, what the page says is in the error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fresh = [c for c in b.op("pending", wait=1) if c["kind"] == kind and c["id"] not in seen]
        if fresh:
            seen.add(fresh[0]["id"])
            return fresh[0]
        time.sleep(0.005)
    page = " ".join(web.text().split())[:1500]
    raise RuntimeError(f"no new {kind} card within {timeout:.0f} s; the page says: {page}")


def click_approve(web: Browser, card_id: str) -> dict[str, float]:
    """Wait until the page shows the card, click its Approve button: the epoch times
    (s) the card entered the DOM and the click was sent. The click is the mouse's, as
    the DevTools protocol sends it (a trusted event, as a person's): WebDriver's own click
    spent about 70 ms on this machine finding the element before it clicked."""
    shown_ms, x, y = web.script(BUTTON_JS, card_id)
    clicked = time.time()
    for kind in ("mousePressed", "mouseReleased"):
        web.cdp("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
    return {"shown": shown_ms / 1e3, "clicked": clicked}


def page_timing(web: Browser, card_id: str) -> dict[str, float | None]:
    """The page's challenge request and its signature's answer (epoch s), once there."""
    got: dict[str, Any] = {}

    def signed(_: object) -> bool:
        got.update(web.driver.execute_script(TIMING_JS, card_id))
        return got["signed"] is not None

    with contextlib.suppress(Exception):
        WebDriverWait(web.driver, 5, poll_frequency=0.01).until(signed)
    return {k: None if v is None else v / 1e3 for k, v in got.items()}


def cards(root: Path, n: int) -> dict[str, Any]:
    with presence_rig(root) as (b, origin), browsers() as made:
        web = Browser()
        made.append(web)
        web.authenticator()
        enroll(b, web, "bench", origin)
        log_in(web, origin)
        web.driver.execute_script(SEEN_JS)
        agent = b.agent()
        seen: set[str] = set()
        # The first command: its session card, then its own command card. Not counted.
        rid = agent.start(COMMAND)
        for kind in ("session", "command"):
            click_approve(web, wait_card(b, kind, seen, web)["id"])
        first = agent.wait(rid, timeout=60)
        if first.rc != 0:
            raise RuntimeError(f"the first command failed: {first.stderr.strip()}")
        samples: list[dict[str, Any]] = []
        failed: list[str] = []
        for _ in range(n):
            rid = agent.start(COMMAND)
            card = wait_card(b, "command", seen, web)
            times = click_approve(web, card["id"])
            r = agent.wait(rid, timeout=60)
            times["ran"] = time.time()
            if r.rc != 0:
                failed.append(r.stderr.strip()[-200:] or f"rc {r.rc}")
                continue
            times |= page_timing(web, card["id"])
            raised = float(card["created_at"])
            samples.append(
                {k: None if v is None else (v - raised) * 1e3 for k, v in times.items()}
                | {"card": card["id"]}
            )
        agent.close()
    out: dict[str, Any] = {"cards": n, "counted": len(samples), "failed": failed}
    for stage in STAGES:
        xs = [s[stage] for s in samples if s.get(stage) is not None]
        out[stage] = summary(xs) if xs else None
    out["samples"] = samples
    return out


def cards_report(r: dict[str, Any]) -> str:
    lines = [
        f"cards: {r['counted']} of {r['cards']} command cards (presence required, one agent, "
        "approved in the console with Chromium's virtual authenticator), ms from the card's "
        "created_at:"
    ]
    for key, label in STAGES.items():
        s = r[key]
        if s is None:
            lines.append(f"  {label:38} -")
            continue
        lines.append(
            f"  {label:38} median {s['median_ms']:7.1f}  p95 {s['p95_ms']:7.1f}  "
            f"min {s['min_ms']:7.1f}"
        )
    lines.append(
        f"  (the command ran: the agent's result, so `{COMMAND}` on the target and ssh's exit "
        "are in it)"
    )
    if r["failed"]:
        lines.append(f"  failed: {len(r['failed'])}: " + "; ".join(r["failed"][:3]))
    return "\n".join(lines)


# -- tabs ----------------------------------------------------------------------------------


def tab_browsers(
    b: Bastion, origin: str, tabs: int, per_browser: int, made: list[Browser]
) -> list[Browser]:
    """Browsers enough for `tabs` tabs, each logged in once (a session cookie, then shared
    by its tabs): the first with the enrolled credential, the others with a copy of it
    whose signature count starts higher, so that the gateway's clone check (the count must
    grow) is met by each login in turn."""
    webs: list[Browser] = []
    cred: dict[str, Any] | None = None
    for i in range(-(-tabs // per_browser)):
        web = Browser()
        made.append(web)
        webs.append(web)
        auth = web.authenticator()
        if cred is None:
            enroll(b, web, "bench", origin)
            (cred,) = web.credentials(auth)
        else:
            copy = cred | {"signCount": int(cred["signCount"]) + 1000 * i}
            web.cdp("WebAuthn.addCredential", authenticatorId=auth, credential=copy)
        log_in(web, origin)
        web.get("about:blank")
        for _ in range(per_browser - 1):
            web.driver.switch_to.new_window("tab")
    return webs


def show_tabs(webs: list[Browser], tabs: int, origin: str | None) -> None:
    """The first `tabs` tabs to the console, each then logged in (its browser's cookie)
    with its stream open; with no origin, every tab to about:blank."""
    opened: list[tuple[Browser, str]] = []
    for web in webs:
        d = web.driver
        for handle in d.window_handles:
            d.switch_to.window(handle)
            if origin is not None and len(opened) < tabs:
                d.get(f"{origin}/")
                opened.append((web, handle))
            else:
                d.get("about:blank")
    for web, handle in opened:
        web.driver.switch_to.window(handle)
        try:
            WebDriverWait(web.driver, WAIT, poll_frequency=0.05).until(
                lambda d: d.execute_script(READY_JS)
            )
        except Exception:
            raise RuntimeError(f"a console tab did not open: {web.text()[:500]}") from None
        web.driver.execute_script(COUNT_JS)


def tab_states(webs: list[Browser]) -> list[dict[str, Any]]:
    """Each console tab's state (STATE_JS); blank tabs left out."""
    out = []
    for web in webs:
        d = web.driver
        for handle in d.window_handles:
            d.switch_to.window(handle)
            got = d.execute_script(STATE_JS)
            if got is not None:
                out.append(got)
    return out


def console_conns(pid: int, port: int) -> int:
    """The gateway's established TCP connections on the console's port."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sum(1 for c in conns if c.laddr and c.laddr[1] == port and c.status == "ESTABLISHED")


def cpu_of(pids: list[int]) -> dict[int, float]:
    """CPU seconds (user + system) of each process and its descendants, by pid."""
    out: dict[int, float] = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    out[p.pid] = t.user + t.system
    return out


def machine_busy() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat, all cores)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def cpu_spent(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


def tabs_load(
    root: Path, n_agents: int, commands: int, rounds: int, tabs: int, per_browser: int
) -> dict[str, Any]:
    port = free_port()
    origin = f"http://localhost:{port}"
    toml = f"[console]\nenabled = true\nport = {port}\n"
    with entered(Rig(root, bastion_toml=toml)) as rig, browsers() as made:
        b = rig.bastion
        assert b is not None
        webs = tab_browsers(b, origin, tabs, per_browser, made)
        agents: list[Agent] = rig.approved_agents(n_agents)
        gw = rig.gateway_pid
        drivers = [w.driver.service.process.pid for w in webs]
        one_round(agents, 1, None)  # warm: the pool, sshd's caches
        show_tabs(webs, tabs, origin)
        one_round(agents, 1, None)  # the tabs' first snapshots of every session
        show_tabs(webs, tabs, None)
        runs: dict[str, list[dict[str, Any]]] = {"none": [], "open": []}
        for _ in range(rounds):
            for kind in ("none", "open"):
                show_tabs(webs, tabs, origin if kind == "open" else None)
                time.sleep(0.5)  # the pages settle; a closed stream's handler ends
                conns = console_conns(gw, port)
                before = tab_states(webs)
                gw0, web0, busy0 = cpu_of([gw]), cpu_of(drivers), machine_busy()
                r = one_round(agents, commands, None)
                r["machine_cpu_s"] = machine_busy() - busy0
                r["gateway_cpu_s"] = cpu_spent(gw0, cpu_of([gw]))
                r["browsers_cpu_s"] = cpu_spent(web0, cpu_of(drivers))
                after = tab_states(webs)
                r["console_conns"] = conns
                # Every tab still holds the stream it had at the start, and what it brought.
                r["tabs_ready"] = sum(t["ready"] and t["same"] for t in after)
                r["snapshots"] = sum(t["snapshots"] for t in after) - sum(
                    t["snapshots"] for t in before
                )
                runs[kind].append(r)
        show_tabs(webs, tabs, None)
        for a in agents:
            a.close()
    out: dict[str, Any] = {
        "agents": n_agents,
        "commands": commands,
        "rounds": rounds,
        "n_tabs": tabs,
        "browsers": len(webs),
        "tabs_per_browser": per_browser,
    }
    for kind, rs in runs.items():
        lat = [x for r in rs for x in r["lat"]]
        count = sum(len(r["lat"]) for r in rs)
        wall = sum(r["wall"] for r in rs)
        out[kind] = {
            "commands_per_s": count / wall,
            "by_round": [len(r["lat"]) / r["wall"] for r in rs],
            "p50_ms": statistics.median(lat) * 1e3,
            "p95_ms": pct(lat, 95) * 1e3,
            "errors": sum(len(r["errors"]) for r in rs),
            "error_lines": sorted({e for r in rs for e in r["errors"]})[:5],
            "gateway_cpu_ms_per_command": sum(r["gateway_cpu_s"] for r in rs) / count * 1e3,
            "browsers_cpu_share": sum(r["browsers_cpu_s"] for r in rs) / wall,
            "machine_busy_cores": sum(r["machine_cpu_s"] for r in rs) / wall,
            "console_conns": [r["console_conns"] for r in rs],
        }
    out["open"] |= {
        "ready_at_end": [r["tabs_ready"] for r in runs["open"]],
        "snapshots_per_command": sum(r["snapshots"] for r in runs["open"])
        / sum(len(r["lat"]) for r in runs["open"]),
    }
    out["ratio_throughput"] = out["open"]["commands_per_s"] / out["none"]["commands_per_s"]
    out["ratio_p95"] = out["open"]["p95_ms"] / out["none"]["p95_ms"]
    return out


def tabs_report(r: dict[str, Any]) -> str:
    n = r["n_tabs"]
    lines = [
        f"tabs: {r['agents']} agents x {r['commands']} commands, {r['rounds']} round(s) each way, "
        f"alternating; {n} console tabs ({r['browsers']} browser(s) of up to "
        f"{r['tabs_per_browser']} tabs, each logged in, Cards view, its event stream open) "
        "against none:"
    ]
    for kind, label in (("none", "no console"), ("open", f"{n} tabs")):
        p = r[kind]
        lines.append(
            f"  {label:10} {p['commands_per_s']:6.2f} commands/s (rounds "
            + ", ".join(f"{x:.2f}" for x in p["by_round"])
            + f")  p50 {p['p50_ms']:6.0f} ms  p95 {p['p95_ms']:6.0f} ms  errors {p['errors']}"
            + (f" ({'; '.join(p['error_lines'])})" if p["error_lines"] else "")
        )
        lines.append(
            f"  {'':10} gateway CPU {p['gateway_cpu_ms_per_command']:.2f} ms/command, browsers "
            f"{p['browsers_cpu_share']:.2f} cores, the machine {p['machine_busy_cores']:.2f} of "
            f"{os.cpu_count()} cores busy"
        )
    t = r["open"]
    lines.append(
        f"  {n} tabs / none: throughput {r['ratio_throughput']:.3f}x "
        f"({r['ratio_throughput'] - 1:+.1%}), p95 {r['ratio_p95']:.2f}x"
    )
    lines.append(
        f"  console connections at the gateway at each round's start: none "
        f"{r['none']['console_conns']}, tabs {t['console_conns']}; tabs with their stream open "
        f"at each tab round's end {t['ready_at_end']}; snapshots the tabs received: "
        f"{t['snapshots_per_command']:.2f} per command ({t['snapshots_per_command'] / n:.2f} "
        "per tab)"
    )
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cards", type=int, default=20, help="command cards approved in the page")
    ap.add_argument("--agents", type=int, default=64, help="agent processes in the tab rounds")
    ap.add_argument("--commands", type=int, default=10, help="per agent per round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds each way (none, tabs, ...)")
    ap.add_argument("--tabs", type=int, default=8, help="console tabs open in a tab round")
    ap.add_argument(
        "--tabs-per-browser",
        type=int,
        default=4,
        help=f"tabs per Chromium (at most {MAX_PER_BROWSER}: one connection per stream, 6 a host)",
    )
    ap.add_argument("--no-cards", action="store_true", help="the tab rounds only")
    ap.add_argument("--no-tabs", action="store_true", help="the cards only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not 1 <= args.tabs_per_browser <= MAX_PER_BROWSER:
        ap.error(f"--tabs-per-browser must be 1 to {MAX_PER_BROWSER}")
    if args.tabs < 1 or args.cards < 1:
        ap.error("--tabs and --cards must be at least 1 (--no-tabs, --no-cards skip a part)")
    missing = browser_missing()
    if missing:
        raise SystemExit(f"bench/console.py needs Chromium: {missing}")
    # A TERM ends the bench as Ctrl-C does: the gateway, sshd and browsers are closed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bastion-console-", dir=TMP) as tmp:
        if not args.no_cards:
            out["cards"] = cards(Path(tmp) / "cards", args.cards)
        if not args.no_tabs:
            out["tabs"] = tabs_load(
                Path(tmp) / "tabs",
                args.agents,
                args.commands,
                args.rounds,
                args.tabs,
                args.tabs_per_browser,
            )
    out["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
    if args.json:
        print(json.dumps(out, indent=2))
        return
    parts = []
    if "cards" in out:
        parts.append(cards_report(out["cards"]))
    if "tabs" in out:
        parts.append(tabs_report(out["tabs"]))
    print("\n".join(parts) + f"\nload average at the end: {out['loadavg_end']}")


if __name__ == "__main__":
    main()
