"""`clover serve` as a live process with a tiny model, driven by the openai client and httpx.

One server with an API key answers most tests; a second one with tight limits (2 running,
2 queued, 3 s timeout) checks overload and timeouts; a third is stopped with SIGTERM.
The tiny model's text is gibberish but deterministic under greedy decoding, which is all
the comparisons need.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from tests.test_server_support import ServerProcess, write_checkpoint

KEY = "sk-Clover-Test-Key-42"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("serve"), context=2048)


@pytest.fixture(scope="module")
def server(checkpoint):
    s = ServerProcess(
        checkpoint, "--api-key", KEY, "--max-running", "8", "--max-queue", "16",
        "--max-body-bytes", "65536",
    )  # fmt: skip
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def small_server(checkpoint):
    s = ServerProcess(
        checkpoint, "--max-running", "2", "--max-queue", "2", "--request-timeout", "3"
    )
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def post(url: str, path: str, body, headers=AUTH, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **headers}
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=timeout)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of a stream, with [DONE] kept as the string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", line
    return events


def metric(url: str, name: str, headers=AUTH) -> float:
    text = httpx.get(f"{url}/metrics", headers=headers).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1))


# --- the openai client, unchanged ------------------------------------------------------------


def test_openai_client_chat_completions_and_streams(client):
    model = client.models.list().data[0].id
    assert model == "tiny"
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24)
    text = chat.choices[0].message.content
    assert isinstance(text, str) and text
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 24 and chat.usage.prompt_tokens > 0
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 24
    timings = chat.model_extra["timings"]
    assert timings["nfe"] > 0 and timings["tpf"] > 0 and timings["tokens_per_s"] > 0

    chunks = list(
        client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=24, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # greedy: the stream spells the same answer
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])

    done = client.completions.create(model=model, prompt="hello", max_tokens=16, n=2)
    assert len(done.choices) == 2 and done.choices[0].text == done.choices[1].text
    assert done.usage.completion_tokens == 32
    pieces = list(
        client.completions.create(model=model, prompt="hello", max_tokens=16, stream=True)
    )
    assert "".join(p.choices[0].text for p in pieces) == done.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"


def test_stream_framing_is_openai_sse(server):
    body = {"messages": CHAT, "max_tokens": 12, "stream": True, "n": 2, "decoder": "ar"}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("clover" not in c for c in chunks)  # commits only when asked for
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [m["finish_reason"] for m in mine][-1] == "length"
        assert all(m["finish_reason"] is None for m in mine[:-1])


def test_commits_stream_on_request(server):
    body = {
        "messages": CHAT, "max_tokens": 16, "stream": True, "clover_commits": True,
        "decoder": "low_confidence", "block_size": 8, "threshold": 0.5,
    }  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH) as r:
        chunks = sse_events(r)[:-1]
    assert chunks[0]["clover"] == {"block_size": 8, "decoder": "low_confidence"}
    commits = [c for chunk in chunks[1:] for c in chunk.get("clover", {}).get("commits", [])]
    assert sorted(i for i, _, _ in commits)[:16] == list(range(16))
    assert all(isinstance(t, str) and step >= 1 for _, t, step in commits)


# --- bad requests --------------------------------------------------------------------------

MSG = {"messages": CHAT}
BAD = [
    ("malformed json", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("json array", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("content wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     400, "messages[0].content"),
    ("max_tokens a string", "/v1/chat/completions", {**MSG, "max_tokens": "10"}, 400, "max_tokens"),
    ("stream not bool", "/v1/chat/completions", {**MSG, "stream": "yes"}, 400, "stream"),
    ("temperature < 0", "/v1/chat/completions", {**MSG, "temperature": -0.5}, 400, "temperature"),
    ("top_p > 1", "/v1/chat/completions", {**MSG, "top_p": 1.5}, 400, "top_p"),
    ("n < 1", "/v1/chat/completions", {**MSG, "n": 0}, 400, "n"),
    ("max_tokens 0", "/v1/chat/completions", {**MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens < 0", "/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("unknown model", "/v1/chat/completions", {**MSG, "model": "gpt-4o"}, 404, "model"),
    ("over the context", "/v1/chat/completions", {**MSG, "max_tokens": 2040}, 400, "max_tokens"),
    ("long prompt", "/v1/completions", {"prompt": [5] * 2048, "max_tokens": 1}, 400, "prompt"),
    ("negative block_size", "/v1/chat/completions", {**MSG, "block_size": -4}, 400, "block_size"),
    ("threshold > 1", "/v1/chat/completions", {**MSG, "threshold": 1.5}, 400, "threshold"),
    ("threshold < 0", "/v1/chat/completions", {**MSG, "threshold": -0.1}, 400, "threshold"),
    ("unknown decoder", "/v1/chat/completions", {**MSG, "decoder": "magic"}, 400, "decoder"),
    ("stop not strings", "/v1/chat/completions", {**MSG, "stop": [1]}, 400, "stop"),
    ("NaN", "/v1/chat/completions", b'{"messages": [], "temperature": NaN}', 400, None),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("token out of range", "/v1/completions", {"prompt": [99999]}, 400, "prompt"),
    ("tools", "/v1/chat/completions", {**MSG, "tools": [{"type": "function"}]}, 400,
     "tools[0].function"),
    ("bad template kwarg", "/v1/chat/completions",
     {**MSG, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    ("no such route", "/v1/embeddings", MSG, 404, None),
    ("lone surrogate", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, None),
    ("schema keyword", "/v1/chat/completions", {**MSG, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "a"}}}},
     400, "response_format.json_schema.schema"),
]  # fmt: skip


def test_bad_requests_get_openai_errors_and_the_server_stays_up(server, checkpoint):
    for name, path, body, status, param in BAD:
        r = post(server.url, path, body)
        assert r.status_code == status, (name, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert error["message"] and error["type"] == "invalid_request_error", name
        if param is not None:
            assert error["param"] == param, (name, error)
        assert "Traceback" not in r.text and str(checkpoint.parent) not in r.text, name
    r = post(server.url, "/v1/chat/completions", {**MSG, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_body_over_the_limit_is_refused(server):
    huge = {"messages": [{"role": "user", "content": "x" * 70_000}]}
    r = post(server.url, "/v1/chat/completions", huge)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


# --- API key -------------------------------------------------------------------------------


def test_api_key_guards_every_route_but_health(server):
    assert httpx.get(f"{server.url}/health").status_code == 200  # public
    wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {KEY.swapcase()}"}]
    wrong += [{"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}]
    for headers in wrong:
        for path in ("/v1/models", "/metrics", "/version"):
            r = httpx.get(f"{server.url}{path}", headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert post(server.url, "/v1/chat/completions", MSG, headers=headers).status_code == 401
    for path in ("/v1/models", "/metrics", "/version"):
        assert httpx.get(f"{server.url}{path}", headers=AUTH).status_code == 200
    assert httpx.get(f"{server.url}/").status_code == 200  # the page itself holds no data


# --- concurrency ---------------------------------------------------------------------------

VARIANTS = [  # different lengths, decoders and block positions, batched together
    {"max_tokens": 20 + 9 * i, "decoder": ("ar", "low_confidence")[i % 2], "block_size": 4 << i % 3}
    for i in range(8)
]


def _stream_text(url: str, body: dict) -> str:
    body = {**body, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        events = sse_events(r)
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])


def test_eight_concurrent_streams_match_one_by_one(server):
    bodies = [
        {"messages": [{"role": "user", "content": f"question {i}: " + "why " * i}], **v}
        for i, v in enumerate(VARIANTS)
    ]
    alone = [post(server.url, "/v1/chat/completions", b).json() for b in bodies]
    alone_text = [a["choices"][0]["message"]["content"] for a in alone]
    alone_nfe = sum(a["timings"]["nfe"] for a in alone)
    passes = metric(server.url, "clover_scheduler_forward_passes_total")
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: _stream_text(server.url, b), bodies))
    assert together == alone_text
    # the 8 answers shared forward passes: far fewer passes than their NFE summed
    shared = metric(server.url, "clover_scheduler_forward_passes_total") - passes
    assert shared < 0.6 * alone_nfe


def test_disconnected_clients_free_their_slots(server):
    cancelled = metric(server.url, "clover_scheduler_cancelled_total")
    body = {"messages": CHAT, "max_tokens": 1500, "decoder": "ar", "stream": True}

    def leave_after_half_a_second(_):
        with httpx.stream(
            "POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=30
        ) as r:
            assert r.status_code == 200
            start = time.monotonic()
            for _ in r.iter_lines():
                if time.monotonic() - start > 0.5:
                    break  # leaving the block closes the connection

    with ThreadPoolExecutor(20) as pool:
        list(pool.map(leave_after_half_a_second, range(20)))
    deadline = time.monotonic() + 5
    while metric(server.url, "clover_running_sequences") or metric(
        server.url, "clover_queue_depth"
    ):
        assert time.monotonic() < deadline, "cancelled sequences are still running"
        time.sleep(0.05)
    assert metric(server.url, "clover_scheduler_cancelled_total") - cancelled >= 8
    start = time.monotonic()
    r = post(server.url, "/v1/chat/completions", {**MSG, "max_tokens": 8})
    assert r.status_code == 200 and time.monotonic() - start < 2


def test_overload_is_refused_quickly_and_queued_requests_complete(small_server):
    body = {"messages": CHAT, "max_tokens": 300, "decoder": "ar"}

    def call(_):
        start = time.monotonic()
        r = post(small_server.url, "/v1/chat/completions", body, headers={})
        return r, time.monotonic() - start

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(8)))
    refused = [(r, s) for r, s in results if r.status_code == 503]
    served = [r for r, _ in results if r.status_code == 200]
    assert len(served) == 4 and len(refused) == 4  # 2 running + 2 queued
    for r, seconds in refused:
        assert seconds < 1.0 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
    assert all(r.json()["usage"]["completion_tokens"] == 300 for r in served)


def test_request_timeout(small_server):
    # 16 rows of 1900 tokens: many times the 3 s limit (a request with n over --max-running
    # runs alone); the limit counts decoding time (queue time does not: test_server_hardening)
    url = f"{small_server.url}/v1/chat/completions"
    body = {"messages": CHAT, "max_tokens": 1900, "decoder": "ar", "n": 16}
    start = time.monotonic()
    r = post(small_server.url, "/v1/chat/completions", body, headers={})
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert 2.9 < time.monotonic() - start < 8
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as r:
        streamed = sse_events(r)
    assert streamed[-2]["error"]["code"] == "timeout" and streamed[-1] == "[DONE]"
    deadline = time.monotonic() + 3  # the timed-out rows left the batch
    while metric(small_server.url, "clover_running_sequences", headers={}):
        assert time.monotonic() < deadline
        time.sleep(0.05)


# --- shutdown ------------------------------------------------------------------------------


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(checkpoint):
    # The answer takes ~1 s here; on a loaded machine the server can finish writing it before
    # this client has read its first line, and then it has nothing to drain and exits before
    # the second request. That attempt says nothing about draining, so it is run again; a
    # server that does not drain refuses the second request every time.
    for _ in range(3):
        if _sigterm_drains_once(checkpoint):
            return
    pytest.fail("the server exited at SIGTERM three times without draining")


def _sigterm_drains_once(checkpoint) -> bool:
    s = ServerProcess(checkpoint, "--shutdown-grace", "20")
    body = {"messages": CHAT, "max_tokens": 1000, "decoder": "ar", "stream": True}
    events, started = [], threading.Event()

    def stream():
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                started.set()
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(10)
    s.process.send_signal(signal.SIGTERM)
    assert "[DONE]" not in events  # the answer is still being written
    time.sleep(0.3)
    try:
        r = post(s.url, "/v1/chat/completions", {**MSG, "max_tokens": 4}, headers={})
    except httpx.ConnectError:
        reader.join(30)
        assert s.process.wait(20) == 0
        return False  # the answer was already written: nothing was left to drain
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert httpx.get(f"{s.url}/health").status_code == 503
    reader.join(30)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert s.process.wait(20) == 0
    return True
