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


def test_a_start_keeps_only_the_last_runs_session(base, tmp_path):
    ray_dir = temp_dir.prepare(tmp_path)
    names = ["session_2026-12-01_09-00-00_000001_11", "session_2026-12-02_08-00-00_000001_12",
             "session_2026-11-30_23-59-59_999999_10"]
    for name in names:
        (ray_dir / name / "logs").mkdir(parents=True)
    (ray_dir / "session_latest").symlink_to(ray_dir / names[2])  # the last run, whatever the names say
    (ray_dir / "tmp" / "x").mkdir(parents=True)  # the fleet processes' TMPDIR
    (ray_dir / "ray_current_cluster").write_text("127.0.0.1:1")
    temp_dir.prepare(tmp_path)
    assert sorted(p.name for p in ray_dir.iterdir()) == ["ray_current_cluster", names[2], "session_latest"]
    assert stat.S_IMODE(temp_root(tmp_path).stat().st_mode) == 0o700


def test_a_folder_that_was_open_to_others_is_emptied_whole(base, tmp_path):
    """The older layout gave Ray the folder itself, which Ray opens to every user: what is in it, Ray's
    dir included, may have been planted (here a symlink to another user's folder)."""
    root = temp_root(tmp_path)
    root.mkdir()
    planted = tmp_path / "planted"
    planted.mkdir()
    (root / "ray").symlink_to(planted)
    (root / "session_2026-11-01_00-00-00_000001_9").mkdir()
    os.chmod(root, 0o777)
    ray_dir = temp_dir.prepare(tmp_path)
    assert ray_dir.is_dir() and not ray_dir.is_symlink() and ray_dir.resolve() == ray_dir
    assert sorted(p.name for p in root.iterdir()) == ["ray"] and list(ray_dir.iterdir()) == []
    assert list(planted.iterdir()) == [] and stat.S_IMODE(root.stat().st_mode) == 0o700


def test_a_symlink_for_rays_dir_is_replaced_even_in_a_private_folder(base, tmp_path):
    root = temp_root(tmp_path)
    root.mkdir(mode=0o700)
    planted = tmp_path / "planted"
    planted.mkdir()
    (root / "ray").symlink_to(planted)
    ray_dir = temp_dir.prepare(tmp_path)
    assert ray_dir.is_dir() and not ray_dir.is_symlink() and planted.is_dir()


def test_a_base_others_can_write_to_without_the_sticky_bit_is_refused(base, tmp_path):
    os.chmod(base, 0o777)
    with pytest.raises(temp_dir.TempDirError, match="writable by other users and not sticky"):
        temp_dir.prepare(tmp_path)
    os.chmod(base, 0o1777)  # as /tmp
    assert temp_dir.prepare(tmp_path).is_dir()


def test_a_missing_base_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_TMPDIR", "/tmp/nobase7f")
    with pytest.raises(temp_dir.TempDirError, match="cannot prepare /tmp/nobase7f/mlxf-"):
        temp_dir.prepare(tmp_path)


def test_the_folder_name_is_the_users_and_the_data_dirs(base, tmp_path, monkeypatch):
    mine = temp_root(tmp_path)
    monkeypatch.setattr(os, "getuid", lambda: 4242)
    assert temp_root(tmp_path) != mine and temp_root(tmp_path).parent == mine.parent


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
    ray_dir = temp_dir.prepare(tmp_path)
    (ray_dir / "session_2026-12-01_09-00-00_000001_11").mkdir()
    temp_dir.remove(ray_dir)
    assert not temp_root(tmp_path).exists()
    temp_dir.remove(ray_dir)  # nothing there: nothing to do
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    temp_root(tmp_path).symlink_to(elsewhere)
    temp_dir.remove(ray_dir)
    assert elsewhere.is_dir() and temp_root(tmp_path).is_symlink()
