"""A model sharded over two processes (tensor parallel over MLX's ring backend on loopback), in lockstep.

Each rank is a real process with its own scheduler (tests/engine/lockstep_rank.py): the leader (rank 0
or 1) serves ten greedy requests, a sampled one and one cancelled mid-way, all batched; the other rank only
follows the turns the leader shares. Tensor-parallel sums round differently from the whole model's: the agreement is measured, and the
bar is the issue's (9 of 10 greedy answers, first-token logprobs within 1e-4 in float32). Then each
rank's prefix cache: restored on both ranks or on none (kvcache/shard_restore.py).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.engine.schedule import on_gpu
from cluster.ports import free_port


def run_ranks(name: str, data_dir: Path, tmp_path: Path, mode: str = "tensor", leader: int = 0) -> list[dict]:
    """Both ranks' results, the leader's first."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.engine.lockstep_rank", str(r), str(hostfile), name,
                               str(data_dir), str(outs[r]), mode, str(leader)], cwd=Path(__file__).parents[2])
             for r in range(2)]
    try:
        codes = [p.wait(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0]
    results = [json.loads(o.read_text()) for o in outs]
    return [results[leader], results[1 - leader]]


# A replica's rank is its node's (sharding.py ranks_by_node), so rank 1 leads in some: here in one of each mode
@pytest.mark.parametrize("name, mode, lead", [("tiny-dense", "tensor", 0), ("tiny-hybrid", "tensor", 1),
                                              ("tiny-hybrid", "pipeline", 0), ("tiny-next", "pipeline", 1)])
def test_two_ranks_serve_batched_requests_in_lockstep(name, mode, lead, data_dir, load_builtin, tmp_path):
    load_builtin(name)  # built in the session's data dir before the ranks load it
    leader, follower = run_ranks(name, data_dir, tmp_path, mode, lead)
    assert (leader["rank"], follower["rank"]) == (lead, 1 - lead)
    assert (leader["size"], follower["size"]) == (2, 2)
    # Every request, the sampled and the cancelled ones included, decoded the same tokens on both ranks.
    assert follower["generated"] == leader["generated"]
    assert 3 <= leader["cancelled_after"] < 40
    sharded, whole = leader["sharded"], leader["unsharded"]
    # The ten greedy ones run to max_tokens; the sampled one (no seed) may draw the end-of-sequence token
    # (about 1% of runs on the tiny vocabulary): then it stops there, on both ranks alike (checked above).
    assert [s["finish"] for s in sharded[:10]] == ["length"] * 10
    assert (sharded[10]["finish"], len(leader["sampled"])) == ("length", 12) or \
        (sharded[10]["finish"] == "stop" and 1 <= len(leader["sampled"]) <= 12)
    # The whole model's reference ran each request alone, the sharded ranks batched them: on a GPU a batched row
    # rounds differently from its solo run in the default mode (tests/engine/batching.py), whatever the split,
    # so the comparison says something about sharding on the CPU only (docs/gpu.md has the GPU's figures).
    if not on_gpu():
        same = sum(a["tokens"] == b["tokens"] for a, b in zip(sharded, whole))
        assert same >= 9, (same, [(a["tokens"], b["tokens"]) for a, b in zip(sharded, whole)])
        gaps = [abs(a["first_logprob"] - b["first_logprob"]) for a, b in zip(sharded, whole)]
        assert max(gaps) <= 1e-4, gaps
        if mode == "pipeline":  # every layer computed whole, on one rank: the whole model's answers, bitwise
            assert same == 10 and max(gaps) == 0.0, (same, gaps)
    # The prefix cache, each rank its own heads' blocks: a repeated prompt is restored on both ranks, bitwise
    # the sharded model's own cold run; once the follower has lost its blocks, the ranks agree on nothing and both
    # prefill cold (a rank restoring alone would part their shapes and hang their collectives).
    # A rank without a cache turns it off on every rank, at start (here the follower said "off").
    assert leader["alone"].startswith("another rank of this sharded replica runs without a prefix cache")
    # One checkpoint interval on both ranks, the larger of theirs: on the block schedule a hybrid's prefill chunks
    # end at checkpoints, and a pipeline's stages must cut the same chunks (tiny-next's stages, on their own: every
    # 2 blocks, and only where a prompt's own checkpoints are due, as the stage without attention has no KV to
    # weigh them against).
    assert leader["every"][1] == follower["every"][1] == max(leader["every"][0], follower["every"][0])
    assert follower["alone"] == "off"
    cold, warm, dropped, peer, pulled = leader["cached"]
    assert cold["offered"] == peer["offered"] == 0 and warm["offered"] == dropped["offered"] > 0
    # The blocks of the complete 64-token chunks; a prompt's tail (kept in a device RAM tier: on a GPU the same
    # prompt again restores 149 tokens) is never pulled
    assert pulled["offered"] == 128
    assert [c["cached_tokens"] for c in leader["cached"]] == [0, warm["offered"], 0, 0, 128]
    assert warm["tokens"] == cold["tokens"] == dropped["tokens"] == peer["tokens"] == pulled["tokens"]
    assert warm["logits"] == cold["logits"] == pulled["logits"]  # bitwise: the same float32 values, every step
    # A fresh replica's ranks each pulled their own heads' blocks from their counterpart in the peer (the leader
    # at admission, the follower in its read), and both restored them: one agreement, nothing cut.
    for rank, reads in [(leader, 0), (follower, 1)]:  # the KV blocks, and the checkpoint where its layers need one
        got = rank["pulled"]
        assert got == {"restore": {"agreed": 1, "cut_short": 0, "dropped": 0, "reads": reads, "late_reads": 0},
                       "blocks": pulled["offered"] // 32 + got["checkpoint"], "checkpoint": got["checkpoint"]}
    assert leader["restore"] == {"agreed": 3, "cut_short": 1, "dropped": 0, "reads": 0, "late_reads": 0}  # it
    # offered blocks the third time; the follower offered what its own reads brought, each in time
    assert follower["restore"] == {"agreed": 3, "cut_short": 0, "dropped": 0, "reads": 3, "late_reads": 0}

