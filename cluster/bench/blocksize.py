"""What the block size costs: the measurements behind the default of --block-tokens.

    mlx-fleet bench blocksize [--sizes 16,32,64,128,256] [--tokens 2048] [--json out.json]

For each block size B, on the Qwen3-0.6B KV geometry (28 layers x 8 KV heads x 128, f32):
- hash:     chain ids of an 8k-token prompt (the gateway pays this per request);
- keys:     index entries an 8k prompt needs (Redis memory, lookup payload);
- capture:  storing every block of a `tokens` prefill (encode, checksum, RAM tier);
- restore:  rebuilding the caches of a fully cached `tokens` prompt;
- waste:    tokens recomputed on a partial hit, (B - 1) / 2 on average, since only
            full blocks are named (more on hybrids: back to the last checkpoint).
Small B wastes little on partial hits but pays per-block overhead everywhere;
large B is cheap per token but misses up to B - 1 tokens of every shared prefix.
"""

from __future__ import annotations

import mlx.core as mx

from cluster.bench.codec import geometry_caches
from cluster.bench.common import best_of, parser, prompt_tokens, write_json
from cluster.store.hashing import chain_ids
from cluster.kvcache.admission import Admission
from cluster.kvcache.tiers import Tiers


def measure(block_tokens: int, tokens: int) -> dict:
    long_prompt = prompt_tokens(8192)
    t_hash = best_of(lambda: chain_ids(bytes(32), long_prompt, block_tokens), repeats=20)
    pc, caches, prompt = geometry_caches("qwen3-0.6b", tokens, block_tokens)
    ids = chain_ids(pc.namespace, prompt, block_tokens)

    def capture():
        pc.tiers = Tiers(1 << 34, pc.namespace)
        for j, bid in enumerate(ids):
            pc.store_block(j, bid, ids[j - 1] if j else pc.namespace,
                           prompt[j * block_tokens:(j + 1) * block_tokens], caches)
        pc.seal()

    t_capture = best_of(capture)
    raw = sum(c.keys[..., :tokens, :].nbytes + c.values[..., :tokens, :].nbytes for c in caches)
    stored = pc.tiers.stats()["ram"]["bytes"]

    def restore():
        restored, n, _ = pc.restore(prompt + [0], Admission(pc).fetch(prompt + [0]))
        assert n == tokens
        mx.eval([c.state for c in restored])

    t_restore = best_of(restore)
    return {"block_tokens": block_tokens, "hash_8k_ms": t_hash * 1e3, "keys_8k": 8192 // block_tokens,
            "capture_ms": t_capture * 1e3, "restore_ms": t_restore * 1e3,
            "capture_gbps": raw / t_capture / 1e9, "restore_gbps": raw / t_restore / 1e9,
            "framing_overhead": stored / raw - 1, "mean_waste_tokens": (block_tokens - 1) / 2}


def main(argv: list[str]) -> int:
    p = parser(__doc__.splitlines()[0], __name__)
    p.add_argument("--sizes", default="16,32,64,128,256", help="block sizes to compare, comma-separated")
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens captured and restored")
    a = p.parse_args(argv)
    rows = []
    print(f"{'B':>5}{'hash 8k ms':>12}{'keys 8k':>9}{'capture ms':>12}{'restore ms':>12}{'capture GB/s':>14}"
          f"{'restore GB/s':>14}{'framing':>9}{'waste tok':>11}")
    for b in (int(x) for x in a.sizes.split(",")):
        r = measure(b, a.tokens)
        rows.append(r)
        print(f"{b:>5}{r['hash_8k_ms']:>12.3f}{r['keys_8k']:>9}{r['capture_ms']:>12.1f}{r['restore_ms']:>12.1f}"
              f"{r['capture_gbps']:>14.2f}{r['restore_gbps']:>14.2f}{r['framing_overhead']:>9.2%}"
              f"{r['mean_waste_tokens']:>11.1f}", flush=True)
    write_json(a.json, "blocksize", {"tokens": a.tokens, "rows": rows})
    return 0

