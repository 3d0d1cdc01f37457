"""The fleet's metrics, exported through Ray (`ray.util.metrics`).

Ray's metrics agent on each node serves them in Prometheus format on the
node's `--metrics-export-port`, next to Ray's own and Serve's, and the Ray
dashboard's metrics view and the Grafana dashboard in deploy/grafana read them
there. Ray prefixes every name with `ray_`, and a counter gets `_total`:
`mlx_fleet_tokens` is scraped as `ray_mlx_fleet_tokens_total`.

`METRICS` is the one list of what the fleet exports (the Grafana test checks
every panel against it). Each process records into its own copies:
- the gateway records requests, latencies and routes as they happen;
- replicas and node stores keep their counters in dicts (which `status` also
  reads), and `StatsExporter` turns those into metrics every few seconds:
  gauges for levels, counters for the growth of running totals.

Tags: `model`, `node` (the persistent node name) and `tier` (ram, disk) where
they apply.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)

LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120]


@dataclass(frozen=True)
class Spec:
    kind: str  # counter | gauge | histogram
    description: str
    tags: tuple[str, ...]
    boundaries: Optional[tuple[float, ...]] = None


METRICS: dict[str, Spec] = {
    # gateway
    "mlx_fleet_requests": Spec("counter", "HTTP requests answered, by model, endpoint and status code",
                               ("model", "endpoint", "code")),
    "mlx_fleet_ttft_seconds": Spec("histogram", "Time to first token seen by the gateway, by cache state "
                                   "(cold: nothing restored, partial, full: every whole block)",
                                   ("model", "cache_state"), tuple(LATENCY_BOUNDARIES)),
    "mlx_fleet_request_seconds": Spec("histogram", "End-to-end request latency seen by the gateway, by cache state",
                                      ("model", "cache_state"), tuple(LATENCY_BOUNDARIES)),
    "mlx_fleet_routes": Spec("counter", "Routing decisions by reason (hit, load, miss, fallback, policy, bypass)",
                             ("model", "reason")),
    "mlx_fleet_prefix_decisions": Spec("counter", "What became of each request's cached prefix: fetch (pulled "
                                       "from a peer), local (restored where it was served), recompute",
                                       ("model", "decision")),
    "mlx_fleet_index_lookup_seconds": Spec("histogram", "Fleet index lookups by the router", ("model",),
                                           (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)),
    # replicas
    "mlx_fleet_tokens": Spec("counter", "Tokens by kind: prompt, cached (restored, not computed), fetched "
                             "(restored from blocks pulled from a peer), generated", ("model", "node", "kind")),
    "mlx_fleet_replica_requests": Spec("counter", "Requests a replica ended, by outcome (finished, failed, "
                                       "cancelled)", ("model", "node", "outcome")),
    "mlx_fleet_replica_sequences": Spec("gauge", "Sequences on a replica's model thread by stage (active, "
                                        "waiting, decoding)", ("model", "node", "stage")),
    "mlx_fleet_replica_queued_tokens": Spec("gauge", "Prompt tokens a replica still has to prefill",
                                            ("model", "node")),
    "mlx_fleet_cache_blocks": Spec("gauge", "Blocks held, per tier", ("model", "node", "tier")),
    "mlx_fleet_cache_bytes": Spec("gauge", "Bytes held, per tier", ("model", "node", "tier")),
    "mlx_fleet_cache_evictions": Spec("counter", "Blocks evicted, per tier", ("model", "node", "tier")),
    "mlx_fleet_cache_quarantined": Spec("counter", "Blocks refused as corrupt, stale or foreign",
                                        ("model", "node", "tier")),
    "mlx_fleet_cache_choices": Spec("counter", "Cache hits taken (restore) or passed over because recomputing "
                                    "was predicted faster (recompute), by the replica's measured speeds",
                                    ("model", "node", "choice")),
    "mlx_fleet_cache_dropped_spills": Spec("counter", "Spills to disk dropped (queue full or disk trouble)",
                                           ("model", "node")),
    "mlx_fleet_migrated_blocks": Spec("counter", "Blocks pulled from peers", ("model", "node")),
    "mlx_fleet_migrated_bytes": Spec("counter", "Bytes pulled from peers", ("model", "node")),
    "mlx_fleet_migration_seconds": Spec("counter", "Seconds spent pulling blocks from peers", ("model", "node")),
    "mlx_fleet_migration_failures": Spec("counter", "Pulls from peers that failed (recomputed instead)",
                                         ("model", "node")),
    "mlx_fleet_redis_errors": Spec("counter", "Redis calls that failed, by component", ("node", "component")),
}


CACHE_STATES = ("cold", "partial", "full")


def cache_state(prompt_tokens: int, cached_tokens: int, block_tokens: int) -> str:
    """cold: nothing restored; full: every whole block before the last prompt token (the most a block
    cache can restore: the last token is always computed); partial: in between."""
    if cached_tokens <= 0:
        return "cold"
    if block_tokens > 0 and cached_tokens >= (prompt_tokens - 1) // block_tokens * block_tokens:
        return "full"
    return "partial"


class _Registry:
    """This process's metric objects, made on first use (Ray must be initialized by then)."""

    def __init__(self):
        self._made: dict[str, object] = {}

    def get(self, name: str):
        metric = self._made.get(name)
        if metric is None:
            from ray.util import metrics

            spec = METRICS[name]
            if spec.kind == "counter":
                metric = metrics.Counter(name, description=spec.description, tag_keys=spec.tags)
            elif spec.kind == "gauge":
                metric = metrics.Gauge(name, description=spec.description, tag_keys=spec.tags)
            else:
                metric = metrics.Histogram(name, description=spec.description, boundaries=list(spec.boundaries),
                                           tag_keys=spec.tags)
            self._made[name] = metric
        return metric


