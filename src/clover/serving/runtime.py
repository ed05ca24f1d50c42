"""The server's model, scheduler and lifecycle, and the bridge from scheduler to handlers.

Lifecycle: loading (the socket is up, `/health` says 503) -> ready -> draining (SIGTERM: new
requests get 503 while running answers finish) -> stopped; a failed load ends the server.
The model loads in a background thread so the port answers at once.

The scheduler runs in its own thread and reports through each ticket's thread-safe queue.
Handlers are async, so they poll that queue without blocking the event loop: a blocking
`get` in a worker thread per request would tie up the small default thread pool with
waiting, and `asyncio.sleep` between non-blocking reads costs nothing measurable beside a
forward pass. Whatever way a handler stops early (client gone, timeout, error), its tickets
are cancelled, so their rows leave the batch before the next step.

The request timeout runs from the moment a ticket starts decoding (`Ticket.admitted`), not
from its arrival: on a busy machine a queued request waits its turn instead of timing out in
the queue (the queue itself is bounded by `--max-queue`). While nothing arrives for
`keepalive` seconds (a long prompt prefilling, a queue wait), `ticket_events` yields a
`{"type": "ping"}` so streams can send a keep-alive to clients with idle timeouts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from typing import Any

from clover.decoding.loop import generate
from clover.decoding.policies import make_policy
from clover.decoding.store import read_saved, save_learned
from clover.engine import LLM, GenerationSettings
from clover.errors import CloverError, ContextTooLong
from clover.serving.connections import ConnectionLimits
from clover.serving.constraints import Vocab
from clover.serving.errors import APIError, bad_request, unavailable
from clover.serving.grammars import Grammars
from clover.serving.metrics import Metrics
from clover.serving.options import ServeOptions
from clover.serving.protocol import Limits
from clover.serving.scheduler import Overloaded, Scheduler, ShuttingDown, Ticket
from clover.serving.tenants import KeyRing, RateLimiter

log = logging.getLogger("clover.serve")
POLL_S = 0.005  # how often a waiting handler looks at its ticket's queue
DISCONNECT_CHECK_S = 0.25


class Runtime:
    def __init__(self, options: ServeOptions, loader: Callable[[], LLM] | None = None) -> None:
        self.options = options
        self.loader = loader or (
            lambda: LLM(
                options.model,
                dtype=options.dtype,
                progress=False,
                adapter=options.adapter,
                compile=options.compile,
                device=options.device,
                drafter=options.drafter,
                wide=options.wide,
                store=list(options.store) or None,
            )
        )
        self.llm: LLM | None = None
        self.scheduler: Scheduler | None = None
        self.limits: Limits | None = None
        self.error: str | None = None
        self.draining = False
        self.metrics = Metrics()
        self.keys = KeyRing(
            options.api_key, options.keys_file, options.rate_limit_rpm, options.rate_limit_tpm
        )
        self.limiter = RateLimiter()
        self.grammars = Grammars()
        self.connections = ConnectionLimits(
            options.header_timeout, options.body_timeout, options.max_connections_per_client
        )
        self.on_failure: Callable[[], None] | None = None  # the server stops itself
        self.store_keeper: StoreKeeper | None = None
        self._token_text: dict[int, str] = {}
        self._vocab = None
        self._vocab_lock = threading.Lock()

    # --- lifecycle ---------------------------------------------------------------------------

    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="clover-load", daemon=True).start()

    def _load(self) -> None:
        try:
            llm = self.loader()
            o = self.options
            if getattr(llm, "compiled", False) and o.max_running > 1 and not o.deterministic:
                llm.warm_up(rows=2)  # the batched graphs too, before the server says ready
            # one token through the model: whatever its first pass builds (the CPU kernels
            # compile on first use, a minute on 2 cores) is built before /health says ready,
            # not inside the first request's timeout
            for _ in generate(
                llm.model, [llm.encode("Hello")], make_policy("ar"), max_new_tokens=1
            ):
                pass
            if (o.defaults.decoder or llm.model.config.default_decoder) == "self_spec":
                # the pass costs adaptive drafts follow (timed once per machine, seconds):
                # before /health says ready, not inside the first request
                llm.runtime.pass_costs()
                if llm.runtime.drafter is not None:
                    llm.runtime.pass_costs(drafter=True)
            llm.set_prefix_cache(o.prefix_cache_mb)  # after the warm-up: it keeps nothing
            if o.store_save is not None:  # after the warm-up: the store learns only answers
                keeper = StoreKeeper(llm, o.store_save, o.store_save_every)
                keeper.start()
                self.store_keeper = keeper
            scheduler = Scheduler(llm, o.max_running, o.max_queue, o.deterministic)
            self.limits = Limits(
                model_names=(o.served_model_name or llm.name,),
                context_length=llm.model.context_length,
                vocab_size=llm.tokenizer.vocab_size,
                defaults=llm.default_settings(o.defaults),
                capacity=o.max_running + o.max_queue,
            )
            scheduler.start()
            self.llm, self.scheduler = llm, scheduler  # ready from here on
        except Exception as e:  # noqa: BLE001 (any failure must stop the server cleanly)
            self.error = str(e) if isinstance(e, CloverError) else f"{type(e).__name__}: {e}"
            if self.on_failure is not None:
                self.on_failure()
            else:
                log.error("loading %s failed: %s", self.options.model, self.error)

    @property
    def state(self) -> str:
        if self.error is not None:
            return "error"
        if self.draining:
            return "draining"
        return "ready" if self.scheduler is not None else "loading"

    def require_ready(self) -> None:
        state = self.state
        if state == "loading":
            raise unavailable("the model is still loading", "model_loading", retry_after=5)
        if state == "draining":
            raise unavailable("the server is shutting down", "shutting_down")
        if state == "error":
            raise unavailable("the model failed to load", "model_load_failed")

    def drain(self, grace: float) -> None:
        """Refuse new requests; let running answers finish for up to `grace` seconds."""
        self.draining = True
        if self.scheduler is not None:
            self.scheduler.shutdown(grace)
        if self.store_keeper is not None:
            self.store_keeper.stop()  # after the last answers: they are in the file too

    # --- requests ----------------------------------------------------------------------------

    def submit(
        self,
        prompt: list[int],
        settings: GenerationSettings,
        n: int,
        marks: tuple = (),
        partition: Hashable = None,
    ) -> Ticket:
        try:
            return self.scheduler.submit(prompt, settings, n, marks, partition)
        except Overloaded as e:
            raise unavailable(str(e), "overloaded", retry_after=1) from None
        except ShuttingDown:
            raise unavailable("the server is shutting down", "shutting_down") from None
        except CloverError as e:
            raise bad_request(str(e), code="invalid_settings") from None

    @property
    def vocab(self) -> Vocab:
        """The vocabulary as text for constrained decoding, built on first use."""
        with self._vocab_lock:
            if self._vocab is None:
                self._vocab = Vocab.from_tokenizer(self.llm.tokenizer, self.llm.eos_token_ids)
            return self._vocab

    def token_text(self, token: int) -> str:
        """One token as text, for the commit animation (cached: the vocabulary is fixed)."""
        text = self._token_text.get(token)
        if text is None:
            text = self.llm.tokenizer.decode([token])
            self._token_text[token] = text
        return text


def engine_error(error: Exception) -> APIError:
    """A scheduler error event as the client should see it: the drain (503), a refused
    request (400: the decoder checks a request when it admits it; a prompt over the context
    is `context_length_exceeded`), or a failed step (500, with the details kept in the
    server's log)."""
    if isinstance(error, ShuttingDown):
        return unavailable("the server is shutting down", "shutting_down")
    if isinstance(error, ContextTooLong):
        return bad_request(str(error), "messages", "context_length_exceeded")
    if isinstance(error, CloverError):
        return bad_request(str(error), code="invalid_request")
    log.error("decoding failed: %s: %s", type(error).__name__, error)
    return APIError(500, "generation failed", kind="server_error", code="engine_error")


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


async def ticket_events(
    tickets: list[tuple[Ticket, int]],
    timeout: float | None,
    disconnected: Callable[[], Awaitable[bool]] | None = None,
    keepalive: float | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """Events of several tickets as they come; each ticket's choices are offset by its int.

    Ends after every choice is done. Raises APIError once a ticket has decoded for longer
    than `timeout` seconds (504) or on a scheduler error, and ClientGone when `disconnected`
    (checked every quarter second; the streaming path learns it by being cancelled instead)
    says so. Yields `{"type": "ping"}` after `keepalive` seconds without an event. However it
    ends early, the tickets are cancelled; callers close it with `contextlib.aclosing`.
    """
    pending = sum(t.n for t, _ in tickets)
    left = {id(t): t.n for t, _ in tickets}  # choices not done, per ticket
    now = time.monotonic()
    next_check = now + DISCONNECT_CHECK_S
    quiet_since = now
    try:
        while pending:
            got = False
            for ticket, offset in tickets:
                try:
                    event = ticket.events.get_nowait()
                except queue.Empty:
                    continue
                got = True
                if event["type"] == "error":
                    raise engine_error(event["error"])
                if event["type"] == "done":
                    pending -= 1
                    left[id(ticket)] -= 1
                yield {**event, "choice": event.get("choice", 0) + offset}
            now = time.monotonic()
            if got:
                quiet_since = now
                continue
            if timeout is not None and any(
                left[id(t)] and t.admitted is not None and now > t.admitted + timeout
                for t, _ in tickets
            ):
                raise APIError(504, "the request timed out", kind="timeout", code="timeout")
            if disconnected is not None and now > next_check:
                next_check = now + DISCONNECT_CHECK_S
                if await disconnected():
                    raise ClientGone
            if keepalive is not None and now - quiet_since > keepalive:
                quiet_since = now
                yield {"type": "ping"}
            await asyncio.sleep(POLL_S)
    finally:
        if pending:
            for ticket, _ in tickets:
                ticket.cancel()


class StoreKeeper:
    """`--store-save FILE`: the model's n-gram store keeps what answers taught it across
    restarts. At start the file's sequences (if it exists) are learned again; a thread writes
    the learned sequences back every `every` seconds while they changed (atomically,
    `decoding.store.save_learned`), and `stop` writes them a last time. A failed write is
    logged and retried at the next interval; the server goes on answering."""

    def __init__(self, llm: LLM, path: str, every: float) -> None:
        self.path, self.name, self.every = path, llm.name, every
        self.store = llm.runtime.ngram_store()  # made now: finished rows feed it from here on
        self.saved = 0  # learned sequences in the file
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if os.path.exists(self.path):
            self.store.relearn(read_saved(self.path, self.name))
        self.saved = len(self.store.learned)
        self._thread = threading.Thread(target=self._run, name="clover-store", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.save()

    def save(self) -> bool:
        """Write the file if the store learned something since the last write."""
        with self._lock:
            n = len(self.store.learned)
            if n == self.saved:
                return False
            try:
                save_learned(self.store, self.path, self.name)
            except OSError as e:
                log.warning(
                    "--store-save %s: could not write it (%s); retrying later", self.path, e
                )
                return False
            self.saved = n
            return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.save()
