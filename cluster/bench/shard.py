"""A 2-way sharded replica against the same model whole, in one run; and what the links between Macs would cost.

    mlx-fleet bench shard [--model bench-qwen3-0.6b] [--mode tensor|pipeline] [--prompt-tokens 256]
                          [--max-tokens 16] [--concurrency 1 4] [--rounds 2] [--json out.json]

1. Whole: the model in this process, one scheduler: TTFT of one prompt (prefill, then its first token) and
   decode tokens/s with c requests at once (medians of --rounds).
2. Sharded: two rank processes over MLX's ring backend on loopback (--mode, engine/sharding.py), in
   lockstep (engine/lockstep.py): rank 0 runs the same requests. Before it serves, both ranks time the
   communication a forward makes, in the model's dtype: tensor parallel, two all_sums per layer of
   [rows, hidden]; pipeline, one hand-off of [rows, hidden] and the all_gather of the last stage's output.
   So the report splits each decode step into communication and the rest.
3. Macs: what a decode step's communication would cost in either mode (the same bytes, priced with a
   link's bandwidth and per-message latency): ring over 10 GbE and JACCL over Thunderbolt 5 (reported
   figures, not measured here).

On this 2-core box the two ranks share the two cores that the whole model has to itself, and loopback TCP
is the link: sharding is expected to be slower here, and the report says by how much and why.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster.bench.common import environment, load, parser, write_json

# Reported, not measured here: 10 GbE carries 1.25 GB/s and TCP ring collectives cost tens of microseconds;
# JACCL over Thunderbolt 5 (macOS 26.2+) 50-60 Gbit/s with 5-9 us latency (docs/sharding.md).
LINKS = {"ring over 10 GbE": (1.25e9, 50e-6), "JACCL over Thunderbolt 5": (6.5e9, 8e-6)}


def prompts(n: int, tokens: int, salt: int) -> list[list[int]]:
    return [[3 + (i * 7919 + (salt + j) * 104729) % 1000 for i in range(tokens)] for j in range(n)]


def measure(scheduler, model, tok, a) -> dict:
    """TTFT of one prompt and decode tokens/s at each concurrency, on `scheduler` (whole or rank 0)."""
    from cluster.engine.cold_session import ColdSession
    from cluster.engine.events import Finished
    from cluster.engine.request import GenerationParams
    from cluster.engine.schedule import Schedule
    from cluster.engine.sequence import Sequence

    schedule = Schedule.of("chunk", 64, 512)

    def seqs(ps, n):
        return [Sequence(p, GenerationParams(max_tokens=n), model, tok, ColdSession(model, schedule=schedule))
                for p in ps]

    def finished(events):
        return [next(e for e in ev if isinstance(e, Finished)) for ev in events]

    scheduler.run_all(seqs(prompts(1, 16, 0), 2))  # warm-up
    ttft = [finished(scheduler.run_all(seqs(prompts(1, a.prompt_tokens, r), 1)))[0].timings["ttft_s"]
            for r in range(a.rounds)]
    decode = {}
    for c in a.concurrency:
        runs = []
        for r in range(a.rounds):
            t0 = time.perf_counter()
            done = finished(scheduler.run_all(seqs(prompts(c, 32, 100 * c + r), a.max_tokens)))
            wall = time.perf_counter() - t0
            first = min(f.timings["ttft_s"] for f in done)
            runs.append(sum(f.completion_tokens - 1 for f in done) / (wall - first))
        decode[c] = {"decode_tokens_per_s": round(statistics.median(runs), 2), "rounds": [round(x, 2) for x in runs]}
    return {"ttft_s": round(statistics.median(ttft), 4), "ttft_runs_s": [round(x, 4) for x in ttft], "decode": decode}


def collectives(group, hidden: int, dtype, rows: list[int], mode: str, iters: int = 30) -> dict:
    """Seconds of communication per forward unit with [rows, hidden] (every rank runs this, in the same
    order): tensor, one all_sum (a forward makes two per layer); pipeline, a forward's whole hand-off."""
    import mlx.core as mx

    def once(x):
        if mode == "tensor":
            return mx.distributed.all_sum(x, group=group)
        # rank 1 (the first stage) sends to rank 0, and every rank gathers the last stage's output
        y = mx.distributed.send(x, 0, group=group) if group.rank() == 1 else \
            mx.distributed.recv_like(x, 1, group=group)
        return mx.distributed.all_gather(y, group=group)

    out = {}
    for _ in range(20):  # the connections' first messages are slower than any later ones
        mx.eval(once(mx.ones((1, hidden), dtype)))
    for r in rows:
        x = mx.ones((r, hidden), dtype)
        mx.eval(once(x))
        t0 = time.perf_counter()
        for _ in range(iters):
            mx.eval(once(x))
        out[r] = (time.perf_counter() - t0) / iters
    return out


