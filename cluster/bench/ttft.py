"""Time to first token: a fully cached prompt against the same prompt cold, in one run.

    mlx-fleet bench ttft [--models bench-qwen3-0.6b] [--tokens 2048 ...] [--block-tokens 64]
                         [--resume-at auto|chunk|block ...] [--repeat 3] [--vs-mlx-lm-server]
                         [--json out.json]

Per model, on one prompt of `tokens` tokens (max_tokens=1, greedy), each figure the median of
`--repeat` runs:
- cold:     no cache at all (what a cache miss costs);
- capture:  cold, while storing every block (the overhead of filling the cache);
- spill:    then, as a replica does while idle, its blocks written to the disk (a
            device tier's spills wait for idle: PrefixCache.spill_idle);
- ram:      the same prompt again, restored from the RAM tier: all but the last
            token, from the blocks and the prompt's tail (kvcache/tails.py);
- disk:     the same prompt in a fresh replica (empty RAM tier) over the same disk
            tier, with the block files dropped from the page cache first (Linux), restored:
            a replica that has measured nothing takes every hit. `disk_s` is their median.
            On CUDA one untimed disk restore comes first: a replica's first disk hit makes
            its page-locked read buffers, later ones reuse them (`read_buffers_warmed_s`
            is that hit's time).
- chosen:   the same again, in one replica whose RAM tier lets its blocks go before each
            run, with the speeds the capturing replica measured (it did not restart): where recomputing is predicted faster it
            recomputes (costs.py; until a read is measured, the spills' write speed stands
            in, and such a recompute reads a sample in the background). `choices` counts what
            was chosen, `disk_recompute_s` is the median of the chosen runs that recomputed,
            `chosen_worst_vs_cold` the slowest chosen run against cold (the goal: never above
            it), and `chosen_worst_vs_capture` against the capture runs: what a cold request
            costs on a replica that keeps its blocks, which a chosen recompute does too (it
            keeps the blocks in RAM again, so the next hit is a RAM hit). `disk_limit_s` is
            1.25 x the blocks' bytes / the disk's read bandwidth measured on those files (4
            readers, page cache dropped), plus the prefill left after the restore at the cold
            run's speed (it ends with the forward of the last token). A prompt's tail is RAM
            only, so the disk hit restores to the last cut. `admission_s` lists each RAM and
            disk hit's admission stage (lookups, the choice, reads), so a row shows where a
            hit's time went.
The target is cached/cold <= 0.05 on a realistic-shape model from RAM, and disk <= its limit.
With --vs-mlx-lm-server, mlx_lm.server's cold and cached TTFT on the same model and prompt
length (bench/mlx_lm_server.py) join each row, and `ram_vs_server` compares the RAM hit with
its prompt cache.
Every run is cut by the replica's prefill schedule (`--resume-at`, several: one row each;
engine/schedule.py), the cold ones too, and the first token's logits of the RAM and
disk hits are compared with the cold run's: `ram_logit_diff` and `disk_logit_diff`,
0.0 when bitwise.

bench-qwen3-0.6b is the Qwen3-0.6B geometry with random float32 weights (built
on first use, 1.8 GB). Its cold 2k prefill is slow on the CPU backend; on Linux
preload an optimized BLAS for this benchmark:
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 [OPENBLAS_CORETYPE=SkylakeX] mlx-fleet bench ttft
    (the core type only on a CPU with AVX-512: elsewhere it crashes with SIGILL)
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from cluster.bench.common import load, parser, prompt_tokens, write_json
from cluster.config import CacheConfig
from cluster.engine.cold_session import ColdSession
from cluster.engine.events import Delta, Started
from cluster.engine.request import GenerationParams
from cluster.engine.schedule import on_gpu
from cluster.engine.sequence import Sequence
from cluster.bench.disk import drop_cache, read_bandwidth
from cluster.kvcache.admission import SAMPLE_THREAD, Admission
from cluster.kvcache.session import BlockSession
from cluster.kvcache.store_link import LocalLink
from cluster.kvcache.setup import setup_cache
from cluster.store.disk_tier import DiskStore


def first_token(model, tok, prompt, session, logits: Optional[list] = None) -> tuple[float, int, int]:
    """(seconds to the first token, cached tokens, the token); `session` may be a callable making it,
    timed too (the admission stage: lookups and reads). The first step's logits go to `logits`."""
    t0 = time.perf_counter()
    session = session() if callable(session) else session
    seq = Sequence(prompt, GenerationParams(max_tokens=1, record_logits=logits is not None), model, tok, session,
                   prefill_step=PREFILL_STEP)
    cached = 0
    while True:
        for e in seq.step():
            if isinstance(e, Started):
                cached = e.cached_tokens
            if isinstance(e, Delta):
                elapsed = time.perf_counter() - t0
                while not seq.done:
                    seq.step()
                if logits is not None:
                    logits.append(seq.logits[0])
                return elapsed, cached, e.token_ids[0]


