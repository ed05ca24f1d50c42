"""`GET /metrics` in the Prometheus text format, written by hand.

The exposition format is a few lines of text, so a client library would add a dependency
for nothing. Counters and histograms are updated from the event loop (one thread) and read
there too, but a lock keeps them consistent if a handler ever runs elsewhere. Gauges and the
scheduler's own counters (forward passes, queue depth, running rows, the prefix cache's
size, hits and evictions) are read at scrape time from the scheduler, which is their single
source of truth.

By tenant (`tenants.py`): requests by status, prompt / generated / cached tokens, and refusals
by the rate limits. Every tenant that holds a key is listed from the start (zeros until it
calls); the names come from the operator's keys file, never from a request. Beside them, the
socket guard's counts: connections closed for being slow and refused past the per-client cap.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable

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
        self.tenant_requests: defaultdict[tuple[str, int], int] = defaultdict(int)
        # tenant -> [prompt, completion, cached] tokens
        self.tenant_tokens: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0, 0])

    def request(self, route: str, status: int, tenant: str | None = None) -> None:
        with self._lock:
            self.requests[(route, status)] += 1
            if tenant is not None:
                self.tenant_requests[(tenant, status)] += 1

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
        tenant: str | None = None,
        cached_tokens: int = 0,
    ) -> None:
        """One request's answers done; `drafts`: each answer's source -> [drafted, kept]."""
        with self._lock:
            if tenant is not None:
                counts = self.tenant_tokens[tenant]
                counts[0] += prompt_tokens
                counts[1] += completion_tokens
                counts[2] += cached_tokens
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

    def render(
        self,
        scheduler: object | None,
        loaded: bool,
        tenants: Iterable[str] = (),
        limited: dict[tuple[str, str], int] | None = None,
        connections: object | None = None,
    ) -> str:
        """The whole exposition; `scheduler` is None while the model loads. `tenants`: the
        names to list even before they call; `limited`: the rate limiter's refusals by
        (tenant, "requests" | "tokens"); `connections`: the socket guard's counts."""
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
            self._render_tenants(metric, tenants, limited or {})
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
        for name, field_name, help_ in (
            ("clover_connections_closed_slow_total", "closed_slow",
             "Connections closed because headers or body came too slowly."),
            ("clover_connections_refused_total", "refused",
             "Connections refused past the per-client cap."),
        ):  # fmt: skip
            metric(name, "counter", help_, [f"{name} {getattr(connections, field_name, 0)}"])
        prefix = getattr(getattr(scheduler, "batch", None), "prefix", None)
        report = prefix.report() if prefix is not None else {}
        for key, kind, help_ in PREFIX_CACHE_METRICS:
            name = f"clover_prefix_cache_{key}" + ("_total" if kind == "counter" else "")
            metric(name, kind, help_, [f"{name} {report.get(key, 0)}"])
        return "\n".join(lines) + "\n"

    def _render_tenants(
        self, metric: Callable, tenants: Iterable[str], limited: dict[tuple[str, str], int]
    ) -> None:
        names = sorted({*tenants, *self.tenant_tokens, *(t for t, _ in self.tenant_requests)})
        metric(
            "clover_tenant_requests_total",
            "counter",
            "HTTP requests by tenant and status code.",
            [
                f'clover_tenant_requests_total{{tenant="{t}",code="{c}"}} {n}'
                for (t, c), n in sorted(self.tenant_requests.items())
            ],
        )
        metric(
            "clover_tenant_tokens_total",
            "counter",
            "Tokens by tenant: prompt, completion, and prompt tokens read from the prefix cache.",
            [
                f'clover_tenant_tokens_total{{tenant="{t}",kind="{k}"}} {n}'
                for t in names
                for k, n in zip(
                    ("prompt", "completion", "cached"), self.tenant_tokens.get(t, (0, 0, 0))
                )
            ],
        )
        metric(
            "clover_tenant_rate_limited_total",
            "counter",
            "Requests refused (429) by a tenant's rate limits, by limit.",
            [
                f'clover_tenant_rate_limited_total{{tenant="{t}",limit="{k}"}} '
                f"{limited.get((t, k), 0)}"
                for t in names
                for k in ("requests", "tokens")
            ],
        )
