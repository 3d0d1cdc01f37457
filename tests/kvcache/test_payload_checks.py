"""A well-formed block that is wrong inside is refused: every checksum, the id and the parent pass,
but its payload does not fit the model. Each check has a negative control, and the answer stays exact.

The blocks are planted where blocks enter the replica, as files on the node's disk: a RAM block is
one the replica made from its own caches and is used unchecked (kvcache/device_blocks.py)."""

import numpy as np
import pytest

from cluster.kvcache import prefix_cache
from cluster.store import block_format
from cluster.store.block_format import Block
from cluster.store.hashing import chain_ids, state_key
from tests.kvcache.conftest import forget_ram, plant, prompt_of

B = 32


def reencode(h, key, ids, index, kind="kv", **change) -> None:
    """Replace block `index` by a re-encoded copy with `change` applied (checksums all valid), on disk."""
    blk = h.pc.decode(h.pc.envelope(key), kind, index, ids)
    fields = dict(kind=blk.kind, namespace=blk.namespace, id=blk.id, parent=blk.parent, start=blk.start,
                  tokens=blk.tokens, layout=blk.layout, dtype=blk.dtype, codec=blk.codec,
                  entries=[[(t, np.array(a)) for t, a in arrays] for arrays in blk.entries])
    fields.update(change)
    plant(h, key, block_format.encode(Block(**fields)))


def on_disk(h, key) -> bytes:
    return h.store.path(h.pc.namespace, key).read_bytes()


