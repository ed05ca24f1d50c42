import pytest
import torch

from clover.decoding.loop import generate
from clover.decoding.policies import LowConfidence, make_policy
from clover.decoding.sampling import SamplingParams
from clover.errors import CloverError
from tests.conftest import ScriptedModel, tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]


def run(model, prompts, policy, max_new=24, **kw):
    results = []
    events = list(generate(model, prompts, policy, max_new_tokens=max_new, results=results, **kw))
    return results, events


def test_block_size_one_is_ar_greedy(model):
    ar, _ = run(model, PROMPTS, make_policy("ar"))
    lc, _ = run(model, PROMPTS, LowConfidence(block_size=1, threshold=0.95))
    for a, b in zip(ar, lc):
        assert a.tokens == b.tokens and len(a.tokens) == 24
        assert a.nfe == len(a.tokens)  # one forward per token, prefill included


def test_ar_matches_uncached_greedy(model):
    prompt = PROMPTS[0]
    (res,), _ = run(model, [prompt], make_policy("ar"), max_new=10)
    seq = list(prompt)
    for _ in range(10):
        with torch.no_grad():
            out = model.logits(model(torch.tensor([seq])))
        seq.append(int(out[0, -1].argmax()))
    assert res.tokens == seq[len(prompt) :]


@pytest.mark.parametrize("shape", [(1, 151936), (8, 151936), (3, 5, 4099), (0, 64), (7,)])
def test_greedy_ids_are_the_arg_max(shape):
    """`greedy_ids` (max's index, the fast path) picks what `argmax` (the reference) picks:
    the first of tied largest logits, a NaN over everything, +inf and -inf rows."""
    from clover.decoding.sampling import greedy_ids

    g = torch.Generator().manual_seed(sum(shape))
    for trial in range(6):
        x = torch.randint(-4, 4, shape, generator=g).float()  # many ties
        if trial == 1:
            x = torch.randn(shape, generator=g).half().float()
        if x.numel() and trial >= 2:
            flat = x.view(-1, x.shape[-1])
            cols = torch.randint(0, x.shape[-1], (3,), generator=g)
            value = {2: float("inf"), 3: float("-inf"), 4: float("nan"), 5: 9.0}[trial]
            flat[:, cols] = value
            if trial == 3:
                flat[0] = float("-inf")  # a row with nothing allowed
        assert torch.equal(greedy_ids(x), x.argmax(-1)), trial


def test_greedy_draws_take_the_arg_max_and_skip_the_softmax_where_no_row_reads_it(
    model, monkeypatch
):
    """A greedy draw is the first largest logit, its confidence that token's softmax
    probability; a step whose rows select by no confidence (ar, self_spec) draws the arg-max
    alone, and decodes exactly what it did with the softmax; low_confidence gets its
    confidences."""
    from clover.decoding.sampling import sample

    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index
    tokens, conf = sample(logits, SamplingParams())
    assert tokens.tolist() == logits.argmax(-1).tolist() and int(tokens[2]) == 7
    torch.testing.assert_close(conf, torch.softmax(logits, -1).amax(-1))
    alone, none = sample(logits, SamplingParams(), confidence=False)
    assert torch.equal(alone, tokens) and none is None

    asked: list[bool] = []
    import clover.decoding.sampling as sampling  # the batch's greedy draw (`greedy_picks`)

    real = sampling.sample
    monkeypatch.setattr(sampling, "sample", lambda *a, **kw: (asked.append(kw["confidence"]),
                                                              real(*a, **kw))[1])  # fmt: skip
    policies = [make_policy("ar"), make_policy("self_spec", 4, draft="lookup"),
                LowConfidence(block_size=4, threshold=0.5)]  # fmt: skip
    fast = []
    for p, wanted in zip(policies, (False, False, True)):
        asked.clear()
        fast.append(run(model, PROMPTS, p)[0])
        assert asked and set(asked) == {wanted}, p
    monkeypatch.setattr(sampling, "sample",
                        lambda *a, **kw: real(*a, **{**kw, "confidence": True}))  # fmt: skip
    for p, got in zip(policies, fast):
        want, _ = run(model, PROMPTS, p)
        assert [r.tokens for r in got] == [r.tokens for r in want]


def test_threshold_above_one_commits_one_token_per_step(model):
    (res,), events = run(model, [PROMPTS[0]], LowConfidence(block_size=8, threshold=1.5))
    assert all(len(e.commits) == 1 for e in events)
    assert sorted(res.steps) == list(range(1, 25))  # a distinct step for every token


def test_threshold_zero_commits_whole_block_per_step(model):
    (res,), events = run(model, [PROMPTS[0]], LowConfidence(block_size=8, threshold=0.0))
    assert [len(e.commits) for e in events] == [8, 8, 8]
    assert res.nfe == 3 and res.tpf == 8.0


