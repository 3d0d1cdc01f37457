"""A real model + PrefixCache + engine, and cold/warm runs to compare."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import pytest

from cluster.config import CacheConfig
from cluster.engine.cold_session import ColdSession
from cluster.engine.events import Delta, Finished, Started
from cluster.engine.request import GenerationParams
from cluster.engine.sequence import Sequence
from cluster.kvcache.admission import Admission
from cluster.kvcache.session import BlockSession
from cluster.kvcache.setup import setup_cache
from cluster.models.resolve import resolve_model

# A wrong snapshot must move the logits by more than this (negative controls): a cached run that is right
# moves them by nothing at all (assert_same is bitwise, on every backend, with the replica's schedule).
WRONG = {mx.float32: 1e-2, mx.float16: 0.5, mx.bfloat16: 2.5}


@dataclass
class Run:
    tokens: list[int]
    logits: mx.array  # [steps, vocab]
    cached: int
    finish: Finished
    prompt: tuple = ()


class Harness:
    def __init__(self, model, tokenizer, path, tmp, block_tokens=32, kv_codec="native", prefill_step=64,
                 resume_at="auto"):
        self.model, self.tok = model, tokenizer
        cfg = CacheConfig(block_tokens=block_tokens, kv_codec=kv_codec, ram_bytes=1 << 30, resume_at=resume_at)
        self.setup = setup_cache(model, tokenizer, path, cfg, tmp, prefill_step=prefill_step)
        self.pc = self.setup.cache
        self.schedule = self.pc.schedule
        self.B = block_tokens
        self.step = prefill_step
        self.wrong = WRONG[getattr(mx, self.pc.dtype)]

    def _run(self, prompt, max_tokens, session) -> Run:
        seq = Sequence(list(prompt), GenerationParams(max_tokens=max_tokens, record_logits=True),
                       self.model, self.tok, session, self.step)
        events = []
        while not seq.done:
            events += seq.step()
        started = next(e for e in events if isinstance(e, Started))
        return Run([t for e in events if isinstance(e, Delta) for t in e.token_ids], mx.stack(seq.logits),
                   started.cached_tokens, events[-1], tuple(prompt))

    def cold(self, prompt, max_tokens=12) -> Run:
        return self._run(prompt, max_tokens, ColdSession(self.model, self.pc.new_caches, self.schedule))

    def warm(self, prompt, max_tokens=12) -> Run:
        return self._run(prompt, max_tokens, self.session(prompt))

    def session(self, prompt):
        """The admission stage (lookups, reads, checks), then a session restoring what it fetched."""
        return BlockSession(self.pc, list(prompt), Admission(self.pc).fetch(list(prompt)))

    def resume_point(self, held: int) -> int:
        """Where a hit resumes with tokens [0, held) kept: the last block end there that the schedule
        resumes at (every block end, or on the canonical schedule every chunk end)."""
        step = self.schedule.chunk_tokens if self.schedule.canonical else self.B
        return held - held % step

    def kept_after(self, first_prompt_len: int, fed: int) -> int:
        """Tokens of an earlier sequence (a `first_prompt_len`-token prompt, `fed` tokens in all with its
        reply) whose blocks are kept for a later hit."""
        return min(fed, self.pc.kept_tokens(first_prompt_len))

    def hit_after(self, prompt_len: int, first_len: int, fed: int, tail: bool = True) -> int:
        """Where a `prompt_len`-token prompt resumes after an earlier sequence that shares all of it held its
        own `first_len`-token prompt and `fed` tokens in all: the Planner's rule on the kept blocks (models
        without recurrent layers). `tail`: whether RAM still holds that prompt's tail (not after a restart)."""
        kept = self.kept_after(first_len, fed)
        if tail and self.pc.tails and prompt_len == first_len and kept >= self.pc.kept_tokens(prompt_len):
            return prompt_len - 1  # the very same prompt: its blocks and its tail (kvcache/tails.py)
        return self.pc.planner.best(prompt_len, kept // self.B, set())

    def run_with(self, prompt, session, max_tokens=12) -> Run:
        return self._run(prompt, max_tokens, session)

    def assert_same(self, warm: Run, cold: Run) -> None:
        """Bitwise: the same tokens, and every logit of every step the same bits. On every backend: on MLX's
        CUDA backend too, where a one-query forward attends in the project's kernel, so the cold run repeats
        (docs/gpu.md). A failure makes the cold run again and says whether it repeated."""
        if self._same(warm, cold):
            return
        again = self.cold(cold.prompt, len(cold.tokens)) if cold.prompt else None
        raise AssertionError(self._diagnosis(warm, cold, again))

    @staticmethod
    def _same(a: Run, b: Run) -> bool:
        return a.tokens == b.tokens and mx.array_equal(a.logits, b.logits).item()

    def _diagnosis(self, warm: Run, cold: Run, again: Run | None) -> str:
        n = min(warm.logits.shape[0], cold.logits.shape[0])
        gaps = [mx.abs(warm.logits[i].astype(mx.float32) - cold.logits[i].astype(mx.float32)).max().item()
                for i in range(n)]
        first = next((i for i, g in enumerate(gaps) if g > 0), n)
        text = (f"cached ({warm.cached} tokens restored) vs cold: tokens {warm.tokens} vs {cold.tokens}; "
                f"first step whose logits differ {first} (by {gaps[first] if first < n else 0.0})")
        if again is not None:
            repeat = self.logit_gap(again, cold) if again.tokens == cold.tokens else "tokens differ"
            text += f"; the cold run again: {'bitwise' if repeat == 0.0 else repeat}"
            if repeat != 0.0:
                text += f", and the cached run against it: {self.logit_gap(warm, again)}"
        return text

    def logit_gap(self, a: Run, b: Run) -> float:
        n = min(a.logits.shape[0], b.logits.shape[0])
        return mx.abs(a.logits[:n].astype(mx.float32) - b.logits[:n].astype(mx.float32)).max().item()


@pytest.fixture
def harness(load_builtin, data_dir, tmp_path):
    def make(name: str, **kw) -> Harness:
        model, tok = load_builtin(name)
        return Harness(model, tok, resolve_model(name, data_dir), tmp_path, **kw)
    return make


def prompt_of(n: int, salt: int = 0) -> list[int]:
    """A deterministic, non-repeating token sequence (ids 3..1023: no specials)."""
    return [3 + (i * 7919 + salt * 104729) % 1021 for i in range(n)]


def plant(h: Harness, key: bytes, data) -> None:
    """Replace block `key` by `data` where blocks enter this process: its file on the node's disk (as a bad
    disk, a buggy writer or another process could leave it), with RAM's copy dropped. A RAM block is one this
    process made from its own caches and is used unchecked; a block read in is checked."""
    assert h.pc.tiers.disk.flush(30)
    h.pc.tiers.ram.discard(key)
    h.store.path(h.pc.namespace, key).write_bytes(bytes(data))
    h.store.index.get(key).size = len(data)


def ram_blocks(h: Harness) -> list[bytes]:
    """Keys of the blocks and checkpoints RAM holds: what spills (a prompt's tail never does)."""
    return [k for k, held in h.pc.tiers.ram.snapshot() if getattr(held, "kind", None) != "tail"]


def forget_ram(h: Harness) -> None:
    """Drop every block from RAM (the disk keeps them): the next hit reads, and checks, them all."""
    assert h.pc.tiers.disk.flush(30)
    for key in h.pc.tiers.ram.keys():
        h.pc.tiers.ram.discard(key)


def disk_harness_of(model, tok, model_dir, tmp_path, node_dir, ram_bytes: int = 1 << 30, events=None,
                    budget: int = 1 << 30, **kw) -> Harness:
    """A Harness over `model` whose cache also has a real disk tier (in-process DiskStore at `node_dir`)."""
    from cluster.kvcache.store_link import LocalLink
    from cluster.store.disk_tier import DiskStore

    store = DiskStore(node_dir, budget=budget, listener=events.append if events is not None else None)
    h = Harness.__new__(Harness)
    h.model, h.tok, h.B, h.step = model, tok, kw.get("block_tokens", 32), kw.get("prefill_step", 64)
    cfg = CacheConfig(block_tokens=h.B, ram_bytes=ram_bytes, spill_queue_bytes=kw.get("queue", 256 << 20),
                      kv_codec=kw.get("kv_codec", "native"), resume_at=kw.get("resume_at", "auto"))
    h.setup = setup_cache(model, tok, model_dir, cfg, tmp_path, store_link=LocalLink(store),
                          listener=events.append if events is not None else None, prefill_step=h.step)
    h.pc = h.setup.cache
    h.schedule = h.pc.schedule
    h.wrong = WRONG[getattr(mx, h.pc.dtype)]
    h.store = store
    return h


@pytest.fixture
def disk_harness(load_builtin, data_dir, tmp_path):
    """A Harness whose cache also has a real disk tier (in-process DiskStore) and a tiny RAM tier."""
    def make(name: str, node_dir=None, **kw) -> Harness:
        model, tok = load_builtin(name)
        return disk_harness_of(model, tok, resolve_model(name, data_dir), tmp_path, node_dir or tmp_path / "node", **kw)
    return make
