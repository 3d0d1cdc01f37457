"""Real encoded blocks for store tests (no model needed: the store never looks inside arrays)."""

from __future__ import annotations

import numpy as np

from cluster.store import block_format as bf
from cluster.store.hashing import chain_ids, state_key

NS = bytes(range(32))
B = 16


def tokens_of(n_blocks: int, salt: int = 0) -> list[int]:
    return [(salt * 1000 + i) % 50000 for i in range(n_blocks * B)]


def chain(n_blocks: int, salt: int = 0, ns: bytes = NS, payload: int = 4096) -> list[tuple[bytes, bytes, bytes]]:
    """[(namespace, key, data)] of a chain of KV blocks of about `payload` bytes each."""
    tokens = tokens_of(n_blocks, salt)
    ids = chain_ids(ns, tokens, B)
    out = []
    for j, bid in enumerate(ids):
        arr = np.full(payload // 4, j + salt, dtype=np.float32)
        blk = bf.Block(kind="kv", namespace=ns, id=bid, parent=ids[j - 1] if j else ns, start=j * B,
                       tokens=np.asarray(tokens[j * B:(j + 1) * B], dtype="<u4"), layout=[["full"]],
                       dtype="float32", codec=["native", 1, None, None], entries=[[("float32", arr)]])
        out.append((ns, bid, bytes(bf.encode(blk))))
    return out


def checkpoint(blocks: list[tuple[bytes, bytes, bytes]], j: int, salt: int = 0) -> tuple:
    """The recurrent checkpoint entry at the end of block j of `blocks` (a chain(..., salt))."""
    ns, bid, _ = blocks[j]
    tokens = tokens_of(j + 1, salt)[j * B:]
    blk = bf.Block(kind="state", namespace=ns, id=bid, parent=blocks[j - 1][1] if j else ns, start=j * B,
                   tokens=np.asarray(tokens, dtype="<u4"), layout=[["full"]], dtype="float32",
                   codec=["native", 1, None, None], entries=[[("float32", np.zeros(8, np.float32))]])
    return ns, state_key(bid), bytes(bf.encode(blk))