@pytest.mark.parametrize(
    "policy",
    [
        make_policy("ar"),
        LowConfidence(block_size=4, threshold=0.3),
        LowConfidence(block_size=4, threshold=0.3, slide=True),
    ],
)
def test_batched_equals_one_at_a_time(model, policy):
    batched, _ = run(model, PROMPTS, policy, eos_token_ids=[1])
    for prompt, b in zip(PROMPTS, batched):
        (single,), _ = run(model, [prompt], policy, eos_token_ids=[1])
        assert single.tokens == b.tokens
        assert single.steps == b.steps


def test_mid_block_eos_ends_the_answer():
    # EOS (1) at answer index 3 is confident and committed first; 0..2 come later one by one.
    script = [20, 21, 22, 1, 23, 24, 25, 26]
    conf = [0.5, 0.5, 0.5, 0.99, 0.99, 0.99, 0.99, 0.99]
    m = ScriptedModel(prompt_len=2, script=script, conf=conf)
    (res,), events = run(m, [[5, 6]], LowConfidence(block_size=8, threshold=0.9), eos_token_ids=[1])
    assert res.tokens == [20, 21, 22] and res.finish_reason == "stop"
    first = {c.index for c in events[0].commits}
    assert first == {3, 4, 5, 6, 7}  # committed in parallel before the EOS cut
    assert all(c.index < 3 for e in events[1:] for c in e.commits)  # no steps after the EOS
    streamed = [t for e in events for t in e.final.get(0, [])]
    assert streamed == [20, 21, 22]


def test_final_tokens_stream_in_order_and_never_change():
    script = list(range(10, 26))
    conf = [0.5 if i % 3 else 0.99 for i in range(16)]
    m = ScriptedModel(prompt_len=1, script=script, conf=conf)
    (res,), events = run(m, [[5]], LowConfidence(block_size=8, threshold=0.9), max_new=16)
    streamed = [t for e in events for t in e.final.get(0, [])]
    assert streamed == res.tokens == script
    assert res.finish_reason == "length"


def test_stop_callback_ends_a_row(model):
    seen = []

    def stop(row, tokens):
        seen.append(len(tokens))
        return len(tokens) >= 5

    (res,), _ = run(model, [PROMPTS[0]], make_policy("ar"), stop=stop)
    assert len(res.tokens) == 5 and res.finish_reason == "stop"


def test_sampling_is_reproducible_with_a_seed(model):
    pol = LowConfidence(block_size=4, threshold=0.5)
    s = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=7)
    a, _ = run(model, PROMPTS, pol, sampling=s)
    b, _ = run(model, PROMPTS, pol, sampling=s)
    c, _ = run(model, PROMPTS, pol, sampling=SamplingParams(temperature=1.0, seed=8))
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.tokens for r in a] != [r.tokens for r in c]


def test_bad_requests_are_clear_errors(model):
    with pytest.raises(CloverError, match="empty prompt"):
        run(model, [[]], make_policy("ar"))
    with pytest.raises(CloverError, match="context"):
        run(model, [[5] * 256], make_policy("ar"), max_new=10)
    (capped,), _ = run(model, [[5] * 250], make_policy("ar"), max_new=10)
    assert len(capped.tokens) <= 6 and capped.finish_reason in ("length", "stop")
    with pytest.raises(CloverError, match="unknown decoder"):
        make_policy("beam")
    with pytest.raises(CloverError, match="temperature"):
        SamplingParams(temperature=-1)
    no_mask = tiny_model(mask_token_id=None)
    with pytest.raises(CloverError, match="mask_token_id"):
        run(no_mask, [[5]], LowConfidence(block_size=4))


@pytest.mark.parametrize("policy", [make_policy("ar"), LowConfidence(block_size=4, threshold=0.3),
                                    make_policy("self_spec", 4)])  # fmt: skip
def test_rows_join_and_leave_between_steps(model, policy):
    from clover.decoding.loop import BatchDecoder

    alone = [run(model, [p], policy, eos_token_ids=[1])[0][0].tokens for p in PROMPTS]
    batch = BatchDecoder(model)
    rows = [batch.add(PROMPTS[0], policy, max_new_tokens=24, eos_token_ids=[1])]
    for _ in range(3):
        batch.step()
    rows.append(batch.add(PROMPTS[1], policy, max_new_tokens=24, eos_token_ids=[1]))
    doomed = batch.add([30, 31, 32], policy, max_new_tokens=24, eos_token_ids=[1])
    batch.step()
    rows.append(batch.add(PROMPTS[2], policy, max_new_tokens=24, eos_token_ids=[1]))
    assert batch.cancel(doomed.index) and not batch.cancel(doomed.index)
    while batch.active:
        batch.step()
    assert [r.result.tokens for r in rows] == alone
    assert doomed.result.finish_reason == "cancelled"


@pytest.mark.parametrize("policy", [make_policy("ar"), LowConfidence(block_size=4, threshold=0.3),
                                    make_policy("self_spec", 4)])  # fmt: skip
