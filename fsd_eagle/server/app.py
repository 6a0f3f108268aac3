"""The FastAPI application and ``serve``: the OpenAI-compatible endpoints over one engine loop.

Every error is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``: a request the
schema or the generator refuses is a 400 naming its field, an unknown model a 404, a full queue a 429 with
``Retry-After``, a fault inside decoding a 500 of one line (the other requests go on). ``SIGTERM`` stops
accepting connections, lets running requests finish for up to ``drain_timeout`` seconds, and exits 0.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import socket
import sys
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ..api import SpeculativeGenerator
from ..errors import InputError
from .engine import EngineLoop
from .metrics import Metrics
from .records import folder_for as records_folder
from .protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelCard, ModelList, now
from .serving import APIError, Serving, Settings
from .serving_chat import create_chat_completion
from .serving_completion import create_completion

ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
          429: {"model": ErrorResponse}, 500: {"model": ErrorResponse}}


def build_app(gen: SpeculativeGenerator, settings: Settings, max_batch: int = 8, max_queue: int = 256,
              api_key: str | None = None, on_ready=None, compile: bool = False, compile_options: dict | None = None,
              warm_cache=None, make_compiled=None, records: Path | None = None) -> FastAPI:
    """The application serving ``gen``: its engine thread starts with the app (lifespan) and stops with it;
    ``on_ready()`` is called once it can answer. ``compile`` (with ``compile_options``, or ``warm_cache`` and
    ``make_compiled``): serve on graph rounds while compiled ones are made in another process (``EngineLoop``);
    ``records``: the folder of the configurations taken over (fsd_eagle.server.records)."""
    metrics = Metrics()
    engine = EngineLoop(gen, max_batch, max_queue, settings.context, metrics, compile, compile_options, warm_cache,
                        make_compiled, records)
    serving = Serving(gen, engine, settings)
    created = now()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        await asyncio.to_thread(engine.ready.wait)
        if on_ready is not None:
            on_ready()
        yield
        await asyncio.to_thread(engine.close)

    app = FastAPI(title="fsd-eagle", summary="OpenAI-compatible speculative decoding with per-request FSD",
                  lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError("a valid API key is needed: Authorization: Bearer <key>", status=401,
                           code="invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        if e.status >= 500:
            metrics.requests.labels(status="error").inc()
        elif e.status != 404:
            metrics.requests.labels(status=str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        metrics.requests.labels(status="400").inc()
        return JSONResponse(validation_error(e).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(str(e.detail), status=e.status_code).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def fault(_: Request, e: Exception) -> JSONResponse:
        metrics.requests.labels(status="error").inc()
        message = " ".join(f"{type(e).__name__}: {e}".split())[:500]
        return JSONResponse(APIError(message, status=500, type="server_error").body(), status_code=500)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)], responses=ERRORS)
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(serving, req, raw)

    @app.post("/v1/completions", dependencies=[Depends(authorize)], responses=ERRORS)
    async def completions(req: CompletionRequest, raw: Request):
        return await create_completion(serving, req, raw)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.model_name, created=created)])

    @app.get("/health")
    async def health() -> Response:
        ok = engine.ready.is_set() and engine.failed is None and engine.thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def validation_error(e: RequestValidationError) -> APIError:
    """The first schema error of a request as one line naming its field."""
    err = e.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _type_tag(p)]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        message = f"unknown field {param!r}"
    elif err.get("type") in ("json_invalid", "model_attributes_type"):
        message, param = "the request body must be a JSON object", None
    else:
        message = f"{param}: {err.get('msg', 'invalid')}" if param else str(err.get("msg", "invalid request"))
    return APIError(" ".join(message.split())[:500], param=param, code=err.get("type"))


def _type_tag(part) -> bool:
    """Whether a part of a pydantic error location names a member of a union type (``str``,
    ``list[int]``, ``function-after[...]``) rather than a field or index."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict", "none")
                                      or "[" in part or part.startswith("function-"))


def check_address(host: str, port: int) -> None:
    """InputError unless this process can listen on host:port (checked before the model loads)."""
    if not 0 <= port <= 65535:
        raise InputError(f"--port must be from 0 to 65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise InputError(f"--host {host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise InputError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def serve(gen: SpeculativeGenerator, settings: Settings, host: str = "127.0.0.1", port: int = 8000,
          max_batch: int = 8, max_queue: int = 256, api_key: str | None = None, drain_timeout: float = 30.0,
          quiet: bool = False, compile_options: dict | None = None) -> int:
    """Serve ``gen`` over HTTP until SIGTERM or Ctrl-C; returns 0 after a SIGTERM's drain. ``compile_options``
    (``SpeculativeGenerator.load``'s arguments that made ``gen``, and ``attention``): answer on graph rounds
    and move to compiled ones as a worker process loaded with them gets each configuration's kernels ready."""
    compile = compile_options is not None
    import uvicorn

    def ready() -> None:
        if not quiet:
            print(f"fsd-eagle: serving {settings.model_name} on http://{host}:{port} (OpenAI API under /v1; "
                  f"{max_batch} rows per rule form, context {settings.context} tokens"
                  f"{'; compiling rounds in the background' if compile else ''})", file=sys.stderr, flush=True)

    records = records_folder(compile_options, settings.context) if compile else None
    app = build_app(gen, settings, max_batch, max_queue, api_key, on_ready=ready, compile=compile,
                    compile_options=compile_options, records=records)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=max(1, round(drain_timeout)), lifespan="on")
    # uvicorn re-raises the signal that stopped it once it has drained: for SIGTERM that must not kill the
    # process (the drain succeeded: exit 0), so its handler outside uvicorn does nothing.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
