"""Continuous batching against sequential serving and against mlx_lm.server, in one run.

    mlx-fleet bench batch [--model tiny-dense] [--concurrency 1 2 4 8] [--prompt-tokens 32]
                          [--max-tokens 128] [--rounds 5] [--deterministic] [--no-sequential]
                          [--no-http | --no-engine]
                          [--json out.json]

Two comparisons, each on the same greedy workload (at concurrency c, c distinct
prompts of --prompt-tokens random tokens arrive at once, each generates
--max-tokens):

1. Engine: one replica's Scheduler, batched against sequential (every sequence
   a step in turn, the fleet's mode before batching), and against mlx-lm's own
   BatchGenerator (`batch_generate`, what mlx_lm.server batches with), in this
   process, the three interleaved round by round. Reported per c and way: the
   median of --rounds rounds (5) of aggregate generated tokens/s over the
   round's wall time, with its decode tokens/s (from each request's first token
   to the last token of the round), TTFT p50 and max, every round's tokens/s,
   and whether every request's tokens are identical in every round of all three.
2. HTTP: a one-node fleet (`mlx-fleet up`) against `mlx_lm.server` on the same
   model directory, the same prompts as text through /v1/completions, streamed.
   Every round sends c new prompts (the same to both), so neither server's prompt
   cache answers. Reported per c: the median of --rounds rounds (5) of aggregate
   tokens/s, with its TTFT p50 and max, every round's tokens/s and TTFT max (a
   request admitted late to a running batch shows there), and whether the texts agree
   (mlx_lm.server drops a completion's leading space, ours keeps it: that one
   space aside).

Goals (from the issue): at c=8 at least 2x sequential, at least mlx_lm.server's
aggregate, identical greedy text. This CPU has no GPU: a decode step here is
compute- not bandwidth-bound, so batching gains far less than on a Mac.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster.bench.common import load, parser, write_json


WARM_UP = "Warm-up."
# A replica's prefill cuts: at absolute positions, whatever part of a step's budget a prompt gets beside others,
# so a prompt prefills the same chunks in a batch as alone.
SCHEDULE = None


def prompts_for(seed: int, n: int, tokens: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(tokens)] for _ in range(n)]


def engine_round(model, tok, prompts: list[list[int]], max_tokens: int, batching: bool,
                 fixed_rows: int | None = None) -> dict:
    """One round; `fixed_rows` not None: the batch-invariant mode, every step's matmuls at that many rows (0: as
    they come), on a model `deterministic_rows` prepared."""
    from cluster.engine.cold_session import ColdSession
    from cluster.engine.events import Delta, Finished
    from cluster.engine.schedule import Schedule
    from cluster.engine.request import GenerationParams
    from cluster.engine.scheduler import Scheduler
    from cluster.engine.sequence import Sequence

    global SCHEDULE
    SCHEDULE = SCHEDULE or Schedule.of("chunk", 64, 512)
    scheduler = Scheduler(name="mlx-fleet-bench", batching=batching, decode_concurrency=fixed_rows or max(len(prompts), 1),
                          invariant=fixed_rows is not None, pad_rows=bool(fixed_rows))
    try:
        def seqs(ps, n):
            return [Sequence(p, GenerationParams(max_tokens=n), model, tok, ColdSession(model, schedule=SCHEDULE))
                    for p in ps]
        scheduler.run_all(seqs(prompts[:1], 2))  # warm-up: compiled kernels, allocator
        t0 = time.perf_counter()
        events = scheduler.run_all(seqs(prompts, max_tokens))
        wall = time.perf_counter() - t0
    finally:
        scheduler.stop()
    finished = [next(e for e in ev if isinstance(e, Finished)) for ev in events]
    ttft = [f.timings["ttft_s"] for f in finished]
    generated = sum(f.completion_tokens for f in finished)
    decode_window = wall - min(ttft)
    return {"wall_s": round(wall, 3), "generated": generated, "tokens_per_s": round(generated / wall, 1),
            "decode_tokens_per_s": round((generated - len(finished)) / decode_window, 1) if decode_window > 0 else None,
            "ttft_p50_s": round(statistics.median(ttft), 3), "ttft_max_s": round(max(ttft), 3),
            "tokens": [[t for e in ev if isinstance(e, Delta) for t in e.token_ids] for ev in events]}


def median_round(rounds: list[dict]) -> dict:
    """The median round by tokens/s, with every round's tokens/s (this VM's step time swings 1.7x between
    runs of the very same batched steps, for mlx-lm's BatchGenerator as for ours)."""
    best = dict(sorted(rounds, key=lambda r: r["tokens_per_s"])[len(rounds) // 2])
    return {**best, "rounds_tokens_per_s": [r["tokens_per_s"] for r in rounds]}


async def http_rounds(url: str, model: str, rounds: list[list[str]], max_tokens: int) -> dict:
    """One round per prompt list (one round of c requests takes about a second here, and a shared 2-core VM
    swings 2x between seconds): the median round by tokens/s, every round's tokens/s, and every round's
    texts."""
    runs = [await http_round(url, model, prompts, max_tokens) for prompts in rounds]
    texts = [r.pop("texts") for r in runs]
    return {**median_round(runs), "rounds_ttft_max_s": [r["ttft_max_s"] for r in runs], "texts": texts}


async def http_round(url: str, model: str, prompts: list[str], max_tokens: int) -> dict:
    import httpx

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[float, int, str]:
        t0 = time.perf_counter()
        first, text, usage = None, [], 0
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                import json

                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        first = first or time.perf_counter()
                        text.append(choice["text"])
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
        return (first or time.perf_counter()) - t0, usage, "".join(text)

    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, WARM_UP)  # the connection, and nothing the round's prompts could reuse
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, p) for p in prompts))
        wall = time.perf_counter() - t0
    generated = sum(r[1] for r in results)
    return {"wall_s": round(wall, 3), "generated": generated, "tokens_per_s": round(generated / wall, 1),
            "ttft_p50_s": round(statistics.median(r[0] for r in results), 3),
            "ttft_max_s": round(max(r[0] for r in results), 3), "texts": [r[2] for r in results]}


