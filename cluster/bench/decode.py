"""What the exact one-query attention costs a decode: steps per second with it and with mlx-lm's attention.

    mlx-fleet bench decode [--model bench-qwen3-8b] [--context 2048 8192 32768] [--rows 1 8] [--steps 32]
                           [--json out.json]

On MLX's CUDA backend every one-query forward (a decode step, a prompt's last token) attends in the
project's batch-invariant kernel instead of mlx-lm's attention (engine/invariant.py,
`exact_decode_attention`), because MLX's cuDNN decode path does not repeat itself bit for bit. The kernel
is the price of that exactness. This prices it where it could show: one row and a batch of rows, at long
contexts (a step's attention reads every key, the rest of the step does not grow with the context).

For each context and row count the rows are prefilled once (in the engine's `DecodeBatch`, as a replica
decodes), then `--steps` greedy steps are timed four times, mlx-lm's attention and the kernel alternating;
each way's figure is the faster of its two turns. Reported: steps/s each way, the kernel's over mlx-lm's,
and the rows still decoding at the end (a row that samples its end-of-sequence token leaves the batch). On the CPU and Metal the route is off by default; this bench
turns it on anyway, so it runs there too (on the CPU the kernel is its per-row reference: slow, and not
what it prices).
"""

from __future__ import annotations

import time

from cluster.bench.common import load, parser, prompt_tokens, write_json


def measure(model, tok, contexts: list[int], rows: list[int], steps: int, prefill_step: int = 512) -> list[dict]:
    import mlx.core as mx

    from cluster.engine import invariant
    from cluster.engine.batch import DecodeBatch
    from cluster.engine.cold_session import ColdSession
    from cluster.engine.request import GenerationParams
    from cluster.engine.sequence import Sequence

    was = invariant.routes_one_query()
    out = []
    try:
        for context in contexts:
            for n in rows:
                seqs = [Sequence(prompt_tokens(context, salt=r), GenerationParams(max_tokens=5 * steps + 8), model,
                                 tok, ColdSession(model), prefill_step) for r in range(n)]
                for s in seqs:
                    s.begin()
                    while not s.prefilled:
                        s.prefill(prefill_step)
                batch = DecodeBatch(model)
                batch.step(seqs)  # the prompts' last tokens

                def timed(route: bool) -> float:
                    invariant.exact_decode_attention(route)
                    batch.step([])  # a first step each way, untimed: its graph and kernels
                    mx.eval(batch._y)
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        batch.step([])
                    mx.eval(batch._y)
                    return steps / (time.perf_counter() - t0)

                turns = {"kernel": [], "mlx_lm": []}
                for route in (False, True, False, True):  # each way twice, alternating: order favours neither
                    turns["kernel" if route else "mlx_lm"].append(timed(route))
                kernel, stock = max(turns["kernel"]), max(turns["mlx_lm"])
                out.append({"context": context, "rows": n, "rows_at_end": len(batch), "steps": steps,
                            "kernel_steps_per_s": kernel, "mlx_lm_steps_per_s": stock,
                            "kernel_vs_mlx_lm": kernel / stock, "turns": turns})
                del batch, seqs
                mx.clear_cache()
    finally:
        invariant.exact_decode_attention(was)
    return out


def main(argv: list[str]) -> int:
    p = parser(__doc__.splitlines()[0], __name__)
    p.add_argument("--model", default="bench-qwen3-8b", help="built-in model")
    p.add_argument("--context", type=int, nargs="+", default=[2048, 8192, 32768], help="prompt tokens per row")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows decoding together")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per way")
    p.add_argument("--prefill-step", type=int, default=512, help="prefill chunk tokens")
    a = p.parse_args(argv)
    if min(a.context) < 2 or min(a.rows) < 1 or a.steps < 1:
        p.error("--context at least 2, --rows and --steps at least 1")
    model, tok, _ = load(a.model, a.data_dir)
    r = measure(model, tok, a.context, a.rows, a.steps, a.prefill_step)
    for x in r:
        print(f"{a.model}, context {x['context']}, {x['rows']} rows: kernel {x['kernel_steps_per_s']:.1f} steps/s, "
              f"mlx-lm's attention {x['mlx_lm_steps_per_s']:.1f} steps/s, kernel {x['kernel_vs_mlx_lm']:.3f}x",
              flush=True)
    write_json(a.json, "decode", {"model": a.model, "runs": r})
    return 0
