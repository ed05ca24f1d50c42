"""JSON grammars by schema: compiled in a worker thread, within a budget, and cached.

A request's schemas (its answer's format, its tools' parameters, a forced call's shape) are
compiled before it is queued, in one worker thread: not on the event loop, whose other
clients would wait, and not on the scheduler thread, whose running answers would. The same
schema (by the digest of its canonical JSON text) compiles once and serves every request of
the same tenant that sends it, so an agent that sends its tools with every turn pays once; a
refused schema is remembered too, so sending it again costs a dictionary lookup. Tenants do
not share entries: how fast a schema compiles must not tell one tenant what another sent.
One request's schemas share one deadline (`Budget.seconds`), however many there are. A schema
that is too large, too deep, too slow or impossible is a 400 that names its field.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from clover.errors import CloverError
from clover.serving.errors import bad_request
from clover.serving.json_grammar import JsonGrammar
from clover.serving.json_schema import Budget, OverBudget


class Grammars:
    """An LRU of `size` compiled schemas (or their refusals), with its compiling thread."""

    def __init__(self, budget: Budget | None = None, size: int = 32) -> None:
        self.budget = budget or Budget()
        self.size = size
        self._cache: OrderedDict[bytes, JsonGrammar | tuple[str, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clover-schema")
        self.compiled = self.hits = 0

    async def compile_async(
        self, schemas: list[tuple[str, Any]], tenant: str = ""
    ) -> list[JsonGrammar]:
        """`compile` in the worker thread."""
        if not schemas:
            return []
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.compile, schemas, tenant)

    def compile(self, schemas: list[tuple[str, Any]], tenant: str = "") -> list[JsonGrammar]:
        """Each (field, schema)'s grammar, for `tenant`; raises a 400 APIError naming the
        field of the first schema that is refused."""
        deadline = time.monotonic() + self.budget.seconds
        return [self._get(where, schema, tenant, deadline) for where, schema in schemas]

    def _get(self, where: str, schema: Any, tenant: str, deadline: float) -> JsonGrammar:
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        key = hashlib.sha256(f"{tenant}\0{text}".encode("utf-8", "surrogatepass")).digest()
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                self.hits += 1
        if found is None:
            found = self._build(schema, deadline)
            if not (isinstance(found, tuple) and found[1] == "schema_timeout"):
                with self._lock:  # a timeout may pass with less load: not remembered
                    self._cache[key] = found
                    while len(self._cache) > self.size:
                        self._cache.popitem(last=False)
        if isinstance(found, tuple):
            message, code = found
            raise bad_request(f"{where}: {message}", where, code)
        return found

    def _build(self, schema: Any, deadline: float) -> JsonGrammar | tuple[str, str]:
        left = deadline - time.monotonic()
        if left <= 0:
            seconds = f"{self.budget.seconds:g}"
            return f"the request's schemas took over {seconds} s to compile", "schema_timeout"
        try:
            grammar = JsonGrammar(schema, replace(self.budget, seconds=left))
        except OverBudget as e:
            return str(e), e.code
        except CloverError as e:
            return str(e), "invalid_schema"
        except RecursionError:
            return "the schema is nested too deeply", "schema_too_large"
        self.compiled += 1
        return grammar