def geometry_of(model_dir: Path) -> tuple[int, int]:
    """(hidden size, layers) from the model's config (a multimodal one's text part)."""
    from cluster.models.resolve import read_config, text_config

    config = text_config(read_config(model_dir))
    return config["hidden_size"], config["num_hidden_layers"]


def per_step(mode: str, layers: int, unit_s: float) -> float:
    """A decode step's communication from `collectives`' unit."""
    return 2 * layers * unit_s if mode == "tensor" else unit_s


def rank_main(a) -> int:
    """One rank of the sharded run (a child process of the driver)."""
    from cluster.models.loading import load_model

    from cluster.engine.cold_session import ColdSession
    from cluster.engine.lockstep import Lockstep
    from cluster.engine.schedule import Schedule
    from cluster.engine.sequence import Sequence
    from cluster.engine.sharded_scheduler import ShardedScheduler
    from cluster.engine.sharding import init_group, shard
    from cluster.models.resolve import resolve_model

    scheduler = ShardedScheduler(name=f"mlx-fleet-bench-rank{a.rank}", decode_concurrency=max(a.concurrency))

    def setup():
        group = init_group(a.rank, Path(a.hostfile))
        path = resolve_model(a.model, a.data_dir)
        model, tok = load_model(path, lazy=True)
        shard(model, group, a.mode)
        hidden, layers = geometry_of(path)
        comm = collectives(group, hidden, model.model.embed_tokens.weight.dtype, sorted({1, *a.concurrency}), a.mode)
        return group, model, tok, comm, layers

    group, model, tok, comm, layers = scheduler.run(setup)
    schedule = Schedule.of("chunk", 64, 512)

    def rebuild(prompt, params, step, cached):
        return Sequence(prompt, params, model, tok, ColdSession(model, schedule=schedule), step)

    scheduler.join(Lockstep(group), rebuild)
    if a.rank == 0:
        result = {"measured": measure(scheduler, model, tok, a), "collective_s": comm, "layers": layers}
        scheduler.stop()
        Path(a.out).write_text(json.dumps(result))
    else:
        while scheduler.alive:
            time.sleep(0.05)
    return 0


def sharded(a) -> dict:
    from cluster.ports import free_port

    with tempfile.TemporaryDirectory(prefix="bench-shard-") as work:
        hosts, out = Path(work) / "hosts.json", Path(work) / "rank0.json"
        hosts.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(2)]))
        argv = [sys.executable, "-m", "cluster.cli", "bench", "shard", "--data-dir", str(a.data_dir), "--model", a.model,
                "--mode", a.mode,
                "--prompt-tokens", str(a.prompt_tokens), "--max-tokens", str(a.max_tokens), "--rounds", str(a.rounds),
                "--concurrency", *map(str, a.concurrency), "--hostfile", str(hosts), "--out", str(out)]
        procs = [subprocess.Popen([*argv, "--rank", str(r)], stderr=subprocess.DEVNULL if r else None) for r in range(2)]
        codes = [p.wait(timeout=3600) for p in procs]
        if codes[0] != 0:
            raise RuntimeError(f"rank 0 of the sharded run failed ({codes})")
        return json.loads(out.read_text())


