"""Continuous batching of decode: every decoding sequence of a replica advances in one forward.

A decode step of one sequence reads the whole model for one token; on a GPU
that is bound by memory bandwidth, so R sequences in one [R, 1] forward cost
little more than one. The batch keeps mlx-lm's batched caches
(`BatchKVCache`, `BatchRotatingKVCache`, `ArraysCache`, left-padded; made with
their `merge`, grown with `extend`, shrunk with `filter`, as mlx-lm's own
BatchGenerator does), while everything per request stays per request:

- prefill: each sequence restores its cached prefix and prefills alone, in
  block-aligned chunks (sequence.py), so block capture during prefill is the
  solo capture; it joins the batch with every prompt token but the last in its
  cache, and that token is its first input here;
- sampling: each row's own logits processors (penalties, logit_bias, grammar)
  run on its row; greedy rows then take one argmax, a sampled row uses its own
  TokenPicker (its own key stream), so a seed means the same tokens in or out
  of a batch; logprobs come from the same processed row;
- stops, detokenizing and events: `Sequence.accept`, as alone;
- capture: after each step a row's session sees a per-row view of the batched
  caches, built only when it asks (at block ends), so generated blocks and
  recurrent checkpoints are captured as they are alone.

Decode is pipelined like mlx-lm's: the forward for step t+1 is queued before
the tokens of step t are read back. A row whose token being read is its last
(max_tokens) leaves before that forward; a row that stops on EOS or a stop
string leaves at the next step (its one extra forward is wasted, as alone).
"""

from __future__ import annotations

import logging
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from cluster.engine import invariant, model_thread
from cluster.engine.events import Event, Failed
from cluster.engine.sampling import normalize
from cluster.engine.sequence import Sequence

log = logging.getLogger(__name__)


def batchable(caches: list) -> tuple[bool, str]:
    """Whether sequences with these (per-sequence) caches can decode in one batch, and why not."""
    for cache in caches:
        if not callable(getattr(type(cache), "merge", None)):
            return False, f"{type(cache).__name__} has no batched form in mlx-lm; sequences decode one at a time"
    return True, ""


class RowCaches:
    """One row of the batched caches, seen as the per-sequence caches a session captures from.

    Built lazily: indexing or iterating makes the row's caches then (a strided
    view of a BatchKVCache row, mlx-lm's `extract` for the others)."""

    def __init__(self, caches: list, row: int):
        self._caches = caches
        self._row = row
        self._made: Optional[list] = None

    def _all(self) -> list:
        if self._made is None:
            self._made = [row_cache(c, self._row) for c in self._caches]
        return self._made

    def __len__(self) -> int:
        return len(self._caches)

    def __getitem__(self, i):
        return self._all()[i]

    def __iter__(self):
        return iter(self._all())


def row_cache(cache, row: int):
    """Row `row` of a batched cache as a per-sequence cache (lazy: nothing is copied until evaluated)."""
    if isinstance(cache, BatchKVCache):
        view = KVCache()
        if cache.keys is not None:
            pad = int(cache.left_padding[row].item())
            view.keys = cache.keys[row:row + 1, :, pad:cache._idx]
            view.values = cache.values[row:row + 1, :, pad:cache._idx]
            view.offset = cache._idx - pad
        return view
    if isinstance(cache, ArraysCache):
        # A row of recurrent state is kept as a checkpoint past this step: copy it out (x * 1 is exact
        # for every float, -0 and NaN included) and evaluate it, or the slice would keep the whole
        # batch's state of this step alive with it.
        state = ArraysCache(len(cache.cache))
        state.cache = [None if c is None else mx.contiguous(c[row:row + 1]) * 1 for c in cache.cache]
        mx.eval([c for c in state.cache if c is not None])
        return state
    return cache.extract(row)


