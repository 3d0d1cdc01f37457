"""The prefill schedule: where a prompt's chunks are cut, where a hit may resume, which blocks may serve one.

A GPU (Metal, CUDA) picks its kernels by shape: a matmul over 4 rows and one over 452 can round the
same row differently, and attention is picked by the K/V buffer's layout. So a cached run gives what
the cold run gives, bit for bit, only if from the resume point on it runs the very same shapes on the
very same buffers. The canonical schedule ("chunk") makes that so:
- chunks are cut at absolute multiples of C tokens (prefill_step rounded down to whole blocks) and at
  the prompt's last token but one; the last token always runs alone (Sequence does that);
- a hit resumes only at a multiple of C, so the chunks after it are the cold run's;
- only blocks computed inside a complete chunk are kept: a block of a prompt's final, shorter chunk (or
  one made while decoding, a row at a time) holds bytes that a longer prompt's cold run would compute
  differently under the same block id, so it never serves a hit;
- a restored K/V buffer has the capacity a cold mlx-lm KVCache has at that offset (it grows in steps of
  256), so decode takes the same attention kernel.
Recomputing up to C - 1 tokens past the last cut costs a GPU a few milliseconds.

The CPU backend's BLAS computes a row the same way whatever the number of rows (measured: bitwise,
tests/kvcache/test_exactness.py), so there the finer "block" schedule is exact too for full attention and
recurrent layers: chunks run block end to block end, a hit resumes at any block end (or mid-block at the
prompt's end), and the blocks of the final chunk and of replies are kept. A sliding window is the
exception: its attention runs over the ring's (window - 1 + chunk) keys, so a chunk of another length
reduces in another order (last bits, 1.6e-5 in float32 on tiny-swa). `auto` (the default) takes chunk on a
GPU; on the CPU, block, or for models with sliding windows chunk with one block per chunk. The schedule is part of the fingerprint:
blocks made under one never restore under the other.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_STEP = 256  # mlx-lm's KVCache and QuantizedKVCache grow their buffers in steps of this many tokens


@dataclass(frozen=True)
class Schedule:
    block_tokens: int
    chunk_tokens: int  # C: a multiple of block_tokens
    canonical: bool  # True: "chunk" (exact on every backend); False: "block" (exact where rows are independent)

    @classmethod
    def of(cls, mode: str, block_tokens: int, prefill_step: int, sliding: bool = False) -> "Schedule":
        """`mode` is CacheConfig.resume_at: auto, chunk or block; `sliding`: the model has sliding windows."""
        if mode not in ("auto", "chunk", "block"):
            raise ValueError(f"cache.resume_at must be auto, chunk or block, not {mode!r}")
        chunk = max(block_tokens, prefill_step - prefill_step % block_tokens)
        if mode == "auto" and not on_gpu():
            # The CPU: block for most models; a sliding model's chunks must be canonical too, and there one
            # block each, so it still resumes at every block end (512-token chunks would leave every prompt
            # shorter than 513 tokens uncached, at a CPU's cost to recompute).
            return cls(block_tokens, block_tokens, True) if sliding else cls(block_tokens, chunk, False)
        return cls(block_tokens, chunk, mode in ("auto", "chunk"))

    @property
    def mode(self) -> str:
        return "chunk" if self.canonical else "block"

    @property
    def resume_every(self) -> int:
        """A hit resumes only at multiples of this many tokens (what the router predicts with)."""
        return self.chunk_tokens if self.canonical else 1

    def fingerprint(self) -> list:
        return ["chunk", self.chunk_tokens] if self.canonical else ["block"]

    def next_stop(self, start: int, limit: int, step: int) -> int:
        """End of the prefill chunk that starts at `start` (at most `limit`). `step` is the scheduler's budget
        left this round: the block schedule cuts shorter chunks for it; the canonical one never does."""
        if self.canonical:
            return min((start // self.chunk_tokens + 1) * self.chunk_tokens, limit)
        return min(start + max(self.block_tokens, step - step % self.block_tokens), limit)

    def resumable(self, n: int) -> bool:
        """Whether a hit may resume at n (the Planner adds each layer kind's own rule)."""
        return n % self.resume_every == 0

    def kept_tokens(self, prompt_len: int) -> int:
        """Tokens [0, kept) of a sequence with this prompt whose blocks may serve a later hit."""
        if self.canonical:
            return (prompt_len - 1) // self.chunk_tokens * self.chunk_tokens
        return 1 << 62

    def capacity(self, n: int, prompt_len: int) -> int:
        """Token capacity of a restored K/V buffer holding n tokens of a `prompt_len`-token prompt.

        Canonical: what a cold KVCache has grown to after the schedule's chunks up to n. Block: room for
        the rest of the prompt and a first reply step, so no copy happens at once (numerics do not
        depend on it on the CPU)."""
        if not self.canonical:
            return -(-(prompt_len + 256) // KV_STEP) * KV_STEP
        capacity = offset = 0
        while offset < n:
            end = self.next_stop(offset, n, self.chunk_tokens)
            if not capacity or end > capacity:
                if capacity and offset % KV_STEP:
                    capacity = offset  # it trims its buffer to the tokens held before growing
                capacity += -(-(end - offset) // KV_STEP) * KV_STEP
            offset = end
        return capacity


def on_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


def cuda() -> bool:
    """MLX runs on its CUDA backend (managed memory), not Metal's unified memory or the CPU."""
    import mlx.core as mx

    backend = getattr(mx, "cuda", None)  # absent from some builds
    return on_gpu() and backend is not None and backend.is_available()