class MlxLmServer:
    """`python -m mlx_lm.server` on a loopback port, for the length of a `with`."""

    def __init__(self, model_path: Path, work: Path):
        from cluster.ports import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        hub = work / "hf-hub"  # /v1/models scans it; offline machines have none
        hub.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm.server", "--model", str(model_path), "--host", "127.0.0.1",
             "--port", str(self.port)],
            env={**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"},
            stdout=subprocess.DEVNULL, stderr=open(work / "mlx_lm.server.log", "wb"))

    def __enter__(self) -> "MlxLmServer":
        import httpx

        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("mlx_lm.server did not start")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def mlx_lm_round(model, tok, prompts: list[list[int]], max_tokens: int) -> dict:
    """The same round through mlx-lm's own BatchGenerator (`batch_generate`), in this process."""
    from mlx_lm.generate import batch_generate

    batch_generate(model, tok, prompts[:1], max_tokens=2)  # warm-up
    t0 = time.perf_counter()
    out = batch_generate(model, tok, prompts, max_tokens=max_tokens, return_token_ids=True)
    wall = time.perf_counter() - t0
    generated = sum(len(t) for t in out.token_ids)
    return {"wall_s": round(wall, 3), "generated": generated, "tokens_per_s": round(generated / wall, 1),
            "tokens": [list(t) for t in out.token_ids]}


def deterministic_rows(a, model) -> int | None:
    """The deterministic way's fixed row count (the largest concurrency, as a replica's decode_concurrency; 0
    where the backend's matmuls are row-exact), on the model prepared for it; None without --deterministic."""
    from cluster.engine import invariant

    if not a.deterministic:
        return None
    pad = invariant.pads_rows()
    invariant.prepare(model)
    return max(a.concurrency) if pad else 0


