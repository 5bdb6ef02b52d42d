"""`bastion ssh-config`'s text: which destinations it captures, and its known_hosts file."""

from __future__ import annotations

from pathlib import Path

from bastion.cli.agents import Scope, known_hosts_text, ssh_config_text

PINNED = ["bastion-gateway", "ssh-ed25519", "AAAAkey"]
ARGV = ("/usr/bin/python3", "-I", "-S", "/x/proxy.py", "--socket", "/s/agent.sock")
USERS: dict[str, str | None] = {"web1": "deploy", "db": None}


def blocks(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("Host ", "Match "))]


def test_by_default_every_destination_goes_through_bastion() -> None:
    text = ssh_config_text(USERS, PINNED, ARGV, "t")
    assert blocks(text) == ["Host web1", "Host *"]  # db has no single user: no User line
    assert "    UserKnownHostsFile /dev/null" in text


def test_policy_hosts_capture_only_the_policys_aliases() -> None:
    text = ssh_config_text(USERS, PINNED, ARGV, "t", Scope(hosts=True))
    assert blocks(text) == ["Host web1", "Host db web1"]
    assert "Host *" not in text
    assert blocks(ssh_config_text({}, PINNED, ARGV, "t", Scope(hosts=True))) == ["Host !*"]


def test_a_match_the_user_names_and_a_known_hosts_file() -> None:
    scope = Scope(match="host *.prod", known_hosts=Path("/k/known hosts"))
    text = ssh_config_text(USERS, PINNED, ARGV, "t", scope)
    assert blocks(text)[-1] == "Match host *.prod"
    assert '    UserKnownHostsFile "/k/known hosts"' in text
    assert "    KnownHostsCommand /bin/echo bastion-gateway ssh-ed25519 AAAAkey" in text


def test_the_known_hosts_file_names_every_alias_and_the_host_key_alias() -> None:
    assert (
        known_hosts_text(["web1", "db"], PINNED) == "db,web1,bastion-gateway ssh-ed25519 AAAAkey\n"
    )
