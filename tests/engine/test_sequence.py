"""The engine against mlx-lm's own generate_step, which is the reference."""

import time

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from cluster.engine.cold_session import ColdSession
from cluster.engine.events import Delta, Finished, Started
from cluster.engine.request import GenerationParams, SamplingParams
from cluster.engine.scheduler import Scheduler
from cluster.engine.sequence import Sequence

PROMPT = list(range(3, 150))


def run(seq: Sequence) -> list:
    events = []
    while not seq.done:
        events += seq.step()
    return events


def tokens(events) -> list[int]:
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-swa", "tiny-hybrid"])
def test_greedy_matches_mlx_lm(load_builtin, name):
    model, tok = load_builtin(name)
    ref = [t for t, _ in zip((t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=20)), range(20))]
    events = run(Sequence(PROMPT, GenerationParams(max_tokens=20), model, tok, ColdSession(model), prefill_step=32))
    assert tokens(events) == ref
    assert isinstance(events[0], Started) and events[0].cached_tokens == 0
    done = events[-1]
    assert isinstance(done, Finished)
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == ("length", len(PROMPT), 20)


def test_eos_finishes_with_stop(load_builtin):
    model, tok = load_builtin("tiny-dense")
    greedy = tokens(run(Sequence(PROMPT, GenerationParams(max_tokens=8), model, tok, ColdSession(model))))
    k = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
    tok.eos_token_ids = {greedy[k]}  # pretend a later greedy token is EOS
    try:
        events = run(Sequence(PROMPT, GenerationParams(max_tokens=8), model, tok, ColdSession(model)))
    finally:
        tok.eos_token_ids = {2}
    assert tokens(events) == greedy[: k + 1]
    assert (events[-1].finish_reason, events[-1].completion_tokens) == ("stop", k + 1)


def test_stop_string_cuts_text_and_finishes(load_builtin):
    model, tok = load_builtin("tiny-dense")
    full = run(Sequence(PROMPT, GenerationParams(max_tokens=12), model, tok, ColdSession(model)))
    text = "".join(e.text for e in full if isinstance(e, Delta))
    stop = text[5:8]
    cut = run(Sequence(PROMPT, GenerationParams(max_tokens=12, stop=(stop,)), model, tok, ColdSession(model)))
    assert "".join(e.text for e in cut if isinstance(e, Delta)) == text[: text.index(stop)]
    assert cut[-1].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(load_builtin):
    model, tok = load_builtin("tiny-dense")
    params = GenerationParams(max_tokens=16, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=7))
    a = tokens(run(Sequence(PROMPT, params, model, tok, ColdSession(model))))
    b = tokens(run(Sequence(PROMPT, params, model, tok, ColdSession(model))))
    other = GenerationParams(max_tokens=16, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=8))
    c = tokens(run(Sequence(PROMPT, other, model, tok, ColdSession(model))))
    assert a == b and a != c


def test_interleaved_requests_equal_solo_runs(load_builtin):
    model, tok = load_builtin("tiny-swa")
    prompts = [PROMPT, PROMPT[:77], list(range(200, 290))]
    solo = [tokens(run(Sequence(p, GenerationParams(max_tokens=10), model, tok, ColdSession(model), 32))) for p in prompts]
    scheduler = Scheduler()
    got: dict[int, list] = {i: [] for i in range(len(prompts))}
    import threading
    done = threading.Event()

    def emit_for(i):
        def emit(events):
            got[i].extend(events)
            if all(isinstance(g[-1], Finished) for g in got.values() if g) and all(got.values()):
                done.set()
        return emit

    for i, p in enumerate(prompts):
        scheduler.submit(str(i), Sequence(p, GenerationParams(max_tokens=10), model, tok, ColdSession(model), 32), emit_for(i))
    assert done.wait(60)
    scheduler.stop()
    assert [tokens(got[i]) for i in range(len(prompts))] == solo


WORDS = ("the cache of a fleet keeps every block of the prompt in memory and on disk so that the next "
         "request with the same prefix starts at once ") * 12


def streamed_text(model, tok, prompt, trim: bool) -> tuple[str, list[int]]:
    events = run(Sequence(prompt, GenerationParams(max_tokens=24, trim_leading_space=trim), model, tok,
                          ColdSession(model)))
    return "".join(e.text for e in events if isinstance(e, Delta)), tokens(events)


def test_a_completion_is_exactly_the_decoded_continuation(load_builtin):
    model, tok = load_builtin("tiny-swa")
    prompt = tok.encode(WORDS)
    text, ids = streamed_text(model, tok, prompt, trim=False)
    assert tok.decode(ids).startswith(" ")  # the case that matters: the first token carries a space
    assert text == tok.decode(ids)
    assert tok.decode(prompt) + text == tok.decode(prompt + ids)


def test_a_chat_reply_drops_the_leading_space_as_mlx_lm_does(load_builtin):
    model, tok = load_builtin("tiny-swa")
    text, ids = streamed_text(model, tok, tok.encode(WORDS), trim=True)
    assert text == tok.decode(ids)[1:]


def test_idle_work_runs_only_while_no_sequence_is_in_flight(load_builtin):
    """What waits for idle (a device tier's spills) never runs beside a sequence, and runs again while it
    says it has more to do; a request arriving meanwhile is served."""
    model, tok = load_builtin("tiny-dense")
    scheduler = Scheduler()
    calls: list[int] = []
    left = {"n": 200}

    def idle() -> bool:
        calls.append(len(scheduler._jobs))
        left["n"] -= 1
        return left["n"] > 0

    scheduler.when_idle(idle)
    got = scheduler.run_all([Sequence(PROMPT, GenerationParams(max_tokens=10), model, tok, ColdSession(model))], 60)
    assert isinstance(got[0][-1], Finished)
    deadline = time.monotonic() + 30
    while left["n"] > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    done = len(calls)  # once it has said it is done, it is not called again until there is a reason to
    scheduler.stop()
    assert done == 200 and set(calls) == {0}
