"""One request's latency as the gateway sees it, recorded by cache state and route once known.

TTFT runs from the request's arrival at the gateway (after validation and
tokenizing, which `mlx_fleet_requests` counts either way) to the first token's
arrival from the replica; the cache state (cold, partial, full) comes from
the tokens the replica restored and its block size, as the load test
classifies it.
"""

from __future__ import annotations

import time

from cluster import metrics


class RequestTiming:
    def __init__(self, model: str, prompt_tokens: int):
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.t0 = time.monotonic()
        self.state = "cold"
        self._done = False

    def first_token(self, run, view) -> None:
        started = run.started
        cached = started.cached_tokens if started is not None else 0
        block = next((r.block_tokens for r in view.of(self.model) if r.node_id == run.node_id), 0)
        self.state = metrics.cache_state(self.prompt_tokens, cached, block)
        if run.started_at:
            metrics.observe("mlx_fleet_ttft_seconds", run.started_at - self.t0, model=self.model,
                            cache_state=self.state)
        reason = dict(p.split("=", 1) for p in run.route.split()[1:] if "=" in p).get("reason", "")
        metrics.inc("mlx_fleet_routes", model=self.model, reason=reason)
        metrics.inc("mlx_fleet_prefix_decisions", model=self.model, decision=prefix_decision(started))

    def done(self) -> None:
        if not self._done:
            self._done = True
            metrics.observe("mlx_fleet_request_seconds", time.monotonic() - self.t0, model=self.model,
                            cache_state=self.state)


def prefix_decision(started) -> str:
    """What became of the request's cached prefix: pulled from a peer ("fetch"), restored from the serving
    node's own tiers ("local"), or computed with the rest ("recompute"). Counted from what the replica
    did, once per request, so a planned pull that failed counts as the recompute it became."""
    if started is not None and started.fetched_tokens > 0:
        return "fetch"
    return "local" if started is not None and started.cached_tokens > 0 else "recompute"
