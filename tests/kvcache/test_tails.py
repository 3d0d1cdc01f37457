"""A prompt's tail (kvcache/tails.py) is a RAM-only entry: never spilled, never announced, and gone means the
same prompt resumes at its last cut again. Its exactness is pinned with the canonical schedule's tests
(test_canonical_schedule.py), for every family."""

from cluster.store.hashing import chain_ids, tail_key
from tests.kvcache.conftest import forget_ram, prompt_of

B, C = 32, 64


def test_a_tail_stays_in_ram_and_is_never_announced(disk_harness):
    events: list = []
    h = disk_harness("tiny-dense", events=events, resume_at="chunk")
    prompt = prompt_of(200)  # chunks [0, 64), [64, 128), [128, 192), then the tail [192, 199)
    h.warm(prompt)
    ids = chain_ids(h.pc.namespace, prompt, B)
    key = tail_key(ids[192 // B - 1], prompt[192:199])
    assert h.pc.tiers.ram.present([key]) == [True] and h.pc.counters.tails_stored == 1
    assert h.pc.tiers.disk.flush(30) and len(h.store.index) == 192 // B  # the blocks, not the tail
    assert key not in {e.key for e in events} and key not in {k for k, *_ in h.pc.tiers.ram_holdings()}
    assert h.warm(prompt).cached == 199


def test_without_its_tail_the_same_prompt_resumes_at_its_last_cut(disk_harness):
    h = disk_harness("tiny-dense", resume_at="chunk")
    prompt = prompt_of(200)
    h.warm(prompt)
    forget_ram(h)  # a restart, or the LRU: the disk holds the blocks, nothing holds the tail
    again = h.warm(prompt)
    assert again.cached == 192 and h.pc.counters.tail_hits == 0
    h.assert_same(again, h.cold(prompt))
    assert h.warm(prompt).cached == 199  # the run from the disk kept the tail again


def test_the_ram_tier_counts_a_tail_only_when_a_restore_takes_it(harness):
    h = harness("tiny-dense", resume_at="chunk")
    prompt = prompt_of(200)
    h.warm(prompt)  # cold: nothing held; looking for its tail is no miss
    ram = h.pc.tiers.ram
    assert (ram.hits, ram.misses) == (0, 0)
    assert h.warm(prompt).cached == 199  # the 6 blocks before the tail, and the tail
    assert (ram.hits, ram.misses) == (192 // B + 1, 0) and h.pc.counters.tail_hits == 1
    shorter = prompt[:199]  # another length: its tail key is another, and the one held goes unused
    assert h.warm(shorter).cached == 192
    assert (ram.hits, ram.misses) == (2 * (192 // B) + 1, 0) and h.pc.counters.tail_hits == 1


def test_a_one_token_final_chunk_of_a_sliding_model_keeps_no_tail(harness):
    """tiny-swa (W=64) cuts its chunks at every block on the CPU. A 130-token prompt's final chunk is the one
    token 128: written in place, it rotates the full window's ring, which a restore does not lay out the same
    way (tails.py). So it keeps no tail and resumes at 128, bitwise as cold; a 131-token prompt's two-token
    chunk is a concatenation, and its tail restores 130 tokens exactly. (Once found by the random property
    test in test_exactness.py: logits 2e-5 off.)"""
    h = harness("tiny-swa", block_tokens=B)
    for length, cached, tails in [(130, 128, 0), (131, 130, 1)]:
        prompt = prompt_of(length, salt=length)
        h.warm(prompt, max_tokens=3)
        warm, cold = h.warm(prompt, max_tokens=6), h.cold(prompt, max_tokens=6)
        assert (warm.cached, h.pc.counters.tails_stored) == (cached, tails)
        h.assert_same(warm, cold)


def test_a_one_token_final_chunk_keeps_its_tail_where_no_window_rotates(harness):
    h = harness("tiny-dense", resume_at="chunk")
    prompt = prompt_of(130)  # chunks [0, 64), [64, 128), then the one token 128
    h.warm(prompt, max_tokens=3)
    warm = h.warm(prompt, max_tokens=6)
    assert (warm.cached, h.pc.counters.tail_hits) == (129, 1)
    h.assert_same(warm, h.cold(prompt, max_tokens=6))
