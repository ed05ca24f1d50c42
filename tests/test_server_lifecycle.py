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


def test_a_model_that_cannot_load_ends_the_server_with_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    cmd = [sys.executable, "-m", "clover.cli", "serve", "--model", str(missing), "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("error: ") and "no such file or directory" in done.stderr
    assert "Traceback" not in done.stderr
