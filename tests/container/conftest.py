"""Container tier: bastion against the sshd of fixtures/sshd/Dockerfile, run by podman.

One container per session (the image is built first: about 40 s from nothing, about 1 s
from podman's cache); a fresh bastion per test, as in the loopback-sshd tests. Skipped
only where the tools are missing; a failing build or start is an error.

The integration harness (tests/harness.py) and the sshd fixture's SshdInfo are imported
here, and Bastion once more in test_container_exec.py: nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.devtools.sshd_fixture import SshdInfo
from fixtures.sshd.podman import Container, Podman, unavailable
from tests.harness import Bastion, make_bastion, policy_toml


@pytest.fixture(scope="session")
def podman() -> Podman:
    reason = unavailable()
    if reason:
        pytest.skip(f"container tier: {reason}")
    return Podman()


@pytest.fixture(scope="session")
def container_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("container-sshd")


@pytest.fixture(scope="session")
def container(
    podman: Podman, container_run_dir: Path, client_key: tuple[Path, str]
) -> Iterator[Container]:
    """The fixture image's sshd on a free loopback port, trusting the tests' deploy key."""
    authorized_keys = container_run_dir / "authorized_keys"
    authorized_keys.write_text(client_key[1] + "\n")
    authorized_keys.chmod(0o600)
    podman.build()
    # The container's log file stays in the run dir after the container is gone.
    with podman.start(authorized_keys, log_dir=container_run_dir) as running:
        yield running


@pytest.fixture(scope="session")
def container_sshd(container: Container, container_run_dir: Path) -> SshdInfo:
    assert container.log_path is not None
    return SshdInfo(
        address=container.address,
        port=container.port,
        host_key=container.host_key,
        user="root",
        run_dir=container_run_dir,
        log_path=container.log_path,
        authorized_keys=container_run_dir / "authorized_keys",
    )


@pytest.fixture
def bastion(
    tmp_path: Path, container_sshd: SshdInfo, client_key: tuple[Path, str]
) -> Iterator[Bastion]:
    """A bastion whose policy sends web1 to the container, as root (its only account)."""
    policy = policy_toml(container_sshd, user="root")
    b = make_bastion(tmp_path, container_sshd, client_key[0], policy=policy)
    try:
        yield b
    finally:
        b.close()
