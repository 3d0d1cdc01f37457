"""The exactness checks have teeth: a wrong offset or a wrong checkpoint is caught by the logits,
and damaged blocks where they enter the replica (a disk read) are misses that still give the right answer."""

import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from cluster.kvcache.admission import Admission
from cluster.kvcache.session import BlockSession
from cluster.store.hashing import chain_ids, state_key
from tests.kvcache.conftest import plant, prompt_of

B = 32


class Tampered(BlockSession):
    def __init__(self, cache, prompt, tamper):
        super().__init__(cache, prompt, Admission(cache).fetch(prompt))
        self.tamper = tamper

    def restore(self):
        caches, n = super().restore()
        assert n > 0
        self.tamper(caches, n)
        return caches, n


def tampered_run(h, prompt, tamper):
    return h.run_with(prompt, Tampered(h.pc, prompt, tamper))


def test_full_attention_offset_plus_one_is_detected(harness):
    h = harness("tiny-dense", block_tokens=B)
    prompt = prompt_of(200)
    h.warm(prompt[:150], max_tokens=2)

    def shift(caches, n):
        for c in caches:
            if type(c) is KVCache:
                c.offset += 1

    bad, cold = tampered_run(h, prompt, shift), h.cold(prompt)
    assert h.logit_gap(bad, cold) > h.wrong


def test_sliding_window_relative_offset_is_detected(harness):
    h = harness("tiny-swa", block_tokens=B)
    prompt = prompt_of(300)
    h.warm(prompt[:260], max_tokens=2)

    def relative(caches, n):
        for c in caches:
            if type(c) is RotatingKVCache:
                c.offset = c.keys.shape[2]  # the classic bug: buffer length instead of absolute position

    bad, cold = tampered_run(h, prompt, relative), h.cold(prompt)
    assert h.logit_gap(bad, cold) > h.wrong


@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-next"])
def test_recurrent_checkpoint_from_the_wrong_position_is_detected(harness, name):
    h = harness(name, block_tokens=B)
    prompt = prompt_of(260)
    h.warm(prompt, max_tokens=2)  # checkpoints at several block ends

    def earlier_state(caches, n):
        from cluster.store.arrays import to_mlx
        ids = chain_ids(h.pc.namespace, prompt, B)
        j = n // B - 1
        k = next(i for i in range(j - 1, -1, -1) if h.pc.tiers.ram.present([state_key(ids[i])])[0])
        blk = h.pc.decode(h.pc.envelope(state_key(ids[k])), "state", k, ids)
        for c, arrays in zip(caches, blk.entries):
            if type(c) is ArraysCache:
                c.cache = [to_mlx(a) for a in arrays]

    bad, cold = tampered_run(h, prompt, earlier_state), h.cold(prompt)
    assert h.logit_gap(bad, cold) > h.wrong  # tokens alone may not show it


def corrupt_block(h, key, how):
    """Damage block `key` where it enters this process (its file on the node's disk: RAM blocks are the
    process's own and unchecked)."""
    data = bytearray(h.pc.envelope(key))
    if how == "flip":
        data[-7] ^= 0x10
    elif how == "truncate":
        data = data[: len(data) // 2]
    plant(h, key, data)


def refused_on_read(h, reason: str) -> int:
    """Blocks the node's store quarantined for `reason` (the replica reports a bad read asynchronously)."""
    assert h.pc.tiers.disk.flush(30)
    return h.store.counters["quarantined"][reason]


@pytest.mark.parametrize("how,reason", [("flip", "payload"), ("truncate", "truncated")])
def test_damaged_block_is_a_miss_with_a_counter_and_the_answer_is_still_right(disk_harness, how, reason):
    h = disk_harness("tiny-swa", block_tokens=B)
    prompt = prompt_of(250)
    h.warm(prompt, max_tokens=2)
    ids = chain_ids(h.pc.namespace, prompt, B)
    corrupt_block(h, ids[4], how)
    warm, cold = h.warm(prompt), h.cold(prompt)
    assert warm.cached == h.resume_point(4 * B)  # blocks 0..3 still good
    assert refused_on_read(h, reason) == 1 and h.pc.tiers.disk.counters["read_errors"] == 1
    h.assert_same(warm, cold)
    # The bad block was replaced by the recomputed one: a full hit again (224 on the block schedule; on the
    # canonical one, the CPU's for sliding windows, 249: the blocks to 224, then the prompt's tail).
    assert h.warm(prompt).cached == (249 if h.pc.tails else h.resume_point(min(249, h.pc.kept_tokens(250))))


def test_foreign_block_under_our_id_is_refused(disk_harness, harness):
    h = disk_harness("tiny-dense", block_tokens=B)
    other = harness("tiny-llama", block_tokens=B)
    prompt = prompt_of(100)
    h.warm(prompt, max_tokens=2)
    other.warm(prompt, max_tokens=2)
    ids, foreign_ids = chain_ids(h.pc.namespace, prompt, B), chain_ids(other.pc.namespace, prompt, B)
    plant(h, ids[0], other.pc.envelope(foreign_ids[0]))
    warm, cold = h.warm(prompt), h.cold(prompt)
    assert warm.cached == 0 and refused_on_read(h, "namespace") == 1
    h.assert_same(warm, cold)


def test_damaged_checkpoint_falls_back_to_an_earlier_one(disk_harness):
    h = disk_harness("tiny-hybrid", block_tokens=B)
    h.pc.tails = False  # the same prompt restores from its checkpoints, not from its tail (tails.py)
    prompt = prompt_of(300)
    h.warm(prompt, max_tokens=2)
    ids = chain_ids(h.pc.namespace, prompt, B)
    best = h.warm(prompt).cached
    corrupt_block(h, state_key(ids[best // B - 1]), "flip")
    warm, cold = h.warm(prompt), h.cold(prompt)
    assert 0 < warm.cached < best and refused_on_read(h, "payload") == 1
    h.assert_same(warm, cold)
