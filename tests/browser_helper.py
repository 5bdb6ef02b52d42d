"""The console in a real browser: Debian's headless Chromium driven by Selenium, with
Chromium's virtual authenticator (the DevTools protocol's `WebAuthn` domain) standing in
for a passkey or a security key. What the page does with it is what it does with a real
one: `navigator.credentials.create()` and `.get()`, with a person's presence simulated.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import (
    PASSPHRASE,
    Agent,
    Bastion,
    cli_argv,
    make_bastion,
    policy_toml,
    wait_for,
    write_bastion_toml,
)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).parent / "artifacts"
# Chromium as the machine's probe starts it: no sandbox (root), and none of the background
# connections a closed network refuses many at a time.
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)
WAIT = 30.0  # seconds any one thing on the page may take to appear
# An element the page re-drew while a wait looked at it: look again.
IGNORED = (StaleElementReferenceException,)


def browser_missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is not installed (Debian's chromium and chromium-driver; .ci/run)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def console_gateway(
    root: Path, sshd: SshdInfo, key_file: Path, **account: Any
) -> tuple[Bastion, str]:
    """A started, unlocked gateway with its console on, whose one per-command account
    asks presence (and has `account`'s other fields); and the console's origin. A card
    waits a minute: long enough for a browser on a loaded machine."""
    policy = policy_toml(sshd, approval="per-command", presence="required", **account)
    b = make_bastion(root, sshd, key_file, policy=policy, start=False)
    origin = enable_console(b)
    b.daemon_args = ("--approval-timeout", "60")
    b.start_daemon()
    b.unlock()
    return b, origin


def enable_console(b: Bastion, port: int | None = None) -> str:
    """bastion.toml with the console on a free port; its origin."""
    port = port or free_port()
    write_bastion_toml(b, f"[console]\nenabled = true\nport = {port}\n")
    return f"http://localhost:{port}"


@dataclass
class Browser:
    """One Chromium with a fresh profile; `authenticator` adds a virtual one."""

    width: int = 1280
    height: int = 800
    profile: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="chromium-")))
    driver: webdriver.Chrome = field(init=False)
    authenticators: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={self.profile}")
        options.add_argument(f"--window-size={self.width},{self.height}")
        self.driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        self.driver.set_script_timeout(WAIT)
        self.cdp("WebAuthn.enable", enableUI=False)

    def cdp(self, method: str, **params: Any) -> Any:
        return self.driver.execute_cdp_cmd(method, params)

    def authenticator(self, transport: str = "internal", user_verification: bool = True) -> str:
        """A virtual CTAP2 authenticator that answers with presence (and, if it has it,
        user verification) at once."""
        got = self.cdp(
            "WebAuthn.addVirtualAuthenticator",
            options={
                "protocol": "ctap2",
                "transport": transport,
                "hasResidentKey": True,
                "hasUserVerification": user_verification,
                "isUserVerified": user_verification,
                "automaticPresenceSimulation": True,
            },
        )
        self.authenticators.append(got["authenticatorId"])
        return str(got["authenticatorId"])

    def credentials(self, authenticator: str) -> list[dict[str, Any]]:
        got = self.cdp("WebAuthn.getCredentials", authenticatorId=authenticator)
        return list(got["credentials"])

    def get(self, url: str) -> None:
        self.driver.get(url)

    def find(self, css: str, timeout: float = WAIT) -> WebElement:
        """The first element matching `css` once it is displayed."""

        def shown(d: webdriver.Chrome) -> WebElement | bool:
            for el in d.find_elements(By.CSS_SELECTOR, css):
                if el.is_displayed():
                    return el
            return False

        try:
            return WebDriverWait(self.driver, timeout, ignored_exceptions=IGNORED).until(shown)
        except TimeoutException:
            page = self.text()[:2000]
            raise AssertionError(f"{css!r} never appeared; the page says: {page}") from None

    def gone(self, css: str, timeout: float = WAIT) -> None:
        WebDriverWait(self.driver, timeout, ignored_exceptions=IGNORED).until(
            lambda d: not any(e.is_displayed() for e in d.find_elements(By.CSS_SELECTOR, css))
        )

    def until(self, what: Callable[[], object], timeout: float = WAIT) -> Any:
        wait = WebDriverWait(self.driver, timeout, ignored_exceptions=IGNORED)
        return wait.until(lambda _: what())

    def text(self) -> str:
        return str(self.driver.find_element(By.TAG_NAME, "body").text)

    def script(self, source: str, *args: Any) -> Any:
        """Run async JavaScript; its last argument is the callback."""
        return self.driver.execute_async_script(source, *args)

    def cookie(self, name: str) -> str | None:
        got = self.driver.get_cookie(name)
        return None if got is None else str(got["value"])

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.driver.quit()
        shutil.rmtree(self.profile, ignore_errors=True)


@contextlib.contextmanager
def browser(width: int = 1280, height: int = 800) -> Iterator[Browser]:
    b = Browser(width, height)
    try:
        yield b
    finally:
        b.close()


class Enrolment:
    """`bastion operator enroll` running as the operator runs it: the passphrase given,
    its page's URL read, the code typed when `finish` is called."""

    def __init__(self, b: Bastion, name: str) -> None:
        argv = ["operator", "enroll", "--name", name, "--passphrase-stdin", "--no-open"]
        self.proc = subprocess.Popen(
            cli_argv(b.home.root, *argv, "--code-stdin"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(PASSPHRASE + "\n")
        self.proc.stdin.flush()
        self.proc.stdout.readline()  # "Open this page ..."
        self.url = self.proc.stdout.readline().strip()
        self.token = self.url.partition("#")[2]

    def finish(self, code: str) -> subprocess.CompletedProcess[str]:
        """Type `code` at the CLI; what it printed, and how it exited."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(code + "\n")
        self.proc.stdin.flush()
        out, err = self.proc.communicate(timeout=60)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def register(web: Browser, url: str) -> str:
    """The page at `url` registers the browser's authenticator; the code it shows."""
    web.get(url)
    web.find("#enroll-button").click()
    return str(web.find("#enroll-code").text.strip())


def enroll(b: Bastion, web: Browser, name: str, origin: str) -> dict[str, str]:
    """`bastion operator enroll` as the operator runs it, its page in `web`: the code the
    page shows typed back at the CLI. Returns what the CLI printed, and the code."""
    enrolment = Enrolment(b, name)
    try:
        assert enrolment.url.startswith(f"{origin}/enroll#"), enrolment.url
        code = register(web, enrolment.url)
        done = enrolment.finish(code)
    finally:
        enrolment.close()
    assert done.returncode == 0, done.stderr
    return {"out": done.stdout, "code": code, "url": enrolment.url}


def log_in(web: Browser, origin: str) -> None:
    web.get(f"{origin}/")
    web.find("#login-button").click()
    web.find("#app")


def card_element(web: Browser, card_id: str, timeout: float = WAIT) -> WebElement:
    return web.find(f'[data-card="{card_id}"]', timeout)


def next_card(b: Bastion, kind: str, timeout: float = WAIT) -> dict[str, Any]:
    """The first pending card of `kind` ("session" or "command"), once there is one."""
    found: list[dict[str, Any]] = []

    def there() -> bool:
        found[:] = [c for c in b.op("pending", wait=1) if c["kind"] == kind]
        return bool(found)

    wait_for(there, timeout)
    return found[0]


def approve(web: Browser, card_id: str) -> None:
    card_element(web, card_id).find_element("css selector", ".approve").click()


def first_command(b: Bastion, web: Browser, agent: Agent, command: str) -> int:
    """Start `command`; approve its session card in the console; return its request."""
    rid = agent.start(command)
    approve(web, next_card(b, "session")["id"])
    return rid


@dataclass
class Stolen:
    """What a process of the operator's uid can take from a logged-in browser: the
    cookie (its profile is readable) and the CSRF token (the state API gives it to the
    cookie). It speaks HTTP to the console as it likes: any header, any Origin."""

    origin: str
    cookie: str
    csrf: str = ""

    @classmethod
    def from_browser(cls, web: Browser, origin: str) -> Stolen:
        cookie = web.cookie("bastion_console")
        assert cookie, "the browser is not logged in"
        thief = cls(origin, cookie)
        status, state = thief.request("GET", "/api/state")
        assert status == 200 and state["login"], state
        thief.csrf = state["login"]["csrf"]
        return thief

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        headers: dict[str, str | None] | None = None,
    ) -> tuple[int, Any]:
        """One request, with the page's headers unless `headers` says otherwise."""
        import http.client
        import json

        host, port = self.origin.removeprefix("http://").split(":")
        sent = {
            "Host": f"{host}:{port}",
            "Origin": self.origin,
            "Cookie": f"bastion_console={self.cookie}",
            "X-CSRF-Token": self.csrf,
            "Content-Type": "application/json",
        } | (headers or {})
        sent = {k: v for k, v in sent.items() if v is not None}
        conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=WAIT)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers=sent)
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, raw.decode(errors="replace")