def run_engine(a, model, tok) -> dict:
    rows = {}
    det = deterministic_rows(a, model)
    for c in a.concurrency:
        prompts = prompts_for(1000 + c, c, a.prompt_tokens)
        ways = {"batched": [], "reference": []} if a.no_sequential else {"sequential": [], "batched": [], "reference": []}
        invariant_rounds = []
        for _ in range(a.rounds):  # interleaved, so that a slow spell of the VM hits all three alike
            if not a.no_sequential:
                ways["sequential"].append(engine_round(model, tok, prompts, a.max_tokens, batching=False))
            ways["batched"].append(engine_round(model, tok, prompts, a.max_tokens, batching=True))
            ways["reference"].append(mlx_lm_round(model, tok, prompts, a.max_tokens))
            if det is not None:
                invariant_rounds.append(engine_round(model, tok, prompts, a.max_tokens, batching=True, fixed_rows=det))
        got = [r.pop("tokens") for way in ways.values() for r in way]
        same = all(t == got[0] for t in got)
        bat_r, ref_r = median_round(ways["batched"]), median_round(ways["reference"])
        seq_r = median_round(ways["sequential"]) if "sequential" in ways else {"tokens_per_s": None,
                                                                              "decode_tokens_per_s": None, "ttft_p50_s": None}
        rows[c] = {"sequential": seq_r, "batched": bat_r, "mlx_lm_batch_generate": ref_r, "identical_tokens": same,
                   "vs_mlx_lm": round(bat_r["tokens_per_s"] / ref_r["tokens_per_s"], 2),
                   "speedup": round(bat_r["tokens_per_s"] / seq_r["tokens_per_s"], 2) if seq_r["tokens_per_s"] else None,
                   "decode_speedup": round(bat_r["decode_tokens_per_s"] / seq_r["decode_tokens_per_s"], 2)
                   if bat_r["decode_tokens_per_s"] and seq_r["decode_tokens_per_s"] else None}
        if det is not None:
            rows[c]["deterministic"] = deterministic_row(model, tok, prompts, a.max_tokens, det, invariant_rounds, bat_r)
        print(f"engine c={c}: sequential {seq_r['tokens_per_s']} tok/s (decode {seq_r['decode_tokens_per_s']}), "
              f"batched {bat_r['tokens_per_s']} tok/s (decode {bat_r['decode_tokens_per_s']}): "
              f"{rows[c]['speedup']}x, decode {rows[c]['decode_speedup']}x; mlx-lm batch_generate "
              f"{ref_r['tokens_per_s']} tok/s ({rows[c]['vs_mlx_lm']}x); TTFT p50 "
              f"{seq_r['ttft_p50_s']} -> {bat_r['ttft_p50_s']} s; identical tokens: {same}")
        if det is not None:
            d = rows[c]["deterministic"]
            print(f"engine c={c}: deterministic {d['tokens_per_s']} tok/s ({d['vs_batched']}x the default batched); "
                  f"every round's tokens those of each request alone in the mode: {d['solo_identical']}")
    return rows


def deterministic_row(model, tok, prompts, max_tokens: int, rows: int, rounds: list[dict], batched: dict) -> dict:
    """The deterministic way's median round, its cost against the default batched way, and whether every
    round gave each request its tokens alone (each prompt run once alone, in the mode)."""
    alone = [engine_round(model, tok, [p], max_tokens, batching=True, fixed_rows=rows)["tokens"][0] for p in prompts]
    got = [r.pop("tokens") for r in rounds]
    best = median_round(rounds)
    return {**best, "vs_batched": round(best["tokens_per_s"] / batched["tokens_per_s"], 2),
            "solo_identical": all(t == alone for t in got)}


