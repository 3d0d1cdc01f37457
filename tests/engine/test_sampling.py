"""Logits processors, samplers and logprobs against mlx-lm's own generate_step, alone and in a batch.

mlx-lm's generate_step with make_sampler / make_logits_processors is what
mlx_lm.server runs: a sequence with the same settings must give the same tokens
and logprobs, and a batch must give each row what it gives alone.
"""

import json

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from cluster.engine.cold_session import ColdSession
from cluster.engine.constraints import Grammars, Unservable
from cluster.engine.events import Delta
from cluster.engine.request import GenerationParams, SamplingParams
from cluster.engine.sampling import MIN_LOGPROB
from cluster.engine.scheduler import Scheduler
from cluster.engine.sequence import Sequence
from tests.engine.batching import run_alone, serve_all, solo_equals_batched, tokens

MODEL = "tiny-dense"
PROMPT = [3 + (i * 7919) % 1021 for i in range(50)]
SETTINGS = [
    dict(repetition_penalty=1.4, repetition_context_size=6),
    dict(presence_penalty=1.1),
    dict(frequency_penalty=0.9, frequency_context_size=8),
    dict(logit_bias=((17, 5.0), (40, -100.0))),
    dict(temperature=0.9, top_k=4, seed=3),
    dict(temperature=0.8, min_p=0.1, top_p=0.9, seed=9),
]


@pytest.fixture(scope="module")
def scheduler():
    s = Scheduler(name="mlx-fleet-test", batching=True, decode_concurrency=8, prefill_concurrency=4)
    yield s
    s.stop()


def reference(model, settings: dict, n: int) -> tuple[list[int], list[float]]:
    """mlx-lm's generate_step, seeded through the global state as mlx_lm.server does."""
    if settings.get("seed") is not None:
        mx.random.seed(settings["seed"])
    sampler = make_sampler(settings.get("temperature", 0.0), top_p=settings.get("top_p", 0.0),
                           min_p=settings.get("min_p", 0.0), top_k=settings.get("top_k", 0))
    processors = make_logits_processors(
        dict(settings.get("logit_bias", ())) or None, settings.get("repetition_penalty"),
        settings.get("repetition_context_size", 20), settings.get("presence_penalty"),
        settings.get("presence_context_size", 20), settings.get("frequency_penalty"),
        settings.get("frequency_context_size", 20))
    out, lps = [], []
    # Prefilled in the same 16-token chunks as ours: a GPU's kernels depend on the shapes.
    for (token, logprobs), _ in zip(generate_step(mx.array(PROMPT), model, sampler=sampler, prefill_step_size=16,
                                                  logits_processors=processors), range(n)):
        out.append(int(token))
        lps.append(logprobs[int(token)].item())
    return out, lps


def ours(model, tok, settings: dict, n: int, **extra) -> Sequence:
    return Sequence(PROMPT, GenerationParams(max_tokens=n, sampling=SamplingParams(logprobs=3, **settings), **extra),
                    model, tok, ColdSession(model), prefill_step=16, grammars=Grammars(tok._tokenizer))


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "+".join(s))
def test_processors_and_samplers_give_mlx_lms_tokens_and_logprobs(load_builtin, scheduler, settings):
    model, tok = scheduler.run(lambda: load_builtin(MODEL))
    want, want_lp = scheduler.run(lambda: reference(model, settings, 12))
    events = scheduler.run(lambda: run_alone(ours(model, tok, settings, 12)))
    got = [lp for e in events if isinstance(e, Delta) for lp in e.logprobs]
    assert tokens(events) == want
    assert [g.logprob for g in got] == pytest.approx(want_lp, abs=1e-5)
    assert all(len(g.top) == 3 and [v for _, v in g.top] == sorted((v for _, v in g.top), reverse=True) for g in got)


@solo_equals_batched
def test_a_batch_of_different_settings_gives_each_its_solo_tokens_and_logprobs(load_builtin, scheduler):
    model, tok = scheduler.run(lambda: load_builtin(MODEL))
    solo = scheduler.run(lambda: [run_alone(ours(model, tok, s, 10)) for s in SETTINGS])
    batched = serve_all(scheduler, [ours(model, tok, s, 10) for s in SETTINGS])
    assert [tokens(e) for e in batched] == [tokens(e) for e in solo]
    for a, b in zip(batched, solo):
        la = [lp.logprob for e in a if isinstance(e, Delta) for lp in e.logprobs]
        lb = [lp.logprob for e in b if isinstance(e, Delta) for lp in e.logprobs]
        assert la == pytest.approx(lb, abs=1e-4)


def test_a_grammar_holds_in_a_batch(load_builtin, scheduler):
    from cluster.api.structured import schema_grammar

    model, tok = scheduler.run(lambda: load_builtin(MODEL))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 999}}, "required": ["n"],
              "additionalProperties": False}
    grammar = schema_grammar(schema, "response_format")
    seqs = [ours(model, tok, dict(grammar=grammar, temperature=1.0, seed=i), 40) for i in range(3)]
    seqs += [ours(model, tok, {}, 20)]
    events = serve_all(scheduler, seqs)
    for e in events[:3]:
        text = "".join(x.text for x in e if isinstance(x, Delta))
        assert set(json.loads(text)) == {"n"} and e[-1].finish_reason == "stop"
        # The tokens the grammar masks are -inf: reported as JSON can carry them (a 500 otherwise)
        lps = [lp for x in e if isinstance(x, Delta) for lp in x.logprobs]
        json.dumps([(lp.logprob, lp.top) for lp in lps], allow_nan=False)
        assert any(v == MIN_LOGPROB for lp in lps for _, v in lp.top)


def test_tools_need_a_template_with_tool_calling(load_builtin, scheduler):
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    model, tok = scheduler.run(lambda: load_builtin(MODEL))
    assert tok.has_tool_calling  # the built-in template renders tools as Qwen 2.5 does
    plain = TokenizerWrapper(tok._tokenizer)  # the same tokenizer, without tool calling
    with pytest.raises(Unservable, match="no tool calling") as refused:
        Sequence(PROMPT, GenerationParams(max_tokens=4, tools="[]", tool_choice="get_time"), model, plain,
                 ColdSession(model))
    assert refused.value.param == "tools"  # the replica's 400 names it, even with a tool_choice
