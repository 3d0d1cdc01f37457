"""Configuration: one pydantic model per concern.

The CLI (`mlx-fleet up`), the Serve config file (`deploy/serve.yaml`, whose
`args` are an `AppConfig`) and the tests all build these same objects, so a
field means the same thing everywhere. Every field has a description and extra
keys are refused, so a typo in a YAML file is an error that names the field,
not a silently ignored setting.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Annotated, Literal, Optional, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from cluster.models.catalog import DEFAULT_MODEL

NODE_RESOURCE = "mlx_fleet"
NODE_LABEL = "mlx-fleet/node"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def default_data_dir() -> Path:
    """Where fleet state lives unless --data-dir says otherwise."""
    return Path(os.environ.get("MLX_FLEET_DATA_DIR", "~/.mlx-fleet")).expanduser()


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


class _Config(BaseModel):
    # hide_input_in_errors: an error's text never carries the value (a Redis URL or password may be one)
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, v, info: ValidationInfo):
        """pydantic reads `true` as 1 for an int or float: `ram_bytes: true` in YAML would be a 1-byte tier."""
        if isinstance(v, bool) and cls.model_fields[info.field_name].annotation in (int, float, Optional[int],
                                                                                     Optional[float]):
            raise ValueError(f"{str(v).lower()} is a boolean; give a number")
        return v


def first_error(e: ValidationError, root: Optional[type[BaseModel]] = None) -> tuple[str, str]:
    """(field path, message) of a ValidationError's first error, for a one-line message that names the
    field (`models[0].max_context`); without pydantic's "Value error, " prefix, which says nothing to a user.
    Given the model validated (`root`), an unknown key gets the closest field names of its place."""
    err = e.errors()[0]
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden" and root is not None:
        fields = _model_at(root, err["loc"][:-1]).model_fields
        msg = f"no such setting; {did_you_mean(str(err['loc'][-1]), fields) or 'here: ' + ', '.join(fields)}"
    return path, msg


def did_you_mean(word: str, choices) -> str:
    """"did you mean a or b?" with the closest of `choices` to a misspelt key, or "" if none is close."""
    near = difflib.get_close_matches(word, list(choices), n=3)
    return f"did you mean {' or '.join(near)}?" if near else ""


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel]:
    """The config model at `loc` under `root` (`("models", 0)` -> ModelSpec)."""
    model = root
    for part in loc:
        if isinstance(part, int):
            continue
        annotation = model.model_fields[part].annotation
        inner = [a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not inner:
            break
        model = inner[0]
    return model


def check_redis_url(v: Optional[str]) -> Optional[str]:
    """Refuse a URL redis-py cannot open here, by the field's name, rather than in every replica's log later.
    Empty means none (`--redis-url "$UNSET"`). The value is never echoed: it may hold a password."""
    if v is None or not v.strip():
        return None
    if not v.startswith(REDIS_SCHEMES):
        typo = re.match(r"(rediss?|unix):/?(?!/)", v)
        said = (f"this one starts with {v.split('://', 1)[0] + '://'!r}" if "://" in v
                else f"this one needs // after {typo.group(1)}:" if typo else "this one has no scheme")
        raise ValueError(f"a Redis URL starts with redis:// (redis://[:password@]host:port/db), rediss:// (TLS) "
                         f"or unix:// (a socket path); {said}")
    return v


RedisURL = Annotated[Optional[str], AfterValidator(check_redis_url)]


class CacheConfig(_Config):
    """The replica's KV block cache: block size, codec and the RAM tier."""

    enabled: bool = Field(True, description="Reuse KV blocks across requests. Off means every prompt is prefilled cold.")
    block_tokens: int = Field(
        64, ge=16, le=256,
        description="Tokens per KV block (16-256). Part of the model fingerprint: nodes with different values never share blocks. 64 was chosen by measurement (docs/cache.md).",
    )
    kv_codec: Literal["native", "q8", "q4", "tq8", "tq4", "tq3", "tq2"] = Field(
        "native",
        description="How attention K/V are kept: 'native' in the model dtype (exact); 'q8'/'q4' as mlx QuantizedKVCache (the model runs quantized; full-attention models only); 'tq8'/'tq4'/'tq3'/'tq2' TurboQuant-packed in the RAM and disk tiers and between nodes, decoded to the model dtype on restore (lossy, every family; see docs/turboquant.md).",
    )
    kv_group_size: int = Field(64, description="Quantization group size along head_dim for q8/q4.")
    resume_at: Literal["auto", "chunk", "block"] = Field(
        "auto",
        description="The prefill schedule, which makes a cached answer bitwise the cold one (cluster/engine/schedule.py). 'chunk': prefill chunks cut at absolute multiples of prefill_step_tokens (whole blocks), hits resume only there and only blocks of complete chunks are kept; exact on every backend, as a GPU picks kernels by shape. 'block': chunks block end to block end, hits resume at any block end and reply blocks are kept; exact only where the backend computes a row the same whatever the rows beside it (the CPU, for models without sliding windows). 'auto': chunk on a GPU; on the CPU block, or chunk with one block per chunk for sliding-window models. Part of the model fingerprint.",
    )
    ram_bytes: int = Field(
        2 << 30, ge=0,
        description="Byte budget of the replica's in-process RAM tier of encoded blocks (LRU).",
    )
    disk: bool = Field(True, description="Keep blocks on the node's disk tier too (write-through, survives restarts).")
    pinned_read_bytes: int = Field(
        4 << 30, ge=0,
        description="MLX's CUDA backend only (ignored on Metal and the CPU): page-locked host memory the replica process may keep for reading block files bound for the GPU, so a disk hit's copy to the device runs at the bus's speed and its buffers are not faulted in anew each time (cluster/kernels/cuda_upload.py). Made as disk hits need it and kept for the process's life; past it reads use ordinary memory. 0 turns it off.",
    )
    disk_bytes: Optional[int] = Field(
        None, ge=0,
        description="Byte budget of each node's disk tier. Default: half of the free space where it lives, at most 100 GiB.",
    )
    spill_queue_bytes: int = Field(
        256 << 20, ge=1 << 20,
        description="Bytes of blocks a replica may have waiting for the disk; beyond it the oldest pending spill is dropped (and counted) so generation never waits on the disk.",
    )
    store_timeout_s: float = Field(
        2.0, gt=0,
        description="Deadline for one call to the node's disk store while admitting a request (a lookup, or opening a read). A slower store is a miss for that request, never a stall of the model thread.",
    )
    read_timeout_s: float = Field(10.0, gt=0, description="Deadline for reading one restore's block files from the node's disk.")
    admission_timeout_s: float = Field(
        15.0, gt=0,
        description="Deadline for the whole admission stage of a request (lookups, reads, checks); past it the request is prefilled cold.",
    )
    breaker_failures: int = Field(3, ge=1, description="Consecutive failed calls to the node store after which it is not asked again for breaker_cooldown_s.")
    breaker_cooldown_s: float = Field(10.0, gt=0, description="How long an unresponsive node store is skipped before one trial call.")
    checkpoint_overhead: float = Field(
        0.5, ge=0,
        description="Hybrid models: a recurrent-state checkpoint is stored every k-th block, with k the smallest interval whose checkpoints add at most this fraction to the KV bytes of those k blocks (real hybrids' checkpoints are tens of MiB). The last full block of every prompt and of every finished reply always gets one. 0 = only those.",
    )


