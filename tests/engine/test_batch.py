"""Continuous batching against sequences run alone, on every built-in model.

The contract: a greedy request gives the same tokens in a batch as alone, and
logits within the dtype's tolerance; a seeded sampled one the same tokens; a
cancelled one frees its row and leaves the others exact; caches that cannot
batch are served one step at a time, with the reason stated.
"""

import time

import mlx.core as mx
import pytest

from cluster.engine.batch import batchable
from cluster.engine.cold_session import ColdSession
from cluster.engine.events import Failed, Finished, Started
from cluster.engine.request import GenerationParams, SamplingParams
from cluster.engine.scheduler import Scheduler
from cluster.engine.sequence import Sequence
from cluster.models.catalog import BUILTINS
from tests.engine.batching import Collector, run_alone, serve_all, solo_equals_batched, tokens

TOLERANCE = {mx.float32: 1e-3, mx.float16: 5e-2, mx.bfloat16: 0.25}


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 7919 + salt * 104729) % 1021 for i in range(n)]


# Lengths that make rows join and leave at different steps; one prompt of a single token
# (nothing to prefill: it joins with an empty cache), one past gemma's 64-token window.
PROMPTS = [prompt_of(n, salt) for salt, n in enumerate([40, 130, 77, 1, 200])]
MAX_TOKENS = [10, 15, 20, 25, 12]


def seq(model, tok, prompt, max_tokens, **params) -> Sequence:
    return Sequence(prompt, GenerationParams(max_tokens=max_tokens, record_logits=True, **params), model, tok,
                    ColdSession(model), prefill_step=32)


@pytest.fixture
def scheduler():
    s = Scheduler(name="mlx-fleet-test", batching=True, decode_concurrency=8, prefill_concurrency=2)
    yield s
    s.stop()


