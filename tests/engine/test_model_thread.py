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
