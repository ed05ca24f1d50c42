"""The FastAPI application: routes, middleware and error handling.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`,
`GET /metrics`, `GET /version`, and the web page at `/` (static files, no build step).
Handlers stay thin: read the body (size-limited), validate it (`protocol`), render and
tokenize the prompt (with tools, `tools`), attach the answer's decoding rule if the request
has one (JSON output, a forced tool call, a thinking budget: `constraints`), submit to the
scheduler, and hand the tickets to `responses`.

Every error leaves as an OpenAI error object, including 404/405 from routing and unexpected
exceptions, whose details are logged on the server and never sent. The interactive API docs
are off: they would be one more unauthenticated surface and nothing here needs them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import StreamingResponse

from clover import __version__
from clover.engine import LLM
from clover.errors import CloverError
from clover.serving.constraints import JsonRule, TokenConstraint, answer_rule
from clover.serving.errors import APIError, bad_request, internal_error
from clover.serving.options import ServeOptions
from clover.serving.protocol import fit, parse_chat, parse_completion, parse_json
from clover.serving.reasoning import prompt_opens_reasoning
from clover.serving.responses import Call, complete, stream
from clover.serving.runtime import ClientGone, Runtime
from clover.serving.security import ApiKeyMiddleware, read_body
from clover.serving.tools import call_rule, render_inputs, template_knows_tools

log = logging.getLogger("clover.serve")
STATIC = Path(__file__).parent / "static"
# /metrics labels requests by these routes; anything else counts as "other"
ROUTES = frozenset(
    "/ /health /metrics /version /v1/models /v1/chat/completions /v1/completions".split()
)


def create_app(options: ServeOptions, loader: Callable[[], LLM] | None = None) -> FastAPI:
    """The app; the model starts loading (in a thread) when the server starts the app."""
    runtime = Runtime(options, loader)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        runtime.start_loading()
        yield
        if not runtime.draining:  # stopped without a signal (tests, embedding)
            await asyncio.to_thread(runtime.drain, options.shutdown_grace)

    app = FastAPI(
        title="Clover", version=__version__, lifespan=lifespan,
        docs_url=None, redoc_url=None, openapi_url=None,
    )  # fmt: skip
    app.state.runtime = runtime
    started = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, e: HTTPException) -> JSONResponse:
        messages = {404: "no such route", 405: "method not allowed on this route"}
        message = messages.get(e.status_code, "request refused")
        return APIError(e.status_code, message, code=str(e.status_code)).response()

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error while serving a request")
        return internal_error().response()

    @app.get("/health")
    async def health() -> JSONResponse:
        state = runtime.state
        return JSONResponse({"status": state}, status_code=200 if state == "ready" else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__, "state": runtime.state}

    @app.get("/v1/models")
    async def models() -> dict:
        runtime.require_ready()
        limits = runtime.limits
        data = [
            {"id": name, "object": "model", "created": started, "owned_by": "clover",
             "max_model_len": limits.context_length}
            for name in limits.model_names
        ]  # fmt: skip
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = runtime.metrics.render(runtime.scheduler, runtime.scheduler is not None)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        runtime.require_ready()
        raw = await read_body(request, options.max_body_bytes)
        req = parse_chat(parse_json(raw), runtime.limits)
        llm = runtime.llm

        def render() -> tuple[str, list[int], tuple[int, ...]]:
            knows = template_knows_tools(llm.tokenizer)
            messages, extra = render_inputs(req.messages, req.tools, knows)
            kwargs = {**req.template_kwargs, **extra}
            try:
                text = llm.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, **kwargs
                )
            except CloverError as e:
                raise bad_request(str(e), "messages") from None
            ids = llm.tokenizer.encode(text)
            return text, ids, llm.chat_marks(messages, ids, **kwargs)

        # long prompts must not stall the loop
        text, ids, marks = await run_in_threadpool(render)
        settings = fit(req, len(ids), runtime.limits)
        opens = prompt_opens_reasoning(text)
        then = JsonRule(req.json_grammar) if req.json_grammar is not None else None
        if req.tool_choice not in ("auto", "none"):  # required, or a named function
            then = call_rule(req.tools, None if req.tool_choice == "required" else req.tool_choice)
        rule = answer_rule(then, req.thinking_budget, opens)
        if rule is not None:
            vocab = await run_in_threadpool(lambda: runtime.vocab)  # decoded once, on first use
            settings = replace(settings, constraint=lambda: TokenConstraint(rule, vocab))
        ticket = runtime.submit(ids, settings, req.n, marks)
        call = Call(
            runtime, True, f"chatcmpl-{uuid.uuid4().hex}", req.model, req,
            llm.default_settings(settings), [(ticket, 0)], len(ids), reasoning_start=opens,
            tool_names=req.tool_names if req.tools else None,
        )  # fmt: skip
        return await _respond(call, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        runtime.require_ready()
        raw = await read_body(request, options.max_body_bytes)
        req = parse_completion(parse_json(raw), runtime.limits)
        llm = runtime.llm
        prompts = await run_in_threadpool(
            lambda: [llm.encode(p) if isinstance(p, str) else p for p in req.prompts]
        )
        fitted = [fit(req, len(ids), runtime.limits) for ids in prompts]
        tickets = []
        try:
            for k, (ids, settings) in enumerate(zip(prompts, fitted)):
                tickets.append((runtime.submit(ids, settings, req.n), k * req.n))
        except APIError:
            for t, _ in tickets:
                t.cancel()
            raise
        echo = []
        if req.echo:
            texts = [p if isinstance(p, str) else llm.tokenizer.decode(p) for p in req.prompts]
            echo = [t for t in texts for _ in range(req.n)]
        call = Call(
            runtime, False, f"cmpl-{uuid.uuid4().hex}", req.model, req,
            llm.default_settings(fitted[0]), tickets, sum(len(p) for p in prompts), echo=echo,
        )  # fmt: skip
        return await _respond(call, request)

    @app.get("/")
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    if options.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=options.api_key)
    app.add_middleware(CountRequests, runtime=runtime)
    return app


class TicketStream(StreamingResponse):
    """An SSE response that cancels its tickets however it ends, even before it started."""

    def __init__(self, call: Call) -> None:
        super().__init__(
            stream(call),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.call = call

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for ticket, _ in self.call.tickets:
                ticket.cancel()  # a no-op for tickets already finished


async def _respond(call: Call, request: Request) -> Response:
    if call.request.stream:
        return TicketStream(call)
    try:
        return JSONResponse(await complete(call, request.is_disconnected))
    except ClientGone:
        return Response(status_code=499)  # nobody is listening any more
    finally:
        for ticket, _ in call.tickets:
            ticket.cancel()


class CountRequests:
    """Raw ASGI middleware: counts responses by route and status for /metrics."""

    def __init__(self, app: Callable, runtime: Runtime) -> None:
        self.app, self.runtime = app, runtime

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.runtime.metrics.request(route, message["status"])
            await send(message)

        await self.app(scope, receive, counted)
