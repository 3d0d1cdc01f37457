"""The fleet's folder for Ray's files: private, refused when not ours, short enough, pruned to the last run."""

import os
import stat
import tempfile
from pathlib import Path

import pytest

from cluster.fleet import temp_dir
from cluster.fleet.state import ray_temp_dir, temp_root


@pytest.fixture
def base(monkeypatch):
    """A short RAY_TMPDIR of the test's own (pytest's tmp_path is too long for Ray's sockets)."""
    short = tempfile.mkdtemp(prefix="mt", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", short)
    yield Path(short)
    import shutil

    shutil.rmtree(short, ignore_errors=True)


def test_the_folder_is_private_and_holds_rays_dir(base, tmp_path):
    ray_dir = temp_dir.prepare(tmp_path)
    root = temp_root(tmp_path)
    assert ray_dir == ray_temp_dir(tmp_path) == root / "ray" and root.parent == base
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and ray_dir.is_dir()


def test_a_start_keeps_only_the_last_runs_session_and_drops_an_older_layout(base, tmp_path):
    ray_dir = temp_dir.prepare(tmp_path)
    root = temp_root(tmp_path)
    names = ["session_2026-12-01_09-00-00_000001_11", "session_2026-12-02_08-00-00_000001_12",
             "session_2026-11-30_23-59-59_999999_10"]
    for name in names:
        (ray_dir / name / "logs").mkdir(parents=True)
    (ray_dir / "session_latest").symlink_to(ray_dir / names[1])
    (root / "session_2026-11-01_00-00-00_000001_9").mkdir()  # Ray's files straight in the folder, as before
    os.chmod(root, 0o777)  # as Ray leaves its temp dir
    temp_dir.prepare(tmp_path)
    assert sorted(p.name for p in ray_dir.iterdir()) == [names[1], "session_latest"]
    assert sorted(p.name for p in root.iterdir()) == ["ray"]
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_a_symlink_in_its_place_is_refused(base, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    temp_root(tmp_path).symlink_to(elsewhere)
    with pytest.raises(temp_dir.TempDirError, match="exists and is not a folder of yours"):
        temp_dir.prepare(tmp_path)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="making a folder another user owns needs root")
def test_a_folder_another_user_made_is_refused(base, tmp_path):
    root = temp_root(tmp_path)
    root.mkdir()
    os.chown(root, 1, 1)
    with pytest.raises(temp_dir.TempDirError, match="another user may have made it"):
        temp_dir.prepare(tmp_path)


def test_a_base_too_long_for_rays_sockets_is_refused_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_TMPDIR", "/tmp/" + "x" * 60)
    with pytest.raises(temp_dir.TempDirError, match=r"set RAY_TMPDIR to a shorter folder \(/tmp\)"):
        temp_dir.prepare(tmp_path)
    assert not Path("/tmp/" + "x" * 60).exists()


def test_remove_takes_the_whole_folder_and_only_ours(base, tmp_path):
    temp_dir.prepare(tmp_path)
    (ray_temp_dir(tmp_path) / "session_2026-12-01_09-00-00_000001_11").mkdir()
    temp_dir.remove(tmp_path)
    assert not temp_root(tmp_path).exists()
    temp_dir.remove(tmp_path)  # nothing there: nothing to do
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    temp_root(tmp_path).symlink_to(elsewhere)
    temp_dir.remove(tmp_path)
    assert elsewhere.is_dir() and temp_root(tmp_path).is_symlink()
