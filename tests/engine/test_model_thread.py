"""All MLX work of a replica belongs on its model thread: the guard trips when it runs anywhere else."""

import threading

import mlx.core as mx
import pytest

from cluster.engine import model_thread
from cluster.engine.cold_session import ColdSession
from cluster.engine.model_thread import WrongThread
from cluster.engine.request import GenerationParams
from cluster.engine.scheduler import Scheduler
from cluster.engine.sequence import Sequence


def work() -> float:
    return (mx.array([1.0, 2.0]) * 3).sum().item()


def test_mlx_work_off_the_model_thread_trips_the_guard(load_builtin):
    assert model_thread.enabled()  # the tests run with MLX_FLEET_THREAD_GUARD=1
    model, tok = load_builtin("tiny-dense")
    scheduler = Scheduler()
    try:
        assert scheduler.run(work) == 9.0  # on the model thread: fine
        with pytest.raises(WrongThread, match="model thread"):
            mx.eval(mx.array([1.0]) + 1)  # the main thread, while a model thread exists
        lazy = mx.array([1.0]) + 1
        for read in (lambda: lazy.item(), lambda: lazy.tolist()):
            with pytest.raises(WrongThread, match="mx.array"):
                read()  # reading an array evaluates it: checked too
        seq = Sequence([3, 4, 5], GenerationParams(max_tokens=2), model, tok, ColdSession(model))
        with pytest.raises(WrongThread):
            seq.step()  # our own entry points check too
        errors = []

        def other():
            try:
                mx.async_eval(mx.array([2.0]) * 2)
            except WrongThread as e:
                errors.append(e)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert len(errors) == 1
    finally:
        scheduler.stop()
    assert work() == 9.0  # no model thread left: nothing is checked


def test_run_returns_results_and_raises_errors_from_the_model_thread():
    scheduler = Scheduler(name="mlx-fleet-test")
    try:
        assert scheduler.run(lambda: threading.current_thread().name) == "mlx-fleet-test"
        with pytest.raises(ZeroDivisionError):
            scheduler.run(lambda: 1 / 0)
        assert scheduler.alive
    finally:
        scheduler.stop()


def test_a_model_thread_releases_its_streams_as_it_ends(monkeypatch):
    """MLX destroys a thread's GPU streams in the thread's exit unless it clears them first, and on CUDA that
    teardown can abort the process: a Scheduler's thread clears its own, on that thread, as its last act."""
    ended = []
    monkeypatch.setattr(model_thread, "release_streams", lambda: ended.append(threading.current_thread().name))
    scheduler = Scheduler(name="mlx-fleet-ending")
    assert scheduler.run(work) == 9.0 and ended == []
    scheduler.stop()
    assert ended == ["mlx-fleet-ending"] and not scheduler.alive


def test_schedulers_left_running_are_stopped_at_exit_and_release_their_streams(tmp_path):
    """A process that exits with a model thread still running (a replica's, a bench's) stops it first, so the
    thread ends as above instead of being torn down during the interpreter's finalization."""
    import subprocess
    import sys

    script = (
        "import threading\n"
        "from cluster.engine import model_thread\n"
        "from cluster.engine.scheduler import Scheduler\n"
        "real = model_thread.release_streams\n"
        "def release():\n"
        "    real()\n"
        "    print('released on', threading.current_thread().name, flush=True)\n"
        "model_thread.release_streams = release\n"
        "import mlx.core as mx\n"
        "s = Scheduler(name='left-running')\n"
        "print(s.run(lambda: (mx.array([1.0, 2.0]) * 3).sum().item()), flush=True)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["9.0", "released on left-running", "released on MainThread"], r.stdout
