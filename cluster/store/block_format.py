"""The block envelope: one token block's KV (or one recurrent checkpoint) as bytes.

Layout (little-endian; every array starts on a 64-byte boundary so a reader can
view it in place with numpy and copy it once into an mx.array):

     0        8        10       12         16                 24                32
     +--------+--------+--------+----------+------------------+-----------------+
     | magic  | version| flags  | hdr_len  | payload_len      | hdr_sum         |
     | MLXFBLK| u16 = 1| u16 = 0| u32      | u64              | xxh3_64         |
     +--------+--------+--------+----------+------------------+-----------------+
  32 | header: msgpack map, hdr_len bytes                                       |
     |   kind "kv" | "state", ns (32 B), id (32 B), parent (32 B), start,        |
     |   tokens (u32 LE bytes), layout, dtype, codec [name, version, ...],       |
     |   arrays [[entry, dtype, shape, offset, nbytes], ...], sum (xxh3_128)     |
     +-- zero padding to a 64-byte boundary ------------------------------------+
   P | payload: the arrays at their offsets (relative to P), zero padded         |
     +--------------------------------------------------------------------------+

hdr_sum covers bytes 0..24, the header and its padding; `sum` covers the
payload (padding included). So any flipped bit anywhere is caught: in the
preamble by magic/version/lengths or hdr_sum, in the header by hdr_sum, in the
payload by sum. The header also
carries the block's tokens and parent, so the id can be recomputed from its
own contents: a block can only be used under the name it was made for.

Decoding never unpickles anything: msgpack for the header, raw bytes for arrays.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import msgpack
import numpy as np
import xxhash

from cluster.store.hashing import block_id

MAGIC = b"MLXFBLK\x00"
VERSION = 1
ALIGN = 64
_PREAMBLE = struct.Struct("<8sHHIQQ")  # magic, version, flags, hdr_len, payload_len, hdr_sum
PREAMBLE_SIZE = _PREAMBLE.size  # 32
MAX_HEADER = 16 << 20


class BlockError(ValueError):
    """A block that must not be used. Subclasses say why; the store treats every one as a miss."""

    reason = "corrupt"


class Truncated(BlockError):
    reason = "truncated"


class BadMagic(BlockError):
    reason = "magic"


class UnsupportedVersion(BlockError):
    reason = "version"


class CorruptHeader(BlockError):
    reason = "header"


class CorruptPayload(BlockError):
    reason = "payload"


class ForeignNamespace(BlockError):
    reason = "namespace"


class WrongBlock(BlockError):
    reason = "id"


class LayoutMismatch(BlockError):
    reason = "layout"


class BadTokenCount(BlockError):
    reason = "tokens"


class ChainBroken(BlockError):
    reason = "parent"


class BadStart(BlockError):
    reason = "start"


class BadDtype(BlockError):
    reason = "dtype"


class BadCodec(BlockError):
    reason = "codec"


class BadShape(BlockError):
    reason = "shape"


# Why a block can be refused: every BlockError reason, plus "unexpected" for any
# other exception while decoding or restoring it (still a miss, never an answer).
REASONS = tuple(sorted({cls.reason for cls in (BlockError, *BlockError.__subclasses__())} | {"unexpected"}))


# mlx dtype name -> how its bytes are stored (numpy has no bfloat16: its bits travel as uint16).
STORAGE = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "uint32": "<u4", "int32": "<i4",
           "uint16": "<u2", "uint8": "|u1", "int8": "|i1"}

Tagged = tuple[str, np.ndarray]  # (mlx dtype name, array of its storage dtype)


@dataclass
class Block:
    """A decoded (or to-be-encoded) block. `entries[i]` holds cache entry i's (dtype, array) pairs."""

    kind: str
    namespace: bytes
    id: bytes
    parent: bytes
    start: int
    tokens: np.ndarray
    layout: list
    dtype: str
    codec: list
    entries: list[list[Tagged]] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


Signature = tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]  # per entry: ((dtype tag, shape), ...)


@dataclass(frozen=True)
class Expect:
    """What the reader asked for; a block that disagrees on any of it is refused.

    Checksums prove the bytes are the ones written; these fields prove they are
    what this model needs at this place of this chain: a well-formed block made
    by a buggy or foreign writer is refused as surely as a damaged one."""

    namespace: bytes
    id: bytes
    kind: str
    layout: list
    block_tokens: int
    parent: bytes
    start: int
    dtype: str
    codec: list
    arrays: Signature


def _pad(n: int) -> int:
    return (-n) % ALIGN


