"""Gateway: the OpenAI HTTP API, as the Serve ingress deployment (2 replicas by default).

It validates and tokenizes every request (off the event loop), then calls the
model's ModelReplica deployment through a DeploymentHandle with token ids (the
body-aware part of routing has to live behind the ingress: Serve's ingress
router never sees the HTTP body). Replies stream back as SSE or are gathered
into one JSON body. The front door (api/front_door.py) checks API keys and the
body size on real bytes before any of this; every error is an OpenAI-format
JSON body.
"""

# No `from __future__ import annotations`: FastAPI must see the real body types
# through Serve's ingress wrapper, or it treats them as query parameters.

import asyncio
import dataclasses
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.actors import loopback
from cluster.actors.dispatch import Dispatcher
from cluster.actors.fleet_view import FleetView
from cluster.actors.gateway_stats import GatewayStats
from cluster.actors.health import Health
from cluster.actors.request_metrics import RequestTiming
from cluster.actors.routing import Affinity
from cluster.actors.served_model import ServedModel
from cluster.api.errors import APIError, bad_request, from_validation_errors, internal
from cluster.api.front_door import FrontDoor, FrontDoorSettings
from cluster.api.keys import ApiKeys, read_keys
from cluster.api.responses import SSE_DONE, Reply, sse
from cluster.api.schemas import ChatCompletionRequest, CompletionRequest
from cluster.config import AppConfig
from cluster.engine.events import Delta, Failed, Finished
from cluster.status import fleet_status
from cluster.store.fleet_index import FleetIndex
from cluster.store.redis_client import aconnect

log = logging.getLogger(__name__)

# strict_content_type: a body without a Content-Type is not read as JSON (what a browser's cross-site POST
# sends); errors.from_validation_errors says so.
app = FastAPI(title="mlx-fleet", description="OpenAI-compatible serving from a fleet of Apple Silicon Macs.",
              strict_content_type=True)
front_door = FrontDoorSettings()
CACHE_HEADER = "x-fleet-cache"
app.add_middleware(FrontDoor, settings=front_door)


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return from_validation_errors(list(exc.errors()), request.headers.get("content-type")).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:  # OpenAI's own answer to a path it does not serve
        return APIError(404, f"Invalid URL ({request.method} {request.url.path})").response()
    if exc.status_code == 405:  # with its Allow header: the methods the path takes
        return APIError(405, str(exc.detail), code="method_not_allowed", headers=dict(exc.headers or {})).response()
    if exc.status_code == 400:  # FastAPI could not read the body (e.g. not UTF-8)
        return APIError(400, f"Request body is not valid UTF-8 JSON: {exc.detail}", code="invalid_json").response()
    return APIError(exc.status_code, str(exc.detail), code="http_error").response()


@app.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return internal(f"internal error: {type(exc).__name__}").response()


def use_cache(headers) -> bool:
    """`x-fleet-cache: bypass` asks for the cold path (no restore, no capture), so a client can check that
    the cache never changes an answer (the load test's replay does)."""
    value = headers.get(CACHE_HEADER, "use").strip().lower()
    if value not in ("use", "bypass"):
        raise bad_request(f"header {CACHE_HEADER} must be 'use' (the default) or 'bypass', not {value!r}",
                          CACHE_HEADER)
    return value == "use"


