"""`mlx-fleet`: start, stop, inspect and benchmark a fleet.

Every subcommand builds the same pydantic config objects the Serve app uses,
so a bad flag fails with the field's name and what to do, before anything
starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from cluster.config import (AppConfig, CacheConfig, FleetConfig, GatewayConfig, ModelSpec, RoutingConfig,
                            default_data_dir, first_error)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-fleet", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a local fleet and wait until it is healthy")
    up.add_argument("--nodes", type=int, default=1, help="Ray nodes on this machine (default 1)")
    up.add_argument("--model", action="append", default=None, metavar="[NAME=]SOURCE",
                    help="built-in name, model directory or Hugging Face repo id; repeat to serve several (default tiny-dense)")
    up.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    up.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    up.add_argument("--redis-url", default=None,
                    help="use this Redis (redis://, rediss:// or unix://) instead of starting one (default: its own, "
                         "under the data dir; an empty value means that too)")
    up.add_argument("--block-tokens", type=int, default=None, help="tokens per KV block, 16-256 (default 64)")
    up.add_argument("--kv-codec", default=None, choices=["native", "q8", "q4", "tq8", "tq4", "tq3", "tq2"],
                    help="how K/V are kept: native (exact, the default), q8/q4 (mlx's quantized cache), tq8..tq2 (TurboQuant-packed in the tiers and between nodes)")
    up.add_argument("--resume-at", default=None, choices=["auto", "chunk", "block"],
                    help="prefill schedule that keeps cached answers bitwise the cold ones: chunk (exact on a GPU), "
                         "block (finer reuse, exact on the CPU), auto (the default: chunk on a GPU; on the CPU block, "
                         "or one-block chunks for sliding-window models)")
    up.add_argument("--cache-ram-gb", type=float, default=None, help="RAM tier budget per replica in GiB (default 2)")
    up.add_argument("--cache-disk-gb", type=float, default=None,
                    help="disk tier budget per node in GiB (default: half the free space, at most 100)")
    up.add_argument("--no-disk-cache", action="store_true", help="keep blocks in RAM only")
    up.add_argument("--no-cache", action="store_true", help="disable KV block reuse")
    up.add_argument("--max-context", type=int, default=None,
                    help="override every model's context window in tokens (default: each model's own)")
    up.add_argument("--no-batching", action="store_true",
                    help="decode each replica's sequences in turns, one token each, instead of in one batch")
    up.add_argument("--shards", type=int, default=None,
                    help="nodes each replica of every model spans (one rank per node; default 1: a whole model per node)")
    up.add_argument("--shard-mode", choices=["auto", "tensor", "pipeline"], default=None,
                    help="how a sharded replica splits the model: tensor (every layer over the ranks), pipeline "
                         "(a run of layers per rank), auto (default: tensor where the family can)")
    up.add_argument("--shard-backend", choices=["ring", "jaccl"], default=None,
                    help="how a sharded replica's ranks talk: ring (TCP, any network; default) or jaccl (RDMA over "
                         "Thunderbolt 5, macOS 26.2+ with RDMA enabled: docs/sharding.md)")
    up.add_argument("--deterministic", action="store_true",
                    help="batch-invariant decode: a batched request's logits bitwise its solo run's (on a GPU; costs throughput)")
    up.add_argument("--decode-concurrency", type=int, default=None,
                    help="sequences a replica decodes in one batch (default: its max ongoing requests, 16)")
    up.add_argument("--prefill-concurrency", type=int, default=None,
                    help="sequences a replica prefills at once (default 8)")
    up.add_argument("--stream-interval", type=float, default=None, metavar="SECONDS",
                    help="once the first text is out, send each request's tokens at most this often, gathered (default 0.02; 0: every step)")
    up.add_argument("--stream-messages", type=float, default=None, metavar="PER_S",
                    help="most messages per second a replica streams over all its requests; with more streams each "
                         "one's interval grows (default 100; 0: no bound)")
    up.add_argument("--assign-timeout", type=float, default=None, help="seconds a request may wait for a replica before 503 (default 15)")
    up.add_argument("--api-keys-file", default=None, metavar="FILE",
                    help="require 'Authorization: Bearer <key>' with one of the keys in FILE (one per line); "
                         "MLX_FLEET_API_KEYS (comma-separated) adds more")
    up.add_argument("--gateways", type=int, default=None, help="gateway replicas (default 2)")
    up.add_argument("--routing", default=None, choices=["affinity", "pow2", "round_robin"],
                    help="how requests pick a replica (default affinity: the one predicted to answer first)")
    up.add_argument("--no-dashboard", action="store_true", help="do not start the Ray dashboard")
    up.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops the fleet")
    _data_dir(up)

    down = sub.add_parser("down", help="stop every process the fleet under --data-dir started")
    _data_dir(down)

    status = sub.add_parser("status", help="nodes, replicas and models of a running fleet")
    status.add_argument("--json", action="store_true",
                        help="print it as JSON (with \"running\": false and the reason when no fleet runs)")
    _data_dir(status)

    models = sub.add_parser("models", help="list the built-in models (building any that are missing)")
    models.add_argument("--json", action="store_true", help="print the list as JSON")
    _data_dir(models)

    deploy = sub.add_parser("deploy", help="deploy or update the app on a running Ray cluster (a `ray up` fleet) "
                                          "from a Serve config such as deploy/serve.yaml, and wait until it serves")
    deploy.add_argument("file", help="the Serve config (deploy/serve.yaml); its args are checked like `up`'s")
    deploy.add_argument("--address", default=None,
                        help="the head's dashboard, http://<head>:8265 (default $RAY_DASHBOARD_ADDRESS, an http "
                             "$RAY_ADDRESS, or http://127.0.0.1:8265); the token comes from RAY_AUTH_MODE=token "
                             "and ~/.ray/auth_token or RAY_AUTH_TOKEN_PATH, as for every Ray command")
    deploy.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for every replica (900)")

    bench = sub.add_parser("bench", help="benchmarks (see `mlx-fleet bench -h`)")
    bench.add_argument("name", nargs="?", help="which benchmark: ttft | codec | blocksize | disk | lookup | routing | migrate | turboquant | batch | shard | gpu "
                                    "(`mlx-fleet bench <name> -h` for its options)")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")

    # Listed here for the help; its arguments are its own (loadtest/run.py), see main().
    sub.add_parser("loadtest", add_help=False,
                   help="locust load test with a report: TTFT by cache state, routing policies compared "
                        "(see `mlx-fleet loadtest -h`)")
    return p


def _this_command() -> str:
    """How this CLI was run, for the hints it prints: `.venv/bin/mlx-fleet` (make's) is not on PATH."""
    exe = Path(sys.argv[0])
    return shlex.quote(str(exe)) if exe.name == "mlx-fleet" and exe.parent != Path() else "mlx-fleet"


def _data_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, default=None,
                   help=f"fleet state directory (default $MLX_FLEET_DATA_DIR or {default_data_dir()})")


