"""Blocks made by one process restore bitwise in another: a replica's restart, where the cold run the answer
must equal is the earlier process's as much as this one's. A GPU chooses kernels per process (and per shape),
so the GPU run (docs/gpu.md) is where this shows; in bfloat16, on the canonical schedule a GPU runs."""

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from cluster.models.resolve import resolve_model
from tests.kvcache import fill_in_another_process as fill

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])  # a hybrid's recurrent checkpoints cross too
def test_blocks_made_in_another_process_restore_bitwise_its_cold_run(name, data_dir, tmp_path):
    resolve_model(name, data_dir)  # built here, once: the other process only loads it
    node, out = tmp_path / "node", tmp_path / "there.npz"
    r = subprocess.run([sys.executable, "-m", "tests.kvcache.fill_in_another_process", name, "bfloat16",
                        str(data_dir), str(node), str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    there = np.load(out)
    h = fill.harness(name, "bfloat16", data_dir, node, tmp_path / "here")
    assert h.store.recovery["blocks"] > 0
    prompt = fill.prompt_of(fill.PROMPT_LEN)
    warm = h.warm(prompt, fill.MAX_TOKENS)
    assert warm.cached >= 128 and h.pc.tiers.disk.counters["disk_hits"] > 0
    assert warm.tokens == there["tokens"].tolist()
    assert np.array_equal(np.array(warm.logits.astype(mx.float32)), there["logits"])  # bitwise the other's cold
    h.assert_same(warm, h.cold(prompt, fill.MAX_TOKENS))  # and this process's