def encode(block: Block) -> memoryview:
    """Frame `block`; each array is copied exactly once, straight into the envelope."""
    arrays, offset = [], 0
    for entry, layer in enumerate(block.entries):
        for tag, a in layer:
            if a.dtype != np.dtype(STORAGE[tag]):
                raise ValueError(f"array tagged {tag} must be stored as {STORAGE[tag]}, got {a.dtype}")
            arrays.append((entry, tag, a, offset))
            offset += a.nbytes + _pad(a.nbytes)
    fields = {
        "kind": block.kind, "ns": block.namespace, "id": block.id, "parent": block.parent,
        "start": block.start, "tokens": np.asarray(block.tokens, dtype="<u4").tobytes(),
        "layout": block.layout, "dtype": block.dtype, "codec": block.codec,
        "arrays": [[e, tag, list(a.shape), off, a.nbytes] for e, tag, a, off in arrays],
        "sum": bytes(16),  # placeholder of the final length: the header's size does not depend on it
    }
    hdr_len = len(msgpack.packb(fields, use_bin_type=True))
    payload_at = PREAMBLE_SIZE + hdr_len + _pad(PREAMBLE_SIZE + hdr_len)
    buf = np.empty(payload_at + offset, dtype=np.uint8)  # not zero-filled: only the gaps are zeroed
    buf[PREAMBLE_SIZE + hdr_len:payload_at] = 0
    for _, _, a, off in arrays:
        start = payload_at + off
        buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
        buf[start + a.nbytes:start + a.nbytes + _pad(a.nbytes)] = 0
    view = memoryview(buf)
    fields["sum"] = xxhash.xxh3_128_digest(view[payload_at:])
    header = msgpack.packb(fields, use_bin_type=True)
    assert len(header) == hdr_len
    view[PREAMBLE_SIZE:PREAMBLE_SIZE + hdr_len] = header
    _PREAMBLE.pack_into(view, 0, MAGIC, VERSION, 0, hdr_len, offset, 0)
    hdr_sum = xxhash.xxh3_64()
    hdr_sum.update(view[:24])
    hdr_sum.update(view[PREAMBLE_SIZE:payload_at])
    _PREAMBLE.pack_into(view, 0, MAGIC, VERSION, 0, hdr_len, offset, hdr_sum.intdigest())
    return view


def decode(buf, expect: Expect, payload_verified: bool = False) -> Block:
    """Parse and verify `buf` (bytes or memoryview); arrays are numpy views into it.

    `payload_verified`: `verify` already checked this very buffer's payload checksum (a disk read does, in
    the thread that read it), so it is not hashed twice; the header's checksum and every check against
    `expect` still run."""
    view = memoryview(buf)
    h, payload_at = _read_header(view, whole=True)
    block = _check_header(h, expect)
    payload = view[payload_at:]
    if not payload_verified and xxhash.xxh3_128_digest(payload) != h["sum"]:
        raise CorruptPayload("payload checksum mismatch")
    block.entries = _arrays(h["arrays"], payload, len(block.layout))
    _check_arrays(block.entries, expect.arrays)
    return block


def signature(entries: list[list[Tagged]]) -> Signature:
    """The (dtype tag, shape) of every array, entry by entry."""
    return tuple(tuple((tag, tuple(int(d) for d in a.shape)) for tag, a in arrays) for arrays in entries)


def _check_arrays(entries: list[list[Tagged]], expected: Signature) -> None:
    got = signature(entries)
    if len(got) != len(expected):
        raise BadShape(f"{len(got)} cache entries, the layout has {len(expected)}")
    for i, (have, want) in enumerate(zip(got, expected)):
        if len(have) != len(want):
            raise BadShape(f"entry {i} holds {len(have)} arrays, its layer spec needs {len(want)}")
        for (tag, shape), (want_tag, want_shape) in zip(have, want):
            if tag != want_tag:
                raise BadDtype(f"entry {i} has a {tag} array, its layer spec needs {want_tag}")
            if shape != want_shape:
                raise BadShape(f"entry {i} has an array of shape {list(shape)}, its layer spec needs {list(want_shape)}")


def _read_header(view: memoryview, whole: bool) -> tuple[dict, int]:
    """Preamble checks, header checksum, msgpack: (header fields, payload offset).

    `whole`: `view` must be the entire block; otherwise a prefix holding the header is enough."""
    payload_at = header_size(view)
    hdr_len, payload_len, hdr_sum = _PREAMBLE.unpack_from(view, 0)[3:]
    if (len(view) != payload_at + payload_len) if whole else (len(view) < payload_at):
        raise Truncated(f"{len(view)} bytes, the preamble promises {payload_at + payload_len}")
    check = xxhash.xxh3_64()
    check.update(view[:24])
    check.update(view[PREAMBLE_SIZE:payload_at])
    if check.intdigest() != hdr_sum:
        raise CorruptHeader("header checksum mismatch")
    try:
        h = msgpack.unpackb(view[PREAMBLE_SIZE:PREAMBLE_SIZE + hdr_len], raw=False)
    except Exception as e:  # msgpack raises several types for garbage
        raise CorruptHeader(f"header is not msgpack: {e}") from None
    if not isinstance(h, dict):
        raise CorruptHeader("header is not a map")
    h["_total"] = payload_at + payload_len
    return h, payload_at