def logit_diff(a, b) -> float:
    """Largest absolute difference of two logit rows, in float32 (0.0: bitwise the same)."""
    import mlx.core as mx

    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


PREFILL_STEP = 512  # ModelSpec.prefill_step_tokens' default


def warm(pc, prompt, spent: Optional[list] = None):
    """A callable making the request's session through the admission stage (lookups, the restore-or-recompute
    choice, reads); its seconds are appended to `spent`, so a row can say where a hit's time went."""
    def make():
        t0 = time.perf_counter()
        prefetch = Admission(pc).fetch(prompt)
        if spent is not None:
            spent.append(time.perf_counter() - t0)
        return BlockSession(pc, prompt, prefetch)
    return make


def measure(name: str, data_dir: Path, tokens: int, block_tokens: int, loaded=None, resume_at: str = "auto",
            repeat: int = 3) -> dict:
    """One row; `loaded` is load(name, data_dir) if the caller has it already.

    Each figure is the median of `repeat` runs (the lists are in the row too): a GPU's first run of a
    shape compiles kernels and its allocator's first use of a size maps fresh pages, which a serving
    replica pays once, not per request. The cold run is warmed first; each capture fills a replica of its
    own, fresh; each disk hit reads into a fresh replica with the page cache dropped."""
    model, tok, path = loaded or load(name, data_dir)
    work = Path(tempfile.mkdtemp(prefix="bench-ttft-", dir=data_dir))
    config = CacheConfig(block_tokens=block_tokens, ram_bytes=16 << 30, resume_at=resume_at)
    stores: list[DiskStore] = []

    def replica(new_disk: bool = False, **kw):
        """A replica with an empty RAM tier, over the last disk or (`new_disk`) an empty one of its own."""
        if new_disk or not stores:
            stores.append(DiskStore(work / f"node{len(stores)}", budget=1 << 40))
        pc = setup_cache(model, tok, path, config, work, store_link=LocalLink(stores[-1]),
                         prefill_step=PREFILL_STEP, **kw).cache
        pc.spill_when_idle = pc.device  # as in a replica: a device tier spills while the model thread is idle
        return pc

    try:
        pc = replica()
        schedule = pc.schedule
        prompt = prompt_tokens(tokens)
        # Warm up: a GPU compiles kernels per shape, so there the whole prompt once (its chunks' attention
        # shapes); on the CPU a short one is enough.
        first_token(model, tok, prompt if on_gpu() else prompt[:64], ColdSession(model, pc.new_caches, schedule))
        logits: list = []
        colds = [first_token(model, tok, prompt, ColdSession(model, pc.new_caches, schedule), logits)
                 for _ in range(repeat)]
        captures = []
        for i in range(repeat):  # the last replica stays: its RAM tier serves the RAM hits, its disk the disk hits
            # An empty disk each: a slow prefill (the CPU's) spills blocks overdue while it runs, and the next
            # capture would restore them instead of computing cold.
            pc = replica(new_disk=True, schedule=schedule) if i else pc
            captures.append(first_token(model, tok, prompt, warm(pc, prompt)))
            if captures[-1][1]:
                raise RuntimeError(f"capture run {i} found {captures[-1][1]} tokens cached: it is not cold")
        t0 = time.perf_counter()
        while pc.spill_idle():
            time.sleep(0.001)
        pc.tiers.disk.flush(600)
        spill = time.perf_counter() - t0
        store = stores[-1]
        admitted: dict = {"ram": [], "disk": [], "chosen": []}
        rams = [first_token(model, tok, prompt, warm(pc, prompt, admitted["ram"]), logits if not i else None)
                for i in range(repeat)]
        files = [store.path(k.ns, k.key) for k in store.index.entries.values()]
        read_bps = read_bandwidth(files)
        disks, cold_cache, warmed = [], False, None
        if pc.tiers.disk.buffers is not None:
            # A replica that has restored from its disk before holds its read buffers (page-locked, on CUDA:
            # kernels/cuda_upload.py): one untimed restore, with speeds of its own, makes them as that hit did.
            drop_cache(files)
            warmed = first_token(model, tok, prompt, warm(replica(schedule=schedule), prompt))[0]
        costs = pc.costs  # the replica's measured speeds carry over: its RAM let the blocks go, it did not restart
        costs.prefill_tps = lambda: tokens / statistics.median([r[0] for r in colds])
        for i in range(repeat):  # what a restore costs: a replica that has measured nothing takes every hit
            cold_cache = drop_cache(files)
            disks.append(first_token(model, tok, prompt, warm(replica(schedule=schedule), prompt, admitted["disk"]),
                                     logits if not i else None))
        chosen = []
        chooser = replica(schedule=schedule)  # one replica, as a serving one is: its allocator warms up
        chooser.costs = costs
        for i in range(repeat):  # what the replica chooses, with the speeds it measured (costs.py)
            assert chooser.tiers.disk.flush(600)
            for key in chooser.tiers.ram.keys():  # what its last run restored or captured: only the disk has it
                chooser.tiers.ram.discard(key)
            drop_cache(files)
            chosen.append(first_token(model, tok, prompt, warm(chooser, prompt, admitted["chosen"])))
            for t in threading.enumerate():  # a recompute chosen on the write speed reads a sample: let it end
                if t.name == SAMPLE_THREAD:
                    t.join()
        cold, capture, ram = (statistics.median([r[0] for r in runs]) for runs in (colds, captures, rams))
        # The forced restores are the hit's cost; the chosen runs what the choice makes of it (never above cold
        # is the goal), those that recomputed a figure of their own.
        restored, recomputed = [r for r in disks if r[1]], [r for r in chosen if not r[1]]
        disk = statistics.median([r[0] for r in restored]) if restored else None
        recompute = statistics.median([r[0] for r in recomputed]) if recomputed else None
        worst = max(r[0] for r in chosen)
        n, n_disk = rams[0][1], (statistics.median([r[1] for r in restored]) if restored else 0)
        same = (len({r[2] for r in colds + captures + rams + disks + chosen}) == 1
                and {r[1] for r in rams} == {n})
        if not same:
            print(f"  {name} at {tokens}: the first token or cached length differs: cold {colds}, capture "
                  f"{captures}, ram {rams}, disk {disks}, chosen {chosen}", flush=True)
        return {"model": name, "tokens": tokens, "block_tokens": block_tokens, "resume_at": schedule.mode,
                "chunk_tokens": schedule.chunk_tokens, "repeat": repeat, "cached_tokens": n,
                "disk_cached_tokens": n_disk, "same_first_token": same, "choices": dict(costs.choices),
                "costs": costs.stats(),
                "ram_logit_diff": logit_diff(logits[repeat], logits[0]),
                "disk_logit_diff": logit_diff(logits[repeat + 1], logits[0]),
                "cold_s": cold, "capture_s": capture, "spill_s": spill, "ram_s": ram, "disk_s": disk,
                "disk_recompute_s": recompute,
                "runs_s": {"cold": [r[0] for r in colds], "capture": [r[0] for r in captures],
                           "ram": [r[0] for r in rams], "disk": [r[0] for r in disks],
                           "chosen": [r[0] for r in chosen]},
                "disk_cached_runs": [r[1] for r in disks], "chosen_cached_runs": [r[1] for r in chosen],
                "chosen_worst_vs_cold": worst / cold, "chosen_worst_vs_capture": worst / capture,
                "admission_s": admitted,
                "disk_read_gbps": read_bps / 1e9 if read_bps else None,
                "disk_limit_s": (1.25 * store.index.bytes / read_bps + cold * (tokens - n_disk) / tokens
                                 if read_bps and restored else None),
                "spilled": pc.tiers.disk.counters["spilled"], "dropped_spills": pc.tiers.disk.counters["dropped_spills"],
                "ram_vs_cold": ram / cold, "disk_vs_cold": disk / cold if restored else None,
                "recompute_vs_cold": recompute / cold if recomputed else None, "capture_overhead": capture / cold - 1,
                "page_cache": "dropped" if cold_cache else "warm", "cached_bytes": store.index.bytes,
                "read_buffers_warmed_s": warmed,
                "read_buffers": pc.tiers.disk.buffers.stats() if pc.tiers.disk.buffers is not None else None}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def vs_server(name: str, loaded, rows: list[dict]) -> None:
    """mlx_lm.server's cold and cached TTFT for each row's prompt length, added to the rows."""
    from cluster.bench.mlx_lm_server import MlxLmServer

    _, tok, path = loaded
    with MlxLmServer(path) as server:
        for tokens in sorted({r["tokens"] for r in rows}):
            got = server.measure(tok.decode(prompt_tokens(tokens, salt=1)), tok.decode(prompt_tokens(tokens)))
            print(f"  mlx_lm.server {name} at {got['server_tokens']} tokens: cold {got['server_cold_s']:.3f} s, "
                  f"cached {got['server_cached_s']:.3f} s", flush=True)
            for r in rows:
                if r["tokens"] == tokens:
                    r.update(got, ram_vs_server=r["ram_s"] / got["server_cached_s"])
                    print(f"    ours ({r['resume_at']}) from RAM {r['ram_s']:.3f} s: {r['ram_vs_server']:.2f}x its cached",
                          flush=True)


