"""All MLX work of a replica belongs on its model thread: the guard trips when it runs anywhere else."""

import subprocess
import sys
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


def test_streams_are_cleared_even_when_the_last_sync_fails(monkeypatch):
    """After a CUDA error mx.synchronize raises; the streams must still go, or the thread's exit tears them
    down."""
    cleared = []

    def failing():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(mx, "synchronize", failing)
    monkeypatch.setattr(mx, "clear_streams", lambda: cleared.append(True))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        model_thread.release_streams()
    assert cleared == [True]


def test_a_stop_asked_on_the_model_thread_itself_does_not_wait_for_itself():
    scheduler = Scheduler(name="mlx-fleet-self-stop")
    scheduler.run(lambda: scheduler.stop())  # a finalizer running there, say: it asks, and the thread ends
    assert scheduler.wait_stopped(10) and scheduler.stopping


EXITING = """
import atexit, sys, threading
from cluster.engine import model_thread
from cluster.engine.scheduler import Scheduler
real = model_thread.release_streams
def release():
    real()
    print("released on", threading.current_thread().name, flush=True)
model_thread.release_streams = release
if sys.argv[1] == "without-the-hook":
    atexit.unregister(model_thread._at_exit)
import mlx.core as mx
s = Scheduler(name="left-running")
print(s.run(lambda: (mx.array([1.0, 2.0]) * 3).sum().item()), flush=True)
"""


def test_schedulers_left_running_are_stopped_at_exit_and_release_their_streams():
    """A process that exits with a model thread still running (a bench's, a script's) stops it first, so the
    thread ends as above instead of being torn down during the interpreter's finalization; then the main
    thread releases its own. Without the exit hook neither happens (the negative control)."""
    def exits(how: str) -> list[str]:
        r = subprocess.run([sys.executable, "-c", EXITING, how], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    assert exits("with-the-hook") == ["9.0", "released on left-running", "released on MainThread"]
    assert exits("without-the-hook") == ["9.0"]
