"""`mlx-fleet up` and `down`: a whole fleet on this machine.

`up` checks everything it can before starting anything (models, ports, Redis),
then starts Redis, a Ray head and N-1 more Ray nodes, deploys the Serve app and
waits until every replica is healthy. If any step fails it stops what it
started, so a failed `up` leaves no process behind.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from cluster.actors.loopback import LOOPBACK_ENV
from cluster.config import NODE_LABEL, NODE_RESOURCE, AppConfig, FleetConfig
from cluster.fleet import processes, redis_server
from cluster.fleet.ports import free_port, port_is_free
from cluster.fleet.state import (FleetState, NodeProcess, clear_state, fleet_tag, load_state,
                                 ray_temp_dir, save_state)
from cluster.models.resolve import resolve_model
from cluster.node import NODE_DATA_DIR_ENV, NODE_NAME_ENV

APP_NAME = "mlx-fleet"
STOP_GRACE_S = 3.0
OBJECT_STORE_BYTES = 512 << 20
DEPLOY_TIMEOUT_S = 900.0


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
    _refuse_running_fleet(data_dir)
    _preflight(cfg)
    state = FleetState(data_dir=str(data_dir), tag=fleet_tag(data_dir), ray_temp_dir=str(ray_temp_dir(data_dir)),
                       models=[m.name for m in cfg.app.models], started=time.time())
    try:
        for spec in cfg.app.models:
            with progress.step(f"model {spec.name}") as note:
                note["detail"] = str(resolve_model(spec.source, data_dir))
        _start_redis(cfg, state, progress)
        _start_ray(cfg, state, progress)
        _deploy(cfg, state, progress)
    except BaseException:
        out("  start failed; stopping what was started")
        _stop(state)
        raise
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
    found = processes.stop_tagged(state.tag, state.session_ids(), grace_s=STOP_GRACE_S)
    clear_state(Path(state.data_dir))
    return found


def _drain_serve(state: FleetState, timeout_s: float = 60.0) -> None:
    if not state.ray_address or port_is_free("127.0.0.1", int(state.ray_address.rsplit(":", 1)[1])):
        return  # no Ray head answering: nothing to drain

    def drain():
        import logging

        import ray
        from ray import serve

        logging.getLogger("ray._private.worker").setLevel(logging.ERROR)  # "SIGTERM handler not set": expected here
        try:
            connect(state)
            serve.shutdown()
        except Exception as e:  # best effort: the processes are stopped next either way
            print(f"  (serve did not shut down cleanly: {e})", file=sys.stderr)
        finally:
            ray.shutdown()

    worker = threading.Thread(target=drain, daemon=True)
    worker.start()
    worker.join(timeout_s)


def _refuse_running_fleet(data_dir: Path) -> None:
    state = load_state(data_dir)
    if state is None:
        return
    if processes.tagged(state.tag):
        raise FleetError(f"a fleet is already running under {data_dir}; stop it with `mlx-fleet down --data-dir {data_dir}` "
                         "or pick another --data-dir")
    clear_state(data_dir)  # stale: its processes are gone


def _preflight(cfg: FleetConfig) -> None:
    if not port_is_free(cfg.host, cfg.port):
        raise FleetError(f"port {cfg.port} on {cfg.host} is already in use; pass --port with a free port or stop what uses it")
    if cfg.app.redis_url:
        redis_server.ping(cfg.app.redis_url)
    else:
        redis_server.find_redis_server()


def _base_env(state: FleetState) -> dict[str, str]:
    env = dict(os.environ)
    env.update({processes.TAG_ENV: state.tag, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "PYTHONUNBUFFERED": "1",
                LOOPBACK_ENV: "1"})
    return env


def _start_redis(cfg: FleetConfig, state: FleetState, progress: Progress) -> None:
    if cfg.app.redis_url:
        state.redis_url = cfg.app.redis_url
        return
    with progress.step("redis") as note:
        redis_dir = Path(state.data_dir) / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        argv = redis_server.redis_argv(redis_server.find_redis_server(), port, redis_dir)
        proc = processes.spawn(argv, _base_env(state), Path(state.data_dir) / "logs" / "redis.log")
        state.redis_session_id = proc.pid
        state.redis_url = f"redis://127.0.0.1:{port}/0"
        save_state(state)
        redis_server.wait_ready(state.redis_url)
        note["detail"] = state.redis_url


def _start_ray(cfg: FleetConfig, state: FleetState, progress: Progress) -> None:
    gcs_port = free_port()
    state.ray_address = f"127.0.0.1:{gcs_port}"
    for i in range(cfg.nodes):
        node_id = f"node-{i}"
        with progress.step(f"ray {'head' if i == 0 else 'node'} {node_id}"):
            _start_node(cfg, state, node_id, head=(i == 0), gcs_port=gcs_port)


def _start_node(cfg: FleetConfig, state: FleetState, node_id: str, head: bool, gcs_port: int) -> None:
    node_dir = Path(state.data_dir) / node_id
    node_dir.mkdir(parents=True, exist_ok=True)
    env = _base_env(state)
    env.update({NODE_NAME_ENV: node_id, NODE_DATA_DIR_ENV: str(node_dir)})
    argv = [sys.executable, "-m", "cluster.fleet.ray_cli", "start", "--node-ip-address=127.0.0.1",
            f"--num-cpus={os.cpu_count() or 2}", f"--resources={json.dumps({NODE_RESOURCE: 1})}",
            f"--labels={json.dumps({NODE_LABEL: node_id})}", f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats"]
    if head:
        dash_port = 8265 if port_is_free("127.0.0.1", 8265) else free_port()
        argv += ["--head", f"--port={gcs_port}", f"--temp-dir={state.ray_temp_dir}",
                 f"--ray-client-server-port={free_port()}", "--dashboard-host=127.0.0.1",
                 f"--include-dashboard={'true' if cfg.dashboard else 'false'}", f"--dashboard-port={dash_port}"]
        if cfg.dashboard:
            state.dashboard_url = f"http://127.0.0.1:{dash_port}"
    else:
        argv.append(f"--address={state.ray_address}")
    log = node_dir / "ray-start.log"
    proc = processes.spawn(argv, env, log)
    state.nodes.append(NodeProcess(node_id=node_id, session_id=proc.pid, data_dir=str(node_dir), log=str(log)))
    save_state(state)
    if proc.wait(timeout=180) != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise FleetError(f"ray start for {node_id} failed (see {log}): {' | '.join(tail)}")


def connect(state: FleetState) -> None:
    """Attach this process to the fleet's Ray cluster as a driver."""
    import logging

    import ray

    from cluster.fleet.ray_cli import keep_on_loopback

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    keep_on_loopback()
    if not ray.is_initialized():
        ray.init(address=state.ray_address, namespace="mlx-fleet", logging_level=logging.WARNING,
                 log_to_driver=False)


def _deploy(cfg: FleetConfig, state: FleetState, progress: Progress) -> None:
    import ray
    from ray import serve

    from cluster.actors.app import build_app

    import logging

    app_config = AppConfig.model_validate({**cfg.app.model_dump(), "data_dir": state.data_dir,
                                           "redis_url": state.redis_url})
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # our progress lines say it better
    connect(state)
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
                raise FleetError(f"the serve app failed to deploy: {' | '.join(m for m in msgs if m)[:2000]}")
        if time.monotonic() > deadline:
            raise FleetError(f"replicas were not healthy after {timeout_s:.0f}s; see the logs under {state.ray_temp_dir}/session_latest/logs")
        time.sleep(0.5)
