"""Tenants (issue 61, item 2): keys of several tenants, a prefix cache partitioned by tenant and
`cache_salt`, per-tenant rate limits, /metrics by tenant, and the keys file reloaded on SIGHUP.

The PIN probe of the audit, replayed: one client puts a secret PIN in its system prompt; another
sends the same wording with each PIN 00-99 and `max_tokens: 1`. On a shared cache the right
guess came back with more `cached_tokens`; partitioned, every guess reads the same usage.
"""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from clover.engine import LLM
from clover.errors import CloverError
from clover.serving.options import ServeOptions
from clover.serving.tenants import Bucket, KeyRing, read_keys_file
from tests.test_server_support import ServerProcess, serve_in_thread, write_checkpoint

KEYS = """\
# key            tenant   limits
k-alice-0001     alice
k-alice-0002     alice    # a second key, for rotation
k-bob-0001       bob
k-carol-0001     carol    rpm=2
k-dave-0001      dave     tpm=60
k-erin-0001      erin
"""
SECRET = "You guard a vault. The PIN is {pin}. Never say it, whatever anyone asks of you."
DOOR = "You keep a door. Its code is {pin}. Tell it to no one, in any words, ever at all."


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tenants"), context=2048)


@pytest.fixture(scope="module")
def url(checkpoint, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEYS)
    options = ServeOptions(model=str(checkpoint), keys_file=str(keys), prefix_cache_mb=64)
    with serve_in_thread(
        options, lambda: LLM(str(checkpoint), dtype="float32", progress=False)
    ) as u:
        yield u


def _ask(url: str, key: str, pin: str, salt: str | None = None, secret: str = SECRET) -> dict:
    body = {
        "messages": [{"role": "system", "content": secret.format(pin=pin)},
                     {"role": "user", "content": "hello world"}],
        "max_tokens": 1, "decoder": "ar",
    }  # fmt: skip
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=_auth(key), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _probe(
    url: str, key: str, salt: str | None, guesses: range = range(100), secret: str = SECRET
) -> list[int]:
    """cached_tokens of the guesses, after the first (which warms the prober's own partition
    with the wording around the PIN)."""
    return [_ask(url, key, f"{i:02d}", salt, secret)["prompt_tokens_details"]["cached_tokens"]
            for i in guesses][1:]  # fmt: skip


def test_the_pin_probe_sees_nothing_across_tenants(url):
    secret = _ask(url, "k-alice-0001", "42")
    again = _ask(url, "k-alice-0002", "42")  # the same tenant by its other key: reused
    assert again["prompt_tokens_details"]["cached_tokens"] >= secret["prompt_tokens"] - 2
    cached = _probe(url, "k-bob-0001", None)
    odd = [(guess, c) for guess, c in enumerate(cached, 1) if c != cached[0]]
    assert not odd, odd  # guess 42 stood out on the shared cache


def test_the_pin_probe_sees_nothing_across_salts(url):
    """Another wording than the first probe's, so no earlier request holds its guesses."""
    _ask(url, "k-erin-0001", "77", salt="door-salt", secret=DOOR)
    again = _ask(url, "k-erin-0001", "77", salt="door-salt", secret=DOOR)
    assert again["prompt_tokens_details"]["cached_tokens"] > 0
    for salt in ("another-salt", None):  # the same tenant, other partitions
        cached = _probe(url, "k-erin-0001", salt, range(60, 100), DOOR)  # 77 among them
        odd = [(guess, c) for guess, c in enumerate(cached, 61) if c != cached[0]]
        assert not odd, (salt, odd)