def main(argv: list[str]) -> int:
    p = parser(__doc__.splitlines()[0], __name__)
    p.add_argument("--models", default="bench-qwen3-0.6b", help="built-in models, comma-separated")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048], help="prompt tokens (several: one row each)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per block")
    p.add_argument("--resume-at", nargs="+", default=["auto"], choices=["auto", "chunk", "block"],
                   help="prefill schedules to measure (several: one row each)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each figure (cold, capture, RAM hit, disk hit); the row has their median")
    p.add_argument("--vs-mlx-lm-server", action="store_true",
                   help="also time mlx_lm.server's prompt cache on the same model and prompt lengths (over HTTP)")
    a = p.parse_args(argv)
    rows = []
    print(f"{'model':<20}{'tokens':>7}{'sched':>6}{'cached':>8}{'disk':>6}{'cold s':>9}{'capture s':>11}{'ram s':>8}{'disk s':>8}"
          f"{'ram/cold':>10}{'disk/cold':>11}{'disk/limit':>11}{'recompute s':>13}{'chosen/cold':>13}{'/capture':>10}{'capture ovh':>13}{'spill s':>9}"
          f"{'ram diff':>10}{'disk diff':>11}")
    for name in a.models.split(","):
        loaded = load(name, a.data_dir)
        for tokens in a.tokens:
            for resume_at in a.resume_at:
                r = measure(name, a.data_dir, tokens, a.block_tokens, loaded, resume_at, a.repeat)
                rows.append(r)
                print(f"{r['model']:<20}{r['tokens']:>7}{r['resume_at']:>6}{r['cached_tokens']:>8}{r['disk_cached_tokens']:>6}{r['cold_s']:>9.3f}"
                      f"{r['capture_s']:>11.3f}{r['ram_s']:>8.3f}{_num(r['disk_s'], '.3f'):>8}{r['ram_vs_cold']:>10.4f}"
                      f"{_num(r['disk_vs_cold'], '.4f'):>11}{_ratio(r['disk_s'], r['disk_limit_s']):>11}"
                      f"{_num(r['disk_recompute_s'], '.3f'):>13}{r['chosen_worst_vs_cold']:>13.3f}"
                      f"{r['chosen_worst_vs_capture']:>10.3f}"
                      f"{r['capture_overhead']:>12.1%}{r['spill_s']:>9.3f}{r['ram_logit_diff']:>10.2g}"
                      f"{r['disk_logit_diff']:>11.2g}", flush=True)
        if a.vs_mlx_lm_server:
            try:
                vs_server(name, loaded, [r for r in rows if r["model"] == name])
            except Exception as e:  # the peer failing must not lose our rows
                print(f"  mlx_lm.server on {name} failed: {e}", flush=True)
                for r in rows:
                    if r["model"] == name:
                        r.setdefault("server_error", str(e))
        del loaded
    print(f"(disk reads with the page cache {rows[-1]['page_cache']}; goals: ram/cold <= 0.05, disk/limit <= 1, "
          "chosen/cold (the slowest chosen disk run) <= 1, capture overhead <= 10%)")
    write_json(a.json, "ttft", {"rows": rows})
    return 0


def _ratio(value: float | None, limit: float | None) -> str:
    return f"{value / limit:.2f}" if value is not None and limit else "-"


def _num(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"
