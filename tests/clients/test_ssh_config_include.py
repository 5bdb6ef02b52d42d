"""`bastion ssh-config --policy-hosts` (or `--match`) fits an `Include` in ~/.ssh/config.

The default config sends every destination through bastion (`Host *`), which cannot
sit beside the user's own hosts; with --policy-hosts only the policy's aliases go
through bastion, and every other host resolves as the user's config says. On the base
tree there was no such option: every host of the including config went to bastion.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.harness import Agent, Bastion


def resolved(config: Path, host: str) -> dict[str, str]:
    """`ssh -G`: what OpenSSH would use for `host` (first word -> the rest)."""
    out = subprocess.run(
        ["ssh", "-G", "-F", str(config), host], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return dict(line.partition(" ")[::2] for line in out.stdout.splitlines())


def user_config(tmp_path: Path, included: Path) -> Path:
    """A user's ssh config: bastion's file included, then hosts of the user's own."""
    config = tmp_path / "user_ssh_config"
    config.write_text(
        f"Include {included}\n\nHost otherhost\n    HostName 192.0.2.7\n    User me\n"
        "\nHost *\n    ServerAliveInterval 5\n"
    )
    return config


def test_an_included_policy_hosts_config_captures_only_the_policy_hosts(
    bastion: Bastion, tmp_path: Path
) -> None:
    included = tmp_path / ".config" / "bastion" / "ssh_config"
    included.parent.mkdir(parents=True)
    known = tmp_path / "known_hosts"
    text = bastion.cli("ssh-config", "--policy-hosts", "--known-hosts", str(known)).stdout
    assert "Host *" not in text
    included.write_text(text)
    config = user_config(tmp_path, included)

    web1 = resolved(config, "web1")
    assert "proxy.py" in web1.get("proxycommand", ""), web1
    assert (web1["hostkeyalias"], web1["controlmaster"]) == ("bastion-gateway", "false")
    assert web1["userknownhostsfile"] == str(known)
    other = resolved(config, "otherhost")
    assert "proxycommand" not in other and "hostkeyalias" not in other, other
    assert (other["hostname"], other["user"], other["serveraliveinterval"]) == (
        "192.0.2.7",
        "me",
        "5",
    )
    # The known_hosts file names the gateway's key under each alias and the HostKeyAlias.
    names, kind, key = known.read_text().split()
    assert names == "web1,bastion-gateway"
    assert [kind, key] == bastion.home.known_hosts.read_text().split()[1:3]

    # And a command runs through it, the host key checked against that file.
    agent = Agent(config)
    bastion.agents.append(agent)
    rid = agent.start("echo through-include")
    bastion.approve_next()
    r = agent.wait(rid)
    assert (r.rc, r.stdout) == (0, b"through-include\n"), r.stderr


def test_match_selects_what_goes_through_bastion(bastion: Bastion, tmp_path: Path) -> None:
    included = tmp_path / "bastion_ssh_config"
    included.write_text(bastion.cli("ssh-config", "--match", "host web1,*.bastion").stdout)
    config = user_config(tmp_path, included)
    assert "proxy.py" in resolved(config, "db.bastion").get("proxycommand", "")
    assert "proxy.py" in resolved(config, "web1").get("proxycommand", "")
    assert "proxycommand" not in resolved(config, "otherhost")


def test_the_flags_refuse_what_they_cannot_mean(bastion: Bastion) -> None:
    both = bastion.cli("ssh-config", "--policy-hosts", "--match", "all", check=False)
    assert both.returncode != 0 and "not both" in both.stderr
    lines = bastion.cli("ssh-config", "--match", "host a\nHost *", check=False)
    assert lines.returncode != 0 and "one line" in lines.stderr
