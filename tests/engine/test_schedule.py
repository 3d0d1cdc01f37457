"""The prefill schedule: cut points by absolute position, resume points, kept tokens, and the capacity a
restored K/V buffer needs to be laid out as a cold mlx-lm cache is."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from cluster.engine.schedule import Schedule, on_gpu

CHUNK = Schedule(block_tokens=32, chunk_tokens=64, canonical=True)
BLOCK = Schedule(block_tokens=32, chunk_tokens=64, canonical=False)


def cuts(schedule: Schedule, start: int, limit: int, budgets) -> list[int]:
    out, budgets = [], iter(budgets)
    while start < limit:
        start = schedule.next_stop(start, limit, next(budgets))
        out.append(start)
    return out


def test_canonical_cuts_are_absolute_multiples_whatever_the_budget_left():
    # A resume at 96 (a block end) runs up to 128 first, then whole chunks, then the prompt's last token but one.
    assert cuts(CHUNK, 96, 300, [16, 64, 5, 200, 64]) == [128, 192, 256, 300]
    assert cuts(CHUNK, 0, 300, [64] * 9) == [64, 128, 192, 256, 300]
    # The block schedule cuts from where it starts, and shorter for a smaller budget (whole blocks, one at least).
    assert cuts(BLOCK, 96, 300, [16, 64, 5, 200, 64]) == [128, 192, 224, 300]


def test_resume_points_and_kept_tokens():
    assert [n for n in range(0, 260, 32) if CHUNK.resumable(n)] == [0, 64, 128, 192, 256]
    assert all(BLOCK.resumable(n) for n in range(0, 260, 7))
    # The blocks of a prompt's complete chunks only: 169 tokens are prefilled, [128, 169) in a partial chunk.
    assert CHUNK.kept_tokens(170) == 128 and CHUNK.kept_tokens(193) == 192 and CHUNK.kept_tokens(64) == 0
    assert BLOCK.kept_tokens(170) > 10**9  # the reply's blocks too


def test_of_rounds_the_chunk_to_whole_blocks_and_auto_follows_the_backend():
    assert Schedule.of("chunk", 64, 500) == Schedule(64, 448, True)
    assert Schedule.of("chunk", 64, 32) == Schedule(64, 64, True)  # at least one block
    assert Schedule.of("block", 64, 512) == Schedule(64, 512, False)
    assert Schedule.of("auto", 64, 512).canonical is on_gpu()
    # A window's attention depends on the chunk: canonical, on the CPU one block per chunk.
    assert Schedule.of("auto", 64, 512, sliding=True) == (Schedule(64, 512, True) if on_gpu() else Schedule(64, 64, True))
    assert not Schedule.of("block", 64, 512, sliding=True).canonical  # what the user asked for
    assert CHUNK.fingerprint() == ["chunk", 64] and BLOCK.fingerprint() == ["block"]
    with pytest.raises(ValueError, match="cache.resume_at must be auto, chunk or block"):
        Schedule.of("sometimes", 64, 512)


def cold_capacity(schedule: Schedule, n: int) -> int:
    """A real mlx-lm KVCache fed the schedule's chunks up to n: its buffer's token capacity."""
    cache, offset = KVCache(), 0
    while offset < n:
        end = schedule.next_stop(offset, n, schedule.chunk_tokens)
        kv = mx.zeros((1, 1, end - offset, 4))
        cache.update_and_fetch(kv, kv)
        offset = end
    mx.eval(cache.keys)
    return cache.keys.shape[2]


@pytest.mark.parametrize("chunk", [32, 64, 96, 320, 512])
def test_a_restored_buffer_has_the_capacity_a_cold_cache_grew_to(chunk):
    schedule = Schedule(32, chunk, True)
    for k in range(1, 12):
        assert schedule.capacity(k * chunk, 10_000) == cold_capacity(schedule, k * chunk), (chunk, k)


def test_the_block_schedule_leaves_room_for_the_rest_of_the_prompt():
    assert BLOCK.capacity(96, 300) == 768 and BLOCK.capacity(256, 256) == 512
