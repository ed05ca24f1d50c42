"""The prefix cache at the edges: `LLM.chat` turns (llama and the hybrid), `clover chat`, and
`clover serve` (usage.prompt_tokens_details.cached_tokens, timings, /metrics, the flag)."""

import httpx
import pytest
import torch
from openai import OpenAI

from clover.cli import build_parser, cmd_chat, main
from clover.engine import LLM, GenerationSettings
from clover.errors import CloverError
from clover.models.clover import CloverModel, preset_config
from clover.serving.options import ServeOptions
from tests.test_server_support import serve_in_thread, write_checkpoint

SYSTEM = {"role": "system", "content": "You are a terse assistant. " * 6}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("prefix"), context=1024)


def turns(llm: LLM, n: int, max_tokens: int = 8) -> list:
    """n chat turns, each answer appended to the conversation; -> the completions."""
    messages, out = [SYSTEM], []
    for i in range(n):
        messages.append({"role": "user", "content": f"question {i}: what is {i} + {i}?"})
        c = llm.chat(messages, max_tokens=max_tokens, decoder="ar")
        out.append(c)
        messages.append({"role": "assistant", "content": c.text})
    return out


def test_llm_chat_turns_reuse_the_cache_and_answer_the_same(checkpoint):
    warm = LLM(str(checkpoint), dtype="float32", progress=False)
    cold = LLM(str(checkpoint), dtype="float32", progress=False)
    cold.set_prefix_cache(0)
    assert cold.prefix_cache is None
    w, c = turns(warm, 4), turns(cold, 4)
    assert [x.text for x in w] == [x.text for x in c]
    assert w[0].cached_tokens == 0 and all(x.cached_tokens == 0 for x in c)
    for prev, now in zip(w, w[1:]):  # at least the previous prompt is reused
        assert now.cached_tokens >= prev.prompt_tokens - 1
    assert all(x.ttft > 0 and x.prefill_seconds > 0 for x in w)
    assert w[-1].prefill_tokens_per_s > 0
    report = warm.prefix_cache.report()
    assert report["hits"] == 3 and report["pinned_blocks"] == 0
    # cached=False (measurement harnesses): a full prefill, nothing read or kept
    out: list = []
    settings = GenerationSettings(max_tokens=4, decoder="ar")
    for _ in warm.stream([warm.chat_prompt([SYSTEM])], settings, out, cached=False):
        pass
    assert out[0].cached_tokens == 0 and warm.prefix_cache.report() == report


