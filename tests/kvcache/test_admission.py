"""Admission's offer and exact fetch: what a rank of a sharded replica restores once the ranks agree.

`restorable` is the most a process's tiers could restore, read from nothing; `fetch_exactly(n)` reads
exactly n tokens' blocks or nothing, never another length (kvcache/shard_restore.py).
"""

import pytest

from cluster.kvcache.admission import Admission
from cluster.kvcache.session import BlockSession
from tests.kvcache.conftest import prompt_of


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_the_offer_is_what_a_fetch_restores_and_a_shorter_exact_fetch_is_exact(harness, name):
    h = harness(name)
    prompt = prompt_of(150)
    cold = h.cold(prompt)
    assert h.warm(prompt).cached == 0  # the first run computes and keeps the blocks
    admission = Admission(h.pc)
    offer = admission.restorable(prompt)
    assert offer == admission.fetch(prompt).n == h.warm(prompt).cached > 0
    # And the smallest resume point the schedule allows (a block's end on the CPU, a chunk's on a GPU), for the
    # dense model (a hybrid also needs a checkpoint there)
    planner = h.pc.planner
    smallest = min(planner.candidates(len(prompt), planner.usable_blocks(len(prompt))))
    for n in sorted({offer, smallest if name == "tiny-dense" else offer}):
        prefetch = admission.fetch_exactly(prompt, n)
        assert prefetch.n == n
        run = h.run_with(prompt, BlockSession(h.pc, prompt, prefetch))
        assert run.cached == n
        h.assert_same(run, cold)


def test_an_exact_fetch_of_what_cannot_be_restored_is_nothing(harness):
    h = harness("tiny-hybrid")
    prompt = prompt_of(150)
    h.warm(prompt)
    admission = Admission(h.pc)
    held = admission.restorable(prompt)
    assert held > 0  # a checkpoint's block end, or all but the last token where the prompt's tail is kept (a GPU)
    assert admission.fetch_exactly(prompt, 5).n == 0  # inside a block: a hybrid resumes at checkpoints only
    assert admission.fetch_exactly(prompt, held + h.B).n == 0  # past what the tiers hold
    assert admission.fetch_exactly(prompt, 0).n == 0
    assert admission.fetch_exactly(prompt_of(150, salt=1), held).n == 0  # another prompt's blocks: none held