def _check_header(h: dict, expect: Expect) -> Block:
    try:
        kind, ns, bid, parent, start = h["kind"], h["ns"], h["id"], h["parent"], h["start"]
        tokens = np.frombuffer(h["tokens"], dtype="<u4")
        block = Block(kind=kind, namespace=ns, id=bid, parent=parent, start=int(start), tokens=tokens,
                      layout=h["layout"], dtype=h["dtype"], codec=h["codec"])
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptHeader(f"header field missing or mistyped: {e}") from None
    if ns != expect.namespace:
        raise ForeignNamespace("block belongs to another model fingerprint")
    if kind != expect.kind:
        raise WrongBlock(f"expected a {expect.kind} block, got {kind}")
    if bid != expect.id:
        raise WrongBlock("block id differs from the one requested")
    if len(tokens) != expect.block_tokens or block.start % expect.block_tokens:
        raise BadTokenCount(f"{len(tokens)} tokens at {block.start}, blocks hold {expect.block_tokens}")
    if block_id(ns, parent, tokens) != bid:
        raise CorruptHeader("id does not hash from the header's parent and tokens")
    if block.layout != expect.layout:
        raise LayoutMismatch(f"layout {block.layout} differs from the model's {expect.layout}")
    if parent != expect.parent:
        raise ChainBroken("parent is not the previous block of the chain")
    if block.start != expect.start:
        raise BadStart(f"block starts at token {block.start}, it is asked for at {expect.start}")
    if block.dtype != expect.dtype:
        raise BadDtype(f"block holds {block.dtype} KV, the model computes in {expect.dtype}")
    if block.codec != expect.codec:
        raise BadCodec(f"block codec {block.codec} differs from the model's {expect.codec}")
    return block


def _arrays(records: list, payload: memoryview, n_entries: int) -> list[list[Tagged]]:
    entries: list[list[Tagged]] = [[] for _ in range(n_entries)]
    end = 0
    for rec in records:
        try:
            entry, tag, shape, off, nbytes = rec
            dt = np.dtype(STORAGE[tag])
            count = math.prod(shape)
        except (TypeError, ValueError, KeyError) as e:
            raise CorruptHeader(f"bad array record {rec!r}: {e}") from None
        if not (0 <= entry < n_entries) or count * dt.itemsize != nbytes or off % ALIGN or off < end \
                or off + nbytes > len(payload):
            raise CorruptHeader(f"array record {rec!r} does not fit the payload")
        end = off + nbytes
        entries[entry].append((tag, np.frombuffer(payload, dtype=dt, count=count, offset=off).reshape(shape)))
    return entries


@dataclass(frozen=True)
class Header:
    """What a store needs to know about a block without reading its payload."""

    kind: str
    namespace: bytes
    id: bytes
    parent: bytes
    start: int
    tokens: int
    total_len: int  # the whole envelope, preamble to payload end


def header_size(prefix) -> int:
    """Bytes to read to parse the header (preamble + header + padding); needs the 32-byte preamble."""
    view = memoryview(prefix)
    if len(view) < PREAMBLE_SIZE:
        raise Truncated(f"{len(view)} bytes is shorter than the {PREAMBLE_SIZE}-byte preamble")
    magic, version, _flags, hdr_len, _payload_len, _sum = _PREAMBLE.unpack_from(view, 0)
    if magic != MAGIC:
        raise BadMagic(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise UnsupportedVersion(f"format version {version}, this reader knows {VERSION}")
    if hdr_len > MAX_HEADER:
        raise CorruptHeader(f"header length {hdr_len} is implausible")
    return PREAMBLE_SIZE + hdr_len + _pad(PREAMBLE_SIZE + hdr_len)


def _header_of(h: dict) -> Header:
    try:
        tokens = np.frombuffer(h["tokens"], dtype="<u4")
        header = Header(kind=h["kind"], namespace=h["ns"], id=h["id"], parent=h["parent"], start=int(h["start"]),
                        tokens=len(tokens), total_len=h["_total"])
    except Exception as e:  # any malformed field
        raise CorruptHeader(f"header field missing or mistyped: {e}") from None
    if block_id(header.namespace, header.parent, tokens) != header.id:
        raise CorruptHeader("id does not hash from the header's parent and tokens")
    return header


def peek(prefix) -> Header:
    """Parse and checksum the header from (at least) the first header_size() bytes of a block."""
    return _header_of(_read_header(memoryview(prefix), whole=False)[0])


def verify(buf, namespace: bytes, key: bytes, key_of) -> Header:
    """Everything a store can check without knowing the model: framing, checksums, and that
    the block is the one stored under (namespace, key). `key_of(header)` gives its storage key."""
    view = memoryview(buf)
    h, payload_at = _read_header(view, whole=True)
    header = _header_of(h)
    if header.namespace != namespace:
        raise ForeignNamespace("block belongs to another model fingerprint")
    if key_of(header) != key:
        raise WrongBlock("block is not the one stored under this key")
    if xxhash.xxh3_128_digest(view[payload_at:]) != h["sum"]:
        raise CorruptPayload("payload checksum mismatch")
    return header