class ModelSpec(_Config):
    """One served model: a deployment of ModelReplica, one replica per node."""

    name: str = Field(description="The id clients send as `model`.")
    source: str = Field(
        description="A built-in model name (tiny-dense, tiny-swa, tiny-hybrid, ...), a local mlx-lm model directory, or a Hugging Face repo id such as mlx-community/Qwen3-4B-4bit.",
    )
    max_context: Optional[int] = Field(
        None, ge=16, description="Context window in tokens. Default: the model config's max_position_embeddings.",
    )
    default_max_tokens: int = Field(512, ge=1, description="max_tokens when a request gives none (clipped to the context left).")
    default_temperature: float = Field(
        0.0, ge=0.0, description="temperature when a request gives none. 0 (greedy), as mlx_lm.server's --temp; OpenAI's API uses 1.0.",
    )
    max_ongoing_requests: int = Field(16, ge=1, le=1024, description="Requests one replica takes at once (batched, or in turns); more wait in the router.")
    num_replicas: Optional[int] = Field(
        None, ge=0, description="Replicas of this model. Default: one per fleet node (nodes with the mlx_fleet resource).",
    )
    stream_interval_s: float = Field(
        0.02, ge=0.0, le=1.0, description="Once a request's first text is out (nothing is held back before it), its tokens go to the gateway at most this often, gathered: each message costs two Ray hops of CPU. 0: every decode step.",
    )
    stream_messages_per_s: float = Field(
        100.0, ge=0.0, description="Most messages per second one replica streams, over all its requests: with many streams each one's interval grows to streams / this (8 streams at 100: 0.08 s), so the CPU the Ray hops cost stays bounded however many stream at once. 0: no bound (stream_interval_s alone).",
    )
    prefill_step_tokens: int = Field(512, ge=16, description="Prompt tokens per prefill chunk; other requests' decode steps interleave between chunks.")
    batching: bool = Field(
        True, description="Continuous batching: every decoding sequence of a replica advances in one batched forward. Off: sequences take turns, one token each. A model whose cache classes cannot batch (e.g. kv_codec q8/q4) is served in turns either way, and status says why.",
    )
    decode_concurrency: Optional[int] = Field(
        None, ge=1, le=1024, description="Sequences one replica decodes in one batch; more wait, holding only their fetched blocks. Default: max_ongoing_requests.",
    )
    shards: int = Field(
        1, ge=1, le=64, description="Nodes one replica of this model spans (tensor or pipeline parallel over mx.distributed, one rank per node; engine/sharding.py), for a model bigger than one Mac. The replica takes that many fleet nodes at once (a Ray placement group, one bundle per node) and a node holds one rank at most; replicas default to nodes // shards, or, with several sharded models, nodes // their shards together. 1: the whole model on every node.",
    )
    shard_mode: Literal["auto", "tensor", "pipeline"] = Field(
        "auto", description="How a sharded replica splits the model (engine/sharding.py): tensor (every layer's heads and MLP columns over the ranks, two sums per layer: needs fast links and mlx-lm's shard() for the family), pipeline (each rank a run of whole layers, one hand-off per forward: slow links do, logits bitwise the whole model's; needs the family's pipeline() in mlx-lm), or auto: tensor where the family has it, else pipeline.",
    )
    shard_backend: Literal["ring", "jaccl"] = Field(
        "ring", description="How a sharded replica's ranks talk (engine/sharding.py): ring (TCP over any network between the nodes: Ethernet, Wi-Fi or Thunderbolt networking) or jaccl (RDMA over Thunderbolt 5 cables: macOS 26.2+ on every Mac, RDMA enabled once in Recovery with `rdma_ctl enable`, each cable addressed by `mlx.distributed_config --over thunderbolt --auto-setup`; a cable between every two of the replica's Macs, or each and its neighbours; engine/jaccl.py). jaccl's messages take microseconds, not tens of them: what tensor parallel wants.",
    )
    deterministic: bool = Field(
        False, description="Batch-invariant decode: a batched request's logits are bitwise those it gets alone (engine/invariant.py). On a GPU every decode step's matmuls run at decode_concurrency rows and attention runs in a kernel whose sums do not depend on the batch; it costs throughput (docs/gpu.md measures it). On the CPU backend batched rows are already their solo runs, so nothing changes; on Metal it is not available yet and the replica refuses to start.",
    )
    prefill_concurrency: int = Field(
        8, ge=1, le=1024, description="Prompts one replica has in prefill at once: restored, then prefilled in block-aligned chunks, about prefill_step_tokens per decode step (fewest tokens left first and oldest first, by turns).",
    )

    @model_validator(mode="after")
    def _check_shards(self) -> "ModelSpec":
        if self.shards > 1 and self.deterministic:
            raise ValueError("deterministic: true with shards > 1 is not offered yet: a sharded model's layers are "
                             "mlx-lm's sharded linears, which the batch-invariant mode does not pad; drop one of them")
        return self

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"model name {v!r} must be 1-128 characters of letters, digits and ._:/- ; pass NAME=SOURCE to choose one")
        return v

    @field_validator("source")
    @classmethod
    def _check_source(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("the model source is empty: give a built-in model (tiny-dense), a model directory or a "
                             "Hugging Face repo id, as SOURCE or NAME=SOURCE")
        return v

    @property
    def deployment(self) -> str:
        """Its Serve deployment's name."""
        return "model-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", self.name)

    @classmethod
    def parse(cls, text: str, **overrides) -> "ModelSpec":
        """`NAME=SOURCE` or just `SOURCE` (a local path is named after its directory)."""
        if "=" in text:
            name, source = text.split("=", 1)
        else:
            source = text
            path = Path(source).expanduser()
            name = path.name if (source.startswith((".", "/", "~")) or path.is_dir()) else source
        return cls(name=name, source=source, **overrides)