_registry = _Registry()


def inc(name: str, value: float = 1.0, **tags: str) -> None:
    if value > 0:
        _guarded(lambda: _registry.get(name).inc(value, tags=_str(tags)))


def zero(name: str, **tags: str) -> None:
    """Export a counter's series at 0 before its first event, so that a dashboard shows 0 (no evictions yet),
    not "No data", which looks like a broken scrape. Ray's `Counter.inc` refuses 0; `_record`, which it
    calls, takes it."""
    global _zero_warned
    try:
        _registry.get(name)._record(0.0, tags=_str(tags))
    except Exception as e:  # a Ray without it: the series appears at its first event, as before
        if not _zero_warned:
            log.warning("counters are not exported at 0 before their first event: %s", e)
            _zero_warned = True


_zero_warned = False


def observe(name: str, value: float, **tags: str) -> None:
    _guarded(lambda: _registry.get(name).observe(value, tags=_str(tags)))


def set_gauge(name: str, value: float, **tags: str) -> None:
    _guarded(lambda: _registry.get(name).set(value, tags=_str(tags)))


def _str(tags: dict) -> dict[str, str]:
    return {k: "" if v is None else str(v) for k, v in tags.items()}


def _guarded(record) -> None:
    """A metric that cannot be recorded (Ray not up, a bad tag) is a log line, never a failed request."""
    try:
        record()
    except Exception as e:
        log.debug("metric not recorded: %s", e)


class StatsExporter:
    """Turns running totals into counter increments: each `total` call adds what grew since the last one.
    A total first seen at 0 is exported at 0."""

    def __init__(self):
        self._last: dict[tuple, float] = {}

    def total(self, name: str, value: Optional[float], **tags: str) -> None:
        if value is None:
            return
        key = (name, tuple(sorted(tags.items())))
        last = self._last.get(key)
        self._last[key] = value
        if last is None and value == 0:
            zero(name, **tags)
            return
        last = last or 0.0
        inc(name, value - last if value >= last else value, **tags)  # a total that went down was reset

    gauge = staticmethod(set_gauge)


def export_replica(exp: StatsExporter, s: dict) -> None:
    """A replica's stats() (what its lease and `status` carry) as metrics."""
    tags = {"model": s.get("model", ""), "node": s.get("node_name", "")}
    for kind, key in (("prompt", "prompt_tokens"), ("cached", "cached_tokens"), ("fetched", "fetched_tokens"),
                      ("generated", "completion_tokens")):
        exp.total("mlx_fleet_tokens", s.get(key), kind=kind, **tags)
    for outcome in ("finished", "failed", "cancelled"):
        exp.total("mlx_fleet_replica_requests", s.get(outcome), outcome=outcome, **tags)
    for stage in ("active", "waiting", "decoding"):
        exp.gauge("mlx_fleet_replica_sequences", s.get(stage, 0), stage=stage, **tags)
    exp.gauge("mlx_fleet_replica_queued_tokens", s.get("queued_tokens", 0), **tags)
    cache = s.get("cache") or {}
    if not cache.get("enabled"):
        return
    ram = cache.get("ram") or {}
    exp.gauge("mlx_fleet_cache_blocks", ram.get("blocks", 0), tier="ram", **tags)
    exp.gauge("mlx_fleet_cache_bytes", ram.get("bytes", 0), tier="ram", **tags)
    exp.total("mlx_fleet_cache_evictions", ram.get("evictions"), tier="ram", **tags)
    exp.total("mlx_fleet_cache_quarantined", sum((cache.get("corrupt") or {}).values()), tier="restore", **tags)
    exp.total("mlx_fleet_cache_dropped_spills", (cache.get("spill") or {}).get("dropped_spills"), **tags)
    for choice, count in ((cache.get("costs") or {}).get("choices") or {}).items():
        exp.total("mlx_fleet_cache_choices", count, choice=choice, **tags)
    migration = cache.get("migration") or {}
    exp.total("mlx_fleet_migrated_blocks", migration.get("blocks"), **tags)
    exp.total("mlx_fleet_migrated_bytes", migration.get("bytes"), **tags)
    exp.total("mlx_fleet_migration_seconds", migration.get("seconds"), **tags)
    exp.total("mlx_fleet_migration_failures", migration.get("failures"), **tags)
    exp.total("mlx_fleet_redis_errors", (cache.get("index") or {}).get("errors"), node=tags["node"],
              component="index_publisher")


def export_node_store(exp: StatsExporter, s: dict) -> None:
    """A node store's stats (its disk tier, shared by the node's models) as metrics."""
    tags = {"model": "", "node": s.get("node_name", ""), "tier": "disk"}
    exp.gauge("mlx_fleet_cache_blocks", s.get("blocks", 0), **tags)
    exp.gauge("mlx_fleet_cache_bytes", s.get("bytes", 0), **tags)
    exp.total("mlx_fleet_cache_evictions", s.get("evictions"), **tags)
    exp.total("mlx_fleet_cache_quarantined", sum((s.get("quarantined") or {}).values()), **tags)
    exp.total("mlx_fleet_cache_dropped_spills", s.get("dropped_spills"), model="", node=tags["node"])


class Every:
    """Calls `fn` every `period_s` on a daemon thread, until `stop()`; an exception is a log line."""

    def __init__(self, fn, period_s: float, name: str):
        import threading

        self._fn, self._period = fn, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._fn()
            except Exception as e:
                log.debug("%s failed: %s", self._thread.name, e)

    def stop(self) -> None:
        self._stop.set()
