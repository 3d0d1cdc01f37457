"""The block envelope: exact round trips, and every kind of damage refused with a typed error."""

import dataclasses
import struct

import msgpack
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.store import block_format as bf
from cluster.store.hashing import block_id

NS = b"N" * 32
B = 16
LAYOUT = [["full"], ["sliding", 8], ["recurrent", 2], ["quantized", 8, 64]]
TOKENS = np.arange(100, 100 + B, dtype="<u4")
PARENT = b"P" * 32
BID = block_id(NS, PARENT, TOKENS)


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    return [
        [("float32", rng.standard_normal((1, 2, B, 4), dtype=np.float32)),
         ("float32", rng.standard_normal((1, 2, B, 4), dtype=np.float32))],
        [("bfloat16", rng.integers(0, 2**16, (1, 1, 8, 4), dtype=np.uint16)),
         ("bfloat16", rng.integers(0, 2**16, (1, 1, 8, 4), dtype=np.uint16))],
        [],
        [("uint32", rng.integers(0, 2**32, (1, 2, B, 1), dtype=np.uint32)),
         ("float16", rng.standard_normal((1, 2, B, 1)).astype(np.float16)),
         ("float16", rng.standard_normal((1, 2, B, 1)).astype(np.float16))],
    ]


def make(**over) -> bf.Block:
    fields = dict(kind="kv", namespace=NS, id=BID, parent=PARENT, start=3 * B, tokens=TOKENS, layout=LAYOUT,
                  dtype="float32", codec=CODEC, entries=arrays())
    fields.update(over)
    return bf.Block(**fields)


CODEC = ["native", 1, None, None]
EXPECT = bf.Expect(namespace=NS, id=BID, kind="kv", layout=LAYOUT, block_tokens=B, parent=PARENT, start=3 * B,
                   dtype="float32", codec=CODEC, arrays=bf.signature(arrays()))


def expect(**over) -> bf.Expect:
    return dataclasses.replace(EXPECT, **over)


def test_round_trip_every_layer_kind_and_dtype():
    data = bf.encode(make())
    out = bf.decode(data, EXPECT)
    assert (out.kind, out.namespace, out.id, out.parent, out.start, out.end) == ("kv", NS, BID, PARENT, 3 * B, 4 * B)
    assert out.tokens.tolist() == TOKENS.tolist() and out.layout == LAYOUT and out.codec == CODEC
    for got, want in zip(out.entries, arrays()):
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, g), (_, w) in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)


def test_arrays_are_aligned_views_into_the_buffer():
    data = bf.encode(make())
    out = bf.decode(data, EXPECT)
    base = np.frombuffer(data, dtype=np.uint8).ctypes.data
    for entry in out.entries:
        for _, a in entry:
            assert (a.ctypes.data - base) % bf.ALIGN == 0
            assert not a.flags.owndata


def test_state_entry_round_trip():
    state = [[], [], [("float32", np.ones((1, 3, 4), np.float32)), ("float32", np.zeros((1, 2, 4, 4), np.float32))], []]
    data = bf.encode(make(kind="state", entries=state))
    out = bf.decode(data, expect(kind="state", arrays=bf.signature(state)))
    assert out.entries[2][0][1].shape == (1, 3, 4)


def test_no_pickle_or_eval_anywhere():
    import inspect
    src = inspect.getsource(bf)
    assert "pickle" not in src.replace("unpickles", "") and "eval(" not in src


# -- damage ------------------------------------------------------------------
GOOD = bytes(bf.encode(make()))
HDR_LEN = struct.unpack_from("<I", GOOD, 12)[0]


def flip(data: bytes, pos: int, bit: int = 0) -> bytes:
    b = bytearray(data)
    b[pos] ^= 1 << bit
    return bytes(b)


@pytest.mark.parametrize("pos,err", [
    (0, bf.BadMagic), (7, bf.BadMagic), (8, bf.UnsupportedVersion), (10, bf.CorruptHeader),
    (12, (bf.Truncated, bf.CorruptHeader)), (13, bf.Truncated), (16, bf.Truncated), (24, bf.CorruptHeader),
    (31, bf.CorruptHeader),
])
def test_preamble_damage(pos, err):
    with pytest.raises(err):
        bf.decode(flip(GOOD, pos), EXPECT)


def test_every_header_byte_is_protected():
    for pos in range(bf.PREAMBLE_SIZE, bf.PREAMBLE_SIZE + HDR_LEN + (-(bf.PREAMBLE_SIZE + HDR_LEN)) % 64):
        with pytest.raises(bf.CorruptHeader):
            bf.decode(flip(GOOD, pos, pos % 8), EXPECT)


