"""`mlx-fleet up` and `down`: a whole fleet on this machine.

`up` takes the data dir's lock (lock.py), checks everything it can before
starting anything (models, ports, Redis), then starts the supervisor (which
keeps the lock and runs Redis), a Ray head and N-1 more Ray nodes, deploys the
Serve app and waits until every replica is healthy. If any step fails it stops
what it started, so a failed `up` leaves no process behind.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from cluster.config import AppConfig, FleetConfig
from cluster.fleet import lock, processes, ray_env, ray_nodes, redis_server, supervisor, temp_dir
from cluster.ports import bind_error, is_listening
from cluster.fleet.state import FleetState, clear_state, fleet_tag, load_state, ray_temp_dir, save_state
from cluster.models.resolve import check_source, resolve_model

APP_NAME = "mlx-fleet"
STOP_GRACE_S = 12.0  # the supervisor's: it gives its Redis 10 s, then records that it stopped
DAEMON_GRACE_S = 0.5  # everything else's
DEPLOY_TIMEOUT_S = 900.0
REDIS_TIMEOUT_S = 60.0


class FleetError(RuntimeError):
    """`up` cannot proceed; the message says why and what to do."""


class Progress:
    """Prints each long step with its duration."""

    def __init__(self, out: Callable[[str], None] = print):
        self.out = out

    @contextmanager
    def step(self, what: str) -> Iterator[dict]:
        t0 = time.monotonic()
        note: dict = {}
        self.out(f"  {what} ...")
        yield note
        extra = f" ({note['detail']})" if note.get("detail") else ""
        self.out(f"  {what}: done in {time.monotonic() - t0:.1f}s{extra}")


def up(cfg: FleetConfig, out: Callable[[str], None] = print) -> FleetState:
    data_dir = cfg.data_dir.expanduser().resolve()
    progress = Progress(out)
    try:
        lock_fd = lock.acquire(data_dir)
    except lock.FleetLocked as e:
        raise FleetError(str(e)) from None
    try:
        clear_state(data_dir)  # we hold the lock: any state file is a dead fleet's
        _preflight(cfg)
        try:
            temp_dir.prepare(data_dir)
        except temp_dir.TempDirError as e:
            raise FleetError(str(e)) from None
        out(f"mlx-fleet: starting {cfg.nodes} node(s) under {data_dir}")
        state = FleetState(data_dir=str(data_dir), tag=fleet_tag(data_dir),
                           ray_temp_dir=str(ray_temp_dir(data_dir)), models=[m.name for m in cfg.app.models],
                           started=time.time())
        try:
            for spec in cfg.app.models:
                with progress.step(f"model {spec.name}") as note:
                    model_dir = resolve_model(spec.source, data_dir)
                    note["detail"] = str(model_dir)
                _check_split(spec, model_dir)
            ray_env.write_token(data_dir)
            _start_supervisor(cfg, state, lock_fd, progress)
            _start_ray(cfg, state, progress)
            _deploy(cfg, state, progress)
        except BaseException as e:
            why = "interrupted" if isinstance(e, KeyboardInterrupt) else "start failed"
            out(f"  {why}; stopping what was started")
            _stop(state)
            raise
    finally:
        os.close(lock_fd)  # the supervisor holds its own copy for the fleet's lifetime
    state.ready = True
    save_state(state)
    return state


def down(data_dir: Path) -> int:
    """Stop every process of the fleet under `data_dir`; return how many were found.

    Serve is shut down first so replicas finish in-flight requests and flush their
    pending disk spills; then every process of the fleet is signalled, and killed
    if it does not exit (Ray's daemons take their time, and hold nothing we need)."""
    data_dir = data_dir.expanduser().resolve()
    state = load_state(data_dir) or FleetState(data_dir=str(data_dir), tag=fleet_tag(data_dir),
                                               ray_temp_dir=str(ray_temp_dir(data_dir)))
    _drain_serve(state)
    return _stop(state)


def _stop(state: FleetState) -> int:
    # The fleet's Redis runs in a session of its own, which the supervisor does not record (it restarts it).
    # The supervisor (it stops its Redis and records that) and Redis get the grace; Ray's daemons hold nothing
    # (Serve drained first) but linger for seconds on SIGTERM, so they get a brief one.
    found = processes.stop_tagged(state.tag, state.session_ids(), grace_s=STOP_GRACE_S,
                                  leaders=redis_server.running_in(Path(state.data_dir) / "redis"),
                                  patient=[state.supervisor_session_id] if state.supervisor_session_id else [],
                                  brief_s=DAEMON_GRACE_S)
    clear_state(Path(state.data_dir))
    return found


def _drain_serve(state: FleetState, timeout_s: float = 60.0) -> None:
    if state.ray_port() is None or not is_listening("127.0.0.1", state.ray_port()):
        return  # no Ray head answering: nothing to drain

    def drain():
        ray_env.prepare_driver(state)  # before Ray is imported: it reads its auth settings then
        import ray
        from ray import serve

        logging.getLogger("ray._private.worker").setLevel(logging.ERROR)  # "SIGTERM handler not set": expected here
        try:
            ray_env.connect(state)
            serve.shutdown()
        except Exception as e:  # best effort: the processes are stopped next either way
            print(f"  (serve did not shut down cleanly: {e})", file=sys.stderr)
        finally:
            ray.shutdown()

    worker = threading.Thread(target=drain, daemon=True)
    worker.start()
    worker.join(timeout_s)


def _preflight(cfg: FleetConfig) -> None:
    """What would fail later, said now, before anything starts: the models first (a typo there is the
    likeliest mistake), then the port, Redis and the API keys file."""
    for spec in cfg.app.models:
        check_source(spec.source)
    err = bind_error(cfg.host, cfg.port)
    if err is not None and err.errno == errno.EADDRINUSE:
        raise FleetError(f"port {cfg.port} on {cfg.host} is already in use; pass --port with a free port or stop what uses it")
    if err is not None:
        raise FleetError(f"cannot listen on {cfg.host}:{cfg.port}: {err.strerror or err}; pass --host with an address "
                         "of this machine (127.0.0.1 by default) and --port with a port you may bind")
    if cfg.app.redis_url:
        redis_server.ping(cfg.app.redis_url)
    else:
        redis_server.find_redis_server()
    if cfg.app.gateway.api_keys_file:
        from cluster.api.keys import read_keys

        read_keys(cfg.app.gateway.api_keys_file)


def _check_split(spec, model_dir: Path) -> None:
    """A sharded model mlx-lm cannot split so is refused now, from its config, not by every replica's start."""
    if spec.shards <= 1:
        return
    from cluster.engine.sharding import UnshardableModel, check_shardable
    from cluster.models.resolve import read_config

    config = read_config(model_dir)
    try:
        check_shardable(config.get("model_type", "?"), spec.shard_mode, spec.shards, config)
    except UnshardableModel as e:
        raise FleetError(f"model {spec.name}: {e}") from None


def _start_supervisor(cfg: FleetConfig, state: FleetState, lock_fd: int, progress: Progress) -> None:
    """The process that keeps the data dir's lock and runs (and restarts) the fleet's Redis."""
    own = not cfg.app.redis_url
    with progress.step("supervisor" + (" and redis" if own else "")) as note:
        env = ray_env.base_env(state)
        argv = [sys.executable, "-m", "cluster.fleet.supervisor", "--data-dir", state.data_dir,
                "--lock-fd", str(lock_fd)] + ([] if own else ["--no-redis"])
        log = Path(state.data_dir) / "logs" / "supervisor.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, pass_fds=(lock_fd,))
        state.supervisor_session_id = proc.pid
        save_state(state)
        state.redis_url = cfg.app.redis_url or _wait_for_redis(state, proc)
        save_state(state)
        note["detail"] = redis_server.redact(state.redis_url)


def _wait_for_redis(state: FleetState, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + REDIS_TIMEOUT_S
    data_dir = Path(state.data_dir)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise FleetError(f"the fleet supervisor exited; see {data_dir / 'logs' / 'supervisor.log'}")
        known = supervisor.read_state(data_dir)
        if known and known.get("pid") == proc.pid and known.get("redis") and known["redis"].get("running"):
            url = redis_server.local_url(known["redis"]["port"], redis_server.password(data_dir / "redis"))
            redis_server.ping(url)
            return url
        time.sleep(0.1)
    raise FleetError(f"redis did not start in {REDIS_TIMEOUT_S:.0f}s; see {data_dir / 'logs'}")


def _start_ray(cfg: FleetConfig, state: FleetState, progress: Progress) -> None:
    try:
        with progress.step("ray head node-0"):
            ray_nodes.start_head(cfg, state)
        for i in range(1, cfg.nodes):
            with progress.step(f"ray node node-{i}"):
                ray_nodes.start_worker(state, f"node-{i}")
    except ray_nodes.NodeStartError as e:
        raise FleetError(str(e)) from None


def _deploy(cfg: FleetConfig, state: FleetState, progress: Progress) -> None:
    ray_env.prepare_driver(state)  # before Ray is imported: it reads its auth settings then
    import ray
    from ray import serve

    from cluster.actors.app import build_app

    app_config = AppConfig.model_validate({**cfg.app.model_dump(), "data_dir": state.data_dir,
                                           "redis_url": state.redis_url})
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # our progress lines say it better
    ray_env.connect(state)
    try:
        with progress.step(f"serve app ({len(app_config.models)} model(s) x {cfg.nodes} node(s))"):
            serve.start(http_options={"host": cfg.host, "port": cfg.port}, proxy_location="HeadOnly")
            # serve.run would block until RUNNING; _run lets us report each replica as it comes up.
            serve._run(build_app(app_config), _blocking=False, name=APP_NAME, route_prefix="/")
            _wait_healthy(state, progress)
        state.http_url = f"http://{cfg.host}:{cfg.port}"
        save_state(state)
    finally:
        ray.shutdown()


def deploy_failure(messages: list[str], limit: int = 2000) -> str:
    """What Serve says of a failed deployment, the error itself first: its message ends in a traceback whose
    last line is the exception, which a cut from the front would lose."""
    reasons = []
    for m in filter(None, messages):
        lines = [ln.strip() for ln in m.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else ""
        reasons.append(last if len(lines) > 1 and "Traceback" in m else m.strip())
    return " | ".join(reasons)[:limit]


def _wait_healthy(state: FleetState, progress: Progress, timeout_s: float = DEPLOY_TIMEOUT_S) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    t0 = time.monotonic()
    seen: dict[str, int] = {}
    while True:
        app = serve.status().applications.get(APP_NAME)
        if app is not None:
            for name, dep in app.deployments.items():
                running = dep.replica_states.get("RUNNING", 0)
                if seen.get(name) != running and running:
                    progress.out(f"    {name}: {running} replica(s) running ({time.monotonic() - t0:.1f}s)")
                seen[name] = running
            if app.status == "RUNNING":
                return
            if app.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                msgs = [d.message for d in app.deployments.values() if d.message] or [app.message]
                raise FleetError(f"the serve app failed to deploy: {deploy_failure(msgs)}; the full error is in the "
                                 f"logs under {state.ray_temp_dir}/session_latest/logs")
        if time.monotonic() > deadline:
            raise FleetError(f"replicas were not healthy after {timeout_s:.0f}s; see the logs under {state.ray_temp_dir}/session_latest/logs")
        time.sleep(0.5)
