"""Does the backend repeat a cold run bit for bit? The same prompt cold, several times in one process.

    mlx-fleet bench repeat [--model tiny-swa] [--dtype bfloat16] [--tokens 250] [--max-tokens 12]
                           [--runs 8] [--variants stock,contiguous,ops] [--json out.json]

A cached answer can only be bitwise the cold one where the cold run is bitwise itself. On the CPU it is.
On MLX's CUDA backend a bf16 decode of the tiny sliding-window model past position 256 was not, in one
process (docs/gpu.md, the eleventh session): the cold run made again parted from the first, and a cached
run from both. This finds which step varies and whether the attention kernel is the cause, by running the
decode's attention three ways (prefill always the stock way):
- stock: mlx-lm's `scaled_dot_product_attention` as the model calls it (on CUDA, cuDNN where K/V are
  slices of a buffer whose length is a multiple of 256, as a KV cache's are; else MLX's sdpa_vector);
- contiguous: the same, with the decode's K and V copied to contiguous arrays first (sdpa_vector on CUDA);
- ops: attention by plain ops in float32 (matmul, softmax, matmul).
Each run is cut by the replica's prefill schedule (`--resume-at`, `--block-tokens`, `--prefill-step`: by
default the canonical one of tests/kvcache/test_canonical_schedule.py). Reported per variant: how many
distinct logit rows the runs gave at each step (1: bitwise repeatable), the largest difference between
runs, and against the stock runs (on a GPU not 0 where the variant changed the kernel; on the CPU the
contiguous one runs the same kernel, and the ops one too in float32).
No goal: a diagnosis of the backend. Its finding (docs/gpu.md, the twelfth session): cuDNN's decode path,
which MLX takes once 256 keys sit in a KV cache's buffer, does not repeat; since, one-query attention runs in
the project's own kernel on CUDA (engine/invariant.py, `exact_decode_attention`), so there "stock" (and
"contiguous", which hands its copies to it) is that kernel, and this bench checks that it repeats.
"""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path

from cluster.bench.common import environment, load, parser, prompt_tokens, write_json

VARIANTS = ("stock", "contiguous", "ops")


def _attention(variant: str, stock):
    """The model module's attention for `variant`: decode steps (one query row) changed, prefill stock."""
    import mlx.core as mx

    def contiguous(q, k, v, cache, scale, mask, **kw):
        if q.shape[2] == 1:
            k, v = mx.contiguous(k), mx.contiguous(v)
        return stock(q, k, v, cache=cache, scale=scale, mask=mask, **kw)

    def ops(q, k, v, cache, scale, mask, **kw):
        if q.shape[2] != 1 or kw.get("sinks") is not None:  # attention sinks: not this variant's
            return stock(q, k, v, cache=cache, scale=scale, mask=mask, **kw)
        if q.shape[1] != k.shape[1]:  # grouped queries: each KV head serves q_heads / kv_heads of them
            k, v = (mx.repeat(x, q.shape[1] // k.shape[1], axis=1) for x in (k, v))
        scores = (q.astype(mx.float32) * scale) @ k.astype(mx.float32).swapaxes(-1, -2)
        if isinstance(mask, mx.array):
            scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
        return (mx.softmax(scores, axis=-1) @ v.astype(mx.float32)).astype(q.dtype)

    return {"stock": stock, "contiguous": contiguous, "ops": ops}[variant]


def measure(model, tok, path: Path, tokens: int, max_tokens: int, runs: int, resume_at: str = "chunk",
            block_tokens: int = 32, prefill_step: int = 64, variants: tuple[str, ...] = VARIANTS) -> dict:
    import mlx.core as mx
    import numpy as np

    from cluster.config import CacheConfig
    from cluster.engine.cold_session import ColdSession
    from cluster.engine.request import GenerationParams
    from cluster.engine.sequence import Sequence
    from cluster.kvcache.setup import setup_cache

    with tempfile.TemporaryDirectory() as work:
        pc = setup_cache(model, tok, path, CacheConfig(resume_at=resume_at, block_tokens=block_tokens), Path(work),
                         prefill_step=prefill_step).cache
    module = importlib.import_module(type(model).__module__)
    stock = getattr(module, "scaled_dot_product_attention", None)
    if stock is None:
        raise ValueError(f"{module.__name__} calls no scaled_dot_product_attention of its own: nothing to vary")
    prompt = prompt_tokens(tokens)

    def cold() -> np.ndarray:
        seq = Sequence(list(prompt), GenerationParams(max_tokens=max_tokens, record_logits=True), model, tok,
                       ColdSession(model, pc.new_caches, pc.schedule), prefill_step)
        while not seq.done:
            seq.step()
        return np.array(mx.stack(seq.logits).astype(mx.float32))

    variants = ("stock", *(v for v in variants if v != "stock"))  # first: the others are compared with it
    out, first = {}, None
    try:
        for variant in variants:
            setattr(module, "scaled_dot_product_attention", _attention(variant, stock))
            rows = [cold() for _ in range(runs)]
            steps = min(len(r) for r in rows)
            first = rows[0] if first is None else first  # stock's: a variant that took effect differs from it
            distinct = [len({r[s].tobytes() for r in rows}) for s in range(steps)]
            out[variant] = {"distinct_per_step": distinct, "repeatable": max(distinct) == 1,
                            "first_varying_step": next((s for s, d in enumerate(distinct) if d > 1), None),
                            "largest_gap": max(float(np.abs(r[:steps] - rows[0][:steps]).max()) for r in rows),
                            "gap_vs_stock": float(np.abs(rows[0][:steps] - first[:steps]).max())}
    finally:
        setattr(module, "scaled_dot_product_attention", stock)
    return {"tokens": tokens, "max_tokens": max_tokens, "runs": runs, "schedule": pc.schedule.fingerprint(),
            "variants": out}


def main(argv: list[str]) -> int:
    p = parser(__doc__.splitlines()[0], __name__)
    p.add_argument("--model", default="tiny-swa", help="built-in model")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"], help="the model's dtype")
    p.add_argument("--tokens", type=int, default=250, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=12, help="greedy tokens per run (decode steps)")
    p.add_argument("--runs", type=int, default=8, help="cold runs per variant")
    p.add_argument("--resume-at", default="chunk", choices=["auto", "chunk", "block"], help="the prefill schedule")
    p.add_argument("--block-tokens", type=int, default=32, help="tokens per block (the schedule's unit)")
    p.add_argument("--prefill-step", type=int, default=64, help="prefill chunk tokens")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"decode-attention paths, comma-separated, of {VARIANTS}")
    a = p.parse_args(argv)
    variants = tuple(v for v in a.variants.split(",") if v)
    if not variants or set(variants) - set(VARIANTS):
        p.error(f"--variants: each of {VARIANTS}, comma-separated; got {a.variants!r}")
    import mlx.core as mx

    model, tok, path = load(a.model, a.data_dir)
    model.set_dtype(getattr(mx, a.dtype))
    r = measure(model, tok, path, a.tokens, a.max_tokens, a.runs, a.resume_at, a.block_tokens, a.prefill_step,
                variants)
    for variant, v in r["variants"].items():
        print(f"{a.model} {a.dtype}, {a.tokens} tokens, decode attention {variant}: distinct logit rows per step over "
              f"{a.runs} runs {v['distinct_per_step']}; first varying step {v['first_varying_step']}; largest "
              f"difference {v['largest_gap']:.3g}; against stock {v['gap_vs_stock']:.3g}", flush=True)
    write_json(a.json, "repeat", {"model": a.model, "dtype": a.dtype, "environment": environment(), **r})
    return 0