def half_rows(entries):
    (tag, k), v = entries[0]
    return [[(tag, np.ascontiguousarray(k[:, :, :B // 2, :])), v]] + entries[1:]


def as_float16(entries):
    return [[("float16", a.astype(np.float16)) for _, a in arrays] for arrays in entries]


@pytest.mark.parametrize("reason,change", [
    ("shape", lambda blk: {"entries": half_rows(blk["entries"])}),  # one layer's K with 16 rows, not 32
    ("dtype", lambda blk: {"entries": as_float16(blk["entries"]), "dtype": "float16"}),
    ("start", lambda blk: {"start": 2 * B}),
    ("codec", lambda blk: {"codec": ["native", 99, None, None]}),
])
def test_a_block_that_does_not_fit_the_model_is_refused(disk_harness, reason, change):
    h = disk_harness("tiny-dense", block_tokens=B)
    prompt = prompt_of(150)
    h.warm(prompt, max_tokens=2)
    ids = chain_ids(h.pc.namespace, prompt, B)
    blk = h.pc.decode(h.pc.envelope(ids[1]), "kv", 1, ids)
    reencode(h, ids[1], ids, 1, **change({"entries": [[(t, np.array(a)) for t, a in e] for e in blk.entries]}))
    with pytest.raises(block_format.BlockError):  # the envelope itself is sound; only the model checks refuse it
        h.pc.decode(on_disk(h, ids[1]), "kv", 1, ids)
    warm, cold = h.warm(prompt), h.cold(prompt)
    assert warm.cached == h.resume_point(B)  # block 0 only (none on the canonical schedule: no cut there)
    assert h.pc.counters.corrupt[reason] == 1
    assert sum(h.pc.counters.corrupt.values()) == 1
    h.assert_same(warm, cold)
    assert h.warm(prompt).cached == h.hit_after(150, 150, 151)  # the refused block was dropped and recomputed


def test_negative_control_the_same_block_unchanged_is_restored(disk_harness):
    h = disk_harness("tiny-dense", block_tokens=B)
    prompt = prompt_of(150)
    h.warm(prompt, max_tokens=2)
    ids = chain_ids(h.pc.namespace, prompt, B)
    reencode(h, ids[1], ids, 1)  # re-encoded, nothing changed
    assert h.warm(prompt).cached == h.hit_after(150, 150, 151) and sum(h.pc.counters.corrupt.values()) == 0


def test_an_unexpected_exception_while_restoring_is_a_miss_and_drops_the_blocks(harness, monkeypatch):
    h = harness("tiny-swa", block_tokens=B)
    prompt = prompt_of(200)
    h.warm(prompt, max_tokens=2)
    real = prefix_cache.restore_entry
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise IndexError("a bug in a codec")
        return real(*args, **kwargs)

    monkeypatch.setattr(prefix_cache, "restore_entry", broken)
    discarded = h.pc.tiers.ram.stats()["discarded"]
    warm = h.warm(prompt)
    monkeypatch.setattr(prefix_cache, "restore_entry", real)
    cold = h.cold(prompt)
    assert warm.cached == 0 and h.pc.counters.corrupt["unexpected"] == 1
    # Every block of the plan (6, to 192) and the prompt's tail (the canonical schedule, the CPU's for sliding
    # windows, keeps it): never served again.
    assert h.pc.schedule.canonical and h.pc.tiers.ram.stats()["discarded"] == discarded + 7
    h.assert_same(warm, cold)
    assert h.warm(prompt).cached == 199  # recomputed and stored again


def test_an_unexpected_exception_while_decoding_is_a_miss(disk_harness, monkeypatch):
    h = disk_harness("tiny-dense", block_tokens=B)
    prompt = prompt_of(150)
    h.warm(prompt, max_tokens=2)
    forget_ram(h)  # read back from the disk, so decoded
    real = h.pc.decode

    def broken(data, kind, index, ids, **kw):
        if index == 2:
            raise KeyError("a decoder bug")
        return real(data, kind, index, ids, **kw)

    monkeypatch.setattr(h.pc, "decode", broken)
    warm = h.warm(prompt)
    monkeypatch.setattr(h.pc, "decode", real)
    assert warm.cached == 2 * B and h.pc.counters.corrupt["unexpected"] == 1
    h.assert_same(warm, h.cold(prompt))


def one_array_as_float16(entries):
    """One array of one entry in float16, the header still saying float32: only the per-array check sees it."""
    (tag, a), *rest = entries[0]
    return [[("float16", a.astype(np.float16)), *rest]] + entries[1:]


def test_an_array_of_the_wrong_dtype_is_refused_by_the_payload_check(disk_harness):
    h = disk_harness("tiny-dense", block_tokens=B)
    prompt = prompt_of(150)
    h.warm(prompt, max_tokens=2)
    ids = chain_ids(h.pc.namespace, prompt, B)
    blk = h.pc.decode(h.pc.envelope(ids[1]), "kv", 1, ids)
    reencode(h, ids[1], ids, 1, entries=one_array_as_float16([[(t, np.array(a)) for t, a in e] for e in blk.entries]))
    with pytest.raises(block_format.BadDtype, match="entry 0 has a float16 array"):
        h.pc.decode(on_disk(h, ids[1]), "kv", 1, ids)
    warm = h.warm(prompt)
    assert warm.cached == h.resume_point(B) and h.pc.counters.corrupt["dtype"] == 1
    h.assert_same(warm, h.cold(prompt))


def cut_last_axis(arrays):
    (tag, a), *rest = arrays
    return [(tag, np.ascontiguousarray(a[..., : a.shape[-1] // 2])), *rest]


def cut_rows(arrays):
    return [(tag, np.ascontiguousarray(a[:, :, : a.shape[2] // 2, :])) for tag, a in arrays]


@pytest.mark.parametrize("model,kind,layer_kind,cut", [
    ("tiny-swa", "kv", "sliding", cut_rows),  # a sliding layer's stored tail with half its rows
    ("tiny-hybrid", "state", "recurrent", cut_last_axis),  # a recurrent state of the wrong shape
])
def test_a_sliding_tail_or_a_recurrent_state_of_the_wrong_shape_is_refused(disk_harness, model, kind, layer_kind, cut):
    h = disk_harness(model, block_tokens=B)
    h.pc.tails = False  # the same prompt restores from its blocks and checkpoints, not from its tail (tails.py)
    prompt = prompt_of(150)
    h.warm(prompt, max_tokens=2)
    full = h.warm(prompt, max_tokens=2).cached
    ids = chain_ids(h.pc.namespace, prompt, B)
    index = 1 if kind == "kv" else max(j for j in range(len(ids)) if h.pc.tiers.ram.present([state_key(ids[j])])[0])
    key = ids[index] if kind == "kv" else state_key(ids[index])
    blk = h.pc.decode(h.pc.envelope(key), kind, index, ids)
    layer = next(i for i, spec in enumerate(h.pc.layout.layers) if spec.kind == layer_kind)
    entries = [[(t, np.array(a)) for t, a in e] for e in blk.entries]
    entries[layer] = cut(entries[layer])
    reencode(h, key, ids, index, kind, entries=entries)
    with pytest.raises(block_format.BadShape, match=f"entry {layer} has an array of shape"):
        h.pc.decode(on_disk(h, key), kind, index, ids)
    warm = h.warm(prompt)
    assert warm.cached < full and h.pc.counters.corrupt["shape"] == 1
    h.assert_same(warm, h.cold(prompt))
    assert h.warm(prompt).cached == full  # the refused block was dropped, recomputed and stored again
