"""Tenants: who calls (by API key), how much they may ask for, and what they do not share.

A tenant is a name that keys map to. `--api-key KEY` is one key of the tenant "default";
`--keys-file FILE` holds many, one per line:

    # key                         tenant   limits (optional, per minute)
    sk-7f3a9c0e2b4d6a8c1e3f5a7b   alice    rpm=60 tpm=20000
    sk-0b2d4f6a8c0e2a4c6e8a0c2e   alice
    sk-5e7a9c1e3a5c7e9a1c3e5a7c   bob

A tenant may hold several keys (to rotate them); its limits are the largest given on its
lines, else the server's `--rate-limit-rpm` / `--rate-limit-tpm`. The file is read at start
and again on SIGHUP (`KeyRing.reload`): a file that does not parse is refused whole, with the
line that failed, and the keys in use stay. Without any key every request is the tenant
"default".

What a tenant gets to itself: its prefix-cache partition (`BatchDecoder.add(partition=...)`:
the tenant and the request's `cache_salt`), so no request reuses, or learns through
`cached_tokens` or timing, another tenant's prompts; and its rate limits (`RateLimiter`:
requests and tokens per minute, 429 with Retry-After past them).
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from clover.errors import CloverError
from clover.serving.errors import APIError, bad_request

DEFAULT = "default"
_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_LIMIT = re.compile(r"(rpm|tpm)=([0-9]{1,12})")


@dataclass(frozen=True)
class Tenant:
    name: str
    rpm: int | None = None  # requests a minute; None: no limit
    tpm: int | None = None  # tokens a minute, prompt and generated; None: no limit


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def read_keys_file(path: str | Path, rpm: int | None, tpm: int | None) -> dict[bytes, Tenant]:
    """key digest -> tenant; `rpm` / `tpm` apply where a tenant's lines give none."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CloverError(f"--keys-file {path}: cannot read it ({e})") from None
    found: dict[str, dict[str, int]] = {}
    owners: dict[bytes, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--keys-file {path}, line {number}"
        if len(words) < 2:
            raise CloverError(f"{where}: expected KEY TENANT [rpm=N] [tpm=N]")
        key, name, *limits = words
        if not _TENANT.fullmatch(name):
            raise CloverError(f"{where}: a tenant name is 1-64 of A-Z a-z 0-9 _ . -")
        if owners.get(digest(key), name) != name:
            raise CloverError(f"{where}: this key already belongs to another tenant")
        owners[digest(key)] = name
        given = found.setdefault(name, {})
        for limit in limits:
            match = _LIMIT.fullmatch(limit)
            if match is None or int(match[2]) < 1:
                raise CloverError(f"{where}: {limit[:40]!r} is not rpm=N or tpm=N (N >= 1)")
            given[match[1]] = max(given.get(match[1], 0), int(match[2]))
    tenants = {
        name: Tenant(name, given.get("rpm", rpm), given.get("tpm", tpm))
        for name, given in found.items()
    }
    return {key: tenants[name] for key, name in owners.items()}


class KeyRing:
    """The keys the server accepts and the tenant of each. `enabled` is False when the server
    takes no key at all (then every request is the tenant "default")."""

    def __init__(
        self,
        api_key: str | None = None,
        keys_file: str | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
    ) -> None:
        self.api_key, self.keys_file, self.rpm, self.tpm = api_key, keys_file, rpm, tpm
        self.default = Tenant(DEFAULT, rpm, tpm)
        self._keys: dict[bytes, Tenant] = {}
        self._lock = threading.Lock()
        self.reload()

    @property
    def enabled(self) -> bool:
        return self.api_key is not None or self.keys_file is not None

    def reload(self) -> int:
        """Read the keys again (SIGHUP); returns how many there are. On a file that does not
        parse, raises CloverError and keeps the keys in use."""
        keys = {} if self.keys_file is None else read_keys_file(self.keys_file, self.rpm, self.tpm)
        if self.api_key is not None:
            keys[digest(self.api_key)] = self.default
        with self._lock:
            self._keys = keys
        return len(keys)

    def tenant(self, key: str) -> Tenant | None:
        """The tenant of `key`, or None if it is not a key of this server. A lookup by the
        key's SHA-256 digest: its time depends on the digest, never on how much of a real
        key the guess shares."""
        if not key:
            return None
        with self._lock:
            return self._keys.get(digest(key))

    def tenants(self) -> list[Tenant]:
        with self._lock:
            return sorted(set(self._keys.values()) | {self.default}, key=lambda t: t.name)


class Bucket:
    """A token bucket: holds up to `per_minute`, refilled at `per_minute` a minute. Charges
    after the fact may take it below zero (an answer's tokens are known only at its end)."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self.level = float(per_minute)
        self.at = time.monotonic()

    def _refill(self, now: float) -> None:
        rate = self.per_minute / 60
        self.level = min(float(self.per_minute), self.level + (now - self.at) * rate)
        self.at = now

    def wait(self, amount: int, now: float) -> float:
        """Seconds until `amount` may be taken (0: now)."""
        self._refill(now)
        return max(0.0, (amount - self.level) * 60 / self.per_minute)

    def take(self, amount: int, now: float) -> None:
        self._refill(now)
        self.level -= amount


class RateLimiter:
    """Per-tenant request and token buckets (`Tenant.rpm` / `tpm`). Thread-safe."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str, int], Bucket] = {}
        self._lock = threading.Lock()
        self.refused: dict[tuple[str, str], int] = {}  # (tenant, "requests" | "tokens") -> n

    def _bucket(self, tenant: Tenant, kind: str) -> Bucket | None:
        limit = tenant.rpm if kind == "requests" else tenant.tpm
        if limit is None:
            return None
        key = (tenant.name, kind, limit)  # a reload that changes the limit starts afresh
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = Bucket(limit)
        return bucket

    def admit(self, tenant: Tenant) -> None:
        """One more request, or a 429 saying when to retry."""
        self._take(tenant, "requests", 1)

    def charge_prompt(self, tenant: Tenant, tokens: int, where: str = "messages") -> None:
        """A prompt's tokens before it runs: a 429 while the bucket lacks them, a 400 naming
        `where` if the limit could never hold them."""
        if tenant.tpm is not None and tokens > tenant.tpm:
            raise bad_request(
                f"the prompt has {tokens} tokens, more than this key's limit of {tenant.tpm} "
                "tokens a minute allows in one request",
                where,
                "exceeds_rate_limit",
            )
        self._take(tenant, "tokens", tokens)

    def charge(self, tenant: Tenant, tokens: int) -> None:
        """Generated tokens, once known (they may leave the bucket below zero)."""
        with self._lock:
            bucket = self._bucket(tenant, "tokens")
            if bucket is not None:
                bucket.take(tokens, time.monotonic())

    def _take(self, tenant: Tenant, kind: str, amount: int) -> None:
        with self._lock:
            bucket = self._bucket(tenant, kind)
            if bucket is None:
                return
            now = time.monotonic()
            wait = bucket.wait(amount, now)
            if wait <= 0:
                bucket.take(amount, now)
                return
            key = (tenant.name, kind)
            self.refused[key] = self.refused.get(key, 0) + 1
        limit = tenant.rpm if kind == "requests" else tenant.tpm
        raise APIError(
            429,
            f"rate limit: this key may use {limit} {kind} a minute; retry in {math.ceil(wait)} s",
            kind="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(math.ceil(wait))},
        )
