"""The server's life before and after the model: loading, a failed load, stop strings."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest

from clover.engine import LLM, GenerationSettings
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


def test_self_spec_pass_costs_are_timed_before_ready(tmp_path, monkeypatch):
    """A server whose decoder is self_spec times the pass costs its adaptive drafts follow
    while loading (with the drafter's passes when one is attached), not in the first
    request; an `ar` server times nothing."""
    from clover.decoding.runtime import Runtime

    checkpoint = write_checkpoint(tmp_path, 256)
    timed: list[bool] = []
    monkeypatch.setattr(Runtime, "pass_costs", lambda self, drafter=False: timed.append(drafter))

    def loader(drafter: bool) -> LLM:
        llm = LLM(str(checkpoint), dtype="float32", progress=False)
        if drafter:  # what LLM(drafter=F) holds (its passes are timed by the stub only)
            llm.runtime.drafter = object()
        return llm

    cases = [("self_spec", False, [False]), ("self_spec", True, [False, True]), ("ar", True, [])]
    for decoder, drafter, expected in cases:
        timed.clear()
        options = ServeOptions(
            model=str(checkpoint), defaults=GenerationSettings(decoder=decoder, draft="lookup")
        )
        with serve_in_thread(options, lambda d=drafter: loader(d)) as url:
            assert httpx.get(f"{url}/health").status_code == 200
            assert timed == expected


def test_a_model_that_cannot_load_ends_the_server_with_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    cmd = [sys.executable, "-m", "clover.cli", "serve", "--model", str(missing), "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("error: ") and "no such file or directory" in done.stderr
    assert "Traceback" not in done.stderr


def test_store_save_keeps_what_answers_taught_across_restarts(tmp_path):
    """--store-save: the first server's answer is in the file when it stops; the next server
    learns it again at start (and drafts from it), and rewrites nothing it did not learn."""
    from clover.decoding.store import read_saved

    checkpoint = write_checkpoint(tmp_path, 256)
    saved = tmp_path / "store.jsonl"
    llms: list[LLM] = []

    def loader() -> LLM:
        llms.append(LLM(str(checkpoint), dtype="float32", progress=False))
        return llms[-1]

    options = ServeOptions(model=str(checkpoint), store_save=str(saved), store_save_every=30)
    with serve_in_thread(options, loader) as url:
        assert not saved.exists()  # nothing learned yet: nothing written
        assert httpx.post(f"{url}/v1/chat/completions", json=ASK).status_code == 200
    first = read_saved(saved, llms[0].name)
    assert len(first) == 1 and first == llms[0].runtime.store.learned
    stamp = saved.stat().st_mtime_ns
    with serve_in_thread(options, loader):
        assert llms[1].runtime.store.learned == first
    assert saved.stat().st_mtime_ns == stamp


def test_store_options_are_checked_before_the_socket_opens(tmp_path, monkeypatch):
    import clover.serving.server
    from clover.cli import main
    from clover.decoding.store import NgramStore, save_learned
    from clover.errors import CloverError

    other = tmp_path / "notes.txt"
    other.write_text("not a store")
    kept = tmp_path / "kept.jsonl"
    save_learned(NgramStore(), kept, "tiny")
    bad = [
        ({"store": (str(tmp_path / "missing"),)}, "--store .*no such file"),
        ({"store_save": str(tmp_path)}, "must be a file in an existing directory"),
        ({"store_save": str(tmp_path / "no" / "s.jsonl")}, "in an existing directory"),
        ({"store_save": str(other)}, "refusing to overwrite it"),
        ({"store": (str(other),), "store_save": str(other)}, "refusing"),
        ({"store": (str(kept),), "store_save": str(kept)}, "given to both"),
    ]
    for kwargs, message in bad:
        with pytest.raises(CloverError, match=message):
            ServeOptions(**kwargs).check()
    assert other.read_text() == "not a store"  # refused, untouched
    ServeOptions(store=(str(other),), store_save=str(kept)).check()
    # `clover serve` hands both flags to the server (it once dropped --store)
    seen: list[ServeOptions] = []
    monkeypatch.setattr(clover.serving.server, "serve", lambda o: seen.append(o) or 0)
    assert main(["serve", "--store", str(other), "--store-save", str(kept)]) == 0
    assert seen[0].store == (str(other),) and seen[0].store_save == str(kept)


def test_store_keeper_writes_only_what_changed_and_retries_a_failed_write(tmp_path, caplog):
    from types import SimpleNamespace

    from clover.decoding.runtime import Runtime
    from clover.decoding.store import read_saved
    from clover.serving.runtime import StoreKeeper
    from tests.conftest import tiny_model

    folder = tmp_path / "kept"
    folder.mkdir()
    path = folder / "store.jsonl"
    llm = SimpleNamespace(name="tiny", runtime=Runtime(tiny_model(0)))
    keeper = StoreKeeper(llm, str(path), every=3600)  # the thread never wakes in this test
    keeper.start()
    assert not keeper.save() and not path.exists()  # nothing learned: nothing written
    keeper.store.learn([1, 2, 3])
    folder.rmdir()  # a file where the folder was: the write fails, is logged, the server
    folder.write_text("")  # goes on, and the next write retries
    assert not keeper.save() and "could not write it" in caplog.text
    folder.unlink()
    assert keeper.save() and read_saved(path, "tiny") == [[1, 2, 3]]
    keeper.store.learn([4, 5])
    keeper.stop()  # the last write
    assert read_saved(path, "tiny") == [[1, 2, 3], [4, 5]]
    keeper.stop()  # twice (a signal, then the app's end): harmless
