"""The server's life before and after the model: loading, a failed load, stop strings."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx

from clover.engine import LLM
from clover.serving.options import ServeOptions
from tests.test_server_support import serve_in_thread, wait_ready, write_checkpoint

ASK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_health_is_503_while_loading_then_200(tmp_path):
    checkpoint = write_checkpoint(tmp_path, 256)
    release = threading.Event()

    def slow_loader() -> LLM:
        release.wait(30)
        return LLM(str(checkpoint), dtype="float32", progress=False)

    with serve_in_thread(ServeOptions(model=str(checkpoint)), slow_loader, wait=False) as url:
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        chat = httpx.post(f"{url}/v1/chat/completions", json=ASK)
        assert chat.status_code == 503 and chat.headers["retry-after"] == "5"
        assert chat.json()["error"]["code"] == "model_loading"
        release.set()
        wait_ready(url)
        assert httpx.post(f"{url}/v1/chat/completions", json=ASK).status_code == 200


def test_a_compiled_model_is_warmed_for_batches_before_ready(tmp_path):
    """With --compile, LLM warms batch 1 itself; the server also warms the batched graphs
    (rows >= 2) before /health says ready, unless it decodes one row at a time."""
    checkpoint = write_checkpoint(tmp_path, 256)
    warmed: list[int] = []

    def loader() -> LLM:
        llm = LLM(str(checkpoint), dtype="float32", progress=False)
        llm.compiled = True  # as LLM(compile=True) leaves it, without compiling in this test
        real = llm.warm_up
        llm.warm_up = lambda rows=1: (warmed.append(rows), real(rows))
        return llm

    for running, expected in ((8, [2]), (1, [])):
        warmed.clear()
        options = ServeOptions(model=str(checkpoint), compile=True, max_running=running)
        with serve_in_thread(options, loader) as url:
            assert httpx.get(f"{url}/health").status_code == 200
            assert warmed == expected
            assert httpx.post(f"{url}/v1/chat/completions", json=ASK).status_code == 200


def test_a_model_that_cannot_load_ends_the_server_with_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    cmd = [sys.executable, "-m", "clover.cli", "serve", "--model", str(missing), "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("error: ") and "no such file or directory" in done.stderr
    assert "Traceback" not in done.stderr