def hybrid_llm(checkpoint) -> LLM:
    """The tiny hybrid architecture behind the checkpoint's tokenizer (random weights)."""
    llm = LLM(str(checkpoint), dtype="float32", progress=False)
    torch.manual_seed(0)
    config = preset_config(
        "clover-tiny", vocab_size=llm.config.vocab_size, eos_token_id=llm.config.eos_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    llm.model = CloverModel(config).eval()
    with torch.no_grad():
        llm.model.lm_head.weight.mul_(8)  # sharp: no greedy near-ties
    llm.config = config
    llm.set_prefix_cache(None)
    return llm


def test_hybrid_chat_turns_snapshot_at_the_template_boundary(checkpoint):
    warm, cold = hybrid_llm(checkpoint), hybrid_llm(checkpoint)
    cold.set_prefix_cache(0)
    messages = [SYSTEM, {"role": "user", "content": "hi"}]
    prompt = warm.chat_prompt(messages)
    (mark,) = warm.chat_marks(messages, prompt)  # the system turn, rendered, as a prefix
    assert prompt[:mark] == warm.tokenizer.encode(
        warm.tokenizer.apply_chat_template([SYSTEM], add_generation_prompt=False)
    )
    assert cold.chat_marks(messages, prompt) == ()  # no cache: no marks computed
    w, c = turns(warm, 3), turns(cold, 3)
    assert [x.token_ids for x in w] == [x.token_ids for x in c]
    assert all(now.cached_tokens >= prev.prompt_tokens - 1 for prev, now in zip(w, w[1:]))
    # a new conversation with the same system prompt resumes at the snapshot of its boundary
    other = warm.chat([SYSTEM, {"role": "user", "content": "something else"}], max_tokens=4)
    assert other.cached_tokens == mark
    assert (
        other.token_ids
        == cold.chat(
            [SYSTEM, {"role": "user", "content": "something else"}], max_tokens=4
        ).token_ids
    )


def test_cli_chat_reports_cached_tokens(checkpoint, capsys):
    lines = iter(["first question", "second question", "/exit"])
    args = build_parser().parse_args(
        ["chat", "-m", str(checkpoint), "--max-tokens", "4", "--dtype", "float32", "-v"]
    )
    assert cmd_chat(args, read=lambda _p: next(lines)) == 0
    stats = [line for line in capsys.readouterr().out.splitlines() if "cached)]" in line]
    assert len(stats) == 2 and "(0 cached)" in stats[0] and "(0 cached)" not in stats[1]
    lines = iter(["first question", "second question", "/exit"])
    args = build_parser().parse_args(
        ["chat", "-m", str(checkpoint), "--max-tokens", "4", "--dtype", "float32", "-v",
         "--prefix-cache-mb", "0"]
    )  # fmt: skip
    assert cmd_chat(args, read=lambda _p: next(lines)) == 0
    stats = [line for line in capsys.readouterr().out.splitlines() if "cached)]" in line]
    assert len(stats) == 2 and all("(0 cached)" in s for s in stats)
    with pytest.raises(SystemExit):
        main(["chat", "--prefix-cache-mb", "-1"])
    assert "must be >= 0" in capsys.readouterr().err


def test_serve_option_is_checked():
    with pytest.raises(CloverError, match="prefix-cache-mb"):
        ServeOptions(prefix_cache_mb=-5).check()
    ServeOptions(prefix_cache_mb=0).check()


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("clover_prefix_cache_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


MODEL = "tiny"  # the checkpoint directory's name
CHAT = [SYSTEM, {"role": "user", "content": "Say something."}]


def test_server_reports_cached_tokens_timings_and_metrics(checkpoint):
    loader = lambda: LLM(str(checkpoint), dtype="float32", progress=False)  # noqa: E731
    options = ServeOptions(model=str(checkpoint), prefix_cache_mb=3)
    with serve_in_thread(options, loader) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        before = metrics(url)
        assert before["clover_prefix_cache_capacity_bytes"] == 3 * 2**20
        assert before["clover_prefix_cache_hits_total"] == 0
        first = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6)
        second = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        prompt = second.usage.prompt_tokens
        assert second.usage.prompt_tokens_details.cached_tokens == prompt - 1
        assert second.choices[0].message.content == first.choices[0].message.content
        timings = second.model_extra["timings"]
        assert timings["cached_tokens"] == prompt - 1 and timings["prefill_tokens"] == 1
        assert timings["prefill_seconds"] > 0 and timings["prefill_tokens_per_s"] > 0
        stream = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=6, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
        assert usage[-1].prompt_tokens_details.cached_tokens == prompt - 1
        # completions: several prompts and choices, cached tokens counted once per prompt
        body = {"model": MODEL, "prompt": ["The same text, again."] * 2, "max_tokens": 3,
                "n": 2}  # fmt: skip
        httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        per_prompt = r["usage"]["prompt_tokens"] // 2
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * (per_prompt - 1)
        after = metrics(url)
        assert after["clover_prefix_cache_hits_total"] >= 3
        assert after["clover_prefix_cache_cached_tokens_total"] >= 2 * (prompt - 1)
        assert 0 < after["clover_prefix_cache_bytes"] <= after["clover_prefix_cache_capacity_bytes"]
        assert 0 < after["clover_prefix_cache_hit_rate"] < 1


def test_server_without_prefix_cache(checkpoint):
    loader = lambda: LLM(str(checkpoint), dtype="float32", progress=False)  # noqa: E731
    options = ServeOptions(model=str(checkpoint), prefix_cache_mb=0)
    with serve_in_thread(options, loader) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for _ in range(2):
            r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
            assert r.usage.prompt_tokens_details.cached_tokens == 0
        m = metrics(url)
        assert m["clover_prefix_cache_capacity_bytes"] == 0
        assert m["clover_prefix_cache_lookups_total"] == 0


def test_a_failure_while_joining_fails_that_request_only(checkpoint):
    """Admission now reads the prefix cache (and may prefill): an unexpected error there is a
    500 for that request, and the scheduler goes on serving the next ones."""
    llms = []

    def loader():
        llms.append(LLM(str(checkpoint), dtype="float32", progress=False))
        return llms[-1]

    with serve_in_thread(ServeOptions(model=str(checkpoint)), loader) as url:
        cache = llms[0].prefix_cache
        lookup = cache.lookup

        def broken(*args, **kw):
            cache.lookup = lookup  # only once
            raise RuntimeError("index out of range")

        cache.lookup = broken
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 3}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 500 and "index out of range" not in r.text
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200


