"""`clover bench speed --peers llama-server...`: llama.cpp's server as a peer, with a stand-in
server (a Python script in its place) that records its flags and answers as llama-server does."""

import json
import os
import sys

import pytest

from clover.bench.llama_server import LlamaServerEngine, is_server_peer, server_flags
from clover.cli import main
from clover.errors import CloverError
from tests.gguf_files import write_gguf

# Answers /health and /completion as llama-server does: n_predict tokens, its timings, and
# draft counters when a --spec-type is given (two of every three drafts kept).
FAKE = r"""
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
if "--version" in sys.argv:
    print("version: 1 (fake)"); sys.exit(0)
with open(os.environ["FAKE_ARGV"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
port = int(sys.argv[sys.argv.index("--port") + 1])
spec = "--spec-type" in sys.argv
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send({"status": "ok"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["ignore_eos"] and not body["cache_prompt"] and body["temperature"] == 0
        n = body["n_predict"]
        t = {"prompt_n": len(body["prompt"]), "prompt_ms": 5.0, "predicted_n": n,
             "predicted_ms": 10.0 * n}
        if spec:
            t.update(draft_n=3 * (n // 3), draft_n_accepted=2 * (n // 3))
        self._send({"content": "x" * n, "tokens": list(range(n)), "timings": t})
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "llama-server"
    script.write_text(f"#!{sys.executable}\n{FAKE}")
    script.chmod(0o755)
    monkeypatch.setenv("CLOVER_LLAMACPP_BIN", str(bin_dir))
    argv = tmp_path / "argv.jsonl"
    monkeypatch.setenv("FAKE_ARGV", str(argv))
    return argv


def test_peer_names_map_to_llama_server_flags(tmp_path):
    draft = tmp_path / "small.gguf"
    draft.write_bytes(b"GGUF")
    assert is_server_peer("llama-server") and is_server_peer("llama-server:ngram-mod")
    assert not is_server_peer("llama.cpp") and not is_server_peer("llama-serverx")
    assert server_flags("llama-server", str) == ("plain", [])
    ngram = ("ngram-mod", ["--spec-type", "ngram-mod"])
    assert server_flags("llama-server:ngram-mod", str) == ngram
    label, flags = server_flags(f"llama-server:draft={draft}", str)
    assert label == "draft small.gguf" and flags[:2] == ["-md", str(draft)]
    assert flags[flags.index("--spec-type") + 1] == "draft-simple"
    label, flags = server_flags(f"llama-server:dflash={draft}", str)
    assert flags[flags.index("--spec-type") + 1] == "draft-dflash"
    for bad, why in [("llama-server:eagle", "the kinds are"),
                     ("llama-server:draft", "needs a file"),
                     ("llama-server:ngram-mod=x", "takes no argument"),
                     (f"llama-server:draft={tmp_path / 'none.gguf'}", "no GGUF file")]:  # fmt: skip
        with pytest.raises(CloverError, match=why):
            server_flags(bad, str)


def test_the_engine_counts_tokens_and_kept_drafts(fake_server, tmp_path):
    e = LlamaServerEngine(tmp_path / "m.gguf", "Q4_K_M", 2, "ngram-mod",
                          ["--spec-type", "ngram-mod"])  # fmt: skip
    try:
        stats = e.run([[1, 2, 3]], 9)
        assert stats.rows == 1 and stats.tokens_per_row == 9 and stats.token_ids == [list(range(9))]
        assert stats.drafts == {"llama.cpp": [9, 6]}
        assert stats.nfe_per_row == 3  # 9 tokens, 6 of them kept drafts: 3 target passes
        assert stats.ttft == pytest.approx(0.005)
        assert e.peak_rss_mb() > 0
        with pytest.raises(CloverError, match="batch 1"):
            e.run([[1], [2]], 4)
    finally:
        e.close()
    assert e.proc.poll() is not None and not e.log.exists()  # the server and its log are gone
    args = json.loads(fake_server.read_text().splitlines()[0])
    assert args[args.index("-t") + 1] == "2" and args[-2:] == ["--spec-type", "ngram-mod"]
    assert e.describe()["build"] == "version: 1 (fake)"


def test_a_server_that_dies_is_a_clear_error(fake_server, tmp_path, monkeypatch):
    script = tmp_path / "bin" / "llama-server"
    script.write_text(f"#!{sys.executable}\nimport sys\nprint('error: bad flag')\nsys.exit(3)\n")
    with pytest.raises(CloverError, match="llama-server exited .3.: .*bad flag"):
        LlamaServerEngine(tmp_path / "m.gguf", "Q4_K_M", 2, "plain", [])
    monkeypatch.setenv("CLOVER_LLAMACPP_BIN", str(tmp_path / "nowhere"))
    with pytest.raises(CloverError, match="build_llamacpp.sh"):
        LlamaServerEngine(tmp_path / "m.gguf", "Q4_K_M", 2, "plain", [])


def test_bench_speed_runs_server_peers_beside_ours(fake_server, tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    write_gguf(gguf, {"attn_q": "Q4_K"}, config={"max_position_embeddings": 512,
                                                 "vocab_size": 320})  # fmt: skip
    out = tmp_path / "s.json"
    rc = main(["bench", "speed", "-m", str(gguf), "--configs", "ar", "--dtypes", "float32",
               "--peers", "llama-server,llama-server:ngram-mod", "--prompt-set", "code",
               "--tokens", "6", "--reps", "1", "--prompts", "2", "--batch", "1,2", "--no-rss",
               "--no-plot", "--out", str(out)])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    plain, ngram = rows["llama-server plain gguf"], rows["llama-server ngram-mod gguf"]
    assert plain["batch"]["1"]["tpf"] == 1.0 and "speculation" not in plain["batch"]["1"]
    spec = ngram["batch"]["1"]["speculation"]
    assert spec["drafted_kept_by_source"] == {"llama.cpp": [2 * 6, 2 * 4]}  # 2 prompts, 1 rep
    assert spec["kept_fraction"] == pytest.approx(0.667, abs=1e-3)
    assert ngram["batch"]["2"] is None  # batch 1 only
    assert plain["peak_rss_mb"] > 0
    assert report["settings"]["prompt_set"] == "code" and len(report["settings"]["prompts"]) == 2
    runs = report["settings"]["llama_server"]
    assert runs["llama-server ngram-mod gguf"]["command"].endswith("--spec-type ngram-mod")
    assert len(fake_server.read_text().splitlines()) == 2  # one server a row, both closed
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _runs(p, tmp_path / "bin")]
    rc = main(["bench", "speed", "-m", str(gguf), "--peers", "llama-server:eagle", "--no-rss"])
    assert rc == 1 and "the kinds are" in capsys.readouterr().err


def _runs(pid: str, bin_dir) -> bool:
    """Whether process `pid` runs a program from `bin_dir` (a stand-in server left running)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return str(bin_dir).encode() in f.read()
    except OSError:
        return False
