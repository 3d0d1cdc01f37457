"""What a replica leaves on its node's disk before a restart, made in a process of its own.

    python -m tests.kvcache.fill_in_another_process NAME DTYPE DATA_DIR NODE_DIR OUT

Loads the built-in model NAME (built already under DATA_DIR) in DTYPE, runs PROMPT_LEN tokens cold and saves
its tokens and logits (float32) to OUT (.npz), then runs the prompt again through a cache with a disk tier at
NODE_DIR, on the canonical schedule (a GPU's), and waits until its blocks are on the disk. The test beside it
(test_cross_process.py) restores them in its own process: a GPU's kernels are chosen per process, so this is
where a restart's exactness shows."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from cluster.models.loading import load_model
from cluster.models.resolve import resolve_model
from tests.kvcache.conftest import disk_harness_of, prompt_of

PROMPT_LEN, MAX_TOKENS = 250, 8


def harness(name: str, dtype: str, data_dir: Path, node_dir: Path, work: Path):
    model_dir = resolve_model(name, data_dir)
    model, tok = load_model(model_dir)
    model.set_dtype(getattr(mx, dtype))
    return disk_harness_of(model, tok, model_dir, work, node_dir, resume_at="chunk")


def main(argv: list[str]) -> int:
    name, dtype, data_dir, node_dir, out = argv
    with tempfile.TemporaryDirectory() as work:
        h = harness(name, dtype, Path(data_dir), Path(node_dir), Path(work))
        prompt = prompt_of(PROMPT_LEN)
        cold = h.cold(prompt, MAX_TOKENS)
        h.warm(prompt, MAX_TOKENS)
        assert h.pc.tiers.disk.flush(60)
        np.savez(out, tokens=np.array(cold.tokens), logits=np.array(cold.logits.astype(mx.float32)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
