"""Batch-invariant decode (engine/invariant.py): a batched row's logits bitwise the same request's alone.

The mode's whole path runs here: matmuls padded to the fixed row count, attention routed out of
mlx-lm. Its attention is the kernel on CUDA and the per-row reference in MLX ops elsewhere, so this
file proves the property on the CPU in CI and on the GPU in the GPU run (docs/gpu.md).
"""

import mlx.core as mx
import mlx.nn as nn
import pytest
from cluster.models.loading import load_model

from cluster.engine import invariant
from cluster.engine.cold_session import ColdSession
from cluster.engine.request import GenerationParams
from cluster.engine.schedule import Schedule, on_gpu
from cluster.engine.scheduler import Scheduler
from cluster.engine.sequence import Sequence
from cluster.models.resolve import resolve_model
from tests.engine.batching import run_alone, serve_all, tokens

MODELS = ["tiny-dense", "tiny-swa", "tiny-hybrid", "tiny-gemma4", "tiny-next"]
ROWS = 8


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 7919 + salt * 104729) % 1021 for i in range(n)]


# Rows join and leave at different steps; one prompt of a single token, two past the 64-token windows.
PROMPTS = [prompt_of(n, salt) for salt, n in enumerate([40, 130, 77, 1, 200])]
MAX_TOKENS = [6, 9, 12, 10, 7]


@pytest.fixture(scope="module")
def prepared(data_dir):
    """(model, tokenizer, scheduler): fresh copies of the built-in models prepared for the mode (the session's
    shared ones stay as they are), each with a replica's scheduler of its own (one serves one model)."""
    loaded, schedulers = {}, []

    def get(name: str, dtype: str):
        if (name, dtype) not in loaded:
            scheduler = Scheduler(name="mlx-fleet-test", batching=True, decode_concurrency=ROWS,
                                  prefill_concurrency=2, invariant=True, pad_rows=invariant.pads_rows())
            schedulers.append(scheduler)

            def make():
                model, tok = load_model(resolve_model(name, data_dir))
                model.set_dtype(getattr(mx, dtype))
                invariant.prepare(model)
                return model, tok
            loaded[name, dtype] = (*scheduler.run(make), scheduler)
        return loaded[name, dtype]
    yield get
    for s in schedulers:
        s.stop()


# Prefill chunks cut at absolute positions, as a replica's are: alone or beside others (whose
# prefill takes part of a step's budget), a prompt then prefills the same chunks.
SCHEDULE = Schedule(block_tokens=32, chunk_tokens=32, canonical=True)


def seq(model, tok, prompt, max_tokens) -> Sequence:
    return Sequence(prompt, GenerationParams(max_tokens=max_tokens, record_logits=True), model, tok,
                    ColdSession(model, schedule=SCHEDULE), prefill_step=32)


def logits_of(scheduler, seqs) -> list[mx.array]:
    return scheduler.run(lambda: [mx.stack(s.logits) for s in seqs])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", MODELS)