def _fleet_config(a: argparse.Namespace) -> FleetConfig:
    overrides = {k: v for k, v in {"max_context": a.max_context, "decode_concurrency": a.decode_concurrency,
                                   "prefill_concurrency": a.prefill_concurrency,
                                   "stream_interval_s": a.stream_interval,
                                   "stream_messages_per_s": a.stream_messages, "shards": a.shards,
                                   "shard_mode": a.shard_mode, "shard_backend": a.shard_backend}.items()
                 if v is not None}
    if a.no_batching:
        overrides["batching"] = False
    if a.deterministic:
        overrides["deterministic"] = True
    models = [ModelSpec.parse(m, **overrides) for m in (a.model or ["tiny-dense"])]
    ram = int(a.cache_ram_gb * 2**30) if a.cache_ram_gb is not None else None
    disk = int(a.cache_disk_gb * 2**30) if a.cache_disk_gb is not None else None
    cache = {k: v for k, v in {"block_tokens": a.block_tokens, "kv_codec": a.kv_codec, "ram_bytes": ram,
                               "disk_bytes": disk, "resume_at": a.resume_at}.items() if v is not None}
    if a.no_disk_cache:
        cache["disk"] = False
    if a.no_cache:
        cache["enabled"] = False
    gateway = {k: v for k, v in {"assign_timeout_s": a.assign_timeout, "replicas": a.gateways,
                                 "api_keys_file": str(Path(a.api_keys_file).expanduser().resolve())
                                 if a.api_keys_file else None}.items() if v is not None}
    routing = {"policy": a.routing} if a.routing else {}
    app = AppConfig(models=models, redis_url=a.redis_url, cache=CacheConfig(**cache), gateway=GatewayConfig(**gateway),
                    routing=RoutingConfig(**routing))
    return FleetConfig(nodes=a.nodes, port=a.port, host=a.host, redis_url=a.redis_url,
                       data_dir=a.data_dir or default_data_dir(), dashboard=not a.no_dashboard,
                       foreground=a.foreground, app=app)


