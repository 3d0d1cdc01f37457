"""The model thread owns MLX: a debug guard that fails when MLX work runs on any other thread.

Since mlx 0.31.2 streams are thread-local. On Metal, arrays made on one thread
and evaluated on another fail with "There is no Stream(gpu, N) in current
thread" (mlx #3727, mlx-lm #1181). So, as in mlx_lm.server, every MLX call of a
replica - load, probe, restore, capture, generate - runs on its one model
thread. The CPU backend, the only one tested here, does not raise, so this
guard makes the rule visible off a Mac:

- a model thread `claim()`s ownership when it starts and `release()`s it at
  the end;
- `check(what)` at our own MLX entry points raises WrongThread off a model
  thread;
- with MLX_FLEET_THREAD_GUARD=1 (the tests set it), `mx.eval`,
  `mx.async_eval` and the reads that evaluate implicitly (`.item()`,
  `.tolist()`) are wrapped too, so any evaluation anywhere - ours or
  mlx-lm's - is checked while a model thread exists in the process. The
  conversions that go through type slots (`np.array(x)` by the buffer
  protocol, `float(x)`) cannot be wrapped from Python; `check()` at our own
  entry points covers the code that makes them.

With no model thread claimed (a script, a test driving the engine directly),
nothing is checked. The guard is off in production: it costs a dict lookup per
eval, and the rule is enforced by structure, not by the guard.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Protocol

GUARD_ENV = "MLX_FLEET_THREAD_GUARD"

_owners: dict[int, str] = {}
_lock = threading.Lock()
_installed = False


class WrongThread(RuntimeError):
    """MLX work ran outside the replica's model thread (fatal on Metal)."""


def enabled() -> bool:
    return os.environ.get(GUARD_ENV) == "1"


def claim() -> None:
    """Make the calling thread a model thread."""
    with _lock:
        _owners[threading.get_ident()] = threading.current_thread().name
    if enabled():
        _install()


def release() -> None:
    with _lock:
        _owners.pop(threading.get_ident(), None)


def release_streams() -> None:
    """Destroy the calling thread's MLX streams now, at the end of a thread that did MLX work.

    Streams are per thread, and MLX otherwise destroys a thread's GPU streams in its exit (thread-local
    destructors, after Python has let go of the thread). On MLX's CUDA backend that teardown can end the
    whole process with "terminate called without an active exception": seen on an H100 while the main
    thread evaluated just after a test's model thread stopped, and at a bench's exit. MLX's maintainers
    ask for `clear_streams` at the end of threads and of the process (ml-explore/mlx#4110), where it runs
    as an ordinary call: work still queued on the streams is waited for first."""
    import mlx.core as mx

    try:
        mx.synchronize()  # the default stream's work, before its stream goes (it raises after a CUDA error)
    finally:
        mx.clear_streams()


class Stoppable(Protocol):
    def request_stop(self, drain: bool = True) -> None: ...
    def wait_stopped(self, timeout_s: float | None = None) -> bool: ...


_running: set = set()  # the owners of model threads running now (Schedulers), stopped at the process's exit
EXIT_WAIT_S = 10.0  # how long the exit waits for them, all together


def running(owner: Stoppable) -> None:
    with _lock:
        _running.add(owner)


def ended(owner: Stoppable) -> None:
    with _lock:
        _running.discard(owner)


def on_model_thread() -> bool:
    return threading.get_ident() in _owners


def claimed() -> bool:
    """Whether any thread of this process is a model thread (a replica's, a test's scheduler's)."""
    return bool(_owners)


def check(what: str) -> None:
    """Raise WrongThread if a model thread exists and this is not one."""
    if _owners and threading.get_ident() not in _owners:
        raise WrongThread(f"{what} ran on thread {threading.current_thread().name!r}, but MLX work belongs on the "
                          f"model thread ({', '.join(sorted(_owners.values()))}); on Metal this fails with "
                          "'There is no Stream(gpu, N) in current thread'")


def _install() -> None:
    """Wrap mx.eval / mx.async_eval with the check (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        import mlx.core as mx

        for name in ("eval", "async_eval"):
            original = getattr(mx, name)

            def guarded(*args, _original=original, _name=name, **kwargs):
                check(f"mx.{_name}")
                return _original(*args, **kwargs)

            guarded.__wrapped__ = original
            setattr(mx, name, guarded)
        # Reading an array evaluates it too: .item() and .tolist().
        for name in ("item", "tolist"):
            original = getattr(mx.array, name)

            def guarded_method(self, *args, _original=original, _name=name, **kwargs):
                check(f"mx.array.{_name}")
                return _original(self, *args, **kwargs)

            guarded_method.__wrapped__ = original
            setattr(mx.array, name, guarded_method)
        _installed = True


def warm(model) -> None:
    """Run a short prefill and one decode step on the calling thread.

    Some models (gemma4 in mlx-lm 0.32) leave arrays lazy after `load` until
    their first decode step; streams being per thread, such an array evaluated
    first on another thread fails with "There is no Stream(cpu, 0) in current
    thread". A replica loads and runs on its one model thread and needs none of
    this; a process that loads a model on one thread and hands it to a
    Scheduler (benchmarks, tests) warms it where it was loaded."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from cluster.engine import invariant

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5, 6, 7]]), cache=cache))
    with invariant.one_query():  # as a decode step runs (on CUDA the kernel: compiled here, not on a request)
        mx.eval(model(mx.array([[8]]), cache=cache))


@atexit.register
def _at_exit() -> None:
    """At the interpreter's exit: stop every model thread still running, then release the main thread's streams.

    A model thread left running would be torn down during finalization, where MLX's CUDA backend can abort
    the process; stopped here, each releases its own streams as it ends (without the idle drain: the pools
    its spills use are shut by now). The main thread loads models, and a script runs them there. After
    this, MLX work on the main thread fails ("There is no Stream(...) in current thread"): exit hooks that
    were registered before this module was imported run after it."""
    with _lock:
        owners = list(_running)
    for owner in owners:
        try:
            owner.request_stop(drain=False)
        except Exception:  # exiting anyway: the others still get their stop
            pass
    deadline = time.monotonic() + EXIT_WAIT_S
    for owner in owners:
        try:
            owner.wait_stopped(max(0.0, deadline - time.monotonic()))
        except Exception:
            pass
    if "mlx.core" in sys.modules and threading.current_thread() is threading.main_thread():
        try:
            release_streams()
        except Exception:
            pass