class GatewayConfig(_Config):
    """The HTTP gateway: replicas, limits, API keys and how it waits for replicas."""

    replicas: int = Field(2, ge=1, le=64, description="Gateway replicas. Two or more, so losing one does not take the endpoint down.")
    max_body_bytes: int = Field(
        16 << 20, ge=1024, le=1 << 30,
        description="Largest request body in bytes, counted on the bytes actually received (chunked or not); larger gets 413.",
    )
    api_keys_file: Optional[str] = Field(
        None,
        description="A file of API keys, one per line, readable where the gateway runs. With keys set (here or in MLX_FLEET_API_KEYS, comma-separated) every endpoint but /health needs 'Authorization: Bearer <key>'.",
    )
    tokenizer_threads: int = Field(4, ge=1, le=64, description="Threads per gateway replica that tokenize and template prompts, off the event loop.")

    assign_timeout_s: float = Field(
        15.0, gt=0, description="How long a request may wait for a replica to accept it before the gateway answers 503 with Retry-After.",
    )
    retry_after_s: int = Field(2, ge=1, description="Retry-After seconds sent with 503 responses.")


class RoutingConfig(_Config):
    """How the gateway picks a replica: the policy, and the inputs of its time-to-first-token model."""

    policy: Literal["affinity", "pow2", "round_robin"] = Field(
        "affinity",
        description="'affinity': the replica predicted to answer first, from the fleet index (cached prefix, load, prefill speed, peer fetches); 'pow2': Serve's power of two choices; 'round_robin'. The last two ignore the cache; they exist to compare against.",
    )
    load_factor: float = Field(
        1.25, ge=1.0, le=4.0,
        description="Bounded load: no replica takes a request while it holds more than load_factor x the mean load (+1). Affinity never switches off: among the replicas under the bound, the fastest predicted answer wins.",
    )
    near_ratio: float = Field(0.25, ge=0.0, le=10.0, description="Near ties: replicas predicted within near_ratio x the fastest answer + near_s count as equally fast, and the one sent the fewest requests lately wins (spreads shared system prompts under light load).")
    near_s: float = Field(0.05, ge=0.0, le=10.0, description="The absolute part of a near tie, in seconds (see near_ratio).")
    near_share: float = Field(0.5, ge=0.0, le=1.0, description="Near ties apply only to requests of which the fastest replica restores at most this share of the prompt: a new conversation on a shared system prompt spreads, a conversation's next turn stays with its history.")
    recent_half_life_s: float = Field(10.0, gt=0.0, description="Half-life of the per-replica count of requests sent lately, which breaks near ties.")
    default_prefill_tps: float = Field(2000.0, gt=0, description="Prefill tokens/s assumed for a replica that has not measured its own yet.")
    default_link_bytes_per_s: float = Field(200e6, gt=0, description="Peer-to-peer block transfer bytes/s assumed until a replica has measured a link.")
    lookup_timeout_s: float = Field(1.0, gt=0, description="Deadline of one index lookup (normally well under a millisecond; this bounds a stalled Redis or a gateway swamped by a burst); past it the request is routed by power of two choices (reason=fallback).")
    fetch_timeout_s: float = Field(10.0, gt=0, description="Deadline for pulling blocks from a peer; past it the rest is recomputed.")
    index_flush_s: float = Field(0.2, gt=0, description="How often a replica renews its index lease and retries a failed write; block events are flushed as they come (at most every 20 ms).")
    index_gc_s: float = Field(10.0, gt=0, description="How often a replica removes dead nodes' entries from the index.")


