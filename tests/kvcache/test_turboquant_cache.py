"""--kv-codec tq8|tq4|tq3|tq2: blocks are TurboQuant-packed in the tiers and restored in the model dtype, for every
family (sliding windows included); recurrent checkpoints stay lossless; the quality is measured and reported."""

import mlx.core as mx
import numpy as np
import pytest

from cluster.families.specs import FullAttention, Recurrent
from cluster.store.block_format import CorruptPayload
from cluster.store.hashing import chain_ids, state_key
from tests.kvcache.conftest import prompt_of

MODELS = ["tiny-dense", "tiny-swa", "tiny-hybrid", "tiny-gemma4", "tiny-next"]
B = 32


def first_step_error(warm, cold) -> float:
    """Relative L2 error of the first generated step's logits. Later steps are not compared: the tiny
    models' random weights are chaotic (Gaussian noise of tq8's size moves tiny-swa's argmax within 4 steps)."""
    a, b = warm.logits[0].astype(mx.float32), cold.logits[0].astype(mx.float32)
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def restored_error(h, prompt, seed=None) -> float:
    h.warm(prompt)
    h.pc.flush()  # blocks are packed off the model thread
    if seed is not None:
        h.pc.payload.seed = seed  # decode with another node's rotation: the negative control
    warm, cold = h.warm(prompt), h.cold(prompt)
    assert warm.cached == 192
    return first_step_error(warm, cold)


def restored_kv_error(h, prompt, seed=None) -> float:
    """The largest relative L2 error, over layers, of the restored K and V against a cold prefill's."""
    h.warm(prompt)
    h.pc.flush()
    if seed is not None:
        h.pc.payload.seed = seed
    restored, n = h.session(prompt).restore()
    cold, start = h.pc.new_caches(), 0
    while start < n:
        end = h.schedule.next_stop(start, n, h.step)
        h.model(mx.array(prompt[start:end])[None], cache=cold)
        start = end
    errors = []
    for spec, r, c in zip(h.pc.layout.layers, restored, cold):
        if isinstance(spec, Recurrent):
            continue
        # A full layer's first n tokens; a window's last W - 1 (what its next chunk keeps).
        cut = (lambda a: a[..., :n, :]) if isinstance(spec, FullAttention) else (lambda a: a[..., -(spec.window - 1):, :])
        for a, b in ((r.keys, c.keys), (r.values, c.values)):
            a, b = cut(a).astype(mx.float32), cut(b).astype(mx.float32)
            errors.append((mx.linalg.norm(a - b) / mx.linalg.norm(b)).item())
    return max(errors)


@pytest.mark.parametrize("name", MODELS)
def test_a_packed_prefix_restores_close_to_cold_and_more_bits_are_closer(harness, name):
    """On the first answer's logits, tq8 is close and tq4 further; on the restored K/V themselves, a foreign
    rotation (another node's namespace) is far worse than tq4. The negative control is judged on the K/V:
    tiny-swa's random weights are chaotic, so tq4's logit error there swings with the namespace's rotation
    (0.64 and 0.87 seen) while a foreign rotation's stays near sqrt(2), decorrelated."""
    prompt = prompt_of(200)
    e8 = restored_error(harness(name, block_tokens=B, kv_codec="tq8"), prompt)
    e4 = restored_error(harness(name, block_tokens=B, kv_codec="tq4"), prompt)
    assert e8 <= 0.1 and e8 < e4, (e8, e4)
    kv8 = restored_kv_error(harness(name, block_tokens=B, kv_codec="tq8"), prompt)
    kv4 = restored_kv_error(harness(name, block_tokens=B, kv_codec="tq4"), prompt)
    wrong = restored_kv_error(harness(name, block_tokens=B, kv_codec="tq4"), prompt, seed=b"another namespace")
    assert kv8 < kv4 and 2 * kv4 < wrong, (kv8, kv4, wrong)


@pytest.mark.parametrize("codec", ["tq8", "tq4"])
def test_the_replica_measures_its_codec_on_its_own_model(harness, codec):
    q = harness("tiny-gemma4", block_tokens=B, kv_codec=codec).pc.stats()["codec_quality"]
    assert q["codec"] == codec and q["coded_entries"] == q["entries"] == 4 and q["vectors"] > 0
    assert q["cosine_mean"] >= {"tq8": 0.9999, "tq4": 0.995}[codec]