def test_concurrent_requests_sharing_a_prefix_answer_as_without_cache(checkpoint):
    """Requests that share a system prompt, sent together and in waves, through the server's
    batch: each answer equals the cache-off answer, and later ones reuse the shared part."""
    from concurrent.futures import ThreadPoolExecutor

    cold = LLM(str(checkpoint), dtype="float32", progress=False)
    cold.set_prefix_cache(0)
    questions = [f"Question {i}: name a colour." for i in range(6)]
    convs = [[SYSTEM, {"role": "user", "content": q}] for q in questions]
    expected = [cold.chat(m, max_tokens=6, decoder="ar").text for m in convs]
    loader = lambda: LLM(str(checkpoint), dtype="float32", progress=False)  # noqa: E731
    with serve_in_thread(ServeOptions(model=str(checkpoint), max_running=4), loader) as url:

        def ask(messages):
            body = {"model": MODEL, "messages": messages, "max_tokens": 6, "decoder": "ar"}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
            return r["choices"][0]["message"]["content"], r["usage"]

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(ask, convs[:3]))
            got += list(pool.map(ask, convs[3:]))
    assert [text for text, _ in got] == expected
    cached = [u["prompt_tokens_details"]["cached_tokens"] for _, u in got]
    system_tokens = len(cold.chat_prompt([SYSTEM])) - 3  # the rendered system turn, roughly
    assert all(c >= system_tokens // 16 * 16 for c in cached[3:])  # the second wave hits


def test_requests_arriving_together_join_in_one_prefill_pass(checkpoint):
    """A burst of requests arriving while a batch runs joins it with one prefill pass for all
    (each was prefilled alone); every answer equals its answer alone. If that shared pass
    fails, the requests that joined with it get the error and the running one goes on."""
    import time

    from clover.serving.scheduler import Scheduler

    llm = LLM(str(checkpoint), dtype="float32", progress=False)
    settings = GenerationSettings(decoder="ar", max_tokens=6)
    chats = [[SYSTEM, {"role": "user", "content": w}] for w in ("apples", "rivers", "stones")]
    prompts = [llm.chat_prompt(c) for c in chats]
    passes = []
    hook = llm.model.register_forward_pre_hook(lambda m, a: passes.append(tuple(a[0].shape)))
    sched = Scheduler(llm, max_running=8)
    sched.start()

    def settle() -> None:
        while sched.running_rows or sched.queue_depth:
            time.sleep(0.01)

    try:
        sched.submit(prompts[0], GenerationSettings(decoder="ar", max_tokens=40))
        while not sched.stats.steps:
            time.sleep(0.005)
        with sched._lock:  # the scheduler admits them in one round
            tickets = [sched.submit(p, settings) for p in prompts]
        settle()
        # passes over more than one position: the first prompt, then one for the joiners
        # (prompts[0] was cached whole by the first request; the others' user turns remain)
        wide = [shape for shape in passes if shape[1] > 1]
        assert wide == [(1, len(prompts[0])), (2, wide[1][1])], passes
        # a failed shared pass: those requests fail, the running one does not
        forward = llm.model.forward
        running = sched.submit(prompts[0], GenerationSettings(decoder="ar", max_tokens=300))
        while not sched.running_rows or not running.rows:
            time.sleep(0.005)
        fresh_prompts = [llm.chat_prompt([SYSTEM, {"role": "user", "content": w}])
                         for w in ("meadows", "lanterns")]  # fmt: skip

        def broken(ids, *args, **kw):  # the joiners' pass only (the running row's are 1 row)
            if ids.shape[0] > 1:
                raise RuntimeError("shared pass failed")
            return forward(ids, *args, **kw)

        llm.model.forward = broken
        with sched._lock:
            failing = [sched.submit(p, settings) for p in fresh_prompts]
        settle()
        llm.model.forward = forward
    finally:
        hook.remove()
        sched.shutdown(grace=5)
    fresh = LLM(str(checkpoint), dtype="float32", progress=False)
    alone = [fresh.chat(c, max_tokens=6, decoder="ar").token_ids for c in chats]
    assert [r.result.tokens for t in tickets for _, _, r in t.rows.values()] == alone
    for t in failing:
        events = []
        while not t.events.empty():
            events.append(t.events.get())
        assert events and events[-1]["type"] == "error", events
    ((_, _, row),) = running.rows.values()
    assert row.result.finish_reason == "length" and len(row.result.tokens) == 300


def test_the_scheduler_s_answers_carry_their_drafts(checkpoint):
    """A served self_spec answer reports its drafts (source -> [drafted, kept]) and the kept
    count of each verify pass, as `LLM.generate`'s do: /metrics sums them."""
    from clover.serving.scheduler import Scheduler
    from tests.test_drafter import drafter_for

    llm = LLM(str(checkpoint), dtype="float32", progress=False)
    llm.set_prefix_cache(0)  # both answers prefill cold
    llm.runtime.drafter = drafter_for(llm.model)  # as LLM(drafter=F) holds it
    settings = GenerationSettings(decoder="self_spec", block_size=4, draft="drafter+lookup",
                                  adaptive=False, max_tokens=24)  # fmt: skip
    prompt = llm.encode("a b c a b c a b c a b c a b c")
    want = llm.generate(["a b c a b c a b c a b c a b c"], settings)[0]
    sched = Scheduler(llm, max_running=2)
    sched.start()
    try:
        ticket = sched.submit(prompt, settings)
        while True:
            event = ticket.events.get(timeout=60)
            if event["type"] in ("done", "error"):
                break
    finally:
        sched.shutdown(grace=5)
    got = event["completion"]
    assert got.token_ids == want.token_ids and got.drafts == want.drafts
    assert sum(d for d, _ in got.drafts.values()) > 0 and got.accepted == want.accepted
