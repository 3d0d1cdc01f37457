"""Block codec throughput against a plain numpy copy of the same bytes, and KV bytes per token.

    mlx-fleet bench codec [--models tiny-dense,tiny-swa,...] [--tokens 2048] [--block-tokens 64] [--json out.json]

For each model: prefill `tokens` tokens, then time
- encode: capture every block from the live caches (store_block, seal), then frame it as it leaves
          the process: a host view, the checksum, the envelope (PrefixCache.envelope);
- decode: verify and parse every stored block and copy its arrays into MLX memory;
- copy:   numpy copying the same number of bytes once (the floor any codec pays).
Ratios are codec GB/s over copy GB/s, measured in the same run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from cluster.bench.common import best_of, load, parser, prompt_tokens, write_json
from cluster.config import CacheConfig
from cluster.families.codecs import codec_descriptor, new_cache, payload_signature
from cluster.families.specs import FullAttention, Layout
from cluster.kvcache.prefix_cache import PrefixCache, Shapes
from cluster.kvcache.setup import setup_cache
from mlx_lm.models.cache import KVCache
from cluster.store.arrays import dtype_tag, to_mlx
from cluster.store.hashing import chain_ids, state_key
from cluster.kvcache.tiers import Tiers

DEFAULT_MODELS = "tiny-dense,tiny-swa,tiny-hybrid,tiny-gemma4,tiny-next,geometry:qwen3-0.6b"
# Realistic geometry without a model: the codec's cost depends on shapes, not values.
GEOMETRIES = {"qwen3-0.6b": {"layers": 28, "kv_heads": 8, "head_dim": 128, "dtype": mx.float32}}


def real_model_caches(name: str, data_dir: Path, tokens: int, block_tokens: int):
    model, tok, path = load(name, data_dir)
    cfg = CacheConfig(block_tokens=block_tokens, ram_bytes=1 << 34)
    pc = setup_cache(model, tok, path, cfg, Path(tempfile.mkdtemp())).cache
    prompt = prompt_tokens(tokens)
    caches = [new_cache(s) for s in pc.layout.layers]
    fed = min(tokens, 512) if pc.layout.windows() else tokens  # a window model's ring would rotate past 512
    for start in range(0, fed, 512):  # block-aligned chunks: every block is still in the caches
        model(mx.array(prompt[start:min(start + 512, fed)])[None], cache=caches)
        mx.eval([c.state for c in caches])
    return pc, caches, prompt[:fed]


def geometry_caches(name: str, tokens: int, block_tokens: int):
    g = GEOMETRIES[name]
    layout = Layout(family=f"geometry:{name}", layers=tuple(FullAttention() for _ in range(g["layers"])))
    caches = []
    for _ in range(g["layers"]):
        c = KVCache()
        kv = mx.random.normal((1, g["kv_heads"], tokens, g["head_dim"])).astype(g["dtype"])
        c.update_and_fetch(kv, kv + 1)
        caches.append(c)
    mx.eval([c.state for c in caches])
    sig = [payload_signature(spec, c, block_tokens) for spec, c in zip(layout.layers, caches)]
    shapes = Shapes(dtype=dtype_tag(g["dtype"]), kv=tuple(s[0] for s in sig), state=tuple(s[1] for s in sig))
    pc = PrefixCache(layout, bytes(32), CacheConfig(block_tokens=block_tokens, ram_bytes=1 << 34),
                     Tiers(1 << 34, bytes(32)), shapes, codec_descriptor("native", 64))
    return pc, caches, prompt_tokens(tokens)


def measure(name: str, data_dir: Path, tokens: int, block_tokens: int) -> dict:
    if name.startswith("geometry:"):
        pc, caches, prompt = geometry_caches(name.split(":", 1)[1], tokens, block_tokens)
    else:
        pc, caches, prompt = real_model_caches(name, data_dir, tokens, block_tokens)
    fed = len(prompt)
    ids = chain_ids(pc.namespace, prompt, block_tokens)

    def encode_all():
        pc.tiers = Tiers(1 << 34, pc.namespace)
        for j, bid in enumerate(ids):
            pc.store_block(j, bid, ids[j - 1] if j else pc.namespace, prompt[j * block_tokens:(j + 1) * block_tokens], caches)
        if pc.layout.has_recurrent:
            pc.store_state(len(ids) - 1, ids[-1], ids[-2] if len(ids) > 1 else pc.namespace,
                           prompt[(len(ids) - 1) * block_tokens: len(ids) * block_tokens], pc.snapshot_state(caches))
        pc.seal()
        return {key: pc.envelope(key) for key in pc.tiers.ram.keys()}

    t_enc = best_of(encode_all)
    blobs = encode_all()
    total = sum(len(b) for b in blobs.values())

    def decode_all():
        out = []
        for j, bid in enumerate(ids):
            blk = pc.decode(blobs[bid], "kv", j, ids)
            out += [to_mlx(a) for entry in blk.entries for a in entry]
        if pc.layout.has_recurrent:
            key = state_key(ids[-1])
            blk = pc.decode(blobs[key], "state", len(ids) - 1, ids)
            out += [to_mlx(a) for entry in blk.entries for a in entry]
        mx.eval(out)

    t_dec = best_of(decode_all)
    src, dst = np.frombuffer(b"".join(blobs.values()), dtype=np.uint8), np.empty(total, dtype=np.uint8)
    t_copy = best_of(lambda: np.copyto(dst, src), repeats=5)
    # The codec writes every block into new memory; so does this peer (page faults included).
    t_fresh = best_of(lambda: [np.array(np.frombuffer(b, dtype=np.uint8)) for b in blobs.values()], repeats=5)
    state_bytes = sum(len(b) for k, b in blobs.items() if k not in set(ids))
    return {
        "model": name, "family": pc.layout.family, "block_tokens": block_tokens, "tokens": fed,
        "blocks": len(ids), "bytes": total,
        "kv_bytes_per_token": round(sum(len(blobs[i]) for i in ids) / (len(ids) * block_tokens)),
        "checkpoint_bytes": state_bytes,
        "encode_gbps": total / t_enc / 1e9, "decode_gbps": total / t_dec / 1e9, "copy_gbps": total / t_copy / 1e9,
        "fresh_copy_gbps": total / t_fresh / 1e9,
        "encode_vs_copy": t_copy / t_enc, "decode_vs_copy": t_copy / t_dec,
        "encode_vs_fresh_copy": t_fresh / t_enc, "decode_vs_fresh_copy": t_fresh / t_dec,
    }


def main(argv: list[str]) -> int:
    p = parser(__doc__.splitlines()[0], __name__)
    p.add_argument("--models", default=DEFAULT_MODELS, help="built-in models, comma-separated")
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens prefilled, then encoded and decoded")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per block")
    a = p.parse_args(argv)
    rows = [measure(m, a.data_dir, a.tokens, a.block_tokens) for m in a.models.split(",")]
    print(f"{'model':<22}{'KV B/tok':>9}{'ckpt B':>9}{'enc GB/s':>10}{'dec GB/s':>10}{'copy GB/s':>11}"
          f"{'fresh GB/s':>12}{'enc/fresh':>11}{'dec/fresh':>11}")
    for r in rows:
        print(f"{r['model']:<22}{r['kv_bytes_per_token']:>9}{r['checkpoint_bytes']:>9}{r['encode_gbps']:>10.2f}"
              f"{r['decode_gbps']:>10.2f}{r['copy_gbps']:>11.2f}{r['fresh_copy_gbps']:>12.2f}"
              f"{r['encode_vs_fresh_copy']:>11.2f}{r['decode_vs_fresh_copy']:>11.2f}")
    print("copy = numpy copy into a warm buffer; fresh = numpy copy into new memory, as the codec must do")
    write_json(a.json, "codec", {"rows": rows})
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