@serve.ingress(app)
class Gateway:
    """Routes OpenAI requests to the replicas of the named model."""

    def __init__(self, config: AppConfig, handles: dict):
        loopback.apply()
        self.config = config
        front_door.max_body_bytes = config.gateway.max_body_bytes
        front_door.keys = ApiKeys(read_keys(config.gateway.api_keys_file))
        self.dispatch = Dispatcher(config, handles)
        client = aconnect(config.redis_url, config.redis, config.routing.lookup_timeout_s) if config.redis_url else None
        self.view = FleetView(client)
        self.dispatch.router = Affinity(FleetIndex(client) if client is not None else None, self.view, config.routing)
        self.stats = GatewayStats(client, self.dispatch.router)
        self.health_check = Health(self.view, {m.name: m.deployment for m in config.models}, config.lease_ttl_s)
        log.info("gateway ready: %d model(s), %d API key(s)", len(config.models), len(front_door.keys))

    def check_health(self) -> None:
        loopback.check_listeners()

    @app.get("/health")
    async def health(self) -> JSONResponse:
        state = await self.health_check.check()
        ok = all(state["models"].values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "models": state["models"]},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [self._card(m) for m in self.dispatch.models.values()]}

    @app.get("/v1/models/{model:path}")
    async def model_card(self, model: str) -> dict:
        # What the OpenAI SDK's models.retrieve() asks; a model id may hold slashes (a Hugging Face repo id).
        return self._card(self.dispatch.model(model))

    def _card(self, served: ServedModel) -> dict:
        # kv_block_tokens: what a client needs to tell a full cache hit from a partial one (0: no cache).
        block = self.config.cache.block_tokens if self.config.cache.enabled else 0
        return served.card() | {"kv_block_tokens": block}

    @app.get("/v1/fleet/status")
    async def status(self) -> dict:
        return await asyncio.to_thread(fleet_status, self.config.redis_url, [m.name for m in self.config.models],
                                       self.config.data_dir, self.config.redis)

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest, http: Request):
        served = self.dispatch.model(body.model)
        http.state.model = served.name
        prompt = await served.chat_prompt(body)
        reply = Reply(served.name, chat=True, include_usage=body.include_usage(), token_text=served.token_text)
        return await self._respond(served, body, prompt, reply, use_cache=use_cache(http.headers))

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, http: Request):
        served = self.dispatch.model(body.model)
        http.state.model = served.name
        prompt = await served.text_prompt(body)
        echo = await served.decode(prompt) if body.echo else ""
        reply = Reply(served.name, chat=False, include_usage=body.include_usage(), token_text=served.token_text,
                      text_offset=len(echo))
        return await self._respond(served, body, prompt, reply, echo, use_cache=use_cache(http.headers))

    async def _respond(self, served: ServedModel, body, prompt: list[int], reply: Reply, echo: str = "",
                       use_cache: bool = True):
        self.view.start()
        self.stats.start()
        request = dataclasses.replace(served.make_request(body, prompt, chat=reply.chat), use_cache=use_cache)
        timing = RequestTiming(served.name, len(prompt))
        if body.stream:
            run = await self.dispatch.start(served, request)
            timing.first_token(run, self.view)
            return StreamingResponse(self._stream(run, reply, echo, timing), media_type="text/event-stream",
                                     headers=run.headers(run.cached_tokens))
        run, whole, done = await self.dispatch.complete(served, request)
        timing.first_token(run, self.view)
        timing.done()
        return JSONResponse(reply.complete(echo + whole.text, done, whole), headers=run.headers(done.cached_tokens))

    async def _stream(self, run, reply: Reply, echo: str, timing: "RequestTiming"):
        try:
            yield reply.chunk(text="" if reply.chat else echo, role=reply.chat)
            async for event in run.events():
                if isinstance(event, Delta) and (event.text or event.logprobs or event.tool_calls):
                    yield reply.chunk(text=event.text if event.text or not event.tool_calls else None, event=event)
                elif isinstance(event, Finished):
                    timing.done()
                    yield reply.chunk(finish_reason=event.finish_reason)
                    if reply.include_usage:
                        yield reply.usage_chunk(event)
                elif isinstance(event, Failed):
                    yield sse({"error": {"message": event.message, "type": "server_error", "param": None, "code": "generation_failed"}})
            yield SSE_DONE
        except Exception as e:  # the replica died mid-stream: say so in-band, the status is already sent
            log.warning("stream %s broke: %s", reply.id, e)
            yield sse({"error": {"message": f"the replica stopped mid-stream ({type(e).__name__}); retry the request",
                                 "type": "server_error", "param": None, "code": "replica_lost"}})
            yield SSE_DONE
        finally:
            run.cancel()
