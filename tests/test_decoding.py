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


def test_threshold_above_one_commits_one_token_per_step(model):
    (res,), events = run(model, [PROMPTS[0]], LowConfidence(block_size=8, threshold=1.5))
    assert all(len(e.commits) == 1 for e in events)
    assert sorted(res.steps) == list(range(1, 25))  # a distinct step for every token


def test_threshold_zero_commits_whole_block_per_step(model):
    (res,), events = run(model, [PROMPTS[0]], LowConfidence(block_size=8, threshold=0.0))
    assert [len(e.commits) for e in events] == [8, 8, 8]
    assert res.nfe == 3 and res.tpf == 8.0


@pytest.mark.parametrize("policy", [make_policy("ar"), LowConfidence(block_size=4, threshold=0.3)])
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
