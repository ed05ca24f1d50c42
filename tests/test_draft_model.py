"""A whole smaller model as the drafter (`--drafter MODEL`): lossless, its cache kept to the
committed tokens, loaded beside the target only when it shares its tokenizer."""

import pytest
import torch

from clover.decoding.costs import best_length
from clover.decoding.draft_model import ModelDraftRunner, draft_vocabulary
from clover.decoding.policies import SelfSpec
from clover.decoding.runtime import Runtime
from clover.errors import CloverError
from tests.conftest import tiny_model
from tests.test_drafter import answer_in_batch, decoded, drafter_for

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]


@pytest.mark.parametrize("draft", ["drafter", "drafter+lookup"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_draft_model_drafts_are_lossless_batched(draft, adaptive):
    """Another model drafting: float32 greedy answers token-identical to ar, rows of
    different lengths decoded together."""
    target = Runtime(tiny_model(seed=3), tiny_model(seed=5))
    ar = decoded(target, PROMPTS, "ar", 24)
    spec = decoded(target, PROMPTS, SelfSpec(block_size=4, draft=draft, adaptive=adaptive), 24)
    assert [r.tokens for r in spec] == [r.tokens for r in ar]
    if not adaptive:
        assert any("drafter" in r.drafts for r in spec)


def test_the_model_drafting_for_itself_is_always_kept(monkeypatch):
    """The target as its own draft model: every draft is the target's next token, so every
    pass keeps all of its drafts. Any slip in the draft cache (a token fed twice or not at
    all, a draft left in it) would change a draft and lose it. (Chains of the whole width:
    the next test stops them.)"""
    monkeypatch.setattr(ModelDraftRunner, "STOP_BELOW", 0.0)
    model = tiny_model(seed=3)
    runtime = Runtime(model, model)
    ar = decoded(runtime, PROMPTS, "ar", 25)
    spec = decoded(runtime, PROMPTS, SelfSpec(block_size=4, draft="drafter", adaptive=False), 25)
    assert [r.tokens for r in spec] == [r.tokens for r in ar]
    for r in spec:
        drafted, kept = r.drafts["drafter"]
        assert kept == drafted > 0
        assert r.nfe <= 1 + -(-len(r.tokens) // 4)  # the prompt's pass, then 4 tokens a pass


def test_the_draft_model_reads_each_kept_token_once(monkeypatch):
    """A chain's drafts stay in the draft model's cache where the verify pass keeps them: the
    model drafting for itself (every draft kept) reads the prompt and each token of the answer
    once, not the kept drafts a second time at the next draft. A random draft model (drafts
    lost) reads more, and its answers stay ar's: what it read ahead is rolled back."""
    monkeypatch.setattr(ModelDraftRunner, "STOP_BELOW", 0.0)
    model = tiny_model(seed=3)
    policy = SelfSpec(block_size=4, draft="drafter", adaptive=False)
    # the same weights as the target (a model of its own, so its passes can be told apart)
    for draft, all_kept in ((tiny_model(seed=3), True), (tiny_model(seed=5), False)):
        runtime = Runtime(model, draft)
        read = []
        forward = type(draft).forward

        def counting(self, ids, *args, n_valid=None, draft=draft, read=read, forward=forward,
                     **kwargs):  # fmt: skip
            if self is draft:
                read.append(int(n_valid.sum()) if n_valid is not None else ids.numel())
            return forward(self, ids, *args, n_valid=n_valid, **kwargs)

        monkeypatch.setattr(type(draft), "forward", counting)
        ar = decoded(runtime, PROMPTS[:1], "ar", 25)
        read.clear()
        [spec] = decoded(runtime, PROMPTS[:1], policy, 25)
        monkeypatch.setattr(type(draft), "forward", forward)
        assert spec.tokens == ar[0].tokens
        drafted, kept = spec.drafts["drafter"]
        assert (kept == drafted) == all_kept
        if all_kept:  # the prompt and the answer's tokens (but the last chain's), once each
            assert sum(read) <= len(PROMPTS[0]) + len(spec.tokens), read
        else:
            assert sum(read) > len(PROMPTS[0]) + len(spec.tokens)


def test_a_draft_chain_stops_where_its_drafts_become_unlikely(monkeypatch):
    """A chain ends after the draft at which the product of the draft model's probabilities
    of its drafts falls below STOP_BELOW: a random model (top probabilities near 0.05) drafts
    one token a pass, the same model with sharpened logits (the same arg-maxes) the whole
    block where it is sure (all but its first chain here). Drafting for itself, every draft is
    kept either
    way, so the draft cache stays exact when a chain stops early; off (0), every chain is
    whole. The answers are ar's throughout."""
    policy = SelfSpec(block_size=4, draft="drafter", adaptive=False)
    unsure = tiny_model(seed=3)
    sure = tiny_model(seed=3)
    with torch.no_grad():
        sure.model.norm.weight.mul_(10)
    for model, stop, longest in ((unsure, 0.3, 1), (unsure, 0.0, 3), (sure, 0.3, 3)):
        monkeypatch.setattr(ModelDraftRunner, "STOP_BELOW", stop)
        runtime = Runtime(model, model)
        ar = decoded(runtime, PROMPTS, "ar", 25)
        spec = decoded(runtime, PROMPTS, policy, 25)
        assert [r.tokens for r in spec] == [r.tokens for r in ar]
        for r in spec:
            drafted, kept = r.drafts["drafter"]
            assert kept == drafted > 0, (stop, r.drafts)
            assert max(r.accepted) == longest, (stop, r.accepted)
        if model is sure and stop:  # sure of some drafts, not of all
            assert any(min(r.accepted) < 3 for r in spec)


def test_draft_model_rows_joining_a_running_batch_and_the_prefix_cache():
    """A drafting row joining a running batch, and one whose prompt comes from the prefix
    cache: the draft model reads their whole prompts at their first draft."""
    from clover.decoding.prefix_cache import PrefixCache

    model = tiny_model(seed=4)
    policy = SelfSpec(block_size=4, draft="drafter", adaptive=False)

    def answer(prompt, prefix=None, join=None):
        return answer_in_batch(Runtime(model, model, prefix), policy, prompt, join)

    prompt = [7, 8, 9, 10, 11, 12, 13, 14]
    cold = answer(prompt)
    assert cold.tokens == decoded(model, [prompt], "ar", 16)[0].tokens
    assert cold.drafts["drafter"][0] == cold.drafts["drafter"][1] > 0
    joined = answer(prompt, join=[20, 21, 22])
    assert joined.tokens == cold.tokens and joined.drafts == cold.drafts
    cache = PrefixCache(64 * 2**20)
    assert answer(prompt, cache).tokens == cold.tokens
    warm = answer(prompt, cache)  # its prefix from the cache
    assert warm.cached_tokens > 0
    assert warm.tokens == cold.tokens and warm.drafts == cold.drafts


def test_draft_model_resumes_from_its_own_prefix_cache():
    """Beside the model's prefix cache the draft model keeps its own: a repeated prompt and a
    conversation's next turn resume the draft model's cache there instead of reading the
    whole prompt again. The model drafting for itself keeps every draft, so a restored
    position that differed from the one read afresh would show as a lost draft."""
    from clover.decoding.prefix_cache import PrefixCache

    model = tiny_model(seed=4)
    policy = SelfSpec(block_size=4, draft="drafter", adaptive=False)
    prompt = [(7 * i) % 50 + 3 for i in range(40)]
    cold = answer_in_batch(Runtime(model, model), policy, prompt)
    cache = PrefixCache(64 * 2**20)
    runtime = Runtime(model, model, cache)
    first = answer_in_batch(runtime, policy, prompt)
    assert cache.draft is not None and cache.draft.stats.cached_tokens == 0
    # the two share the bound: here the same model, so half each
    assert cache.capacity + cache.draft.capacity == cache.report()["capacity_bytes"] == 64 * 2**20
    assert cache.draft.capacity == 32 * 2**20 and cache.report()["bytes"] > cache.bytes > 0
    again = answer_in_batch(runtime, policy, prompt)
    assert cache.draft.stats.cached_tokens >= 32  # two 16-token blocks of the draft's cache
    for r in (first, again):
        assert r.tokens == cold.tokens and r.drafts == cold.drafts
        assert r.drafts["drafter"][0] == r.drafts["drafter"][1] > 0
    turn = [*prompt, *first.tokens, 9, 10, 11]  # the next turn reads the answer back too
    before = cache.draft.stats.cached_tokens
    nxt = answer_in_batch(runtime, policy, turn)
    assert cache.draft.stats.cached_tokens - before >= 48
    assert nxt.tokens == decoded(model, [turn], "ar", 16)[0].tokens
    assert nxt.drafts["drafter"][0] == nxt.drafts["drafter"][1] > 0
    # the draft logits of a resumed row are those of one that read its whole prompt
    from types import SimpleNamespace

    def draft_logits(prefix):
        runner = ModelDraftRunner(model, model, prefix=prefix)
        runner.add_row()
        row = SimpleNamespace(committed=prompt, pending=[5], partition=None, max_new=0, answer=[])
        runner.take_context([row], None, None, [True])
        out = runner.draft(torch.tensor([5]), 4)
        runner.select([])  # the row leaves: what it read goes into `prefix`
        return out

    own = PrefixCache(64 * 2**20)
    fresh = draft_logits(own)
    resumed = draft_logits(own)
    assert own.stats.cached_tokens == 32
    assert torch.allclose(resumed, fresh, atol=1e-5)
    cache.clear()  # the draft model's goes with the model's
    assert cache.draft.bytes == 0
    # without the model's prefix cache the draft model keeps none either
    assert answer_in_batch(Runtime(model, model), policy, prompt).tokens == cold.tokens


def test_draft_model_reads_a_long_prompt_from_its_window(monkeypatch):
    """A row's first draft reads at most max(`WINDOW`, `READ_PER_TOKEN` x the tokens it may
    still write) committed tokens past what the draft model's prefix cache holds: the last
    ones. Answers stay ar's; a windowed row's draft cache is not saved (it does not start at
    the prompt's start)."""
    from clover.decoding.prefix_cache import PrefixCache

    model = tiny_model(seed=4)
    policy = SelfSpec(block_size=4, draft="drafter", adaptive=False)
    prompt = [(7 * i) % 50 + 3 for i in range(40)]
    ar = decoded(model, [prompt], "ar", 16)[0].tokens
    read = []
    forward = type(model).forward

    def counting(self, ids, *args, **kwargs):
        read.append(ids.shape[1])
        return forward(self, ids, *args, **kwargs)

    draft = tiny_model(seed=4)  # the same weights, its own forward counted
    monkeypatch.setattr(type(draft), "forward", counting)
    monkeypatch.setattr(ModelDraftRunner, "WINDOW", 8)
    monkeypatch.setattr(ModelDraftRunner, "READ_PER_TOKEN", 0)
    cache = PrefixCache(64 * 2**20)
    runtime = Runtime(model, draft, cache)
    read.clear()
    windowed = answer_in_batch(runtime, policy, prompt)
    assert windowed.tokens == ar and windowed.drafts["drafter"][0] > 0
    # the target's passes are counted too (same class): the draft model's first pass is the
    # window and the pending token, never the whole prompt
    assert 9 in read and len(prompt) + 1 not in read
    assert cache.draft.bytes == 0  # nothing saved from a windowed row
    monkeypatch.setattr(ModelDraftRunner, "READ_PER_TOKEN", 3)  # 16 tokens to write: 48
    read.clear()
    whole = answer_in_batch(runtime, policy, prompt)
    assert whole.tokens == ar and cache.draft.bytes > 0 and len(prompt) + 1 in read


def test_draft_model_trees_and_sampling_rows():
    """Tree policies make their trees from the draft model's chain logits; sampling rows draw
    their drafts from its distribution: greedy rows stay ar's, sampling rows run to length."""
    from clover.decoding.loop import generate
    from clover.decoding.sampling import SamplingParams

    target = Runtime(tiny_model(seed=3), tiny_model(seed=5))
    ar = decoded(target, PROMPTS, "ar", 20)
    tree = decoded(target, PROMPTS, SelfSpec(block_size=4, draft="drafter", adaptive=False,
                                             tree=9), 20)  # fmt: skip
    assert [r.tokens for r in tree] == [r.tokens for r in ar]
    results = []
    sampling = SamplingParams(temperature=0.8, seed=1)
    policy = SelfSpec(block_size=4, draft="drafter", adaptive=False)
    for _ in generate(target, PROMPTS, policy, max_new_tokens=12, sampling=sampling,
                      results=results):  # fmt: skip
        pass
    assert all(len(r.tokens) == 12 or r.finish_reason == "stop" for r in results)
    assert any(r.drafts.get("drafter", (0, 0))[0] for r in results)


def test_the_draft_vocabulary_is_the_first_ids_and_the_end_tokens():
    """The first ids, the end tokens past them, padded with the next ids to 16-row tiles;
    none (the whole head) when it would not be smaller."""
    config = tiny_model(eos_token_id=[1, 60]).config
    vocab = draft_vocabulary(config, 20)
    assert len(vocab) == 32 and vocab.tolist() == sorted(vocab.tolist())
    assert vocab[:20].tolist() == list(range(20)) and 60 in vocab.tolist()
    assert len(set(vocab.tolist())) == 32
    assert draft_vocabulary(config, 0) is None and draft_vocabulary(config, 50) is None
    # and the ids its own drafter drafts (past the first ids; 70 is past the vocabulary)
    more = draft_vocabulary(config, 20, torch.tensor([3, 40, 41, 60, 70]))
    assert len(more) == 32 and {40, 41, 60} <= set(more.tolist()) and 70 not in more.tolist()
    assert more[:20].tolist() == list(range(20)) and len(set(more.tolist())) == 32
    assert draft_vocabulary(config, 20, torch.arange(20, 60)) is None  # no fewer than all


def test_a_draft_model_drafts_its_shipped_drafters_ids(tiny_checkpoint, tmp_path, monkeypatch):
    """A draft model whose registry entry ships a drafter file drafts that file's ids too
    (`draft_ids`), and a runtime's head follows its draft vocabulary when that is changed
    after the load (benchmarks/drafter_ab.py compares two)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from clover.checkpoints import loader
    from clover.decoding.runtime import Runtime
    from clover.models.drafter import drafter_vocabulary, new_drafter, save_drafter

    target = tiny_model(seed=3)
    drafter = new_drafter(target, "tiny", num_hidden_layers=1, block_size=4)
    ids = list(range(4, 64, 4)) + [61]  # 16 ids
    drafter.set_vocab(torch.tensor(sorted(ids)))
    path = save_drafter(drafter, tmp_path / "d.safetensors", dtype=torch.float32)
    assert drafter_vocabulary(path).tolist() == sorted(ids)
    real = loader.load

    def load(*args, **kw):  # the draft model's own load finds a registry entry with a drafter
        out = real(*args, **kw)
        if kw["drafter"] != "none":
            return out
        return replace(out, resolved=SimpleNamespace(entry=SimpleNamespace(drafter_path=path)))

    monkeypatch.setattr(loader, "load", load)
    draft = real(str(tiny_checkpoint), dtype="float32", progress=False,
                 drafter=str(tiny_checkpoint)).drafter_model  # fmt: skip
    assert draft.draft_ids.tolist() == sorted(ids)
    draft.draft_vocab = 8
    runtime = Runtime(target, draft)
    vocab = runtime.drafter_runner().vocab.tolist()
    assert set(range(8)) | {61} <= set(vocab) and len(vocab) % 16 == 0
    draft.draft_ids = None
    assert runtime.drafter_runner().vocab.tolist() == list(range(16))
    draft.draft_vocab = 0
    assert runtime.drafter_runner().vocab is None


@pytest.mark.parametrize("head", [None, "int4", "int8"])
def test_a_draft_models_head_over_its_draft_vocabulary(head):
    """The draft model's logits over its draft vocabulary are its whole head's for those ids
    (a quantized head's own levels) and -inf elsewhere, position after position."""
    from clover import kernels
    from clover.quant import quantize_model

    if head and kernels.load() is None:
        pytest.skip("no C++ compiler here")
    target, draft = tiny_model(seed=3), tiny_model(seed=5)
    draft.draft_vocab = 20
    if head:
        quantize_model(draft, "int4", head=head)
    made = ModelDraftRunner.vocab_head(draft)  # made once (a `Runtime` keeps it)
    full, part = ModelDraftRunner(target, draft, made), ModelDraftRunner(target, draft, made)
    assert part.head is not None and len(part.vocab) == 32
    full.head = full.vocab = None  # the whole head: the reference
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    for r in (full, part):
        r.add_row()
        with torch.inference_mode():
            draft(prompt, r.cache, "causal")
        r.fed = [6]
    forced = torch.tensor([[7, 3, 11]])
    pick = lambda i, lg: forced[:, i]  # noqa: E731
    a, b = full.draft(torch.tensor([5]), 4, pick), part.draft(torch.tensor([5]), 4, pick)
    others = torch.ones(64, dtype=torch.bool)
    others[part.vocab] = False
    assert bool(torch.isinf(b[..., others]).all()) and not torch.isinf(a).any()
    torch.testing.assert_close(b[..., part.vocab], a[..., part.vocab], rtol=0, atol=1e-5)


def test_draft_vocabulary_drafts_are_lossless():
    """A draft model drafting from 16 of 64 ids: greedy answers still ar's, and no draft
    outside them; its runtime cuts the head once."""
    draft = tiny_model(seed=5)
    draft.draft_vocab = 16
    target = Runtime(tiny_model(seed=3), draft)
    assert target.drafter_runner().head is target.drafter_runner().head is not None
    ar = decoded(target, PROMPTS, "ar", 24)
    spec = decoded(target, PROMPTS, SelfSpec(block_size=4, draft="drafter", adaptive=False), 24)
    assert [r.tokens for r in spec] == [r.tokens for r in ar]
    assert any(r.drafts["drafter"][0] for r in spec)
    own = tiny_model(seed=3)
    own.draft_vocab = 16
    own = Runtime(tiny_model(seed=3), own)
    for r in decoded(own, PROMPTS, SelfSpec(block_size=4, draft="drafter", adaptive=False), 24):
        # the target drafting for itself keeps only drafts of its answer's tokens among the 16
        # (the whole head would keep every draft: 17 a row here)
        assert 0 < r.drafts["drafter"][1] <= sum(t < 16 for t in r.tokens)


def test_a_draft_model_is_tried_from_its_own_prior():
    """Where a draft pass costs half a target step, a trained drafter's 0.6 prior says drafts
    do not pay (so they are never tried, never learnt); a draft model starts from its own
    higher prior, drafts from the first row, and learns from there."""
    from clover.decoding.costs import PassCosts

    model = tiny_model(seed=3)
    runtime = Runtime(model, model)
    runtime._costs[True] = PassCosts({1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0},
                                     {2: 5.0, 3: 10.0, 4: 15.0})  # fmt: skip
    assert runtime.shared_acceptance("drafter", 3).p == [ModelDraftRunner.PRIOR] * 3
    assert runtime.shared_acceptance("lookup", 3).p == [0.6] * 3
    assert best_length([0.6] * 3, runtime._costs[True], 3, drafter=True) == 0
    [r] = decoded(runtime, [PROMPTS[0]], SelfSpec(block_size=4, draft="drafter"), 16)
    assert r.drafts["drafter"][0] > 0
    assert runtime.shared_acceptance("drafter", 3).p[0] > ModelDraftRunner.PRIOR  # all kept


def test_a_row_alone_prices_the_chains_that_stop_themselves(monkeypatch):
    """A draft model's row alone asks the costs to price its chains by the passes they are
    likely to run (they stop themselves: STOP_BELOW); rows of a batch, a draft model without
    the stop or with PRICE_STOPS off, and a trained drafter price k passes. Answers are ar's."""
    from clover.decoding.costs import PassCosts
    from clover.decoding.sources import DraftSources

    asked = []
    length = DraftSources.drafter_length

    def spy(self, room, stops=False):
        asked.append(stops)
        return length(self, room, stops)

    monkeypatch.setattr(DraftSources, "drafter_length", spy)
    model = tiny_model(seed=3)
    policy = SelfSpec(block_size=4, draft="drafter")
    cheap = PassCosts({1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0}, {2: 1.0, 3: 2.0, 4: 3.0},
                      {2: {w: 10.0 + w / 2 for w in range(1, 6)}},
                      {2: {w: w - 1.0 for w in range(2, 6)}})  # fmt: skip
    cases = [
        (model, {}, 1, True),
        (model, {}, 2, False),
        (model, {"STOP_BELOW": 0.0}, 1, False),
        (model, {"PRICE_STOPS": False}, 1, False),
        (drafter_for(model), {}, 1, False),
    ]
    for draft, attrs, rows, want in cases:
        for name, value in attrs.items():
            monkeypatch.setattr(ModelDraftRunner, name, value)
        asked.clear()
        runtime = Runtime(model, draft)
        runtime._costs[True] = cheap  # drafts pay, in batches too: every row is asked
        prompts = [PROMPTS[0], PROMPTS[2]][:rows]
        ar = decoded(runtime, prompts, "ar", 12)
        spec = decoded(runtime, prompts, policy, 12)
        assert [r.tokens for r in spec] == [r.tokens for r in ar]
        assert asked and set(asked) == {want}, (attrs, rows, asked)
        monkeypatch.undo()
        monkeypatch.setattr(DraftSources, "drafter_length", spy)


def test_draft_model_pass_costs_are_timed():
    """The pass-cost table of a model with a draft model holds its draft passes by length,
    longer drafts costing more."""
    from clover.decoding.timing import measure

    costs = measure(tiny_model(seed=3), tiny_model(seed=5), reps=5, widths=(1, 2, 4, 8),
                    batches=False)  # fmt: skip
    assert sorted(costs.draft_ms) == [2, 4, 8]
    assert costs.draft_ms[8] > costs.draft_ms[2] > 0


def test_loading_a_draft_model_beside_the_target(tiny_checkpoint, tmp_path):
    """`--drafter` takes a model of the same tokenizer (here the target's own checkpoint); a
    model of another vocabulary, or a name that is neither a drafter file nor a model, is a
    clear error."""
    from clover.checkpoints.hf_dir import save_checkpoint
    from clover.checkpoints.loader import load
    from clover.models.base import DiffusionLM

    loaded = load(str(tiny_checkpoint), dtype="float32", progress=False,
                  drafter=str(tiny_checkpoint))  # fmt: skip
    assert isinstance(loaded.drafter_model, DiffusionLM)
    assert loaded.drafter == str(tiny_checkpoint)
    files = [p for p in tiny_checkpoint.iterdir() if p.name.startswith("tokenizer")]
    other = save_checkpoint(tiny_model(vocab_size=330, eos_token_id=1, mask_token_id=0),
                            tmp_path / "other", files)  # fmt: skip
    with pytest.raises(CloverError, match="tokenizer"):
        load(str(tiny_checkpoint), dtype="float32", progress=False, drafter=str(other))
    with pytest.raises(CloverError, match="not a drafter file"):
        load(str(tiny_checkpoint), dtype="float32", progress=False,
             drafter=str(tmp_path / "missing"))  # fmt: skip
    with pytest.raises(CloverError, match="not found"):
        load(str(tiny_checkpoint), dtype="float32", progress=False,
             drafter=str(tmp_path / "missing.safetensors"))  # fmt: skip


def test_a_registry_entry_may_name_a_draft_model():
    """An entry's default drafter: its shipped file, else its draft model's name; a server
    whose default draft needs a drafter accepts either."""
    from dataclasses import replace

    from clover.checkpoints.registry import KNOWN_MODELS

    coder = KNOWN_MODELS["qwen2.5-coder-0.5b"]
    assert coder.default_drafter == coder.drafter_path
    bigger = KNOWN_MODELS["qwen2.5-coder-1.5b"]
    assert bigger.default_drafter == "qwen2.5-coder-0.5b"
    assert replace(bigger, draft_model=None).default_drafter is None
