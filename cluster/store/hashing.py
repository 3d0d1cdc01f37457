"""Block ids: a BLAKE3 chain over full token blocks, inside a model fingerprint.

    id_0 = H(ns, ns,      tokens[0:B])
    id_i = H(ns, id_i-1,  tokens[iB:(i+1)B])
    H(ns, parent, toks) = BLAKE3("mlxf-block\\x01" || ns || parent || u32(len) || u32le(toks))

Only full blocks are named. The encoding is explicit bytes (no Python hash(),
no per-process seed), so every process on every machine, under any Python,
names the same tokens the same way. The namespace is the model fingerprint,
which already pins the block size and codec: ids of different models or
settings can never collide on purpose or by accident.

A recurrent checkpoint taken at the end of block i is stored under
state_key(id_i), so it is found from the same chain. A prompt's tail (the
tokens after its last kept block, kvcache/tails.py) is kept under
tail_key(id of that block, the tail's tokens).
"""

from __future__ import annotations

import array
import sys
from typing import Sequence

import numpy as np
from blake3 import blake3

_TAG = b"mlxf-block\x01"
_STATE_TAG = b"mlxf-state\x01"
_TAIL_TAG = b"mlxf-tail\x01"
ID_BYTES = 32


def _u32le(tokens) -> bytes:
    if isinstance(tokens, np.ndarray):
        return np.asarray(tokens, dtype="<u4").tobytes()
    packed = array.array("I", tokens)  # a C loop over a list: the gateway hashes every prompt
    if packed.itemsize != 4:
        return np.asarray(tokens, dtype="<u4").tobytes()
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def block_id(namespace: bytes, parent: bytes, tokens) -> bytes:
    data = _u32le(tokens)
    h = blake3(_TAG)
    h.update(namespace)
    h.update(parent)
    h.update(len(data).to_bytes(4, "little"))
    h.update(data)
    return h.digest()


def chain_ids(namespace: bytes, tokens: Sequence[int], block_tokens: int, parent: bytes | None = None,
              start_block: int = 0) -> list[bytes]:
    """Ids of every full block of `tokens`, starting at block `start_block` whose parent is `parent`."""
    raw = memoryview(_u32le(tokens))
    width = 4 * block_tokens
    seeded = blake3(_TAG)  # H's constant prefix, hashed once and copied per block
    seeded.update(namespace)
    length = width.to_bytes(4, "little")
    ids, prev = [], parent or namespace
    for i in range(start_block, len(tokens) // block_tokens):
        h = seeded.copy()
        h.update(prev)
        h.update(length)
        h.update(raw[i * width:(i + 1) * width])
        prev = h.digest()
        ids.append(prev)
    return ids


def state_key(block: bytes) -> bytes:
    """Key of the recurrent-state checkpoint taken at the end of `block`."""
    return blake3(_STATE_TAG + block).digest()


def tail_key(parent: bytes, tokens) -> bytes:
    """Key of a prompt's tail: `tokens` right after the block `parent` (the namespace for a prompt's start)."""
    data = _u32le(tokens)
    return blake3(_TAIL_TAG + parent + len(data).to_bytes(4, "little") + data).digest()
