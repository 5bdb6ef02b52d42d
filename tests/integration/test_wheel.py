"""Installable as a user installs it (issue 21, acceptance 6): a wheel built from the
checkout, installed into a fresh venv, carries what `bastion demo` and `bastion init`
need -- `bastion demo` exits 0 and `bastion init` names a policy example that exists.

Offline: the wheel is built without build isolation (setuptools>=70.1, which builds
wheels itself, comes with the `test` extra), from a copy of the working tree (a build
leaves build/ behind, whose stale files a later build would carry). The fresh venv gets
only the wheel; its dependencies come from this venv's site-packages through a `.pth`
line -- a path, not a site directory, so this venv's editable install of the checkout
is not seen -- and everything runs outside the checkout with no PYTHONPATH, so the
`bastion` that runs is the wheel's."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from bastion.devtools.sshd_fixture import sshd_available
from tests.harness import PASSPHRASE

REPO = Path(__file__).resolve().parents[2]
SKIP = (".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")


def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)  # type: ignore[call-overload]
    assert r.returncode == 0, f"{argv} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh venv with the wheel built from this checkout, and the environment to run it in."""
    assert importlib.util.find_spec("setuptools.command.bdist_wheel") is not None, (
        "building a wheel offline needs setuptools>=70.1 in this venv: pip install -e '.[test]'"
    )
    root = tmp_path_factory.mktemp("wheel")
    src, dist, venv = root / "src", root / "dist", root / "venv"
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(*SKIP))
    build = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation"]
    run([*build, "--no-index", "-q", "-w", str(dist)], cwd=src)
    (wheel,) = dist.glob("bastion-*.whl")
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
        ).stdout.strip()
    )
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_bastion_test_deps.pth").write_text("".join(f"{p}\n" for p in deps))
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps"]
    run([*pip, "--no-index", "-q", str(wheel)])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HOME"] = str(root / "user")  # nothing of the operator's own home is read
    (root / "user").mkdir()
    where = run([str(python), "-c", "import bastion; print(bastion.__file__)"], cwd=root, env=env)
    assert where.stdout.startswith(str(site)), where.stdout  # the wheel's, not the checkout's
    return venv, env


def test_the_wheel_carries_the_example_and_the_template(
    installed: tuple[Path, dict[str, str]],
) -> None:
    venv, env = installed
    python = str(venv / "bin" / "python")
    code = "from bastion.data import EXAMPLE_POLICY as e, SSHD_TEMPLATE as t; print(e); print(t)"
    example, template = run([python, "-c", code], cwd=venv, env=env).stdout.split()
    assert Path(example).is_file() and Path(template).is_file()
    assert Path(example).read_bytes() == (REPO / "policies" / "example.toml").read_bytes()
    sshd = REPO / "fixtures" / "sshd" / "sshd_config.template"
    assert Path(template).read_bytes() == sshd.read_bytes()


def test_bastion_init_names_an_example_that_exists(
    installed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    venv, env = installed
    home = tmp_path / "home"
    r = run(
        [str(venv / "bin" / "bastion"), "--home", str(home), "init", "--passphrase-stdin"],
        input=PASSPHRASE + "\n",
        cwd=tmp_path,
        env=env,
    )
    found = re.search(r"^  example: +(\S+)", r.stdout, re.MULTILINE)
    assert found, r.stdout
    example = Path(found.group(1))
    assert example.is_file() and str(example).startswith(str(venv)), example
    assert "[hosts." in example.read_text()


def test_bastion_demo_runs_from_the_wheel(
    installed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    reason = sshd_available()
    if reason:
        pytest.skip(reason)
    venv, env = installed
    r = run([str(venv / "bin" / "bastion"), "demo"], cwd=tmp_path, env=env)
    assert "== Done" in r.stdout, r.stdout