@pytest.mark.parametrize("name", MODELS)
def test_decoded_blocks_have_the_models_own_shapes_and_dtype_and_checkpoints_stay_exact(harness, name):
    native = harness(name, block_tokens=B).pc
    h = harness(name, block_tokens=B, kv_codec="tq4")
    prompt = prompt_of(200)
    h.warm(prompt)
    h.pc.flush()
    ids = chain_ids(h.pc.namespace, prompt, B)
    block = h.pc.decode(h.pc.tiers.ram.get(ids[2]), "kv", 2, ids)
    assert tuple(tuple((tag, a.shape) for tag, a in arrays) for arrays in block.entries) == native.shapes.kv
    assert h.pc.block_bytes < 0.3 * native.block_bytes or not any(h.pc.payload.coded[1:])
    if h.pc.layout.has_recurrent:  # checkpoints: the model's arrays, bit for bit (no codec)
        key = state_key(ids[(200 - 1) // B - 1])
        raw = h.pc.tiers.ram.get(key)
        assert raw is not None and h.pc.expect("state", (200 - 1) // B - 1, ids).arrays == native.shapes.state


def test_a_corrupted_packed_payload_is_caught_by_the_checksum(harness):
    h = harness("tiny-dense", block_tokens=B, kv_codec="tq4")
    prompt = prompt_of(200)
    h.warm(prompt)
    h.pc.flush()
    ids = chain_ids(h.pc.namespace, prompt, B)
    data = bytearray(h.pc.tiers.ram.get(ids[1]))
    data[-40] ^= 0x10  # a bit in the packed indices
    with pytest.raises(CorruptPayload):
        h.pc.decode(bytes(data), "kv", 1, ids)


def test_codecs_never_share_blocks(harness):
    namespaces = {harness("tiny-dense", block_tokens=B, kv_codec=c).pc.namespace for c in ("native", "tq8", "tq4")}
    assert len(namespaces) == 3


def test_the_encoding_of_a_block_is_deterministic(harness):
    a, b = (harness("tiny-swa", block_tokens=B, kv_codec="tq3") for _ in range(2))
    prompt = prompt_of(100)
    a.warm(prompt)
    b.warm(prompt)
    a.pc.flush()
    b.pc.flush()
    ids = chain_ids(a.pc.namespace, prompt, B)
    assert a.pc.namespace == b.pc.namespace
    assert np.array_equal(np.frombuffer(a.pc.tiers.ram.get(ids[0]), np.uint8),
                          np.frombuffer(b.pc.tiers.ram.get(ids[0]), np.uint8))


def test_packed_blocks_reach_the_disk_and_peers_packed_and_restore_as_from_ram(disk_harness, tmp_path):
    """The disk tier and migration move the packed bytes (what makes a pull 3.5x cheaper), and a prefix
    restored from this node's disk or pulled from a peer's gives the logits a RAM restore gives."""
    from cluster.actors.plan import FetchPlan
    from cluster.kvcache.admission import Admission
    from cluster.kvcache.peers import PeerClient
    from cluster.kvcache.session import BlockSession

    prompt = prompt_of(200)
    a = disk_harness("tiny-swa", node_dir=tmp_path / "A", block_tokens=B, kv_codec="tq4")
    a.warm(prompt)
    a.pc.flush()
    assert a.pc.tiers.disk.flush(30)
    from_ram = a.warm(prompt)
    assert from_ram.cached == 192
    ids = chain_ids(a.pc.namespace, prompt, B)
    on_disk = a.store.path(a.pc.namespace, ids[2]).stat().st_size
    native_bytes = a.pc.shapes.kv_bytes_per_token * B
    assert a.pc.block_bytes <= on_disk < 0.35 * native_bytes

    again = disk_harness("tiny-swa", node_dir=tmp_path / "A", block_tokens=B, kv_codec="tq4")  # empty RAM
    from_disk = again.warm(prompt)
    assert from_disk.cached == 192 and again.pc.tiers.disk.stats()["disk_hits"] == 6
    assert mx.array_equal(from_disk.logits, from_ram.logits)

    b = disk_harness("tiny-swa", node_dir=tmp_path / "B", block_tokens=B, kv_codec="tq4")
    peers = PeerClient(b.pc.namespace, local_stores={"A": a.store})
    plan = FetchPlan("A", 0, 6, False, 192, 6 * a.pc.block_bytes)
    prefetch = Admission(b.pc, peers=peers).fetch(list(prompt), plan)
    assert prefetch.fetched == 192 and peers.counters["blocks"] == 6
    assert peers.counters["bytes"] < 6 * 0.35 * native_bytes  # packed on the wire
    pulled = b.run_with(prompt, BlockSession(b.pc, list(prompt), prefetch))
    assert mx.array_equal(pulled.logits, from_ram.logits)
