"""Gateway: the OpenAI HTTP API, as the Serve ingress deployment.

It validates and tokenizes every request, then calls the model's ModelReplica
deployment through a DeploymentHandle with token ids (the body-aware part of
routing has to live behind the ingress: Serve's ingress router never sees the
HTTP body). Replies stream back as SSE or are gathered into one JSON body.
"""

# No `from __future__ import annotations`: FastAPI must see the real body types
# through Serve's ingress wrapper, or it treats them as query parameters.

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.actors.dispatch import Dispatcher, ServedModel
from cluster.api.errors import APIError, from_validation_errors, internal
from cluster.api.responses import SSE_DONE, Reply, sse
from cluster.api.schemas import ChatCompletionRequest, CompletionRequest
from cluster.config import AppConfig
from cluster.engine.events import Delta, Failed, Finished
from cluster.fleet.status import fleet_status

log = logging.getLogger(__name__)

app = FastAPI(title="mlx-fleet", description="OpenAI-compatible serving from a fleet of Apple Silicon Macs.")


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return from_validation_errors(list(exc.errors())).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), type=kind).response()


@app.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return internal(f"internal error: {type(exc).__name__}").response()


MAX_REQUEST_BYTES = 16 << 20  # about 4M tokens of text: far beyond any context we serve


@app.middleware("http")
async def _limit_body(request: Request, call_next):
    size = request.headers.get("content-length")
    if size and size.isdigit() and int(size) > MAX_REQUEST_BYTES:
        return APIError(413, f"request body is larger than {MAX_REQUEST_BYTES} bytes",
                        code="request_too_large").response()
    return await call_next(request)


@serve.ingress(app)
class Gateway:
    """Routes OpenAI requests to the replicas of the named model."""

    def __init__(self, config: AppConfig, handles: dict):
        self.config = config
        self.dispatch = Dispatcher(config, handles)

    @app.get("/health")
    async def health(self) -> JSONResponse:
        alive = await self.dispatch.alive_models()
        ok = all(alive.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "models": alive},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [m.card() for m in self.dispatch.models.values()]}

    @app.get("/v1/fleet/status")
    async def status(self) -> dict:
        return await asyncio.to_thread(fleet_status, self.config.redis_url, [m.name for m in self.config.models])

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest):
        served = self.dispatch.model(body.model)
        prompt = served.chat_prompt(body)
        return await self._respond(served, body, prompt, Reply(served.name, chat=True, include_usage=body.include_usage()))

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        served = self.dispatch.model(body.model)
        prompt = served.text_prompt(body)
        echo = served.decode(prompt) if body.echo else ""
        return await self._respond(served, body, prompt, Reply(served.name, chat=False, include_usage=body.include_usage()), echo)

    async def _respond(self, served: ServedModel, body, prompt: list[int], reply: Reply, echo: str = ""):
        request = served.make_request(body, prompt)
        if body.stream:
            run = await self.dispatch.start(served, request)
            return StreamingResponse(self._stream(run, reply, echo), media_type="text/event-stream",
                                     headers=run.headers(run.cached_tokens))
        run, text, done = await self.dispatch.complete(served, request)
        return JSONResponse(reply.complete(echo + text, done), headers=run.headers(done.cached_tokens))

    async def _stream(self, run, reply: Reply, echo: str):
        try:
            yield reply.chunk(text="" if reply.chat else echo, role=reply.chat)
            async for event in run.events():
                if isinstance(event, Delta) and event.text:
                    yield reply.chunk(text=event.text)
                elif isinstance(event, Finished):
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