def cmd_up(a: argparse.Namespace) -> int:
    cfg = _fleet_config(a)
    if any(m.shards > 1 and m.shard_backend == "jaccl" for m in cfg.app.models):
        from cluster.engine.jaccl import check_available

        check_available()  # before any node starts: this Mac's MLX is the fleet's
    from cluster.fleet.launcher import up

    t0 = time.monotonic()
    with _term_as_interrupt():  # a SIGTERM mid-start (a timeout, a service manager) cleans up as Ctrl-C does
        state = up(cfg)
    model = cfg.app.models[0].name
    print(f"\nmlx-fleet is up in {time.monotonic() - t0:.1f}s: {cfg.nodes} node(s), model(s) {', '.join(state.models)}")
    print(f"  endpoint:  {state.http_url}/v1")
    print(f"  backend:   MLX on {_backend()} (each replica's is in `mlx-fleet status`)")
    if state.dashboard_url:
        print(f"  dashboard: {state.dashboard_url}")
    print("  try:\n"
          f"    curl {state.http_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"      -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 16}}'")
    print(f"  logs:      {state.ray_temp_dir}/session_latest/logs (Ray's and the replicas'; the next up keeps "
          f"this run's session beside its own and drops older ones)")
    print(f"  stop:      {_this_command()} down --data-dir {state.data_dir}")
    if cfg.foreground:
        return _stay_attached(Path(state.data_dir))
    return 0


@contextlib.contextmanager
def _term_as_interrupt():
    """SIGTERM raises KeyboardInterrupt once, so the start's cleanup runs; a second one during it is ignored."""
    import signal

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _backend() -> str:
    """This machine's MLX backend, as replicas started here report it (cpu, gpu:sm_90, gpu:applegpu_g15s)."""
    from cluster.store.fingerprint import backend

    return backend()


def _stay_attached(data_dir: Path) -> int:
    from cluster.fleet.launcher import down

    print("(foreground: Ctrl-C stops the fleet)")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nstopping ...")
    down(data_dir)
    return 0


def cmd_down(a: argparse.Namespace) -> int:
    from cluster.fleet.launcher import down
    from cluster.fleet.state import load_state

    data_dir = Path(a.data_dir or default_data_dir()).expanduser()
    recorded = load_state(data_dir) is not None
    n = down(data_dir)
    if n:
        print(f"mlx-fleet: stopped {n} process(es) under {data_dir}")
    elif recorded:
        print(f"mlx-fleet: nothing was running under {data_dir}; cleared the record of a fleet stopped without "
              "`down` (after a reboot, say)")
    else:
        print(f"mlx-fleet: nothing running under {data_dir}")
    return 0


def cmd_status(a: argparse.Namespace) -> int:
    from cluster.fleet.ray_env import FleetGone, connect
    from cluster.fleet.state import load_state
    from cluster.status import fleet_status

    data_dir = Path(a.data_dir or default_data_dir()).expanduser()
    state = load_state(data_dir)

    def not_running(why: str, out=sys.stdout) -> int:
        if a.json:  # whoever parses it gets JSON either way
            print(json.dumps({"running": False, "data_dir": str(data_dir), "error": why}), file=out, flush=True)
        print(f"mlx-fleet: {why}", file=sys.stderr)
        return 1

    flag = f" --data-dir {shlex.quote(str(data_dir))}" if a.data_dir else ""
    if state is None or not state.ready:
        return not_running(f"no fleet is running under {data_dir} (start one with `{_this_command()} up{flag}`)")
    out = _own_stdout()
    try:
        connect(state)
    except FleetGone as e:
        return not_running(f"{e}; `{_this_command()} down{flag}` clears what is left, `{_this_command()} up{flag}` "
                           "starts it again", out)
    status = fleet_status(state.redis_url, state.models, state.data_dir)
    status["running"] = True
    status["endpoint"] = state.http_url
    status["base_url"] = f"{state.http_url}/v1"  # what an OpenAI client takes, as the text shows it
    status["dashboard"] = state.dashboard_url
    if a.json:
        print(json.dumps(status, indent=2, default=str), file=out, flush=True)
        return 0
    from cluster.fleet.status_text import render

    print(render(status), file=out, flush=True)
    return 0


