"""`make up/down/status` agree on the data dir, and a first install is quiet."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("target", ["up", "down", "status"])
def test_make_targets_pass_the_same_data_dir(target):
    out = subprocess.run(["make", "-n", target, "DATA_DIR=/srv/fleet-a"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if "mlx-fleet" in line and target in line.split())
    assert "--data-dir /srv/fleet-a" in line


def test_without_data_dir_the_cli_default_applies():
    out = subprocess.run(["make", "-n", "down"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    line = next(line for line in out.stdout.splitlines() if "mlx-fleet" in line)
    assert "--data-dir" not in line  # mlx-fleet reads $MLX_FLEET_DATA_DIR, else ~/.mlx-fleet


def test_the_cli_reads_the_data_dir_from_the_environment(tmp_path, monkeypatch):
    from cluster.config import default_data_dir

    monkeypatch.setenv("MLX_FLEET_DATA_DIR", str(tmp_path / "x"))
    assert default_data_dir() == tmp_path / "x"


def test_building_the_package_warns_about_nothing(tmp_path):
    """setuptools used to flood `make up` with 'license table' deprecation warnings; build it as pip does."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "cluster", src / "cluster", ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "wheel"), str(src)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    noise = [line for line in (out.stdout + out.stderr).splitlines()
             if "license" in line.lower() or "deprecat" in line.lower()]
    assert noise == []
    wheel = next((tmp_path / "wheel").glob("mlx_fleet-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta
