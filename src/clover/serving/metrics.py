"""`GET /metrics` in the Prometheus text format, written by hand.

The exposition format is a few lines of text, so a client library would add a dependency
for nothing. Counters and histograms are updated from the event loop (one thread) and read
there too, but a lock keeps them consistent if a handler ever runs elsewhere. Gauges and the
scheduler's own counters (forward passes, queue depth, running rows, the prefix cache's
size, hits and evictions) are read at scrape time from the scheduler, which is their single
source of truth.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Iterable

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
PREFIX_CACHE_METRICS = (  # keys of `PrefixCache.report()`; all 0 when the cache is off
    ("bytes", "gauge", "Bytes the prefix cache holds (K/V blocks and snapshots)."),
    ("capacity_bytes", "gauge", "The prefix cache's memory bound (--prefix-cache-mb)."),
    ("blocks", "gauge", "Blocks of committed tokens in the prefix cache."),
    ("snapshots", "gauge", "Recurrent-state / tail snapshots in the prefix cache."),
    ("hit_rate", "gauge", "Prompt tokens served from the prefix cache / prompt tokens."),
    ("lookups", "counter", "Prompts looked up in the prefix cache."),
    ("hits", "counter", "Lookups that reused at least one token."),
    ("prompt_tokens", "counter", "Prompt tokens looked up."),
    ("cached_tokens", "counter", "Prompt tokens served from the prefix cache."),
    ("evictions", "counter", "Blocks and snapshots evicted to stay within the bound."),
)
TPF_BUCKETS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out += [f"{name}_sum {self.total:.6f}", f"{name}_count {running}"]
        return out


class Metrics:
    """What the server counts itself: requests by route and status, tokens, latencies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.nfe = 0
        self.latency = Histogram(LATENCY_BUCKETS)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.tpf = Histogram(TPF_BUCKETS)
        # self_spec: draft tokens by source (lookup, drafter, store, mask): drafted, kept
        self.drafts: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0])

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def finished(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        nfe: int,
        seconds: float,
        drafts: Iterable[dict[str, list[int]]] = (),
    ) -> None:
        """One request's answers done; `drafts`: each answer's source -> [drafted, kept]."""
        with self._lock:
            for answer in drafts:
                for source, (drafted, kept) in answer.items():
                    self.drafts[source][0] += drafted
                    self.drafts[source][1] += kept
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.nfe += nfe
            self.latency.observe(seconds)
            if nfe:
                self.tpf.observe(completion_tokens / nfe)

    def render(self, scheduler: object | None, loaded: bool) -> str:
        """The whole exposition; `scheduler` is None while the model loads."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples])

        with self._lock:
            metric(
                "clover_requests_total",
                "counter",
                "HTTP requests by route and status code.",
                [
                    f'clover_requests_total{{route="{r}",code="{c}"}} {n}'
                    for (r, c), n in sorted(self.requests.items())
                ],
            )
            for name, value, help_ in (
                ("clover_prompt_tokens_total", self.prompt_tokens, "Prompt tokens processed."),
                ("clover_generation_tokens_total", self.completion_tokens, "Tokens generated."),
                ("clover_nfe_total", self.nfe, "Forward passes summed over finished answers."),
            ):
                metric(name, "counter", help_, [f"{name} {value}"])
            for name, hist, help_ in (
                ("clover_request_latency_seconds", self.latency, "End-to-end answer latency."),
                ("clover_time_to_first_token_seconds", self.ttft, "Time to the first text."),
                ("clover_tokens_per_forward", self.tpf, "Tokens per forward pass per answer."),
            ):
                metric(name, "histogram", help_, hist.lines(name))
            metric(
                "clover_draft_tokens_total",
                "counter",
                "self_spec draft tokens by source: drafted, and kept by the verify passes.",
                [
                    f'clover_draft_tokens_total{{source="{s}",outcome="{o}"}} {n}'
                    for s, counts in sorted(self.drafts.items())
                    for o, n in zip(("drafted", "kept"), counts)
                ],
            )
        stats = getattr(scheduler, "stats", None)
        gauges = [
            ("clover_model_loaded", int(loaded), "1 once the model is loaded."),
            ("clover_queue_depth", getattr(scheduler, "queue_depth", 0), "Requests waiting."),
            ("clover_running_sequences", getattr(scheduler, "running_rows", 0), "Rows decoding."),
        ]
        for name, value, help_ in gauges:
            metric(name, "gauge", help_, [f"{name} {value}"])
        for field, help_ in (
            ("forward_passes", "Batched forward passes of the scheduler."),
            ("steps", "Scheduler steps."),
            ("cancelled", "Sequences cancelled (client gone or timed out)."),
            ("rejected", "Requests refused because the queue was full."),
        ):
            name = f"clover_scheduler_{field}_total"
            metric(name, "counter", help_, [f"{name} {getattr(stats, field, 0)}"])
        prefix = getattr(getattr(scheduler, "batch", None), "prefix", None)
        report = prefix.report() if prefix is not None else {}
        for key, kind, help_ in PREFIX_CACHE_METRICS:
            name = f"clover_prefix_cache_{key}" + ("_total" if kind == "counter" else "")
            metric(name, kind, help_, [f"{name} {report.get(key, 0)}"])
        return "\n".join(lines) + "\n"
