"""Restored KV + the rest of the prompt gives exactly what a cold run gives: tokens and logits."""

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step

from cluster.kvcache.setup import UnsupportedCodec
from tests.kvcache.conftest import prompt_of

MODELS = ["tiny-dense", "tiny-swa", "tiny-hybrid", "tiny-gemma4", "tiny-next"]
B = 32


def mlx_lm_greedy(model, prompt, n, prefill_step):
    """mlx-lm's own greedy tokens, prefilled in the same chunks as a cold run here (a GPU's kernels depend on
    the shapes): from 0, `prefill_step` at a time, the last token alone."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prefill_step_size=prefill_step)
    return [t for t, _ in zip((t for t, _ in steps), range(n))]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("length", [224, 250])  # ends on a block boundary (7 x 32), and off one
def test_extended_prompt_resumes_exactly(harness, name, length):
    h = harness(name, block_tokens=B)
    prompt = prompt_of(length)
    h.warm(prompt[:170], max_tokens=4)                      # leaves blocks 0..4 (+ checkpoints)
    warm, cold = h.warm(prompt), h.cold(prompt)
    assert warm.cached >= 128 and warm.cached % B == 0 or warm.cached == length - 1
    h.assert_same(warm, cold)
    assert warm.tokens == mlx_lm_greedy(h.model, prompt, 12, h.schedule.chunk_tokens)


@pytest.mark.parametrize("name", MODELS)
def test_same_prompt_twice_reuses_all_but_the_tail(harness, name):
    h = harness(name, block_tokens=B)
    prompt = prompt_of(200)
    first = h.warm(prompt)
    again = h.warm(prompt)
    assert first.cached == 0
    # The block schedule restores the full blocks (192; the reply's 12 tokens complete none). The canonical
    # one (the CPU's for sliding windows) restores 199: the blocks, then the tail of its partial last chunk.
    assert again.cached == (199 if h.pc.schedule.canonical else 192)
    assert h.pc.counters.tail_hits == (1 if h.pc.schedule.canonical else 0)
    h.assert_same(again, first)


@pytest.mark.parametrize("name", ["tiny-swa", "tiny-gemma4"])
def test_prompt_many_windows_long(harness, name):
    h = harness(name, block_tokens=B)
    prompt = prompt_of(600)  # ~9x the 64-token window
    h.warm(prompt[:450], max_tokens=2)
    warm, cold = h.warm(prompt), h.cold(prompt)
    assert warm.cached == 448
    h.assert_same(warm, cold)


@pytest.mark.parametrize("name", MODELS)
def test_after_the_window_wrapped_during_decode(harness, name):
    """A 150-token decode (the 64-slot rings wrap twice), then the next turn. Where replies' blocks are kept
    (the block schedule, no sliding window) it resumes inside the reply; elsewhere at the prompt's kept
    blocks. Bitwise either way."""
    h = harness(name, block_tokens=B)
    prompt = prompt_of(90)
    first = h.warm(prompt, max_tokens=150)
    follow = prompt + first.tokens + prompt_of(40, salt=1)
    warm, cold = h.warm(follow), h.cold(follow)
    kept = h.resume_point(h.kept_after(90, 90 + 149))
    if h.pc.layout.has_recurrent:  # at a checkpoint: every few block ends of the reply, and its last
        assert 192 <= warm.cached <= kept or warm.cached == kept, warm.cached
    else:
        assert warm.cached == kept, warm.cached
    assert warm.cached >= 192 or h.pc.kept_tokens(90) < 90  # into the generated part, where it is kept
    h.assert_same(warm, cold)


@pytest.mark.parametrize("name", MODELS)
def test_second_turn_of_a_chat_resumes_after_the_reply(harness, name):
    h = harness(name, block_tokens=B)
    turn1 = h.tok.apply_chat_template([{"role": "system", "content": "You are a fleet of Macs. " * 8},
                                       {"role": "user", "content": "Tell me about caches."}], add_generation_prompt=True)
    reply = h.warm(turn1, max_tokens=40)
    rest = h.tok.encode("<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)
    turn2 = list(turn1) + reply.tokens + rest
    warm, cold = h.warm(turn2), h.cold(turn2)
    fed = len(turn1) + len(reply.tokens) - 1  # the last generated token was never fed
    assert warm.cached == h.resume_point(h.kept_after(len(turn1), fed)), (warm.cached, fed)
    h.assert_same(warm, cold)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-swa", "tiny-hybrid"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(2, 260), split=st.integers(1, 260), salt=st.integers(0, 50))
def test_property_random_lengths_and_split_points(harness, name, length, split, salt):
    h = harness(name, block_tokens=B)
    prompt = prompt_of(length, salt)
    h.warm(prompt[: max(1, min(split, length))], max_tokens=3)
    warm, cold = h.warm(prompt, max_tokens=6), h.cold(prompt, max_tokens=6)
    assert warm.cached <= length - 1
    h.assert_same(warm, cold)


def test_quantized_codec_restores_exactly(harness):
    try:
        h = harness("tiny-dense", block_tokens=B, kv_codec="q8")
    except UnsupportedCodec as e:  # refused at start, with what to use instead (tests/kvcache/test_setup.py)
        pytest.skip(str(e))
    prompt = prompt_of(230)
    h.warm(prompt[:150], max_tokens=2)
    warm, cold = h.warm(prompt), h.cold(prompt)
    assert warm.cached == 128
    h.assert_same(warm, cold)


@pytest.mark.parametrize("block_tokens", [16, 64, 128])
def test_block_sizes_other_than_the_window(harness, block_tokens):
    """W=64 with B=128 stores only each block's last 64 tokens for sliding layers."""
    h = harness("tiny-swa", block_tokens=block_tokens)
    prompt = prompt_of(300)
    h.warm(prompt[:270], max_tokens=2)
    warm, cold = h.warm(prompt), h.cold(prompt)
    assert warm.cached == (270 // block_tokens) * block_tokens
    h.assert_same(warm, cold)


@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-next"])
def test_a_hybrid_at_the_replicas_prefill_step_is_exact(harness, name):
    """512-token chunks as a replica cuts them, while the capture also cuts at every checkpoint: the cold
    run's chunks and the cached run's differ, and on the CPU wheel's BLAS (rows independent of the row
    count) and its recurrent scan the bits still agree. With OpenBLAS preloaded (benchmarks only) they do
    not: its rows depend on how many there are (bench ttft's tiny-hybrid row, ~4e-6)."""
    h = harness(name, block_tokens=32, prefill_step=512)
    h.warm(prompt_of(1100), max_tokens=2)  # two whole 512-token chunks: kept on the canonical schedule too
    prompt = prompt_of(1300)  # the first prompt and 200 tokens more
    warm, cold = h.warm(prompt), h.cold(prompt)
    assert warm.cached >= 1024
    h.assert_same(warm, cold)
