"""Time to first token: a fully cached prompt against the same prompt cold, in one run.

    mlx-fleet bench ttft [--models bench-qwen3-0.6b] [--tokens 2048 ...] [--block-tokens 64] [--json out.json]

Per model, on one prompt of `tokens` tokens (max_tokens=1, greedy):
- cold:     no cache at all (what a cache miss costs);
- capture:  cold, while storing every block (the overhead of filling the cache);
- ram:      the same prompt again, restored from the RAM tier (all but the last
            token, or back to the last checkpoint on hybrids);
- disk:     the same prompt in a fresh replica (empty RAM tier) over the same disk
            tier, with the block files dropped from the page cache first (Linux).
The target is cached/cold <= 0.05 on a realistic-shape model, from RAM and from disk.

bench-qwen3-0.6b is the Qwen3-0.6B geometry with random float32 weights (built
on first use, 1.8 GB). Its cold 2k prefill is slow on the CPU backend; on Linux
preload an optimized BLAS for this benchmark:
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 [OPENBLAS_CORETYPE=SkylakeX] mlx-fleet bench ttft
    (the core type only on a CPU with AVX-512: elsewhere it crashes with SIGILL)
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from cluster.bench.common import load, parser, prompt_tokens, write_json
from cluster.config import CacheConfig
from cluster.engine.cold_session import ColdSession
from cluster.engine.events import Delta, Started
from cluster.engine.request import GenerationParams
from cluster.engine.sequence import Sequence
from cluster.bench.disk import drop_cache
from cluster.kvcache.admission import Admission
from cluster.kvcache.session import BlockSession
from cluster.kvcache.store_link import LocalLink
from cluster.kvcache.setup import setup_cache
from cluster.store.disk_tier import DiskStore


def first_token(model, tok, prompt, session) -> tuple[float, int, int]:
    """(seconds to the first token, cached tokens, the token); `session` may be a callable making it,
    timed too (the admission stage: lookups and reads)."""
    t0 = time.perf_counter()
    session = session() if callable(session) else session
    seq = Sequence(prompt, GenerationParams(max_tokens=1), model, tok, session, prefill_step=512)
    cached = 0
    while True:
        for e in seq.step():
            if isinstance(e, Started):
                cached = e.cached_tokens
            if isinstance(e, Delta):
                elapsed = time.perf_counter() - t0
                while not seq.done:
                    seq.step()
                return elapsed, cached, e.token_ids[0]


def warm(pc, prompt):
    return lambda: BlockSession(pc, prompt, Admission(pc).fetch(prompt))


def measure(name: str, data_dir: Path, tokens: int, block_tokens: int, loaded=None) -> dict:
    """One row; `loaded` is load(name, data_dir) if the caller has it already."""
    model, tok, path = loaded or load(name, data_dir)
    work = Path(tempfile.mkdtemp(prefix="bench-ttft-", dir=data_dir))
    store = DiskStore(work / "node", budget=1 << 40)
    config = CacheConfig(block_tokens=block_tokens, ram_bytes=16 << 30)
    try:
        pc = setup_cache(model, tok, path, config, work, store_link=LocalLink(store)).cache
        prompt = prompt_tokens(tokens)
        first_token(model, tok, prompt[:64], ColdSession(model, pc.new_caches))  # warm up kernels
        cold, _, t_cold = first_token(model, tok, prompt, ColdSession(model, pc.new_caches))
        capture, _, t_capture = first_token(model, tok, prompt, warm(pc, prompt))
        ram, n, t_ram = first_token(model, tok, prompt, warm(pc, prompt))
        pc.tiers.disk.flush(600)
        fresh = setup_cache(model, tok, path, config, work, store_link=LocalLink(store)).cache  # empty RAM
        cold_cache = drop_cache([store.path(k.ns, k.key) for k in store.index.entries.values()])
        disk, n_disk, t_disk = first_token(model, tok, prompt, warm(fresh, prompt))
        same = t_cold == t_capture == t_ram == t_disk and n_disk == n
        if not same:
            print(f"  {name} at {tokens}: the first token or cached length differs: cold {t_cold}, capture "
                  f"{t_capture}, ram {t_ram} ({n} cached), disk {t_disk} ({n_disk} cached)", flush=True)
        return {"model": name, "tokens": tokens, "block_tokens": block_tokens, "cached_tokens": n,
                "disk_cached_tokens": n_disk, "same_first_token": same,
                "cold_s": cold, "capture_s": capture, "ram_s": ram, "disk_s": disk,
                "ram_vs_cold": ram / cold, "disk_vs_cold": disk / cold, "capture_overhead": capture / cold - 1,
                "page_cache": "dropped" if cold_cache else "warm", "cached_bytes": store.index.bytes}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str]) -> int:
    p = parser(__doc__.splitlines()[0], __name__)
    p.add_argument("--models", default="bench-qwen3-0.6b", help="built-in models, comma-separated")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048], help="prompt tokens (several: one row each)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per block")
    a = p.parse_args(argv)
    rows = []
    print(f"{'model':<20}{'tokens':>7}{'cached':>8}{'cold s':>9}{'capture s':>11}{'ram s':>8}{'disk s':>8}"
          f"{'ram/cold':>10}{'disk/cold':>11}{'capture ovh':>13}")
    for name in a.models.split(","):
        loaded = load(name, a.data_dir)
        for tokens in a.tokens:
            r = measure(name, a.data_dir, tokens, a.block_tokens, loaded)
            rows.append(r)
            print(f"{r['model']:<20}{r['tokens']:>7}{r['cached_tokens']:>8}{r['cold_s']:>9.3f}{r['capture_s']:>11.3f}"
                  f"{r['ram_s']:>8.3f}{r['disk_s']:>8.3f}{r['ram_vs_cold']:>10.4f}{r['disk_vs_cold']:>11.4f}"
                  f"{r['capture_overhead']:>12.1%}", flush=True)
    print(f"(disk reads with the page cache {rows[-1]['page_cache']}; goal: ram/cold and disk/cold <= 0.05)")
    write_json(a.json, "ttft", {"rows": rows})
    return 0
