"""A pidfd is tested whatever its number: past 1023 too (issue 18).

A gateway holding a thousand connections and watches hands out descriptors
past 1023; select() refuses those (ValueError), and every identification
failed. The pidfd is moved to a high number with dup2, as the kernel would
have numbered it.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
from collections.abc import Iterator

import pytest

from bastion.identity import pidfd_exited

HIGH = 1500


@contextlib.contextmanager
def numbered(fd: int, number: int) -> Iterator[int]:
    """`fd` duplicated at `number` (the soft descriptor limit raised if need be)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= number:
        pytest.skip(f"the hard descriptor limit ({hard}) is below {number}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, number + 1), hard))
    try:
        os.dup2(fd, number)
        try:
            yield number
        finally:
            os.close(number)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_pidfd_past_1023_says_whether_its_process_lives() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    pidfd = os.pidfd_open(child.pid)
    try:
        with numbered(pidfd, HIGH) as high:
            assert pidfd_exited(high) is False
            assert child.stdin is not None
            child.stdin.close()
            child.wait(30)
            assert pidfd_exited(high) is True
    finally:
        os.close(pidfd)
        if child.poll() is None:
            child.kill()
            child.wait(30)