class RedisConfig(_Config):
    """How every process connects to the shared Redis (the URL is AppConfig.redis_url)."""

    password: Optional[str] = Field(None, description="Password, if it is not in the URL. Never shown in status or logs.")
    tls_ca_file: Optional[str] = Field(None, description="CA bundle to verify a rediss:// (TLS) server with; default: the system's.")
    connect_timeout_s: float = Field(2.0, gt=0, description="Deadline for opening a connection.")
    socket_timeout_s: float = Field(2.0, gt=0, description="Deadline for one command of background work (leases, index updates, status).")


class AppConfig(_Config):
    """Everything the Serve application is built from (`cluster.actors.app:build_app`)."""

    models: list[ModelSpec] = Field(
        default_factory=lambda: [ModelSpec(name=DEFAULT_MODEL, source=DEFAULT_MODEL)],
        min_length=1, description="The models to serve, one deployment each.",
    )
    redis_url: RedisURL = Field(None, description="The shared Redis (index and node leases), e.g. redis://10.0.0.1:6379/0. None disables fleet-wide features.")
    data_dir: str = Field(
        "~/.mlx-fleet",
        description="Base directory for built models and block stores. Each node uses <data_dir>/<node-id>/ unless its Ray node was started with MLX_FLEET_NODE_DATA_DIR.",
    )
    cache: CacheConfig = Field(default_factory=CacheConfig, description="KV block cache settings, shared by all models.")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig, description="Gateway settings.")
    lease_ttl_s: float = Field(6.0, gt=1, description="A replica whose lease in Redis is older than this is considered gone.")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="How requests are routed to replicas.")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="Redis connection settings.")

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelSpec]) -> list[ModelSpec]:
        names = [m.name for m in models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"model names must be unique, {sorted(dup)} repeats: give each model its own `name` "
                             "(on the command line, --model NAME=SOURCE)")
        return models