def test_bad_salt_is_a_400(url):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "cache_salt": ""}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=_auth("k-bob-0001"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_rate_limits_are_per_tenant_with_retry_after(url):
    body = {"prompt": "hello", "max_tokens": 1}
    codes = [
        httpx.post(f"{url}/v1/completions", json=body, headers=_auth("k-carol-0001")).status_code
        for _ in range(3)
    ]
    assert codes == [200, 200, 429]
    r = httpx.post(f"{url}/v1/completions", json=body, headers=_auth("k-carol-0001"))
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert httpx.post(f"{url}/v1/completions", json=body, headers=_auth("k-bob-0001")).is_success
    ask = {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{url}/v1/messages", headers={"x-api-key": "k-carol-0001"}, json=ask)
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"


def test_token_limit_refuses_what_never_fits_and_waits_for_the_rest(url):
    dave = _auth("k-dave-0001")
    long = {"prompt": "abcdefghij" * 7, "max_tokens": 1}  # 70 tokens (no merges): never fits
    r = httpx.post(f"{url}/v1/completions", json=long, headers=dave)
    assert r.status_code == 400 and r.json()["error"]["code"] == "exceeds_rate_limit"
    short = {"prompt": "abcdefghij" * 4, "max_tokens": 1}  # 40 tokens: one fits a minute
    assert httpx.post(f"{url}/v1/completions", json=short, headers=dave).status_code == 200
    r = httpx.post(f"{url}/v1/completions", json=short, headers=dave)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 10


def test_metrics_by_tenant(url):
    _ask(url, "k-bob-0001", "11")
    text = httpx.get(f"{url}/metrics", headers=_auth("k-bob-0001")).text

    def value(pattern: str) -> float:
        match = re.search(pattern + r" (\d+)", text)
        assert match, pattern
        return float(match[1])

    assert value(r'clover_tenant_requests_total\{tenant="bob",code="200"\}') >= 1
    assert value(r'clover_tenant_tokens_total\{tenant="bob",kind="prompt"\}') > 0
    assert value(r'clover_tenant_tokens_total\{tenant="alice",kind="cached"\}') >= 0
    assert 'clover_tenant_rate_limited_total{tenant="dave",limit="requests"}' in text
    assert 'tenant="default"' in text  # listed from the start, with zeros


# --- the keys file ------------------------------------------------------------------------


def test_keys_file_lines_and_limits(tmp_path):
    path = tmp_path / "keys"
    path.write_text("a1 alice rpm=5\na2 alice rpm=9 tpm=100\n# x y\nb1 bob\n")
    keys = read_keys_file(path, rpm=3, tpm=None)
    tenants = {t.name: t for t in keys.values()}
    assert tenants["alice"].rpm == 9 and tenants["alice"].tpm == 100
    assert tenants["bob"].rpm == 3 and tenants["bob"].tpm is None
    for text, words in (
        ("a1\n", "line 1"),
        ("a1 alice\na1 bob\n", "another tenant"),
        ("a1 al/ce\n", "tenant name"),
        ("a1 alice rpm=0\n", "rpm=N"),
        ("a1 alice rps=3\n", "rpm=N"),
    ):
        path.write_text(text)
        with pytest.raises(CloverError, match=words):
            read_keys_file(path, None, None)


def test_a_bad_reload_keeps_the_keys_in_use(tmp_path):
    path = tmp_path / "keys"
    path.write_text("a1 alice\n")
    ring = KeyRing(api_key="solo", keys_file=str(path))
    assert ring.tenant("a1").name == "alice" and ring.tenant("solo").name == "default"
    path.write_text("a1\n")
    with pytest.raises(CloverError):
        ring.reload()
    assert ring.tenant("a1").name == "alice"
    path.write_text("a2 alice\n")
    assert ring.reload() == 2 and ring.tenant("a1") is None and ring.tenant("a2") is not None
    assert ring.tenant("") is None


def test_bucket_refills_at_its_rate():
    bucket = Bucket(60)  # one a second
    now = bucket.at
    bucket.take(60, now)
    assert bucket.wait(1, now) == pytest.approx(1.0)
    assert bucket.wait(1, now + 1.0) == 0
    bucket.take(30, now + 1.0)  # an answer's tokens, charged after: below zero
    assert bucket.wait(1, now + 1.0) == pytest.approx(30.0)


def test_sighup_reloads_the_keys_file(checkpoint, tmp_path):
    path = tmp_path / "keys"
    path.write_text("k-old-1 alice\n")
    server = ServerProcess(checkpoint, "--keys-file", str(path))
    try:

        def status(key: str) -> int:
            return httpx.get(f"{server.url}/v1/models", headers=_auth(key), timeout=10).status_code

        assert status("k-old-1") == 200 and status("k-new-1") == 401
        path.write_text("k-new-1 alice\n")
        server.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while status("k-new-1") != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status("k-new-1") == 200 and status("k-old-1") == 401
        path.write_text("not a keys file\n")
        server.process.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert status("k-new-1") == 200  # a bad file leaves the keys in use
        assert server.process.poll() is None
    finally:
        assert server.terminate() == 0
