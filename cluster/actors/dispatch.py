"""From a tokenized request to a running generation on some replica.

`Dispatcher` plans the route (routing.py: one index lookup), sends the
request with its plan to the model's deployment (whose router honours it) and
waits, with a bound, for a replica to accept it; a replica that dies before any
output reached the client is replaced by another attempt, so the client never
sees that failure. It counts its requests in flight per node, which the next
plans see at once. (Tokenizing and limits: served_model.py.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Optional

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from cluster.actors.plan import RoutePlan
from cluster.actors.routing import Affinity
from cluster.actors.served_model import ServedModel
from cluster.api.errors import APIError, model_not_found, unavailable
from cluster.config import AppConfig
from cluster.engine.events import Accepted, Delta, Event, Failed, Finished, Started
from cluster.actors.plan import GenerateRequest

log = logging.getLogger(__name__)

ATTEMPTS = 3
_REPLICA_LOST = (RayActorError,)


@dataclass
class Run:
    """A request accepted by a replica: what it said so far and the rest of its stream."""

    node_id: str
    plan: RoutePlan
    buffered: list[Event]
    stream: AsyncIterator[Event]
    response: object
    cached_tokens: int = 0
    shard_nodes: tuple[str, ...] = ()
    started: Optional[Started] = None
    started_at: float = 0.0  # monotonic time the first token's Started arrived
    on_close: Optional[Callable[[], None]] = field(default=None, repr=False)
    _closed: bool = field(default=False, repr=False)

    @property
    def route(self) -> str:
        s = self.started
        fetched = s.fetched_tokens if s else 0
        return self.plan.header(self.node_id, (s.cached_tokens if s else 0) - fetched, fetched,
                                s.fetched_from if s else None)

    async def events(self) -> AsyncIterator[Event]:
        for event in self.buffered:
            yield event
        self.buffered = []
        async for event in self.stream:
            yield event

    def headers(self, cached_tokens: int) -> dict[str, str]:
        return {"x-fleet-node": ",".join((self.node_id, *self.shard_nodes)), "x-fleet-route": self.route,
                "x-fleet-cached-tokens": str(cached_tokens)}

    def cancel(self) -> None:
        if not self._closed:
            self._closed = True
            if self.on_close is not None:
                self.on_close()
            try:
                self.response.cancel()
            except Exception:
                pass


class Dispatcher:
    """Finds each request a replica and hands back its event stream."""

    def __init__(self, config: AppConfig, handles: dict):
        data_dir = Path(config.data_dir).expanduser()
        self.config = config
        # Tokenizing and templating: off the event loop, on a few threads (HF tokenizers release the GIL).
        self.executor = ThreadPoolExecutor(config.gateway.tokenizer_threads, thread_name_prefix="mlx-fleet-tokenize")
        self.models = {spec.name: ServedModel(spec, data_dir, handles[spec.name], self.executor)
                       for spec in config.models}
        self.router: Optional[Affinity] = None  # set by the gateway once it has its Redis client

    def model(self, name: str) -> ServedModel:
        served = self.models.get(name)
        if served is None:
            raise model_not_found(name, sorted(self.models))
        return served

    async def start(self, served: ServedModel, request: GenerateRequest) -> Run:
        """Plan, send the request and return once it has started (or ended); retry lost replicas."""
        if request.route is None and not request.use_cache:  # nothing to find: any replica will do
            request = dataclasses.replace(request, route=RoutePlan(policy=self.config.routing.policy, reason="bypass"))
            if self.router is not None:
                self.router.count(request.route)  # so status's routes add up to the requests
        if request.route is None:
            plan = (await self.router.plan(served.name, list(request.prompt_tokens)) if self.router is not None
                    else RoutePlan(policy="pow2", reason="fallback"))
            request = dataclasses.replace(request, route=plan)
        if self.router is not None and request.route.origin != self.router.origin:
            # Every plan names this gateway, bypass and fallback ones too: the replica's lease counts the
            # request under it, and this gateway counts it itself (routing.Affinity.loads).
            request = dataclasses.replace(request, route=dataclasses.replace(request.route, origin=self.router.origin))
        # Counted on the planned node at once, so the next plans (made before this one reaches its
        # replica) see it; both counts move to the node that really accepts it. The request counts until
        # its run closes; its uncached prompt tokens count as that node's queue until its first token
        # (start returns then).
        reserved = _Held(self.router and self.router.track, request.route.node_id, 1)
        queued = _Held(self.router and self.router.track_queued, request.route.node_id,
                        len(request.prompt_tokens) - request.route.tokens)
        try:
            for attempt in range(ATTEMPTS):
                try:
                    return await self._attempt(served, request, reserved, queued)
                except _REPLICA_LOST as e:
                    log.warning("replica lost before %s started (attempt %d): %s", request.request_id, attempt + 1, e)
            raise unavailable(f"no replica of '{served.name}' could take the request; retry shortly",
                              self.config.gateway.retry_after_s)
        except BaseException:
            reserved.release()  # never started: give the reservation back
            raise
        finally:
            queued.release()

    async def _attempt(self, served: ServedModel, request: GenerateRequest, reserved: "_Held", queued: "_Held") -> Run:
        response = served.handle.options(stream=True).generate.remote(request)
        stream = _flatten(response)
        try:
            first = await asyncio.wait_for(stream.__anext__(), self.config.gateway.assign_timeout_s)
        except (asyncio.TimeoutError, BackPressureError, StopAsyncIteration):
            response.cancel()
            raise unavailable(f"no replica of '{served.name}' is available right now; retry shortly",
                              self.config.gateway.retry_after_s)
        except BaseException:
            response.cancel()
            raise
        assert isinstance(first, Accepted), first
        run = Run(node_id=first.node_id, plan=request.route, buffered=[], stream=stream, response=response,
                  shard_nodes=first.shard_nodes)
        reserved.move(first.node_id)  # a moved request (or a fallback plan's) runs and waits there
        queued.move(first.node_id)
        run.on_close = reserved.release
        try:
            async for event in stream:
                run.buffered.append(event)
                if isinstance(event, Started):
                    run.cached_tokens = event.cached_tokens
                    run.started = event
                    run.started_at = time.monotonic()
                if isinstance(event, (Started, Finished, Failed)):
                    break
        except BaseException:
            run.cancel()
            raise
        last = run.buffered[-1] if run.buffered else None
        if isinstance(last, Failed) and 400 <= last.status < 500:  # the replica refused what was asked of it
            run.cancel()
            raise APIError(last.status, last.message, type="invalid_request_error", param=last.param)
        return run

    async def complete(self, served: ServedModel, request: GenerateRequest) -> tuple[Run, Delta, Finished]:
        """Run to the end for a non-streaming reply; a replica lost midway means a fresh attempt."""
        for attempt in range(ATTEMPTS):
            run = await self.start(served, request)
            try:
                whole, done = await _gather(run, self.config.gateway.retry_after_s)
                return run, whole, done
            except _REPLICA_LOST as e:
                log.warning("replica lost during %s (attempt %d): %s", request.request_id, attempt + 1, e)
            finally:
                run.cancel()
        raise unavailable(f"replicas of '{served.name}' kept failing; retry shortly", self.config.gateway.retry_after_s)


class _Held:
    """`amount` counted for one node with `track`, from now until released, once however often release is
    called (a run's close and an error path may both call it); it can move to another node."""

    def __init__(self, track: Optional[Callable[[str, int], None]], node_id: Optional[str], amount: int):
        self.track, self.amount, self.node_id = track, amount, None
        self.move(node_id)

    def move(self, node_id: Optional[str]) -> None:
        if node_id == self.node_id:
            return
        self.release()
        if self.track is not None and node_id is not None and self.amount > 0:
            self.track(node_id, self.amount)
            self.node_id = node_id

    def release(self) -> None:
        if self.node_id is not None:
            self.track(self.node_id, -self.amount)
            self.node_id = None


async def _gather(run: Run, retry_after_s: int) -> tuple[Delta, Finished]:
    """The whole reply as one Delta (text, tokens, logprobs, tool calls) and its end. A replica's 503 (a sharded
    replica that lost a rank) says when to retry, as the gateway's own do."""
    parts: list[Delta] = []
    async for event in run.events():
        if isinstance(event, Delta):
            parts.append(event)
        elif isinstance(event, Finished):
            return Delta("".join(d.text for d in parts), tuple(t for d in parts for t in d.token_ids),
                         tuple(p for d in parts for p in d.logprobs),
                         tuple(c for d in parts for c in d.tool_calls)), event
        elif isinstance(event, Failed):
            raise APIError(event.status, event.message, type="server_error", code="generation_failed",
                           headers={"Retry-After": str(retry_after_s)} if event.status == 503 else None)
    raise RayActorError()  # the stream ended without a verdict: treat as a lost replica


async def _flatten(response) -> AsyncIterator[Event]:
    """The replica's event lists as events, each list's runs of plain Deltas merged into one: a stream then
    writes one chunk (one hop through Serve's proxy) for the tokens a replica sent together."""
    async for events in response:
        for event in coalesce(events):
            yield event


def coalesce(events: list[Event]) -> list[Event]:
    """Consecutive Deltas without tool calls as one Delta (text, tokens and logprobs in order)."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, Delta) and isinstance(last, Delta) and not e.tool_calls and not last.tool_calls:
            out[-1] = Delta(last.text + e.text, last.token_ids + e.token_ids, last.logprobs + e.logprobs)
        else:
            out.append(e)
    return out

