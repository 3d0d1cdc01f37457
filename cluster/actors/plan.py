"""What the gateway sends a replica: the request, and the route plan it was sent on.

Small frozen objects (they cross the Ray boundary). The plan travels with the
request so that the ModelReplica deployment's request router (router.py) can
honour it, and the replica can act on it: pull the blocks the plan says a peer
holds, before prefilling.

`x-fleet-route` is written from the plan and what the replica reports:

    <policy> reason=<hit|load|miss|fallback|policy|bypass> local=<tokens> fetched=<tokens> [from=<peer node id>]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

from cluster.engine.request import GenerationParams


@dataclass(frozen=True)
class FetchPlan:
    """Pull blocks [start_block, end_block) (and the checkpoint at end_block, for hybrids) from `peer`.

    A sharded peer's blocks are its ranks', each on its own node: `peer_ranks` names those nodes in rank
    order, and rank r of the replica that pulls reads its own heads' blocks from `peer_ranks[r]`
    (`for_rank`). The router plans such a pull only between replicas of the same geometry, whose rank r
    keeps the same heads under the same fingerprint."""

    peer: str  # the peer's node id (a sharded peer's leader's)
    start_block: int
    end_block: int
    checkpoint: bool  # the puller needs one (counted in nbytes); each pulling process asks for its own layers'
    tokens: int  # restorable tokens once they are here
    nbytes: int
    peer_ranks: tuple[str, ...] = ()  # a sharded peer's nodes, by rank

    def for_rank(self, rank: int, size: int = 1) -> Optional["FetchPlan"]:
        """The pull that rank `rank` of a replica of `size` ranks makes: from its counterpart's node. None where
        the peer is split otherwise (a plan the router made for another replica, which Serve's router moved
        here): no counterpart holds this rank's heads."""
        if len(self.peer_ranks) != (size if size > 1 else 0):
            return None
        return replace(self, peer=self.peer_ranks[rank], peer_ranks=()) if self.peer_ranks else self

    def shared(self) -> dict:
        """As a sharded replica's leader tells its followers (msgpack: engine/lockstep.py)."""
        return {**asdict(self), "peer_ranks": list(self.peer_ranks)}

    @classmethod
    def from_shared(cls, item: dict) -> "FetchPlan":
        return cls(**{**item, "peer_ranks": tuple(item.get("peer_ranks") or ())})


@dataclass(frozen=True)
class RoutePlan:
    policy: str  # "affinity" | "pow2" | "round_robin"
    reason: str  # "hit" | "load" | "miss" | "fallback" | "policy" | "bypass"
    node_id: Optional[str] = None  # the chosen node (None: let the router pick)
    ranked: tuple[str, ...] = ()  # Ray node ids, most preferred first
    tokens: int = 0  # tokens the chosen node is expected to restore (locally or fetched)
    # What to pull first. Its peer is the chosen node itself when that node holds the prefix: a no-op
    # there, and what a replica the router moved the request to pulls instead of recomputing.
    fetch: Optional[FetchPlan] = None
    predicted_ttft_s: float = 0.0
    origin: str = ""  # the gateway that planned it: replicas count its requests apart (Scheduler.load)

    def header(self, served_by: str, local: int, fetched: int, fetched_from: Optional[str]) -> str:
        """The x-fleet-route value: a replica other than the planned one means the router moved it (load)."""
        reason = "load" if self.node_id and served_by != self.node_id and self.reason == "hit" else self.reason
        out = f"{self.policy} reason={reason} local={local} fetched={fetched}"
        return out + (f" from={fetched_from}" if fetched and fetched_from else "")


@dataclass(frozen=True)
class GenerateRequest:
    """One request as a replica sees it. The gateway has already tokenized and validated it."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    params: GenerationParams
    route: Optional[RoutePlan] = None
    use_cache: bool = True  # False (`x-fleet-cache: bypass`): no restore, no capture: the cold path, to compare
