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
from tests.browser_helper import Browser, browser_missing, console_gateway, enroll, log_in
from tests.harness import Bastion


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
    """A gateway whose one account asks presence, its console on; and its origin."""
    b, origin = console_gateway(tmp_path, sshd, client_key[0])
    try:
        yield b, origin
    finally:
        b.close()


@pytest.fixture
def console(
    presence_bastion: tuple[Bastion, str], web: Browser
) -> Iterator[tuple[Bastion, str, Browser]]:
    """The presence gateway with one signer (alice's) enrolled and logged in."""
    b, origin = presence_bastion
    web.authenticator()
    got = enroll(b, web, "alice", origin)
    assert "enrolled 'alice'" in got["out"], got
    log_in(web, origin)
    yield b, origin, web
