"""Device blocks: runs cut by signature, captures that copy, and the host round trip bitwise."""

import mlx.core as mx
import numpy as np

from cluster.kvcache import device_blocks
from cluster.kvcache.device_blocks import Run, runs_of
from cluster.store import block_format
from cluster.store.block_format import Block, Expect
from cluster.store.hashing import block_id

KV = ((("float32", (1, 2, 4, 8)), ("float32", (1, 2, 4, 8))), (), (("float32", (1, 2, 4, 8)),) * 2)
LAYOUT = ["full", "recurrent", "full"]  # what a block's entries are (only their number matters here)
QUANT = ((("uint32", (1, 2, 4, 2)), ("float32", (1, 2, 4, 1)), ("uint32", (1, 2, 4, 2))),)


def address(a: mx.array) -> int:
    mx.eval(a)
    return np.asarray(a).__array_interface__["data"][0]


def test_runs_are_consecutive_arrays_of_one_dtype_and_shape():
    assert runs_of(KV) == (Run("float32", (1, 2, 4, 8), ((0, 0), (0, 1), (2, 0), (2, 1))),)
    assert [len(r.members) for r in runs_of(QUANT)] == [1, 1, 1]  # same shapes apart are separate runs


def test_a_capture_copies_out_of_the_live_buffer():
    live = mx.arange(2 * 8 * 8, dtype=mx.float32).reshape(1, 2, 8, 8)
    for members in ([live[:, :1, 4:8, :]], [live[:, :, :4, :], live[:, :, 4:, :]]):  # a run of one, and of two
        runs = (Run("float32", tuple(members[0].shape), tuple((0, k) for k in range(len(members)))),)
        blk = device_blocks.capture("kv", b"i" * 32, b"p" * 32, 0, [1, 2, 3, 4], [members], runs)
        device_blocks.seal([blk])
        assert address(blk.runs[0]) != address(live)
        assert all(mx.array_equal(blk.member(0, k), m).item() for k, m in enumerate(members))


def test_the_host_round_trip_is_bitwise_and_views_the_envelope():
    ns, tokens = b"n" * 32, np.arange(4, dtype="<u4")
    bid = block_id(ns, ns, tokens.tolist())
    entries = [[mx.random.normal((1, 2, 4, 8)).astype(mx.bfloat16) for _ in range(2)], [],
               [mx.random.normal((1, 2, 4, 8)).astype(mx.bfloat16) for _ in range(2)]]
    signature = tuple(tuple(("bfloat16", tuple(a.shape)) for a in arrays) for arrays in entries)
    runs = runs_of(signature)
    blk = device_blocks.capture("kv", bid, ns, 0, tokens, entries, runs)
    device_blocks.seal([blk])
    host = device_blocks.to_host([blk], [runs], len(entries))[0]
    data = block_format.encode(Block(kind="kv", namespace=ns, id=bid, parent=ns, start=0, tokens=tokens, layout=LAYOUT,
                                     dtype="bfloat16", codec=["native", 1, None, None], entries=host))
    decoded = block_format.decode(data, Expect(namespace=ns, id=bid, kind="kv", layout=LAYOUT, block_tokens=4,
                                               parent=ns, start=0, dtype="bfloat16",
                                               codec=["native", 1, None, None], arrays=signature))
    stacked = device_blocks._stacked([a for _, a in decoded.entries[0] + decoded.entries[2]])
    assert np.shares_memory(stacked, np.frombuffer(data, np.uint8))  # back to back in the envelope: no copy
    back, = device_blocks.from_host([decoded], [runs])
    assert device_blocks.same(back, blk)


def test_arrays_apart_are_stacked_by_a_copy():
    a, b = np.ones((2, 3), np.float32), np.zeros((2, 3), np.float32)
    stacked = device_blocks._stacked([a, b])
    assert not np.shares_memory(stacked, a) and np.array_equal(stacked, np.stack([a, b]))
