"""The model fingerprint: the namespace every block id lives in.

Two replicas may share a block only if the block's bytes would be identical on
both, so the fingerprint covers everything that changes KV bytes or how tokens
map to them:

| part | why |
| --- | --- |
| config.json (canonical JSON) | architecture, RoPE, window sizes, dtype hints |
| weights: BLAKE3 of every *.safetensors | same name, different weights = different KV; cached next to the model |
| tokenizer files + chat template | same text, different ids = different chain |
| compute dtype | f32 vs bf16 KV are different bytes |
| kv codec: name, version, bits, group | native vs quantized K/V; a new codec version never reads old blocks |
| block size | a block's id covers exactly B tokens |
| block format version | readers refuse other versions anyway; keeps namespaces apart |
| mlx and mlx-lm versions | kernels and cache code change numerics |
| backend (cpu / gpu + GPU architecture) | Metal and CPU, and GPU generations, differ in rounding |

The backend comes from `mx.device_info()`. A GPU whose architecture cannot be
read is named by the machine's chip (sysctl) or, failing that, by its host
name: never a shared placeholder that would let GPU generations mix.

A mismatch anywhere gives a different namespace, which can only miss.
Deliberately not included: the model's path or repo name (a copy of the same
files shares blocks), generation settings (they do not touch KV), and the
node id.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import msgpack
from blake3 import blake3

from cluster.store.block_format import VERSION as BLOCK_FORMAT_VERSION

log = logging.getLogger(__name__)

WEIGHTS_CACHE = ".mlx-fleet-weights.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "added_tokens.json")


@dataclass(frozen=True)
class Fingerprint:
    namespace: bytes  # 32 bytes
    parts: dict

    @property
    def short(self) -> str:
        return self.namespace.hex()[:16]


def _hash_file(path: Path) -> str:
    h = blake3(max_threads=blake3.AUTO)
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def weights_digest(model_dir: Path, cache_dir: Path | None = None) -> str:
    """BLAKE3 over every safetensors file, memoised by (name, size, mtime) next to the model."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    memo_paths = [model_dir / WEIGHTS_CACHE]
    if cache_dir is not None:
        memo_paths.append(cache_dir / f"weights-{blake3(str(model_dir.resolve()).encode()).hexdigest()[:16]}.json")
    memo = {}
    for p in memo_paths:
        try:
            memo = json.loads(p.read_text())
            break
        except (OSError, ValueError):
            continue
    changed, out = False, blake3()
    for f in files:
        st = f.stat()
        key = f"{f.name}:{st.st_size}:{st.st_mtime_ns}"
        if key not in memo:
            memo[key] = _hash_file(f)
            changed = True
        out.update(f"{f.name}={memo[key]};".encode())
    if changed:
        _save_memo(memo, memo_paths)
    return out.hexdigest()


def _save_memo(memo: dict, paths: list[Path]) -> None:
    for p in paths:  # next to the model if writable, else under our data dir
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps(memo, sort_keys=True))
            os.replace(tmp, p)
            return
        except OSError:
            continue


def tokenizer_digest(model_dir: Path, chat_template: str | None) -> str:
    h = blake3()
    for name in TOKENIZER_FILES:
        p = model_dir / name
        if p.is_file():
            h.update(name.encode() + b"=" + blake3(p.read_bytes()).digest())
    h.update(b"template=" + (chat_template or "").encode())
    return h.hexdigest()


def backend() -> str:
    """"cpu", or "gpu:<architecture>" (e.g. gpu:applegpu_g15s). Only verifiable on a Mac."""
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    try:
        arch = mx.device_info().get("architecture")
    except Exception as e:  # an older or unusual build: fall through to the chip's name
        log.warning("mx.device_info() failed (%s); naming the GPU by the machine's chip", e)
        arch = None
    return f"gpu:{arch or _chip_name()}"


def _chip_name() -> str:
    import platform
    import subprocess

    try:
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                             timeout=5).stdout.strip()
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    return f"unidentified@{platform.node()}"  # shares blocks with this machine only


def compute_fingerprint(model_dir: Path, *, dtype: str, codec: list, block_tokens: int, chat_template: str | None,
                        cache_dir: Path | None = None, schedule: list | None = None,
                        shard: dict | None = None, kernels: list | None = None) -> Fingerprint:
    config = json.loads((model_dir / "config.json").read_text())
    parts = {
        "config": blake3(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest(),
        "weights": weights_digest(model_dir, cache_dir),
        "tokenizer": tokenizer_digest(model_dir, chat_template),
        "dtype": dtype,
        "kv_codec": list(codec),
        "block_tokens": block_tokens,
        "block_format": BLOCK_FORMAT_VERSION,
        "mlx": metadata.version("mlx"),
        "mlx_lm": metadata.version("mlx-lm"),
        "backend": backend(),
        "schedule": list(schedule or ["block"]),  # how prefill was cut (engine/schedule.py): it shapes the bytes
    }
    if shard is not None:  # a rank of a sharded model holds its own heads only: {"mode", "size", "rank"}
        parts["shard"] = dict(shard)
    if kernels:  # our kernels that replace mlx-lm's computation (their sums differ): e.g. gated-delta-cuda/1
        parts["kernels"] = sorted(kernels)
    namespace = blake3(b"mlxf-namespace\x01" + msgpack.packb(parts, use_bin_type=True)).digest()
    return Fingerprint(namespace=namespace, parts=parts)
