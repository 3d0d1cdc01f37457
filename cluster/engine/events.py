"""What a replica streams back to the gateway for one request.

Small frozen objects, not dicts: they cross the Ray boundary and the gateway
matches on their type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from cluster.engine.logprobs import TokenLogprob
from cluster.engine.tool_calls import ToolCall


@dataclass(frozen=True)
class Accepted:
    """The replica took the request (sent before any model work)."""

    node_id: str
    shard_nodes: tuple[str, ...] = ()  # a sharded replica's other ranks' nodes (x-fleet-node names them all)


@dataclass(frozen=True)
class Started:
    """Prefill is done and the first token follows; `cached_tokens` were restored, not computed:
    `fetched_tokens` of them from blocks pulled from the peer `fetched_from`, the rest from this node."""

    cached_tokens: int
    prompt_tokens: int
    fetched_tokens: int = 0
    fetched_from: Optional[str] = None


@dataclass(frozen=True)
class Delta:
    """New text (possibly empty while a stop string or a tool call is undecided), the tokens behind it,
    their logprobs (when asked for) and the tool calls completed with it."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()

    def merged_after(self, first: "Delta") -> "Delta":
        """`first` followed by this delta, as one."""
        return Delta(first.text + self.text, first.token_ids, first.logprobs + self.logprobs,
                     first.tool_calls + self.tool_calls)


@dataclass(frozen=True)
class Finished:
    """The request ended normally."""

    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Failed:
    """The request could not be completed; `status` is the HTTP status the gateway should use."""

    message: str
    status: int = 500
    param: Optional[str] = None  # the request field at fault, for a 4xx


Event = Accepted | Started | Delta | Finished | Failed
TERMINAL = (Finished, Failed)
