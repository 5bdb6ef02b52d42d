"""Browser tier: the console in Debian's headless Chromium (Selenium, and the DevTools
protocol's virtual authenticator), over a real gateway and sshd. Skipped where Chromium
is missing, except in CI (`CI=true`), where a missing browser is a failure: .ci/run
installs it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.devtools.sshd_fixture import SshdInfo
from tests.browser_helper import Browser, browser_missing, enable_console
from tests.harness import Bastion, make_bastion, policy_toml


@pytest.fixture(scope="session")
def chromium() -> None:
    missing = browser_missing()
    if missing and os.environ.get("CI") == "true":
        pytest.fail(f"browser tier: {missing}")
    if missing:
        pytest.skip(f"browser tier: {missing}")


@pytest.fixture
def web(chromium: None) -> Iterator[Browser]:
    b = Browser()
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def presence_bastion(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> Iterator[tuple[Bastion, str]]:
    """A gateway whose one account asks presence, its console on; and the console's
    origin. A short card timeout: a card nobody approves ends the test quickly."""
    policy = policy_toml(sshd, approval="per-command", presence="required")
    b = make_bastion(tmp_path, sshd, client_key[0], policy=policy, start=False)
    origin = enable_console(b)
    b.daemon_args = ("--approval-timeout", "60")
    b.start_daemon()
    b.unlock()
    try:
        yield b, origin
    finally:
        b.close()