def estimates(layers: int, hidden: int, itemsize: int, rows: list[int]) -> dict:
    """Communication per decode step on Mac links, two ranks, in either mode: tensor, 2 all_sums a layer of
    rows x hidden (each two messages); pipeline, one hand-off and one all_gather of rows x hidden."""
    out = {}
    for name, (bandwidth, latency) in LINKS.items():
        def ms(r: int, mode: str) -> float:
            message = latency + r * hidden * itemsize / bandwidth
            return round(1e3 * (2 * layers * 2 * message if mode == "tensor" else 3 * message), 3)
        out[name] = {mode: {r: ms(r, mode) for r in rows} for mode in ("tensor", "pipeline")}
    return out


def main(argv: list[str]) -> int:
    p = parser(__doc__.splitlines()[0], __name__)
    p.add_argument("--model", default="bench-qwen3-0.6b", help="a built-in model (its family needs mlx-lm's shard, "
                   "or its pipeline with --mode pipeline)")
    p.add_argument("--mode", choices=["tensor", "pipeline"], default="tensor", help="how the ranks split the model")
    p.add_argument("--prompt-tokens", type=int, default=256, help="the TTFT prompt's tokens")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each decode request generates")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="decode requests at once")
    p.add_argument("--rounds", type=int, default=2, help="runs of every figure; the median is reported")
    for hidden in ("--rank", "--hostfile", "--out"):  # a rank process of the sharded run (set by the driver)
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rank is not None:
        a.rank = int(a.rank)
        code = rank_main(a)
        sys.stdout.flush()
        os._exit(code)  # MLX's ring backend aborts in its teardown at interpreter exit; the result is written
    return driver(a)


def driver(a) -> int:
    from cluster.engine.scheduler import Scheduler
    from cluster.models.resolve import resolve_model

    model, tok, _ = load(a.model, a.data_dir)
    scheduler = Scheduler(name="mlx-fleet-bench", decode_concurrency=max(a.concurrency))
    try:
        whole = measure(scheduler, model, tok, a)
    finally:
        scheduler.stop()
    hidden, _ = geometry_of(resolve_model(a.model, a.data_dir))
    itemsize = model.model.embed_tokens.weight.dtype.size
    del model
    split = sharded(a)
    ours, comm, layers = split["measured"], split["collective_s"], split["layers"]
    rows = {"model": a.model, "mode": a.mode, "whole": whole, "sharded": ours,
            "ttft_sharded_vs_whole": round(ours["ttft_s"] / whole["ttft_s"], 2),
            "decode": {}, "mac_links_ms_per_step": estimates(layers, hidden, itemsize, a.concurrency)}
    print(f"{a.model}: TTFT of {a.prompt_tokens} tokens whole {whole['ttft_s']:.3f} s, {a.mode} parallel over 2 "
          f"{ours['ttft_s']:.3f} s "
          f"({rows['ttft_sharded_vs_whole']}x)")
    for c in a.concurrency:
        w, s = whole["decode"][c]["decode_tokens_per_s"], ours["decode"][str(c)]["decode_tokens_per_s"]
        step_s = c / s
        comm_s = per_step(a.mode, layers, comm[str(c)])
        rows["decode"][c] = {"whole": w, "sharded": s, "sharded_vs_whole": round(s / w, 2),
                             "step_ms": round(1e3 * step_s, 2), "communication_ms": round(1e3 * comm_s, 2),
                             "communication_share": round(comm_s / step_s, 3)}
        r = rows["decode"][c]
        print(f"  c={c}: decode {w} tok/s whole, {s} sharded ({r['sharded_vs_whole']}x); a sharded step {r['step_ms']} ms, "
              f"of which the collectives {r['communication_ms']} ms ({r['communication_share']:.0%})")
    for name, modes in rows["mac_links_ms_per_step"].items():
        for mode, per in modes.items():
            print(f"  {name} (reported figures), {mode}: " + ", ".join(
                f"c={c}: {ms} ms of communication per decode step" for c, ms in per.items()))
    write_json(a.json, "shard", {**rows, "environment": environment()})
    return 0
