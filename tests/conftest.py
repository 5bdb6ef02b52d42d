"""Fixtures for every tier, and the tier markers.

A test's tier is its folder: `tests/unit` (pure parts and fakes, no sshd,
seconds), `tests/integration` (the real ssh client, a real sshd, real
gateways), `tests/container` (the same against sshd in a podman container),
`tests/clients` (third-party clients -- paramiko, fabric, rsync, git -- through
real gateways), `tests/browser` (the console in a real headless Chromium, with its
virtual authenticator, over real gateways).
Each test gets the marker of its folder, so `pytest -m unit` runs one tier.
Shared helpers live in `tests/harness.py`; tests never import each other.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.devtools.sshd_fixture import Sshd, SshdInfo, sshd_available
from tests.harness import Bastion, make_bastion, release_copies

TIERS = ("unit", "integration", "container", "clients", "browser")

# The vault's key derivation costs about 0.8 s and 512 MiB in production; the tests
# create hundreds of vaults. Every subprocess (bastion init, unlock, the daemon)
# inherits this: vault/store.py's cheap profile, documented as for tests only.
os.environ["BASTION_KDF_PROFILE"] = "test"
# Every ssh a test starts runs its ProxyCommand with $SHELL, and bash given a socket on
# stdin with SHLVL 0 reads ~/.bashrc first. A machine whose rc starts pyenv then pays
# ~150 ms a command -- and a pyenv lock left behind by any killed shell stalls each one
# for 60 s, which is how a CI run on such a machine timed out (docs/files-and-clients.md,
# "Slow commands").
os.environ["SHELL"] = "/bin/sh"
# `bastion run` gives every run a private /tmp, so what a test hands an agent inside a run
# (its ssh config, scripts, markers) must not live there: every test's files go under
# /var/tmp instead (pytest's tmp_path follows tempfile's directory).
TEST_TMP = Path("/var/tmp/bt")  # short: unix socket paths in it must fit 107 bytes
TEST_TMP.mkdir(mode=0o1777, exist_ok=True)
os.environ["TMPDIR"] = str(TEST_TMP)
tempfile.tempdir = str(TEST_TMP)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A test's bastions made under its tmp_path end with it, closed or not; a module's
    (its module-scoped fixtures' homes) end with the module's last test."""
    try:
        return (yield)
    finally:
        tmp = getattr(item, "funcargs", {}).get("tmp_path")
        if nextitem is None or nextitem.path != item.path:
            release_copies(Path("/"))
        elif tmp is not None:
            release_copies(tmp)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for tier in TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def client_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The deploy key every test bastion imports (its private half is known
    to the tests so they can look for leaks)."""
    d = tmp_path_factory.mktemp("client-key")
    path = d / "id_ed25519"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "deploy", "-f", str(path)],
        check=True,
        timeout=30,
    )
    return path, path.with_suffix(".pub").read_text().strip()


@pytest.fixture(scope="session")
def sshd_server(
    tmp_path_factory: pytest.TempPathFactory, client_key: tuple[Path, str]
) -> Iterator[Sshd]:
    reason = sshd_available()
    if reason:
        pytest.skip(reason)
    with Sshd(tmp_path_factory.mktemp("sshd"), authorized_keys=[client_key[1]]) as server:
        yield server


@pytest.fixture
def sshd(sshd_server: Sshd) -> SshdInfo:
    assert sshd_server.info is not None
    return sshd_server.info


@pytest.fixture
def bastion(tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]) -> Iterator[Bastion]:
    b = make_bastion(tmp_path, sshd, client_key[0])
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def target(tmp_path: Path, client_key: tuple[Path, str]) -> Iterator[Sshd]:
    """A target sshd of this test's own, which it may kill, freeze or cut off."""
    with Sshd(tmp_path / "target-sshd", authorized_keys=[client_key[1]]) as server:
        yield server


@pytest.fixture(scope="module")
def ca_sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """A target that trusts a CA (each test sets it: `trust_user_cas`) and no plain key
    at all, one per test module."""
    reason = sshd_available()
    if reason:
        pytest.skip(reason)
    with Sshd(tmp_path_factory.mktemp("ca-sshd")) as server:
        yield server
