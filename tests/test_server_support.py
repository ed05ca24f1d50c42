"""Helpers for the server tests (no tests here): checkpoints, live servers, a scripted model.

- `write_checkpoint`: the conftest recipe (tiny random llama, byte-level BPE, ChatML) with a
  longer context, so requests can run long enough to be cancelled or to time out.
- `ServerProcess`: `clover serve` in a subprocess, the way users run it.
- `serve_in_thread`: the same app under uvicorn in a thread, for a test double as the model.
- `ScriptedLM`: a model that spells a chosen answer whatever the weights, so thinking mode
  and the web page can be checked against exact text.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn

from clover.engine import LLM
from clover.models import make_config
from clover.models.base import DiffusionLM
from clover.models.cache import KVCache
from clover.serving.app import create_app
from clover.serving.options import ServeOptions
from clover.serving.server import uvicorn_config
from tests.conftest import TINY, tiny_model
from tests.test_tokenizer import CHATML, _byte_level_backend

THINKING_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking %}{{ '<think>\n' }}{% endif %}{% endif %}"
)


def write_checkpoint(directory: Path, context: int = 2048, template: str = CHATML) -> Path:
    from clover.checkpoints.hf_dir import save_checkpoint

    backend = _byte_level_backend()
    eos = backend.token_to_id("<|im_end|>")
    model = tiny_model(
        vocab_size=320, eos_token_id=eos, mask_token_id=0, max_position_embeddings=context
    )
    files = directory / "tokfiles"
    files.mkdir(parents=True, exist_ok=True)
    backend.save(str(files / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": template}
    (files / "tokenizer_config.json").write_text(json.dumps(config))
    return save_checkpoint(model, directory / "tiny", sorted(files.iterdir()))


def wait_ready(url: str, timeout: float = 600, headers: dict | None = None) -> None:
    # generous: a server runs its first pass before it says ready, and on a fresh cache that
    # builds the CPU kernels (minutes on a busy 2-core machine)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not become ready")


class ServerProcess:
    """`python -m clover.cli serve ...` on a free port; `url` once it is bound."""

    def __init__(self, model: Path, *args: str) -> None:
        cmd = [sys.executable, "-m", "clover.cli", "serve", "--model", str(model)]
        cmd += ["--dtype", "float32", "--port", "0", *args]
        # one torch thread: the tiny model gains nothing from more, and two processes that
        # both spin two threads on a small machine slow each other down many times over
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.banner = self._read_banner()
        self.url = self.banner.split(" at ", 1)[1].split(" ", 1)[0]
        wait_ready(self.url)

    def _read_banner(self) -> str:
        line = self.process.stdout.readline()  # the server prints it once the port is bound
        if " at http://" not in line:
            self.process.kill()
            raise RuntimeError(f"server did not start: {line!r} {self.process.stderr.read()!r}")
        return line

    def terminate(self, timeout: float = 20) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


@contextlib.contextmanager
def serve_in_thread(options: ServeOptions, loader, wait: bool = True, guarded: bool = False):
    """The app under uvicorn in a background thread; yields its base URL (once the model is
    loaded, unless `wait` is False). `guarded`: with `clover serve`'s own uvicorn settings
    (header and body timeouts, connections per client)."""
    app = create_app(options, loader)
    if guarded:
        config = uvicorn_config(app, options, host="127.0.0.1", port=0)
    else:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("in-thread server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    if wait:
        wait_ready(url)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


class ScriptedLM(DiffusionLM):
    """Spells `answers[prompt opens <think>]` after the prompt, then EOS, whatever the input.

    Its one-layer cache keeps each row's token ids (as keys) and marks the prompt (as values:
    1 for tokens committed by the row's first forward pass), so at every position it knows
    the sequence so far and where the answer started, and predicts the scripted token for
    that answer index. `confidence(i)` sets how sure it is about answer token i, which decides
    how many denoising steps a block takes.
    """

    def __init__(
        self, llm: LLM, answers: dict[bool, str], confidence=None, context: int = 512
    ) -> None:
        super().__init__()
        tok = llm.tokenizer
        self.vocab = llm.config.vocab_size
        self.config = make_config(
            {**TINY, "vocab_size": self.vocab, "max_position_embeddings": context,
             "mask_token_id": 0, "eos_token_id": tok.eos_token_id}
        )  # fmt: skip
        self.tok, self.eos = tok, tok.eos_token_id
        self.think = tok.encode("<think>\n")
        self.answers = answers
        self.confidence = confidence or (lambda i: 0.99)
        self.fail = False  # True: the next forward raises, as a broken kernel would
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def make_layer_caches(self, batch_size):
        return [KVCache(batch_size, 1, 1, torch.float32)]

    def next_token(self, seq: list[int], prompt_len: int) -> tuple[int, float]:
        i = len(seq) - prompt_len  # the answer index predicted at the last position
        if i < 0:
            return self.eos, 0.99
        thinking = seq[prompt_len - len(self.think) : prompt_len] == self.think
        script = self.tok.encode(self.answers[thinking]) + [self.eos]
        return (script[i], self.confidence(i)) if i < len(script) else (self.eos, 0.99)

    def backbone(self, input_ids, layout, caches):
        if self.fail:
            raise RuntimeError("kernel failed reading /secret/server/path/weights.bin")
        B, T = input_ids.shape
        ids = input_ids.float()[:, None, :, None]
        is_prompt = torch.zeros_like(ids)
        for b in range(B):
            if int(layout.lengths[b]) == 0:  # the row's first pass commits its prompt
                is_prompt[b, 0, : int(layout.n_commit[b])] = 1
        keys, values = caches[0].write(ids, is_prompt, layout)
        out = torch.zeros(B, T, self.vocab)
        for b in range(B):
            length = int(layout.lengths[b])
            seq = keys[b, 0, : length + T, 0].long().tolist()
            prompt_len = int(values[b, 0, : length + T, 0].sum())
            for t in range(T):
                token, conf = self.next_token(seq[: length + t + 1], prompt_len)
                out[b, t, :] = (1 - conf) / (self.vocab - 1)
                out[b, t, token] = conf
        return out

    def logits(self, hidden):
        return hidden.float().log()


def scripted_loader(
    checkpoint: Path, answers: dict[bool, str], confidence=None, context: int = 512
):
    """A loader for `create_app` whose LLM's model is a `ScriptedLM` (exposed as `.model`);
    `context`: its window (a tools' system block needs more than 512 tokens)."""

    def load() -> LLM:
        llm = LLM(str(checkpoint), dtype="float32", progress=False)
        llm.model = ScriptedLM(llm, answers, confidence, context)
        llm.config = llm.model.config
        # it tells the prompt from the answer by the row's first pass, which a prefix-cache
        # hit would skip: no prefix cache, whatever the server's options say
        llm.set_prefix_cache = lambda _mb: LLM.set_prefix_cache(llm, 0)
        load.model = llm.model
        return llm

    return load