@solo_equals_batched
@pytest.mark.parametrize("name", sorted(n for n in BUILTINS if n.startswith("tiny-")))
def test_a_batch_gives_each_request_its_solo_tokens(load_builtin, scheduler, name):
    model, tok = scheduler.run(lambda: load_builtin(name))
    alone = scheduler.run(lambda: [seq(model, tok, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)])
    solo = scheduler.run(lambda: [run_alone(s) for s in alone])
    batched = [seq(model, tok, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    events = serve_all(scheduler, batched)
    assert [tokens(e) for e in events] == [tokens(e) for e in solo]
    for e, s in zip(events, batched):
        assert isinstance(e[0], Started) and isinstance(e[-1], Finished)
        assert (e[-1].finish_reason, e[-1].completion_tokens) == ("length", s.params.max_tokens)
    gaps = scheduler.run(lambda: [(mx.abs(mx.stack(b.logits) - mx.stack(a.logits)).max().item(), a.logits[0].dtype)
                                  for a, b in zip(alone, batched)])
    assert all(gap <= TOLERANCE[dtype] for gap, dtype in gaps), gaps
    stats = scheduler.stats()
    assert stats["batching"] and stats["batched_steps"] > 0 and stats["mean_batch"] > 1
    assert scheduler.load() == {"active": 0, "queued_tokens": 0, "decoding": 0, "waiting": 0, "by_origin": {}}


@solo_equals_batched
def test_sampled_rows_keep_their_own_seeded_stream(load_builtin, scheduler):
    model, tok = scheduler.run(lambda: load_builtin("tiny-dense"))
    sampled = dict(sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=11))
    solo = scheduler.run(lambda: run_alone(seq(model, tok, PROMPTS[2], 20, **sampled)))
    events = serve_all(scheduler, [seq(model, tok, PROMPTS[0], 20), seq(model, tok, PROMPTS[2], 20, **sampled),
                                   seq(model, tok, PROMPTS[1], 20)])
    assert tokens(events[1]) == tokens(solo)


def test_a_cancelled_row_frees_its_slot_and_the_others_stay_exact(load_builtin, scheduler):
    model, tok = scheduler.run(lambda: load_builtin("tiny-swa"))
    solo = scheduler.run(lambda: [tokens(run_alone(seq(model, tok, p, 40))) for p in PROMPTS[:3]])
    got = Collector()
    for i, p in enumerate(PROMPTS[:3]):
        scheduler.submit(str(i), seq(model, tok, p, 40), got.emit_for(str(i)), origin="gw-b" if i == 1 else "gw-a")
    got.wait_tokens("1", 5)
    by_origin = scheduler.run(lambda: scheduler.load()["by_origin"])  # what the lease tells each gateway
    assert {o: c[0] for o, c in by_origin.items()} == {"gw-a": 2, "gw-b": 1}
    scheduler.cancel("1")
    assert "gw-b" not in scheduler.run(lambda: scheduler.load()["by_origin"])
    got.wait(["0", "2"])
    assert [tokens(got.events["0"]), tokens(got.events["2"])] == [solo[0], solo[2]]
    assert not got.ended("1") and len(tokens(got.events["1"])) < 40
    assert scheduler.run(lambda: (scheduler.load()["active"], len(scheduler._batch))) == (0, 0)


def test_a_request_after_a_batch_drained_starts_a_new_one(load_builtin, scheduler):
    model, tok = scheduler.run(lambda: load_builtin("tiny-hybrid"))
    first = serve_all(scheduler, [seq(model, tok, PROMPTS[0], 6)])
    second = serve_all(scheduler, [seq(model, tok, PROMPTS[0], 6), seq(model, tok, PROMPTS[2], 4)])
    assert tokens(second[0]) == tokens(first[0])
    assert [e[-1].completion_tokens for e in second] == [6, 4]


def test_quantized_caches_cannot_batch_and_are_served_in_turns(load_builtin, data_dir, tmp_path):
    from cluster.config import CacheConfig
    from cluster.kvcache.setup import UnsupportedCodec, setup_cache
    from cluster.models.resolve import resolve_model

    model, tok = load_builtin("tiny-dense")
    try:
        pc = setup_cache(model, tok, resolve_model("tiny-dense", data_dir), CacheConfig(kv_codec="q8"), tmp_path).cache
    except UnsupportedCodec as e:  # refused at start on a backend without the kernels (tests/kvcache/test_setup.py)
        pytest.skip(str(e))
    ok, why = batchable(pc.new_caches())
    assert not ok and why.startswith("QuantizedKVCache has no batched form")
    assert batchable(ColdSession(model).restore()[0]) == (True, "")
    scheduler = Scheduler(name="mlx-fleet-test")
    scheduler.disable_batching(why)
    try:
        def quantized(p):
            return Sequence(p, GenerationParams(max_tokens=8), model, tok, ColdSession(model, pc.new_caches), 32)
        solo = scheduler.run(lambda: [tokens(run_alone(quantized(p))) for p in PROMPTS[:3]])
        events = serve_all(scheduler, [quantized(p) for p in PROMPTS[:3]])
        assert [tokens(e) for e in events] == solo
        assert not any(isinstance(x, Failed) for e in events for x in e)
        assert scheduler.stats()["batching"] is False and scheduler.stats()["reason"] == why
        assert scheduler.stats()["batched_steps"] == 0
    finally:
        scheduler.stop()


class FailingForward:
    """The model, except that its `fail_at`-th batched decode forward raises (a fault: a Metal
    allocation failing mid-batch cannot be provoked on demand)."""

    def __init__(self, model, fail_at: int):
        self.model, self.fail_at, self.calls = model, fail_at, 0

    def __call__(self, inputs, cache=None):
        if inputs.shape[0] > 1 and inputs.shape[1] == 1:
            self.calls += 1
            if self.calls == self.fail_at:
                raise RuntimeError("injected: the batched forward failed")
        return self.model(inputs, cache=cache)


def test_a_failed_batch_step_fails_every_row_it_held_and_the_replica_serves_on(load_builtin, scheduler):
    model, tok = scheduler.run(lambda: load_builtin("tiny-dense"))
    failing = FailingForward(model, fail_at=3)
    got = Collector()
    # Three short prompts prefill in one turn and join together. At the third batched forward the
    # first row (max_tokens 2) is leaving with its last token still unread: it must fail too.
    for i, n in enumerate([2, 3, 20]):
        scheduler.submit(str(i), Sequence(prompt_of(20, i), GenerationParams(max_tokens=n), failing, tok,
                                          ColdSession(model), 512), got.emit_for(str(i)))
    got.wait(["0", "1", "2"], 60)
    assert [type(got.events[i][-1]).__name__ for i in "012"] == ["Failed", "Failed", "Failed"]
    assert all("injected" in got.events[i][-1].message for i in "012")
    assert scheduler.run(lambda: (scheduler.load()["active"], scheduler._batch.caches)) == (0, None)
    solo = scheduler.run(lambda: tokens(run_alone(seq(model, tok, PROMPTS[0], 6))))
    assert tokens(serve_all(scheduler, [seq(model, tok, PROMPTS[0], 6)])[0]) == solo


def test_the_batch_frees_its_caches_when_its_last_rows_stop(load_builtin, scheduler):
    model, tok = scheduler.run(lambda: load_builtin("tiny-swa"))
    got = Collector()
    for i in "01":
        scheduler.submit(i, seq(model, tok, PROMPTS[int(i)], 200), got.emit_for(i))
    got.wait_tokens("0", 3)
    got.wait_tokens("1", 3)
    scheduler.cancel("0")
    scheduler.cancel("1")
    deadline = time.monotonic() + 10
    while scheduler.run(lambda: scheduler._batch.caches) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scheduler.run(lambda: (scheduler._batch.caches, scheduler._batch.rows, scheduler.load()["active"])) == \
        (None, [], 0)


class BreaksAt:
    """A logits processor that raises at its n-th call, as a grammar the model broke does."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, tokens, logits):
        self.calls += 1
        if self.calls == self.n:
            raise ValueError("injected: the grammar broke")
        return logits


def test_a_row_whose_processors_fail_fails_alone(load_builtin, scheduler):
    model, tok = scheduler.run(lambda: load_builtin("tiny-dense"))
    solo = scheduler.run(lambda: [tokens(run_alone(seq(model, tok, p, 12))) for p in PROMPTS[:2]])
    broken = seq(model, tok, PROMPTS[2], 12)
    broken._grammar_processor = BreaksAt(4)  # as a compiled grammar is handed to its picker
    events = serve_all(scheduler, [seq(model, tok, PROMPTS[0], 12), broken, seq(model, tok, PROMPTS[1], 12)])
    assert isinstance(events[1][-1], Failed) and "injected" in events[1][-1].message
    assert [tokens(events[0]), tokens(events[2])] == solo
    assert all(isinstance(e[-1], Finished) for e in (events[0], events[2]))
    assert scheduler.run(lambda: (scheduler.load()["active"], scheduler._batch._failed)) == (0, {})


def test_short_prompts_are_not_held_behind_a_long_ones_prefill_nor_do_they_starve_it(load_builtin):
    """Prompts of 20 tokens submitted with one of 640 (ten chunks) start first, each within a few rounds; the long
    one still prefills in one round of every two. First come, first served held them all behind its ten."""
    s = Scheduler(name="mlx-fleet-test", batching=True, decode_concurrency=8, prefill_concurrency=8)
    try:
        model, tok = s.run(lambda: load_builtin("tiny-dense"))
        prompts = [prompt_of(640)] + [prompt_of(20, salt) for salt in range(1, 5)]
        solo = s.run(lambda: [tokens(run_alone(seq(model, tok, p, 2))) for p in prompts])
        seqs = [seq(model, tok, p, 2) for p in prompts]
        log = []  # "|" at each prefill round, then who prefilled in it: the real calls, spied on
        for name, q in zip(["long", "s0", "s1", "s2", "s3"], seqs):
            q.prefill = lambda step, real=q.prefill, name=name: (log.append(name), real(step))[1]
        rounds = s._prefill_round
        s._prefill_round = lambda: (log.append("|"), rounds())[1]
        events = serve_all(s, seqs)
    finally:
        s.stop()
    assert [tokens(e) for e in events] == solo
    turns = [r.split() for r in " ".join(log).split("|")[1:] if r.strip()]  # the rounds that prefilled
    long_rounds = [i for i, r in enumerate(turns) if "long" in r]
    assert len(long_rounds) >= 10 and all(b - a <= 2 for a, b in zip(long_rounds, long_rounds[1:])), turns
    assert {n for r in turns[:long_rounds[-1]] for n in r} == {"long", "s0", "s1", "s2", "s3"}, turns