def _own_stdout():
    """Keep stdout for our output alone: Ray's driver prints cluster events ("(raylet) The node ... is
    dead") from its own threads, which would break `status --json` for whoever parses it. From here on
    anything else written to stdout, from Python or from native code, goes to stderr."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def cmd_models(a: argparse.Namespace) -> int:
    from cluster.models.listing import list_builtin_models

    rows = list_builtin_models(Path(a.data_dir or default_data_dir()).expanduser())
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['family']:<12} {r['parameters'] / 1e6:6.2f}M  {r['path']}")
    return 0


def cmd_deploy(a: argparse.Namespace) -> int:
    from cluster.fleet.deploy import main

    return main(a.file, a.address, a.timeout)


def cmd_bench(a: argparse.Namespace) -> int:
    from cluster.bench import BENCHMARKS, run_benchmark

    if a.name is None or a.name not in BENCHMARKS:  # argparse would call the optional REMAINDER "required" too
        said = "name a benchmark" if a.name is None else f"no benchmark is called {a.name!r}; choose one of"
        print(f"mlx-fleet bench: {said}: {', '.join(sorted(BENCHMARKS))} (`mlx-fleet bench <name> -h`)",
              file=sys.stderr)
        return 2
    return run_benchmark(a.name, a.rest)


# (config model, field) -> the `up` flag that sets it: a flag's mistake is told by the flag the user typed.
UP_FLAGS = {("FleetConfig", "nodes"): "--nodes", ("FleetConfig", "port"): "--port", ("FleetConfig", "host"): "--host",
            ("FleetConfig", "redis_url"): "--redis-url", ("AppConfig", "redis_url"): "--redis-url",
            ("AppConfig", "models"): "--model", ("ModelSpec", "name"): "--model", ("ModelSpec", "source"): "--model",
            ("ModelSpec", "max_context"): "--max-context", ("ModelSpec", "decode_concurrency"): "--decode-concurrency",
            ("ModelSpec", "prefill_concurrency"): "--prefill-concurrency", ("ModelSpec", "shards"): "--shards",
            ("FleetConfig", ""): "--shards",  # its one check across fields: the shards fit the nodes
            ("ModelSpec", "shard_mode"): "--shard-mode", ("ModelSpec", "shard_backend"): "--shard-backend",
            ("ModelSpec", "stream_interval_s"): "--stream-interval",
            ("ModelSpec", "stream_messages_per_s"): "--stream-messages",
            ("CacheConfig", "block_tokens"): "--block-tokens (16-256, default 64)",
            ("CacheConfig", "ram_bytes"): "--cache-ram-gb", ("CacheConfig", "disk_bytes"): "--cache-disk-gb",
            ("GatewayConfig", "replicas"): "--gateways", ("GatewayConfig", "assign_timeout_s"): "--assign-timeout"}


COMMANDS = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "models": cmd_models, "deploy": cmd_deploy,
            "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["loadtest"]:
        from loadtest.run import main as loadtest

        return loadtest(argv[1:])
    args = _parser().parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        return COMMANDS[args.command](args)
    except ValidationError as e:
        field, msg = first_error(e)
        flag = UP_FLAGS.get((e.title, field.split("[")[0])) if args.command == "up" else None
        print(f"mlx-fleet: {flag}: {msg}" if flag else f"mlx-fleet: invalid {field or 'config'}: {msg}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as e:
        print(f"mlx-fleet: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("mlx"):
            raise
        print("mlx-fleet: MLX has no backend here: on Linux install mlx-fleet with one, "
              "pip install 'mlx-fleet[cpu]' or 'mlx-fleet[cuda]' (NVIDIA, CUDA 13); `make` installs [cpu] "
              f"unless BACKEND=cuda ({e})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