class DecodeBatch:
    """The decoding sequences of one replica and their batched caches."""

    def __init__(self, model, invariant: bool = False, fixed_rows: int = 0):
        self.model = model
        self.invariant = invariant  # batch-invariant decode (invariant.py), on a model it prepared
        self.fixed_rows = fixed_rows  # its matmuls' row count (0: as they come, where the backend needs none)
        self.rows: list[Sequence] = []
        self.caches: Optional[list] = None
        self._y: Optional[mx.array] = None  # each row's sampled next token, not read back yet
        self._kinds: Optional[tuple] = None  # per-sequence cache classes of the rows
        self._in_flight: list[Sequence] = []
        self._logprobs: list = []  # each row's pending logprobs for `_y` (None: not asked for)
        self._failed: dict[int, Exception] = {}  # id(row) -> why its processors failed (it fails alone)

    def __len__(self) -> int:
        return sum(1 for s in self.rows if not s.done)

    def accepts(self, seq: Sequence) -> bool:
        """Whether `seq` (prefilled) can join now: its caches must be of the batch's classes."""
        return self._kinds is None or not self.rows or tuple(type(c) for c in seq.cache) == self._kinds

    def step(self, joiners: list[Sequence]) -> list[tuple[Sequence, list[Event]]]:
        """One forward for every row still going plus the `joiners`; the tokens of the previous one."""
        model_thread.check("DecodeBatch.step")
        old_rows, old_y, old_logprobs = self.rows, self._y, self._logprobs
        self._in_flight = old_rows + joiners  # until read back: what fail_all must fail
        going = [not s.done and id(s) not in self._failed for s in old_rows]  # a failed row goes at once
        keep = [i for i, s in enumerate(old_rows) if going[i] and s.room_after_next]
        if len(keep) < len(old_rows):
            for i, s in enumerate(old_rows):
                if going[i] and i not in keep:  # its last token is pending: no forward, but the session
                    s.session.observe(RowCaches(self.caches, i), s.fed)  # sees its cache once more, as alone
            self._filter(keep)
        rows = [old_rows[i] for i in keep]
        inputs = []
        if keep:
            inputs.append(old_y if len(keep) == len(old_rows) else old_y[mx.array(keep)])
        if joiners:
            self._join(joiners)
            inputs.append(mx.array([s.prompt[-1] for s in joiners]))
        rows += joiners
        self.rows = rows
        self._y = None
        if rows:
            self._y = self._forward(rows, mx.concatenate(inputs) if len(inputs) > 1 else inputs[0])
            for s in rows[:len(keep)]:
                s.fed.append(-1)  # the token read back below
            for s in joiners:
                s.fed.append(s.prompt[-1])
        else:
            self.caches = self._kinds = None
            self._logprobs = []
        results = self._read(old_rows, old_y, old_logprobs, {i: r for r, i in enumerate(keep)})
        self._in_flight = []
        return results

    def fail_all(self) -> list[Sequence]:
        """Drop every row (after a failed step); return the sequences that were still going, including
        the step's joiners and the rows that were leaving with their last token unread."""
        seen, live = set(), []
        for s in self._in_flight + self.rows:
            if not s.done and id(s) not in seen:
                seen.add(id(s))
                live.append(s)
        self.clear()
        return live

    def clear(self) -> None:
        """Forget every row and free the batched caches."""
        self.rows, self.caches, self._y, self._kinds, self._in_flight, self._logprobs = [], None, None, None, [], []
        self._failed = {}

    # -----------------------------------------------------------------------
    def _filter(self, keep: list[int]) -> None:
        if not keep:
            self.caches = None
            return
        index = mx.array(keep)
        for c in self.caches:
            c.filter(index)

    def _join(self, joiners: list[Sequence]) -> None:
        """Merge the joiners' caches into batched ones and append them as rows; the batch owns them now."""
        merged = [type(layer[0]).merge(list(layer)) for layer in zip(*(s.cache for s in joiners))]
        if self.caches is None:
            self.caches = merged
            self._kinds = tuple(type(c) for c in joiners[0].cache)
        else:
            for c, m in zip(self.caches, merged):
                c.extend(m)
        for s in joiners:
            s.cache = None

    def _forward(self, rows: list[Sequence], inputs: mx.array) -> mx.array:
        if self.invariant:
            with invariant.decoding(self.fixed_rows):
                logits = self.model(inputs[:, None], cache=self.caches)[:, -1, :]
        else:
            with invariant.one_query():  # on CUDA, attention in a kernel that repeats itself (invariant.py)
                logits = self.model(inputs[:, None], cache=self.caches)[:, -1, :]
        for i, s in enumerate(rows):
            if s.params.record_logits:
                s.logits.append(logits[i])
        if any(s.picker.processors for s in rows):
            logits = mx.concatenate([self._process(s, inputs[i:i + 1], logits[i:i + 1]) for i, s in enumerate(rows)])
        logprobs = normalize(logits)
        if all(s.params.sampling.greedy for s in rows):
            y = mx.argmax(logprobs, axis=-1)
        else:
            y = mx.concatenate([s.picker.sample(logprobs[i:i + 1]) for i, s in enumerate(rows)])
        self._logprobs = [s.picker.pending(logprobs[i], y[i]) for i, s in enumerate(rows)]
        mx.async_eval(y, *(a for p in self._logprobs if p is not None for a in p.arrays()))
        return y

    def _process(self, s: Sequence, inputs: mx.array, logits: mx.array) -> mx.array:
        """One row's processors; if they raise (a grammar the model broke, say), the row fails when its
        token is read back, and the other rows go on with their own logits."""
        try:
            return s.picker.process(inputs, logits)
        except Exception as e:
            self._failed[id(s)] = e
            return logits

    def _read(self, old_rows: list[Sequence], old_y: Optional[mx.array], old_logprobs: list,
              new_index: dict[int, int]) -> list[tuple[Sequence, list[Event]]]:
        """Read back the previous step's tokens and turn them into each row's events."""
        if old_y is None:
            return []
        out = []
        for i, token in enumerate(old_y.tolist()):
            s = old_rows[i]
            failure = self._failed.pop(id(s), None)
            if s.done:  # cancelled or stopped: its token is not wanted
                continue
            try:
                if failure is not None:
                    raise failure
                if i in new_index:  # the token was fed back: the cache now holds it
                    s.fed[-1] = token
                    s.session.observe(RowCaches(self.caches, new_index[i]), s.fed)
                events = s.accept(token, old_logprobs[i])
            except Exception as e:  # one bad request must not take the others down
                log.exception("a batched sequence failed")
                try:
                    s.close()
                except Exception:
                    log.exception("closing a failed sequence failed")
                    s.done = True
                events = [Failed(f"generation failed: {type(e).__name__}: {e}", status=500)]
            out.append((s, events))
        return out