def test_payload_damage():
    for pos in (len(GOOD) - 1, len(GOOD) - 500, len(GOOD) // 2 + 64):
        with pytest.raises(bf.CorruptPayload):
            bf.decode(flip(GOOD, pos), EXPECT)


@pytest.mark.parametrize("cut", [0, 10, 31, 32, 100, len(GOOD) - 1])
def test_truncation(cut):
    with pytest.raises(bf.Truncated):
        bf.decode(GOOD[:cut], EXPECT)


def test_extra_trailing_bytes():
    with pytest.raises(bf.Truncated):
        bf.decode(GOOD + b"\0", EXPECT)


def reencode_header(**changes) -> bytes:
    """Rewrite header fields and re-seal the checksums: only the semantic checks can catch it."""
    hdr_len, payload_len = struct.unpack_from("<IQ", GOOD, 12)
    h = msgpack.unpackb(GOOD[32:32 + hdr_len], raw=False)
    h.update(changes)
    header = msgpack.packb(h, use_bin_type=True)
    pad = bytes((-(32 + len(header))) % 64)
    payload = GOOD[len(GOOD) - payload_len:]
    pre = struct.pack("<8sHHIQ", bf.MAGIC, bf.VERSION, 0, len(header), payload_len)
    hsum = xxhash.xxh3_64_intdigest(pre + header + pad)
    return pre + struct.pack("<Q", hsum) + header + pad + payload


@pytest.mark.parametrize("changes,err", [
    ({"ns": b"X" * 32}, bf.ForeignNamespace),
    ({"id": b"I" * 32}, bf.WrongBlock),
    ({"kind": "state"}, bf.WrongBlock),
    ({"parent": b"Q" * 32}, bf.CorruptHeader),  # id no longer hashes from parent + tokens
    ({"tokens": TOKENS[:-1].tobytes()}, bf.BadTokenCount),
    ({"tokens": (TOKENS + 1).tobytes()}, bf.CorruptHeader),
    ({"start": 3 * B + 1}, bf.BadTokenCount),
    ({"start": 4 * B}, bf.BadStart),
    ({"dtype": "bfloat16"}, bf.BadDtype),
    ({"codec": ["native", 2, None, None]}, bf.BadCodec),
    ({"codec": ["q8", 1, 8, 64]}, bf.BadCodec),
    ({"layout": LAYOUT[:-1]}, bf.LayoutMismatch),
    ({"layout": [["full"], ["sliding", 16], ["recurrent", 2], ["quantized", 8, 64]]}, bf.LayoutMismatch),
    ({"sum": b"0" * 16}, bf.CorruptPayload),
    ({"arrays": [[0, "float32", [1, 2, B, 4], 0, 999]]}, bf.CorruptHeader),
    ({"arrays": [[9, "float32", [1, 2, B, 4], 0, 512]]}, bf.CorruptHeader),
    ({"arrays": [[0, "complex", [1], 0, 4]]}, bf.CorruptHeader),
    ({"arrays": [[0, "float32", [1, 2, B, 4], 1 << 30, 512]]}, bf.CorruptHeader),
    ({"tokens": None}, bf.CorruptHeader),
])
def test_header_field_semantics(changes, err):
    with pytest.raises(err):
        bf.decode(reencode_header(**changes), EXPECT)


def test_missing_header_field():
    hdr_len = struct.unpack_from("<I", GOOD, 12)[0]
    h = msgpack.unpackb(GOOD[32:32 + hdr_len], raw=False)
    del h["kind"]
    data = reencode_header()  # sanity: unchanged re-seal decodes
    bf.decode(data, EXPECT)
    header = msgpack.packb(h, use_bin_type=True)
    payload_len = struct.unpack_from("<Q", GOOD, 16)[0]
    pad = bytes((-(32 + len(header))) % 64)
    pre = struct.pack("<8sHHIQ", bf.MAGIC, bf.VERSION, 0, len(header), payload_len)
    data = pre + struct.pack("<Q", xxhash.xxh3_64_intdigest(pre + header + pad)) + header + pad + GOOD[-payload_len:]
    with pytest.raises(bf.CorruptHeader):
        bf.decode(data, EXPECT)


def test_mismatched_parent_in_a_chain():
    with pytest.raises(bf.ChainBroken):
        bf.decode(GOOD, expect(parent=b"Z" * 32))


def test_wrong_block_size_expected():
    with pytest.raises(bf.BadTokenCount):
        bf.decode(GOOD, expect(block_tokens=2 * B))


def payload_with(entry: int, index: int, tag: str, a: np.ndarray) -> bytes:
    """A block whose every checksum, id and parent is right, but one array is not what the layout needs."""
    entries = arrays()
    entries[entry][index] = (tag, a)
    return bytes(bf.encode(make(entries=entries)))


@pytest.mark.parametrize("entry,index,tag,shape,err", [
    (0, 1, "float32", (1, 2, B // 2, 4), bf.BadShape),  # half the token rows of a full layer
    (0, 0, "float32", (1, 1, B, 4), bf.BadShape),  # a head missing
    (1, 0, "bfloat16", (1, 1, 9, 4), bf.BadShape),  # a sliding tail one row too long
    (0, 0, "float16", (1, 2, B, 4), bf.BadDtype),  # right shape, wrong dtype
])
def test_payload_is_checked_against_the_layout(entry, index, tag, shape, err):
    a = np.zeros(shape, dtype=bf.STORAGE[tag])
    with pytest.raises(err):
        bf.decode(payload_with(entry, index, tag, a), EXPECT)


def test_payload_with_an_array_too_many_or_too_few_is_refused():
    extra = arrays()
    extra[2].append(("float32", np.zeros((1, 3, 4), np.float32)))  # a recurrent layer holds nothing in a KV block
    with pytest.raises(bf.BadShape):
        bf.decode(bytes(bf.encode(make(entries=extra))), EXPECT)
    short = arrays()
    short[3].pop()
    with pytest.raises(bf.BadShape):
        bf.decode(bytes(bf.encode(make(entries=short))), EXPECT)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(GOOD) - 1), st.integers(0, 7))
def test_any_single_bit_flip_is_refused(pos, bit):
    with pytest.raises(bf.BlockError):
        bf.decode(flip(GOOD, pos, bit), EXPECT)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=600))
def test_garbage_never_decodes(data):
    with pytest.raises(bf.BlockError):
        bf.decode(data, EXPECT)