def sharded_replicas(models: list[ModelSpec], nodes: int) -> dict[str, int]:
    """Replicas of each sharded model. A node holds one rank of a sharded replica at most (actors/app.py), so the
    sharded models share the nodes: each defaults to nodes // (the shards of all of them together), at least one."""
    width = sum(m.shards for m in models if m.shards > 1)
    return {m.name: m.num_replicas if m.num_replicas is not None else max(nodes // width, 1)
            for m in models if m.shards > 1}


def ranks_overflow(models: list[ModelSpec], nodes: int) -> Optional[str]:
    """Why the sharded replicas cannot all be placed on `nodes` nodes (one rank per node), or None. Ray would
    otherwise wait for the missing nodes forever, and `up` or a deploy with it."""
    replicas = sharded_replicas(models, nodes)
    need = sum(replicas[m.name] * m.shards for m in models if m.name in replicas)
    if need <= nodes:
        return None
    parts = ", ".join(f"{m.name} {replicas[m.name]} x {m.shards}" for m in models if m.name in replicas)
    return (f"the sharded replicas need {need} nodes, one rank per node (replicas x shards: {parts}), and the "
            f"fleet has {nodes}; start more nodes (--nodes {need}), lower num_replicas, or shard fewer models")


class FleetConfig(_Config):
    """`mlx-fleet up`: a local fleet of N Ray nodes on this machine."""

    nodes: int = Field(1, ge=1, le=32, description="Ray nodes to start on this machine, each with its own node id, data dir and one replica per model.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the OpenAI endpoint.")
    host: str = Field("127.0.0.1", description="Address the HTTP endpoint binds. Loopback by default; 0.0.0.0 exposes it to the network.")
    redis_url: RedisURL = Field(None, description="Use this Redis instead of starting one under the data dir.")
    data_dir: Path = Field(default_factory=default_data_dir, description="Fleet state: pids, ports, logs, Redis, node dirs, built models.")
    dashboard: bool = Field(True, description="Start the Ray dashboard on the head node.")
    foreground: bool = Field(False, description="Stay attached and stop the fleet on Ctrl-C.")
    app: AppConfig = Field(default_factory=AppConfig, description="The Serve application to deploy.")

    @model_validator(mode="after")
    def _check_shards_fit(self) -> "FleetConfig":
        wide = max((m.shards for m in self.app.models), default=1)
        if wide > self.nodes:
            raise ValueError(f"each replica spans {wide} nodes, and the fleet has {self.nodes}; start at least as "
                             f"many (--nodes {wide}), or shard less")
        overflow = ranks_overflow(self.app.models, self.nodes)
        if overflow:
            raise ValueError(overflow)
        return self