def test_a_batched_row_is_bitwise_the_same_request_alone(prepared, name, dtype):
    if dtype == "bfloat16" and name == "tiny-next" and not on_gpu():
        pytest.skip("MLX's CPU backend has gather_mm (tiny-next's experts) in float32 only")
    model, tok, scheduler = prepared(name, dtype)
    alone = [seq(model, tok, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    solo = [serve_all(scheduler, [s])[0] for s in alone]  # each request alone on the replica: a batch of one
    steps = scheduler.stats()["batched_steps"]
    batched = [seq(model, tok, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    events = serve_all(scheduler, batched)
    assert [tokens(e) for e in events] == [tokens(e) for e in solo]
    for i, (a, b) in enumerate(zip(logits_of(scheduler, alone), logits_of(scheduler, batched))):
        assert a.shape[0] == MAX_TOKENS[i] and b.shape == a.shape
        assert scheduler.run(lambda: mx.array_equal(a, b).item()), (i, scheduler.run(lambda: mx.abs(a - b).max().item()))
    assert scheduler.stats()["batched_steps"] - steps < sum(MAX_TOKENS)  # they did share steps
    if dtype == "float32" and not on_gpu():
        assert_as_the_default_computes(model, tok, scheduler, batched)


def assert_as_the_default_computes(model, tok, scheduler, ours: list[Sequence]) -> None:
    """On the CPU the default path computes each row alone, in order: the mode differs from it only in
    the order of its attention's sums (keys in temporal order, a rotating window unrolled), a few ulps.
    A wrong row geometry (the wrong keys, a shifted window) would not be rounding: the mode's answers
    are the default solo run's tokens, with float32 logits within 1e-4. (On a GPU the default path is
    no reference, its kernels differ with the batch's shape: test_invariant_attention checks the
    kernel against mlx-lm's attention there.)"""
    default = scheduler.run(lambda: [seq(model, tok, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)])
    expected = scheduler.run(lambda: [tokens(run_alone(s)) for s in default])  # mlx-lm's own caches, no mode
    assert [s.generated for s in ours] == expected
    gaps = scheduler.run(lambda: [mx.abs(mx.stack(a.logits) - mx.stack(b.logits)).max().item()
                                  for a, b in zip(default, ours)])
    assert max(gaps) <= 1e-4, gaps


def test_without_the_mode_a_windowed_row_parts_from_its_solo_run(data_dir):
    """The negative control: the default path sums a sliding window's keys as the batch's ring lays them
    out, which is not the solo ring's order, on the CPU too (a GPU parts further: docs/gpu.md)."""
    scheduler = Scheduler(name="mlx-fleet-test", batching=True, decode_concurrency=ROWS, prefill_concurrency=2)
    try:
        model, tok = scheduler.run(lambda: load_model(resolve_model("tiny-swa", data_dir)))
        alone = [seq(model, tok, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
        for s in alone:
            serve_all(scheduler, [s])
        batched = [seq(model, tok, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
        serve_all(scheduler, batched)
        a, b = logits_of(scheduler, alone), logits_of(scheduler, batched)
        same = scheduler.run(lambda: [mx.array_equal(x, y).item() for x, y in zip(a, b)])
    finally:
        scheduler.stop()
    assert not all(same), same


def test_outside_a_decode_step_a_prepared_model_computes_as_before(data_dir, prepared):
    scheduler = prepared("tiny-dense", "float32")[2]
    def run():
        path = str(resolve_model("tiny-dense", data_dir))
        plain, _ = load_model(path)
        model, _ = load_model(path)
        invariant.prepare(model)
        invariant.prepare(model)  # idempotent
        assert type(model.model.layers[0].self_attn.q_proj).__name__ == "_RowsLinear"
        x = mx.array([prompt_of(37)])
        return mx.array_equal(plain(x), model(x)).item()
    assert scheduler.run(run)


def test_a_step_over_the_fixed_rows_is_refused_and_fewer_rows_are_padded(prepared):
    def run():
        linear = nn.Linear(16, 4)
        linear.__class__ = invariant._RowsLinear
        x = mx.random.normal((3, 1, 16))
        with invariant.decoding(8):
            y = linear(x)
            with pytest.raises(RuntimeError, match="over the fixed 8"):
                linear(mx.random.normal((9, 1, 16)))
        assert invariant._rows() == 0  # the step's state ends with it
        return y.shape, mx.allclose(y, nn.Linear.__call__(linear, x), atol=1e-6).item()
    assert prepared("tiny-dense", "float32")[2].run(run) == ((3, 1, 4), True)


@pytest.fixture
def one_query_routed(monkeypatch):
    """exact_decode_attention on, as models/loading.py turns it on for MLX's CUDA backend, here on the CPU
    (where the kernel's place is taken by its per-row reference); the attention calls it routed are listed."""
    calls = []
    real, was = invariant.attention, invariant.routes_one_query()
    monkeypatch.setattr(invariant, "attention", lambda q, *a: calls.append(q.shape) or real(q, *a))
    invariant.exact_decode_attention(True)
    yield calls
    invariant.exact_decode_attention(was)  # on CUDA it stays on for the tests after this one


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-swa", "tiny-gemma4"])  # full, rotating, KV-shared layers
def test_exact_decode_attention_routes_every_one_query_forward_and_a_hit_stays_bitwise_cold(
        load_builtin, data_dir, tmp_path, one_query_routed, name):
    """A prompt's last token, every decode step and a one-token prefill chunk attend in the kernel (each
    attention layer, each of them), other prefill chunks mlx-lm's; a cached answer is bitwise the cold one,
    and the same tokens as unrouted."""
    from tests.kvcache.conftest import Harness, prompt_of as long_prompt

    scheduler = Scheduler(name="mlx-fleet-test")  # all of it on a model thread, as a replica runs it

    def go():
        model, tok = load_builtin(name)
        h = Harness(model, tok, resolve_model(name, data_dir), tmp_path, block_tokens=32, prefill_step=64,
                    resume_at="chunk")
        before = len(one_query_routed)  # loading the model warmed it with a routed decode step
        h.cold(long_prompt(130), max_tokens=12)  # chunks [0, 64), [64, 128), [128, 129): the last of one token
        routed_130 = len(one_query_routed) - before
        prompt = long_prompt(250)
        cold = h.cold(prompt, max_tokens=12)
        routed = one_query_routed[before + routed_130:]
        h.warm(prompt[:170], max_tokens=4)
        warm = h.warm(prompt)
        h.assert_same(warm, cold)
        invariant.exact_decode_attention(False)
        return routed_130, routed, warm.cached, cold.tokens, h.cold(prompt, max_tokens=12).tokens, len(model.layers)
    try:
        routed_130, routed, cached, tokens, unrouted, layers = scheduler.run(go)
    finally:
        scheduler.stop()
    # Attention calls per forward: one a layer, KV-shared ones (tiny-gemma4's last 2) included. 130 tokens: the
    # one-token chunk, the last token and 11 decode steps; 250: the last token and 11 decode steps.
    assert routed_130 == 13 * layers and len(routed) == 12 * layers
    assert cached == 128 and unrouted == tokens  # the same answer as mlx-lm's attention gives
