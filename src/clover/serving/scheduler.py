"""One scheduler thread shares the model among requests: continuous batching of decoding rows.

Requests wait in a bounded queue; the scheduler admits them while fewer than `max_running`
rows run, and every step is one forward over all running rows (different lengths, different
block positions, different decoders). Rows join and leave between steps (`BatchDecoder`).
Each request gets a thread-safe queue of events:

  {"type": "delta", "choice": i, "text": str, "tokens": [...], "commits": [(index, token,
   step)], ...}   text that just became final (never changes later), with the commits behind it
  {"type": "done", "choice": i, "completion": Completion}
  {"type": "error", "error": Exception}   `ShuttingDown`, a `CloverError` the request caused,
   or what failed a step (`runtime.engine_error` says which answer each gets)

A cancelled request (client gone) leaves the batch before the next step. Shutdown stops
admitting, lets running rows finish (or cancels them after a grace period, telling their
clients) and exits. The batch uses the model's prefix cache across requests
(`LLM.prefix_cache`): a request reuses the longest prefix that earlier or running requests
of its partition (its tenant and cache salt) committed.

`deterministic`: one row decodes at a time (a request's choices one after another), so an
answer never depends on what else runs. Batched int4/bf16 kernels round by batch shape, so in
the default mode a greedy answer can change when another request joins its batch; this mode
trades throughput for answers that equal `clover generate`'s at batch 1.

A ticket's `admitted` time is when its first row started decoding: the request timeout counts
from there, so time spent waiting in the (bounded) queue does not count against it.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from clover.decoding.loop import BatchDecoder
from clover.engine import LLM, GenerationSettings, Request
from clover.errors import CloverError


class Overloaded(CloverError):
    """The queue is full: the caller should answer 503 with Retry-After."""


class ShuttingDown(CloverError):
    """The server is draining: no new requests."""


@dataclass(eq=False)  # identity: tickets go into sets and dict keys
class Ticket:
    id: int
    prompt: list[int]
    request: Request
    n: int
    marks: tuple[int, ...] = ()  # prefix-cache snapshot positions (`LLM.chat_marks`)
    partition: object = None  # the prefix-cache partition (tenant, cache salt)
    events: queue.Queue = field(default_factory=queue.Queue)
    created: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    rows: dict = field(default_factory=dict)  # row index -> (choice, TextStream, row)
    admitted: float | None = None  # monotonic time its first row started decoding
    started_choices: int = 0  # choices added to the batch so far

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Stats:
    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    forward_passes: int = 0
    steps: int = 0


class Scheduler:
    def __init__(
        self, llm: LLM, max_running: int = 8, max_queue: int = 64, deterministic: bool = False
    ) -> None:
        if max_running < 1 or max_queue < 0:
            raise CloverError("max_running must be >= 1 and max_queue >= 0")
        self.llm = llm
        self.max_running, self.max_queue = max_running, max_queue
        self.deterministic = deterministic
        self.batch = BatchDecoder(llm.runtime)
        self.waiting: deque[Ticket] = deque()
        self.running: dict[int, Ticket] = {}  # row index -> ticket
        self.stats = Stats()
        self._ids = itertools.count()
        self._rows = itertools.count()
        self._lock = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="clover-scheduler", daemon=True)

    # --- called from request handlers ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(
        self,
        prompt: list[int],
        settings: GenerationSettings,
        n: int = 1,
        marks: tuple = (),
        partition: Hashable = None,
    ) -> Ticket:
        request = Request.of(self.llm, settings)  # checked now, not when it is admitted
        with self._lock:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            free = max(0, self.max_running - self.running_rows)
            if len(self.waiting) >= self.max_queue + free:
                self.stats.rejected += 1
                raise Overloaded(
                    f"server busy: {self.running_rows} running, {len(self.waiting)} queued"
                )
            ticket = Ticket(next(self._ids), prompt, request, n, tuple(marks), partition)
            self.waiting.append(ticket)
            self.stats.requests += 1
            self._lock.notify()
        return ticket

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running_rows(self) -> int:
        return self.batch.rows

    def shutdown(self, grace: float = 30.0) -> None:
        """Stop admitting; wait up to `grace` s for running rows; then cancel what is left."""
        with self._lock:
            self._stopping = True
            for t in self.waiting:
                t.events.put({"type": "error", "error": ShuttingDown()})
            self.waiting.clear()
            self._lock.notify()
        deadline = time.monotonic() + grace
        while self.running_rows and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            for t in set(self.running.values()):
                t.cancel()  # the loop drops their rows before its next step
                t.events.put({"type": "error", "error": ShuttingDown()})
            self._lock.notify()
        self._thread.join(timeout=5)

    # --- the scheduler thread -----------------------------------------------------------------

    def _admit(self) -> None:
        """Start waiting requests while there is room. Prompts joining a running batch
        share one prefill pass (`BatchDecoder.joining`); if that pass fails, the requests that
        joined with it fail and the running ones go on."""
        joined: list[Ticket] = []
        try:
            with self.batch.joining():
                self._admit_some(joined)
        except Exception as e:  # noqa: BLE001 (as in _start: fail these requests only)
            for t in joined:
                self._fail(t, e)

    def _admit_some(self, joined: list[Ticket]) -> None:
        while self.waiting:
            t = self.waiting[0]
            if t.cancelled:
                self.waiting.popleft()
                continue
            active = self.batch.rows
            if self.deterministic:
                if active:
                    return
                rows = 1
            else:
                rows = t.n - t.started_choices
                # a request with n > max_running still runs, alone, rather than waiting forever
                if active and active + rows > self.max_running:
                    return
            started = self._start(t, rows)
            if started and t not in joined:
                joined.append(t)
            if started and t.started_choices < t.n:
                continue  # deterministic: the ticket's next choice waits for this one
            self.waiting.popleft()

    def _start(self, t: Ticket, rows: int) -> bool:
        """Add `rows` more of the ticket's choices to the batch; False if it failed (the
        ticket then got an error event and holds no rows)."""
        request = t.request
        try:
            for choice in range(t.started_choices, t.started_choices + rows):
                text = request.text()
                row = self.batch.add(
                    t.prompt,
                    request.policy,
                    max_new_tokens=request.settings.max_tokens,
                    sampling=request.sampling,
                    eos_token_ids=request.eos_token_ids,
                    stop=lambda _i, final, text=text: text.on_final(final),
                    index=next(self._rows),
                    seed_index=choice,
                    constraint=request.constraint(),
                    marks=t.marks,
                    partition=t.partition,
                )
                row.t_start = time.monotonic()
                t.rows[row.index] = (choice, text, row)
                self.running[row.index] = t
            if t.admitted is None:
                t.admitted = time.monotonic()
                self.stats.prompt_tokens += len(t.prompt)
            t.started_choices += rows
            return True
        except Exception as e:  # noqa: BLE001 (joining prefills and reads the prefix cache:
            # a failure there must fail this request, not the scheduler thread)
            self._fail(t, e)
            return False

    def _fail(self, t: Ticket, e: Exception) -> None:
        """Drop a ticket's rows and send it the error."""
        for index in list(t.rows):
            self.batch.cancel(index)
            self.running.pop(index, None)
        t.cancelled = True
        t.events.put({"type": "error", "error": e})

    def _run(self) -> None:
        while True:
            with self._lock:
                for index, t in list(self.running.items()):
                    if t.cancelled and self.batch.cancel(index):
                        self.running.pop(index)
                        self.stats.cancelled += 1
                self._admit()
                if not self.batch.active:
                    if self._stopping:
                        return
                    self._lock.wait(timeout=0.5)
                    continue
            try:
                event = self.batch.step()
            except Exception as e:  # noqa: BLE001 (a failed step must not kill the server)
                self._fail_all(e)
                continue
            self.stats.steps += 1
            self.stats.forward_passes += 1 if event.forward_rows else 0
            self._dispatch(event)

    def _dispatch(self, event: object) -> None:
        commits: dict[int, list] = {}
        for c in event.commits:
            commits.setdefault(c.row, []).append((c.index, c.token, c.step))
        for index in set(commits) | set(event.final) | set(event.finished):
            t = self.running.get(index)
            if t is None:
                continue
            choice, text, row = t.rows[index]
            if index in event.finished:
                text.finish(cut=event.finished[index] == "length")
            delta = text.take()
            if delta or index in commits:
                t.events.put(
                    {
                        "type": "delta",
                        "choice": choice,
                        "text": delta,
                        "tokens": event.final.get(index, []),
                        "commits": commits.get(index, []),
                        "step": row.steps,
                    }
                )
            if index in event.finished:
                r = row.result
                seconds = time.monotonic() - row.t_start
                completion = t.request.completion(r, text, len(t.prompt), seconds)
                self.stats.output_tokens += len(r.tokens)
                self.stats.finished += 1
                self.running.pop(index, None)
                t.events.put({"type": "done", "choice": choice, "completion": completion})

    def _fail_all(self, e: Exception) -> None:
        with self._lock:
            for index, t in list(self.running.items()):
                self.batch.cancel(index)
                t.events.put({"type": "error", "error": e})
            self.running.clear()