def test_rows_joining_together_share_one_prefill_pass(model, policy):
    """Prompts added inside `joining()` while a batch runs are prefilled in one padded pass
    (not one pass each) when the block ends, and every answer equals its answer alone."""
    from clover.decoding.loop import BatchDecoder

    prompts = [*PROMPTS, [40, 41, 42, 43, 44, 45, 46], [50]]
    alone = [run(model, [p], policy, eos_token_ids=[1])[0][0].tokens for p in prompts]
    passes = []
    hook = model.register_forward_pre_hook(lambda *_: passes.append(1))
    try:
        batch = BatchDecoder(model)
        rows = [batch.add(prompts[0], policy, max_new_tokens=24, eos_token_ids=[1])]
        batch.step()
        batch.step()
        before = len(passes)
        with batch.joining():
            for p in prompts[1:]:
                rows.append(batch.add(p, policy, max_new_tokens=24, eos_token_ids=[1]))
            assert len(batch.active) == 1  # they join when the block ends
        assert len(passes) == before + 1  # one prefill for the three that need one ([50]: none)
        assert len(batch.active) == len(prompts) and batch.cache.batch_size == len(prompts)
        assert [r.result.nfe for r in rows[1:]] == [1, 1, 1, 0]
        while batch.active:
            batch.step()
    finally:
        hook.remove()
    assert [r.result.tokens for r in rows] == alone


def test_a_joining_block_that_fails_adds_none_of_its_rows(model, monkeypatch):
    from clover.decoding.loop import BatchDecoder

    policy = make_policy("ar")
    alone = run(model, [PROMPTS[0]], policy, eos_token_ids=[1])[0][0].tokens
    batch = BatchDecoder(model)
    row = batch.add(PROMPTS[0], policy, max_new_tokens=24, eos_token_ids=[1])
    batch.step()
    with pytest.raises(RuntimeError, match="caller"), batch.joining():
        batch.add(PROMPTS[1], policy, max_new_tokens=24, eos_token_ids=[1])
        raise RuntimeError("the caller failed")
    assert len(batch.active) == 1

    def broken(*args, **kwargs):
        raise RuntimeError("pass failed")

    with monkeypatch.context() as m, pytest.raises(RuntimeError, match="pass failed"):
        with batch.joining():
            batch.add(PROMPTS[2], policy, max_new_tokens=24, eos_token_ids=[1])
            m.setattr(model, "forward", broken)
    assert len(batch.active) == 1 and batch.cache.batch_size == 1
    with pytest.raises(CloverError, match="nest"), batch.joining(), batch.joining():
        pass
    while batch.active:
        batch.step()
    assert row.result.tokens == alone


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("block", [2, 4, 8])
def test_sliding_window_never_confident_is_ar_greedy(seed, block):
    """The window's first position is the prefix's causal prediction: with no other position
    confident enough, a sliding window writes exactly the AR answer, one token per pass."""
    model = tiny_model(seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 64, (n,), generator=g).tolist() for n in (3, 9, 1, 14)]
    ar, _ = run(model, prompts, make_policy("ar"), eos_token_ids=[1])
    slide, _ = run(model, prompts, LowConfidence(block, 1.5, slide=True), eos_token_ids=[1])
    for a, s in zip(ar, slide):
        assert s.tokens == a.tokens and s.finish_reason == a.finish_reason
        assert s.nfe == a.nfe


def test_sliding_window_commits_first_position_and_confident_ones():
    script = list(range(10, 22))
    conf = [0.5, 0.5, 0.99, 0.5, 0.99, 0.99, 0.5, 0.5, 0.5, 0.5, 0.99, 0.5]
    m = ScriptedModel(prompt_len=2, script=script, conf=conf)
    policy = LowConfidence(block_size=4, threshold=0.9, slide=True)
    (res,), events = run(m, [[5, 6]], policy, max_new=12)
    assert res.tokens == script and res.finish_reason == "length"
    per_step = [sorted(c.index for c in e.commits) for e in events]
    # window 0-3: 0 (its first) + 2; window 1-4: 1 + 4; window 3-6: 3 + 5
    assert per_step[:3] == [[0, 2], [1, 4], [3, 5]]
    assert per_step[3:] == [[6], [7, 10], [8], [9], [11]]  # 10 joins the window 7-10
    assert all(len(e.commits) >= 1 for e in events)
    streamed = [t for e in events for t in e.final.get(0, [])]
    assert streamed == script


def test_sliding_window_stops_at_eos_and_budget():
    script = [20, 21, 1, 23, 24]
    m = ScriptedModel(prompt_len=1, script=script, conf=[0.99] * 5)
    (res,), events = run(
        m, [[5]], LowConfidence(block_size=8, threshold=0.9, slide=True), eos_token_ids=[1]
    )
    assert res.tokens == [20, 21] and res.finish_reason == "stop" and res.nfe == 1
    m = ScriptedModel(prompt_len=1, script=list(range(10, 30)), conf=[0.5] * 20)
    (res,), _ = run(m, [[5]], LowConfidence(block_size=8, threshold=0.9, slide=True), max_new=5)
    assert res.tokens == [10, 11, 12, 13, 14] and res.finish_reason == "length"


def test_slide_is_a_low_confidence_option():
    with pytest.raises(CloverError, match="slide"):
        make_policy("self_spec", 4, slide=True)
    assert make_policy("low_confidence", 4, 0.9, slide=True).slide
