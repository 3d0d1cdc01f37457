"""Shared fixtures: offline Hugging Face, the MLX thread guard, built-in models built once per session."""

from __future__ import annotations

import os
import re
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# MLX work off a replica's model thread fails on Metal; in tests it fails everywhere (engine/model_thread.py).
# Fleets started by tests inherit it, so their replicas run guarded too.
os.environ["MLX_FLEET_THREAD_GUARD"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


FLEET_MARK = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.fleet\b", re.M)
_fleet_modules: dict[Path, bool] = {}


def is_fleet_module(path: Path) -> bool:
    """Whether the test module at `path` is marked a fleet module, on its `pytestmark` line (read once)."""
    if path not in _fleet_modules:
        _fleet_modules[path] = path.is_file() and bool(FLEET_MARK.search(path.read_text()))
    return _fleet_modules[path]


def pytest_collection_modifyitems(config, items):
    """The scheduler below finds fleet modules by their text; a fleet mark it cannot see (set on a function,
    or spread over lines) would start a fleet beside another one. Such a module is refused here."""
    unseen = sorted({str(item.path) for item in items
                     if item.get_closest_marker("fleet") and not is_fleet_module(item.path)})
    if unseen:
        raise pytest.UsageError(f"fleet tests outside a module marked on one line `pytestmark = ... "
                                f"pytest.mark.fleet ...`: {', '.join(unseen)}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`make test` runs two workers): every fleet test on one worker, in order; each other
    module on whichever worker is free (its module-scoped fixtures set up once).

    A fleet's Ray, Redis and replicas want the machine's cores: two fleets starting at once on a 2-core box
    would each be slower than one after the other, and their timings are what those tests watch. The
    in-process suites (one core: MLX on the CPU, a model at a time) run on the other worker meanwhile.
    A fleet module is one whose `pytestmark` names the fleet mark (the scheduler sees node ids, not marks;
    tests/test_structure.py checks that every module starting a fleet says so there). xdist's own
    `loadgroup` does not group under pytest 9 (its group suffix on node ids no longer takes), hence this."""
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") != "load":  # another --dist asked for: xdist's own
        return None
    root = config.rootpath

    class FleetsInOrder(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "fleets" if is_fleet_module(root / module) else module

    return FleetsInOrder(config, log)


BASE_NICE = os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0  # `make test`'s own


def pytest_runtest_setup(item):
    """Under xdist, an in-process test runs 10 nicer than `make test` was started, and a fleet test as it was:
    the fleet's Ray, Redis and replicas (started from the worker, so at its priority) get the cores first, and
    the in-process suites take what they leave. Their timings are what the fleet tests watch. Linux sets nice
    per thread: every thread of the worker (MLX's own too) is set. Lowering it back needs root (`make test` on
    the CI box); without, a thread stays as it is."""
    if "PYTEST_XDIST_WORKER" not in os.environ or not sys.platform.startswith("linux"):
        return
    want = BASE_NICE + (0 if item.get_closest_marker("fleet") else 10)
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) != want:
                os.setpriority(os.PRIO_PROCESS, int(tid), want)
        except OSError:  # a thread gone meanwhile, or no right to lower it: that one stays as it is
            pass


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """A data dir whose models/ is shared by every test of the session."""
    return tmp_path_factory.mktemp("mlx-fleet-data")


@pytest.fixture(scope="session")
def load_builtin(data_dir):
    """load_builtin(name) -> (model, tokenizer), loaded once per session."""
    from cluster.models.loading import load_model

    from cluster.engine.model_thread import warm
    from cluster.models.resolve import resolve_model

    loaded = {}

    def _load(name: str):
        if name not in loaded:
            loaded[name] = load_model(resolve_model(name, data_dir))
            warm(loaded[name][0])  # tests hand models to Schedulers' threads
        return loaded[name]

    return _load


@pytest.fixture(scope="session")
def redis_process(tmp_path_factory):
    """A real redis-server of our own, on a free loopback port, no persistence."""
    import subprocess
    import time

    import redis

    from cluster.ports import free_port
    from cluster.fleet.redis_server import find_redis_server

    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def redis_url(redis_process):
    """The session's Redis, emptied for this test."""
    import redis

    redis.Redis.from_url(redis_process).flushall()
    return redis_process