def run_http(a, tok, path: Path) -> dict:
    from cluster.fleet.spawned import SpawnedFleet

    rows = {}
    texts = {c: http_prompts(tok, c, a.rounds, a.prompt_tokens) for c in a.concurrency}
    results: dict[str, dict] = {"mlx_lm.server": {}, "mlx-fleet": {}}
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as work:
        with MlxLmServer(path, Path(work)) as server:
            for c in a.concurrency:
                results["mlx_lm.server"][c] = asyncio.run(http_rounds(server.url, str(path), texts[c], a.max_tokens))
        extra = (("--stream-interval", str(a.stream_interval)) if a.stream_interval is not None else ()) + \
            (("--stream-messages", str(a.stream_messages)) if a.stream_messages is not None else ()) + tuple(a.fleet_arg)
        with SpawnedFleet(Path(work) / "fleet", 1, (a.model,), extra=extra) as fleet:
            for c in a.concurrency:
                results["mlx-fleet"][c] = asyncio.run(http_rounds(fleet.url, a.model, texts[c], a.max_tokens))
    for c in a.concurrency:
        ref, ours = results["mlx_lm.server"][c], results["mlx-fleet"][c]
        rows[c] = {"mlx_lm.server": ref, "mlx-fleet": ours, "identical_text": same_texts(ref.pop("texts"), ours.pop("texts")),
                   "ratio": round(ours["tokens_per_s"] / ref["tokens_per_s"], 2)}
        print(f"http c={c}: mlx_lm.server {ref['tokens_per_s']} tok/s (TTFT p50 {ref['ttft_p50_s']} s; rounds "
              f"{ref['rounds_tokens_per_s']}; TTFT max {ref['rounds_ttft_max_s']}), mlx-fleet {ours['tokens_per_s']} "
              f"tok/s (TTFT p50 {ours['ttft_p50_s']} s; rounds {ours['rounds_tokens_per_s']}; TTFT max "
              f"{ours['rounds_ttft_max_s']}): {rows[c]['ratio']}x; identical text: {rows[c]['identical_text']}")
    return rows


def http_prompts(tok, c: int, rounds: int, tokens: int) -> list[list[str]]:
    """Fresh prompts every round, the same for both servers. mlx_lm.server keeps each finished request's KV
    in its prompt cache and would restore a repeated prompt whole from round 2 on, while the fleet caches
    whole blocks only (64 tokens), so none of a 32-token prompt: repeating them compared its cache with our
    prefill, not batching with batching."""
    return [[tok.decode(p) for p in prompts_for(2000 + 100 * r + c, c, tokens)] for r in range(rounds)]


def same_texts(theirs: list[list[str]], ours: list[list[str]]) -> bool:
    """Every round's texts equal. mlx_lm.server drops a completion's leading space (as a chat reply would);
    ours keeps it, so that prompt + completion is the decoded tokens. Past that, the texts must be equal."""
    def strip(rounds):
        return [[t.removeprefix(" ") for t in texts] for texts in rounds]
    return strip(theirs) == strip(ours)


def main(argv: list[str]) -> int:
    p = parser("Continuous batching vs sequential serving and vs mlx_lm.server.", __name__)
    p.add_argument("--model", default="tiny-dense", help="the model both servers serve")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="requests at once, one run per value")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens of each request's prompt; short, so a round is mostly decode")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens each request generates")
    p.add_argument("--deterministic", action="store_true",
                   help="also the batch-invariant mode (deterministic: true), its cost against the default and whether "
                        "each batched request gets its solo tokens")
    p.add_argument("--no-sequential", action="store_true",
                   help="skip the sequential way (on a GPU its c=32 rounds take minutes and say little)")
    p.add_argument("--no-http", action="store_true", help="skip the HTTP comparison with mlx_lm.server")
    p.add_argument("--no-engine", action="store_true", help="skip the in-process engine comparison")
    p.add_argument("--rounds", type=int, default=5, help="rounds per concurrency and way; the median is reported")
    p.add_argument("--stream-interval", type=float, default=None,
                   help="the fleet's --stream-interval (default: the fleet's own, 0.02 s)")
    p.add_argument("--stream-messages", type=float, default=None,
                   help="the fleet's --stream-messages (default: the fleet's own, 100 per second)")
    p.add_argument("--fleet-arg", action="append", default=[], metavar="ARG",
                   help="another `mlx-fleet up` option for the fleet (repeat), e.g. --fleet-arg=--no-cache")
    a = p.parse_args(argv)
    model, tok, path = load(a.model, a.data_dir)
    results = {"model": a.model, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
               "stream_interval_s": a.stream_interval, "stream_messages_per_s": a.stream_messages, "rounds": a.rounds,
               "fleet_args": a.fleet_arg,
               "engine": {} if a.no_engine else run_engine(a, model, tok)}
    if not a.no_http:
        results["http"] = run_http(a, tok, path)
    write_json(a.json, "batch", results)
    return 0
