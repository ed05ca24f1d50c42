"""Downloading ORG/NAME references (issue 60, item 1) against a fake of the Hub's endpoints:
`HF_ENDPOINT` points at a small HTTP server in this test that answers what huggingface_hub asks
(a model's file list, each file's HEAD and GET), so nothing reaches the internet. What it
fetches lands in the Hugging Face cache as huggingface_hub lays it out, and runs from there."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
import urllib.parse

import pytest

from clover.checkpoints import registry
from clover.checkpoints.local import hub_cache, snapshot
from clover.cli import main
from clover.errors import CloverError
from tests.gguf_files import write_gguf

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub(http.server.BaseHTTPRequestHandler):
    repos: dict[str, dict[str, bytes]] = {}
    gated = {"org/gated"}
    seen: list[str] = []

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = urllib.parse.unquote(self.path.split("?")[0])
        self.seen.append(f"{self.command} {path}")
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        file = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        repo = (info or file)[1] if (info or file) else None
        if repo in self.gated:
            return self._error(401, "GatedRepo")
        if repo not in self.repos:
            return self._error(404, "RepoNotFound")
        files = self.repos[repo]
        if info:
            if info[2] not in (None, "main"):
                return self._error(404, "RevisionNotFound")
            data = json.dumps({"id": repo, "sha": COMMIT,
                               "siblings": [{"rfilename": f} for f in files]}).encode()  # fmt: skip
            return self._send(data, "application/json", body)
        if file[3] not in files:
            return self._error(404, "EntryNotFound")
        data = files[file[3]]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
        return self._send(data, "application/octet-stream", body, headers)

    def _send(self, data: bytes, kind: str, body: bool, headers: dict | None = None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, status: int, code: str) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    write_gguf(gguf, {}, tokenizer=False)
    data = gguf.read_bytes()
    config = json.dumps({"model_type": "llama", "torch_dtype": "float32"}).encode()
    FakeHub.repos = {
        "org/tiny-GGUF": {"tiny-Q8_0.gguf": data, "tiny-F16.gguf": data, "README.md": b"hi"},
        "org/split-GGUF": {"big-Q4_0-00001-of-00002.gguf": data},
        "org/tiny-hf": {
            "config.json": config,
            "model.safetensors": b"\0" * 32,
            "tokenizer.json": b"{}",
            "README.md": b"hi",
        },  # fmt: skip
    }
    FakeHub.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield data
    server.shutdown()


def test_a_quant_is_downloaded_once_into_the_shared_cache(hub):
    r = registry.resolve("org/tiny-GGUF:q8_0", progress=False)
    assert r.kind == "gguf" and r.path == snapshot("org/tiny-GGUF") / "tiny-Q8_0.gguf"
    assert r.path.read_bytes() == hub and r.path.is_symlink()  # huggingface_hub's layout
    gets = [s for s in FakeHub.seen if s.startswith("GET /org/")]
    assert gets == ["GET /org/tiny-GGUF/resolve/main/tiny-Q8_0.gguf"]  # that file alone
    FakeHub.seen.clear()
    assert registry.resolve("org/tiny-GGUF:Q8_0", progress=False).path == r.path
    assert FakeHub.seen == []  # in the cache now: no request at all


def test_pull_takes_a_reference_and_an_hf_repo_comes_whole(hub, capsys):
    assert main(["pull", "org/tiny-hf"]) == 0
    folder = snapshot("org/tiny-hf")
    assert capsys.readouterr().out.strip() == str(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors",
                                                        "tokenizer.json"]  # fmt: skip


@pytest.mark.parametrize(
    ("ref", "words"),
    [
        ("org/gated:Q8_0", "is gated: accept its terms"),
        ("org/missing", "no such repo on the Hub"),
        ("org/tiny-GGUF:Q2_K", "has no Q2_K GGUF; it has: F16, Q8_0"),
        ("org/tiny-GGUF", "several GGUFs; pick one: org/tiny-GGUF:F16"),
        ("org/tiny-GGUF@v9", "has no revision 'v9'"),
        ("org/split-GGUF:Q4_0", "split in 2 parts"),
    ],
)
def test_every_hub_failure_is_one_line(hub, ref, words):
    with pytest.raises(CloverError) as e:
        registry.resolve(ref, progress=False)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not list(hub_cache().rglob("*.gguf"))  # a refusal downloads nothing


def test_no_network_is_one_line_and_offline_reads_only_the_cache(hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(CloverError, match="could not download org/tiny-GGUF .*connect"):
        registry.resolve("org/tiny-GGUF:Q8_0", progress=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    FakeHub.seen.clear()
    with pytest.raises(CloverError, match="HF_HUB_OFFLINE is set"):
        registry.resolve("org/tiny-GGUF:Q8_0", progress=False)
    assert FakeHub.seen == []
