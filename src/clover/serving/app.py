"""The FastAPI application: routes, middleware and error handling.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/messages` (Anthropic),
`POST /v1/responses` (OpenAI Responses), Ollama's `POST /api/chat`, `POST /api/generate`,
`GET /api/tags`, `GET /api/ps`, `POST /api/show`, `GET /api/version` (`ollama`),
`GET /v1/models`, `GET /health`, `GET /metrics`, `GET /version`, and the web page at `/`
(static files, no build step). Handlers stay thin:
read the body (JSON only, size-limited), validate it (`protocol`; the Anthropic and Responses
bodies are first translated into a chat request by `anthropic` / `openai_responses` /
`ollama`), render
and tokenize the prompt (`prompt`), attach the answer's decoding rule if the request has one
(JSON output, a forced tool call, a thinking budget: `constraints`), submit to the scheduler,
and hand the tickets to `responses`, whose pieces each API formats its own way. All three
chat-like APIs share `start_chat`: one generation path.

Every error leaves in the shape of the API the request spoke (`errors.api_for_path`),
including 404/405 from routing and unexpected exceptions, whose details are logged on the
server and never sent (`CatchAll`, which also keeps the connection alive). The interactive
API docs and the OpenAPI route are off: one more unauthenticated surface, and nothing here
needs them. `app.openapi()` still describes every route's request body (`schemas`), which
the fuzz test drives.

Middleware, outermost first: request counting, CORS (only with `--cors-origins`), the
Host/Origin guard, the API key (which finds the request's tenant), then `CatchAll`.

Per request, before it is queued: the tenant's request budget (`tenants.RateLimiter`), its
schemas compiled in a worker thread (`grammars`), a 400 if the shortest answer they allow
cannot fit in max_tokens, then the prompt's tokens against the tenant's token budget. The
scheduler gets the prefix-cache partition (tenant, cache_salt): reuse, and `cached_tokens`,
never cross it.
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
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from clover.engine import LLM
from clover.serving import anthropic, ollama, openai_responses, schemas
from clover.serving.constraints import JsonRule, TextRule, TokenConstraint, answer_rule
from clover.serving.errors import APIError, api_for_path, bad_request, internal_error, send_error
from clover.serving.options import ServeOptions
from clover.serving.prompt import render_chat
from clover.serving.protocol import ChatRequest, fit, parse_chat, parse_completion, parse_json
from clover.serving.reasoning import prompt_opens_reasoning
from clover.serving.responses import Call, complete, stream
from clover.serving.runtime import ClientGone, Runtime
from clover.serving.security import TENANT, ApiKeyMiddleware, HostGuard, read_body
from clover.serving.tenants import Tenant
from clover.serving.tools import call_rule, call_schema
from clover.version import __version__

log = logging.getLogger("clover.serve")
STATIC = Path(__file__).parent / "static"
# /metrics labels requests by these routes; anything else counts as "other"
ROUTES = frozenset(
    "/ /health /metrics /version /v1/models /v1/chat/completions /v1/completions "
    "/v1/messages /v1/responses /api/chat /api/generate /api/tags /api/ps /api/show "
    "/api/version".split()
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
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response(api_for_path(request.url.path))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path[:100]}"
        messages = {404: f"no such route: {where}", 405: f"method not allowed: {where}"}
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = messages.get(e.status_code, "request refused")
        error = APIError(e.status_code, message, code=codes.get(e.status_code, "refused"))
        return error.response(api_for_path(request.url.path))

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
        text = runtime.metrics.render(
            runtime.scheduler, runtime.scheduler is not None,
            tenants=[t.name for t in runtime.keys.tenants()],
            limited=runtime.limiter.refused, connections=runtime.connections,
        )  # fmt: skip
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def answer_rule_of(
        req: ChatRequest, opens: bool, max_tokens: int, tenant: Tenant
    ) -> TextRule | None:
        """The decoding rule of a chat answer (JSON output, a forced tool call, a thinking
        budget), its schemas compiled in the grammars' thread; a 400 naming max_tokens if
        the shortest answer it allows could never fit in them."""
        pairs = list(req.schemas.items())
        forced = req.tool_choice not in ("auto", "none")  # required, or a named function
        if forced:
            name = None if req.tool_choice == "required" else req.tool_choice
            where = req.tool_schemas[name] if name is not None else req.names.tool_choice
            pairs.append((where, call_schema(req.tools, name)))
        grammars = await runtime.grammars.compile_async(pairs, tenant.name)
        then = None
        if req.answer_schema is not None:
            then = JsonRule(grammars[list(req.schemas).index(req.answer_schema)])
        if forced:
            then = call_rule(grammars[-1])
        rule = answer_rule(then, req.thinking_budget, opens)
        if rule is None:
            return None
        need = rule.need()
        longest = (await run_in_threadpool(lambda: runtime.vocab)).longest  # built once
        if need > max_tokens * longest:  # even the longest tokens could not hold it
            param = req.names.max_tokens
            raise bad_request(
                f"the shortest answer the request's schema allows is {need} characters; "
                f"{param} ({max_tokens}) tokens of at most {longest} characters each cannot "
                f"hold it: raise {param} or lower the schema's minLength / minItems",
                param,
                "schema_exceeds_max_tokens",
            )
        return rule

    async def start_chat(req: ChatRequest, arrived: float, prefix: str, request: Request) -> Call:
        """Render, fit, constrain and submit a chat request: the one path behind
        chat/completions, Anthropic messages and Responses."""
        llm = runtime.llm
        tenant = tenant_of(request)
        # long prompts must not stall the event loop
        text, ids, snapshots = await run_in_threadpool(render_chat, llm, req)
        settings = fit(req, len(ids), runtime.limits)
        opens = prompt_opens_reasoning(text)
        rule = await answer_rule_of(req, opens, settings.max_tokens, tenant)
        if rule is not None:
            vocab = await run_in_threadpool(lambda: runtime.vocab)  # decoded once, on first use
            settings = replace(settings, constraint=lambda: TokenConstraint(rule, vocab))
        runtime.limiter.charge_prompt(tenant, len(ids), req.names.messages)
        partition = (tenant.name, req.cache_salt)
        ticket = runtime.submit(ids, settings, req.n, snapshots, partition)
        return Call(
            runtime, True, f"{prefix}{uuid.uuid4().hex}", req.model, req,
            llm.default_settings(settings), [(ticket, 0)], len(ids), reasoning_start=opens,
            tool_names=req.tool_names if req.tools else None, started=arrived, tenant=tenant,
        )  # fmt: skip

    def tenant_of(request: Request) -> Tenant:
        return request.scope.get(TENANT, runtime.keys.default)

    async def json_body(request: Request) -> dict:
        runtime.require_ready()
        runtime.limiter.admit(tenant_of(request))
        body = await read_body(request, options.max_body_bytes, options.body_timeout)
        return parse_json(body)

    @app.post("/v1/chat/completions", openapi_extra=schemas.body(schemas.CHAT))
    async def chat(request: Request) -> Response:
        arrived = time.monotonic()
        req = parse_chat(await json_body(request), runtime.limits)
        call = await start_chat(req, arrived, "chatcmpl-", request)
        return await respond(call, request, stream, None)

    @app.post("/v1/messages", openapi_extra=schemas.body(schemas.MESSAGES))
    async def messages(request: Request) -> Response:
        arrived = time.monotonic()
        body = anthropic.to_chat_body(await json_body(request))
        req = parse_chat(body, runtime.limits, anthropic.NAMES)
        call = await start_chat(req, arrived, "msg_", request)
        return await respond(call, request, anthropic.stream, anthropic.message)

    @app.post("/v1/responses", openapi_extra=schemas.body(schemas.RESPONSES))
    async def responses(request: Request) -> Response:
        arrived = time.monotonic()
        body = await json_body(request)
        chat_body = openai_responses.to_chat_body(body)
        req = parse_chat(chat_body, runtime.limits, openai_responses.NAMES)
        call = await start_chat(req, arrived, "resp_", request)
        call.api = openai_responses.echo_fields(body)  # what the response object repeats
        return await respond(call, request, openai_responses.stream, openai_responses.response)

    @app.post("/v1/completions", openapi_extra=schemas.body(schemas.COMPLETIONS))
    async def completions(request: Request) -> Response:
        arrived = time.monotonic()
        req = parse_completion(await json_body(request), runtime.limits)
        llm = runtime.llm
        tenant = tenant_of(request)
        prompts = await run_in_threadpool(
            lambda: [llm.encode(p) if isinstance(p, str) else p for p in req.prompts]
        )
        fitted = [fit(req, len(ids), runtime.limits) for ids in prompts]
        runtime.limiter.charge_prompt(tenant, sum(len(p) for p in prompts), "prompt")
        partition = (tenant.name, req.cache_salt)
        tickets = []
        try:
            for k, (ids, settings) in enumerate(zip(prompts, fitted)):
                tickets.append((runtime.submit(ids, settings, req.n, (), partition), k * req.n))
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
            started=arrived, tenant=tenant,
        )  # fmt: skip
        return await respond(call, request, stream, None)

    async def ollama_answer(request: Request, generate: bool) -> Response:
        arrived = time.monotonic()
        body = await json_body(request)
        if ollama.is_load(body, generate):  # a client warming the model up: it is loaded
            return JSONResponse(ollama.loaded(runtime.limits.model_names[0], generate))
        chat_body = ollama.to_chat_body(body, runtime.limits, generate)
        req = parse_chat(chat_body, runtime.limits, ollama.NAMES)
        call = await start_chat(req, arrived, "ollama-", request)
        shape = ollama.generated if generate else ollama.message
        return await respond(call, request, ollama.streamer(generate), shape, ollama.MEDIA)

    @app.post("/api/chat", openapi_extra=schemas.body(schemas.OLLAMA_CHAT))
    async def ollama_chat(request: Request) -> Response:
        return await ollama_answer(request, generate=False)

    @app.post("/api/generate", openapi_extra=schemas.body(schemas.OLLAMA_GENERATE))
    async def ollama_generate(request: Request) -> Response:
        return await ollama_answer(request, generate=True)

    @app.get("/api/tags")
    async def ollama_tags() -> dict:
        runtime.require_ready()
        name = runtime.limits.model_names[0]
        return {"models": [ollama.model_entry(runtime.llm, name)]}

    @app.get("/api/ps")
    async def ollama_ps() -> dict:
        runtime.require_ready()
        entry = ollama.model_entry(runtime.llm, runtime.limits.model_names[0])
        return {"models": [{**entry, "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0}]}

    @app.post("/api/show")
    async def ollama_show(request: Request) -> dict:
        body = await json_body(request)
        name = body.get("model") or body.get("name")
        if name not in runtime.limits.model_names:
            served = ", ".join(runtime.limits.model_names)
            raise APIError(404, f"model {str(name)[:80]!r} not found; this server has {served}",
                           param="model", code="model_not_found")  # fmt: skip
        return ollama.show(runtime.llm, name)

    @app.get("/api/version")
    async def ollama_version() -> dict:
        return {"version": __version__}

    @app.api_route("/api/{name:path}", methods=["GET", "POST", "DELETE", "HEAD", "PUT"],
                   include_in_schema=False)  # fmt: skip
    async def ollama_other(name: str) -> Response:
        if name.split("/")[0] in ollama.MANAGEMENT:
            raise ollama.unsupported(name.split("/")[0])
        raise APIError(404, f"no such route: /api/{name[:80]}", code="not_found")

    @app.get("/")
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_middleware(CatchAll)
    if runtime.keys.enabled:
        app.add_middleware(ApiKeyMiddleware, keys=runtime.keys)
    app.add_middleware(
        HostGuard, bound=options.host, allowed_hosts=options.allowed_hosts,
        cors=options.cors_origins,
    )  # fmt: skip
    if options.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(options.cors_origins),
            allow_methods=["GET", "POST"], allow_headers=["*"], max_age=600,
        )  # fmt: skip
    app.add_middleware(CountRequests, runtime=runtime)
    return app


class TicketStream(StreamingResponse):
    """A streamed answer (SSE, or Ollama's NDJSON) that cancels its tickets however it ends,
    even before it started."""

    def __init__(
        self, call: Call, body: AsyncIterator[str], media_type: str = "text/event-stream"
    ) -> None:
        super().__init__(
            body,
            media_type=media_type,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.call = call

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for ticket, _ in self.call.tickets:
                ticket.cancel()  # a no-op for tickets already finished


async def respond(
    call: Call,
    request: Request,
    streamer: Callable[[Call], AsyncIterator[str]],
    shape: Callable[[Call, dict], dict] | None,
    media_type: str = "text/event-stream",
) -> Response:
    """The answer as a stream (`streamer`: SSE, or `media_type`'s) or one JSON body: the
    chat/completions body, reshaped for its API by `shape`."""
    if call.request.stream:
        return TicketStream(call, streamer(call), media_type)
    try:
        body = await complete(call, request.is_disconnected)
        return JSONResponse(shape(call, body) if shape is not None else body)
    except ClientGone:
        return Response(status_code=499)  # nobody is listening any more
    finally:
        for ticket, _ in call.tickets:
            ticket.cancel()


class CatchAll:
    """Raw ASGI: an unexpected exception becomes a logged 500 in the route's API shape.

    Starlette's own last-resort handler re-raises after answering, and uvicorn then closes
    the connection; here the exception ends at the answer, so a keep-alive client keeps its
    connection. If the response had already started, nothing more can be sent: logged only.
    A client that went away is no error: one info line, no traceback.
    """

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except ClientDisconnect:
            client = (scope.get("client") or ("?",))[0]
            log.info("%s went away during %s", client, scope["path"][:100])
        except Exception:  # noqa: BLE001 (the last line of defence: log, answer 500)
            log.exception("unexpected error while serving %s", scope["path"][:100])
            if not started:
                await send_error(send, internal_error(), scope["path"])


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
                tenant = scope.get(TENANT)  # set once the key was checked
                name = tenant.name if tenant is not None else None
                if name is None and not self.runtime.keys.enabled and route.startswith("/v1/"):
                    name = self.runtime.keys.default.name
                self.runtime.metrics.request(route, message["status"], name)
            await send(message)

        await self.app(scope, receive, counted)
