"""The canonical prefill schedule (--resume-at chunk, what a GPU runs): a hit resumes only at a chunk cut,
only blocks of complete chunks are kept, restored buffers are laid out as a cold cache's, and the answer is
bitwise the cold one, for every family in float32 and bfloat16.

Here B = 32 and the prefill step 64, so the chunk C is 64. On the CPU the block schedule is exact too; these
tests pin the canonical one's rules, and on a GPU (docs/gpu.md) they are where its exactness shows."""

import mlx.core as mx
import pytest
from cluster.models.loading import load_model

from cluster.families.specs import FullAttention, SlidingWindow
from cluster.models.resolve import resolve_model
from cluster.engine.schedule import on_gpu
from cluster.store.hashing import chain_ids, state_key
from tests.kvcache.conftest import Harness, prompt_of

MODELS = ["tiny-dense", "tiny-swa", "tiny-hybrid", "tiny-gemma4", "tiny-next"]
B, C = 32, 64


@pytest.fixture(scope="module")
def bf16_models(data_dir):
    """Fresh copies of the built-in models cast to bfloat16 (the session's shared ones stay float32)."""
    loaded = {}

    def get(name):
        if name not in loaded:
            model, tok = load_model(resolve_model(name, data_dir))
            model.set_dtype(mx.bfloat16)
            loaded[name] = model, tok
        return loaded[name]
    return get


@pytest.fixture(params=["float32", "bfloat16"])
def chunked(request, load_builtin, bf16_models, data_dir, tmp_path):
    def make(name: str, **kw) -> Harness:
        if request.param == "bfloat16" and name == "tiny-next" and not on_gpu():
            pytest.skip("MLX's CPU backend has gather_mm (tiny-next's experts) in float32 only")
        model, tok = (bf16_models if request.param == "bfloat16" else load_builtin)(name)
        return Harness(model, tok, resolve_model(name, data_dir), tmp_path, block_tokens=B, prefill_step=C,
                       resume_at="chunk", **kw)
    return make


def in_ram(h: Harness, prompt: list[int]) -> list[bool]:
    ids = chain_ids(h.pc.namespace, prompt, B)
    return list(h.pc.tiers.ram.present(ids))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("length", [224, 250])  # a hit ending on a cut (128 + 96 more), and mid-chunk
def test_an_extended_prompt_resumes_at_the_last_cut_and_is_bitwise_cold(chunked, name, length):
    h = chunked(name)
    assert h.pc.dtype in ("float32", "bfloat16") and h.pc.schedule.fingerprint() == ["chunk", C]
    prompt = prompt_of(length)
    h.warm(prompt[:170], max_tokens=4)
    # 169 tokens prefilled: chunks [0, 64), [64, 128), then [128, 169), a partial chunk whose block 4 a
    # longer prompt's cold run computes with 64 rows, not 41: it is not kept, nor are the reply's blocks.
    assert in_ram(h, prompt[:170]) == [True] * 4 + [False]
    warm, cold = h.warm(prompt), h.cold(prompt)
    assert warm.cached == 128
    h.assert_same(warm, cold)


@pytest.mark.parametrize("name", MODELS)
def test_the_same_prompt_again_restores_all_but_its_last_token_from_its_tail(chunked, name):
    """Blocks up to the last cut (192), then the tail the first run kept of its partial chunk [192, 199)."""
    h = chunked(name)
    prompt = prompt_of(200)
    first, again = h.warm(prompt), h.warm(prompt)
    assert (first.cached, again.cached) == (0, 199)
    assert (h.pc.counters.tails_stored, h.pc.counters.tail_hits) == (1, 1)
    h.assert_same(again, first)
    if h.pc.layout.has_recurrent:  # checkpoints at cuts only (every few, and the last kept one: 192)
        ids = chain_ids(h.pc.namespace, prompt, B)
        held = h.pc.tiers.ram.present([state_key(i) for i in ids])
        assert held[192 // B - 1] and all((j + 1) * B % C == 0 for j, x in enumerate(held) if x), held


@pytest.mark.parametrize("name", MODELS)
def test_a_prompt_shorter_than_a_chunk_is_its_tail_alone(chunked, name):
    """No complete chunk, so no block is kept; the tail alone restores the same prompt, and one with another
    last token (which runs alone in either run), bitwise as cold."""
    h = chunked(name)
    prompt = prompt_of(50)
    first = h.warm(prompt)
    assert in_ram(h, prompt) == [False]
    other = prompt[:-1] + [prompt[-1] + 1]
    again, twin, twin_cold = h.warm(prompt), h.warm(other), h.cold(other)
    assert (first.cached, again.cached, twin.cached) == (0, 49, 49)
    h.assert_same(again, first)
    h.assert_same(twin, twin_cold)


def test_a_tail_serves_only_its_own_prompt_length(chunked):
    """A longer or shorter prompt over the same tokens resumes at its last cut: the tail's chunk was computed
    with another number of rows than theirs would be."""
    h = chunked("tiny-dense")
    prompt = prompt_of(200)
    h.warm(prompt)
    longer, shorter = h.warm(prompt_of(210)), h.warm(prompt_of(190))
    assert (longer.cached, shorter.cached, h.pc.counters.tail_hits) == (192, 128, 0)
    h.assert_same(longer, h.cold(prompt_of(210)))


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-gemma4"])
def test_a_next_turn_resumes_in_the_prompt_not_the_reply(chunked, name):
    """A reply's tokens were computed a row at a time, so none of its blocks is kept."""
    h = chunked(name)
    prompt = prompt_of(150)
    first = h.warm(prompt, max_tokens=80)
    follow = prompt + first.tokens + prompt_of(30, salt=3)
    held = in_ram(h, prompt + first.tokens)
    assert held == [True] * 4 + [False] * (len(held) - 4) and len(held) > 4
    warm, cold = h.warm(follow), h.cold(follow)
    assert warm.cached == 128
    h.assert_same(warm, cold)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-gemma4"])
def test_a_restored_cache_is_laid_out_as_the_cold_cache_at_that_offset(chunked, name):
    """The same buffer capacity for full attention (a decode then takes the same attention kernel), the same
    window contents for sliding layers."""
    h = chunked(name)
    prompt = prompt_of(300)
    h.warm(prompt)
    for probe, at in ((prompt_of(310), 256), (prompt, 299)):  # from blocks at the last cut; blocks and the tail
        assert_laid_out_as_cold(h, probe, at)


def assert_laid_out_as_cold(h: Harness, prompt: list[int], at: int) -> None:
    restored, n = h.session(prompt).restore()
    assert n == at
    cold = h.pc.new_caches()
    for start in range(0, n, C):
        h.model(mx.array(prompt[start:min(start + C, n)])[None], cache=cold)
    mx.eval([c.state for c in cold])
    for spec, r, c in zip(h.pc.layout.layers, restored, cold):
        assert r.offset == c.offset == n
        if isinstance(spec, FullAttention):  # the cold capacity (256, then 512), the first n tokens the same bits
            assert r.keys.shape == c.keys.shape and r.values.shape == c.values.shape
            assert mx.array_equal(r.keys[..., :n, :], c.keys[..., :n, :]).item()
        elif isinstance(spec, SlidingWindow):  # what the next chunk keeps: the window's last W - 1 tokens
            keep = spec.window - 1
            assert mx.array_equal(r.keys[..., -keep:, :], c.keys[..., -keep:, :]).item()
            assert mx.array_equal(r.values[..., -keep:, :], c.values[..., -keep:, :]).item()
