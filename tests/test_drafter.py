"""The block-diffusion drafter: target features, decode path == training path, files, training."""

import json
import math
from dataclasses import asdict, replace

import pytest
import torch

from clover.errors import CloverError
from clover.models.drafter import (
    fingerprint,
    load_drafter,
    new_drafter,
    read_drafter_config,
    save_drafter,
)
from tests.conftest import tiny_model


def test_capture_returns_the_outputs_of_the_named_layers():
    model = tiny_model(num_hidden_layers=3)
    ids = torch.randint(4, 64, (2, 7))
    seen = {}
    hooks = [
        layer.register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(k, o))
        for k, layer in enumerate(model.model.layers)
    ]
    with torch.inference_mode():
        hidden, feats = model(ids, capture=(2, 0))
        plain = model(ids)
    for h in hooks:
        h.remove()
    assert torch.equal(hidden, plain)
    D = model.config.hidden_size
    assert feats.shape == (2, 7, 2 * D)
    torch.testing.assert_close(feats[..., :D], seen[2].float())
    torch.testing.assert_close(feats[..., D:], seen[0].float())
    with pytest.raises(CloverError, match="layer ids"):
        with torch.inference_mode():
            model(ids, capture=(7,))


def test_capture_on_the_fused_layers_matches_the_modules():
    from clover import kernels
    from tests.test_kernels import fused_and_modules, tiny_llama

    if kernels.load() is None:
        pytest.skip("no C++ compiler here")
    fast, ref = fused_and_modules(tiny_llama())
    ids = torch.randint(4, 256, (1, 6))
    with torch.inference_mode():
        _, a = fast(ids, capture=(0, 1))
        _, b = ref(ids, capture=(0, 1))
    assert fast.fused and a.dtype == torch.float32
    assert float((a - b).abs().max()) < 0.02 * float(b.abs().max())


def drafter_for(model, **kw):
    torch.manual_seed(0)
    d = new_drafter(model, "tiny", feature_layers=[0, 1], num_hidden_layers=2, block_size=4, **kw)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return d.eval()


def test_decode_path_equals_training_path():
    """commit (context in a cache, in two chunks, two rows of different lengths) + one block
    pass gives the same block outputs as the training pass over the whole context."""
    model = tiny_model()
    drafter = drafter_for(model)
    feats = torch.randn(2, 9, 2 * model.config.hidden_size)
    embed = model.model.embed_tokens
    n = torch.tensor([9, 6])
    first = torch.tensor([5, 7])
    with torch.no_grad():
        want = drafter.train_hidden(feats, n, first[:, None], n[:, None], embed)[:, 0]
        cache = drafter.make_cache(2)
        drafter.commit(feats[:, :4], torch.tensor([4, 4]), cache)
        drafter.commit(feats[:, 4:], torch.tensor([5, 2]), cache)
        got = drafter.block_hidden(first, embed, cache)
    assert torch.equal(cache.lengths, n)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # several blocks at once in training: each sees only the context before its start
    with torch.no_grad():
        starts = torch.tensor([[3, 9], [2, 6]])
        both = drafter.train_hidden(feats, n, torch.tensor([[1, 5], [2, 7]]), starts, embed)
        for row in range(2):
            for s in range(2):
                c = drafter.make_cache(1)
                p = int(starts[row, s])
                drafter.commit(feats[row : row + 1, :p], torch.tensor([p]), c)
                one = drafter.block_hidden(torch.tensor([[1, 5], [2, 7]][row][s : s + 1]), embed, c)
                torch.testing.assert_close(one[0], both[row, s], rtol=1e-4, atol=1e-5)


def test_chain_decode_path_equals_training_path():
    """A chain drafter: its passes over a growing block (positions 0 and 1, then one position
    a pass, each over the block positions the earlier passes wrote) give the teacher-forced
    training pass's outputs; inside the block it is causal (a later token changes nothing
    before it); the block path refuses it."""
    model = tiny_model()
    drafter = drafter_for(model, chain=True)
    feats = torch.randn(2, 9, 2 * model.config.hidden_size)
    embed = model.model.embed_tokens
    n = torch.tensor([9, 6])
    first = torch.tensor([5, 7])
    before = torch.tensor([[5, 11, 12], [7, 13, 14]])  # position i >= 1 reads before[:, i - 1]
    with torch.no_grad():
        want = drafter.train_hidden(feats, n, first[:, None], n[:, None], embed,
                                    before=before[:, None])[:, 0]  # fmt: skip
        other = before.clone()
        other[:, 2] = 20
        moved = drafter.train_hidden(feats, n, first[:, None], n[:, None], embed,
                                     before=other[:, None])[:, 0]  # fmt: skip
        cache = drafter.make_cache(2)
        drafter.commit(feats[:, :4], torch.tensor([4, 4]), cache)
        drafter.commit(feats[:, 4:], torch.tensor([5, 2]), cache)
        got = [drafter.chain_hidden(torch.stack([first, first], 1), 0, embed, cache)]
        got.append(drafter.chain_hidden(before[:, 1:2], 2, embed, cache))
        got.append(drafter.chain_hidden(before[:, 2:3], 3, embed, cache))
    assert torch.equal(cache.lengths, n)  # nothing committed
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(moved[:, :3], want[:, :3])
    assert not torch.allclose(moved[:, 3], want[:, 3])
    with pytest.raises(CloverError, match="token by token"):
        drafter.block_hidden(first, embed, cache)


def test_chain_drafts_feed_each_draft_to_the_next_pass():
    """DrafterRunner.draft with a chain drafter: position i's logits are the training pass's
    with the drafts before it as the block's tokens: the greedy ones, or those `pick` chose."""
    from clover.decoding.drafting import DrafterRunner

    model = tiny_model()
    drafter = drafter_for(model, chain=True)
    feats = torch.randn(1, 7, 2 * model.config.hidden_size)
    embed = model.model.embed_tokens
    runner = DrafterRunner(model, drafter)
    runner.add_row()
    runner.commit(feats, torch.tensor([7]))
    first = torch.tensor([5])
    logits = runner.draft(first, 4)  # [1, 3, V]
    drafts = logits.argmax(-1)
    with torch.no_grad():
        before = torch.cat([first[:, None], drafts[:, :2]], 1)[:, None]
        h = drafter.train_hidden(feats, torch.tensor([7]), first[:, None], torch.tensor([[7]]),
                                 embed, before=before)[:, 0]  # fmt: skip
        want = model.logits(h[:, 1:])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(runner.cache.lengths, torch.tensor([7]))
    # a pick (what a sampling row does: its own draw) is what the next position reads
    forced = torch.tensor([[9, 3, 14]])
    seen = []

    def pick(i, step_logits):
        seen.append(i)
        torch.testing.assert_close(step_logits, got[:, i])
        return forced[:, i]

    got = runner.draft(first, 4, pick=lambda i, lg: forced[:, i])
    assert not torch.allclose(got[:, 1:], logits[:, 1:])  # not the greedy chain's
    with torch.no_grad():
        before = torch.cat([first[:, None], forced[:, :2]], 1)[:, None]
        h = drafter.train_hidden(feats, torch.tensor([7]), first[:, None], torch.tensor([[7]]),
                                 embed, before=before)[:, 0]  # fmt: skip
    torch.testing.assert_close(got, model.logits(h[:, 1:]), rtol=1e-4, atol=1e-4)
    runner.draft(first, 4, pick=pick)
    assert seen == [0, 1, 2]  # every position's draft goes through it, the last one too


@pytest.mark.parametrize("layers", [1, 2])
def test_narrow_training_pass_equals_the_first_positions_of_the_whole_block(layers):
    """train_hidden(width=w) runs the last layer for the first w block positions only; the
    outputs equal the whole block's first w (the other positions still serve as keys)."""
    model = tiny_model()
    drafter = drafter_for(model)
    drafter.layers = drafter.layers[:layers]
    feats = torch.randn(2, 11, 2 * model.config.hidden_size)
    embed = model.model.embed_tokens
    n, starts = torch.tensor([11, 8]), torch.tensor([[2, 6, 9], [1, 3, 8]])
    first = torch.tensor([[1, 5, 3], [2, 7, 4]])
    with torch.no_grad():
        whole = drafter.train_hidden(feats, n, first, starts, embed)
        for width in (1, 2, 3):
            narrow = drafter.train_hidden(feats, n, first, starts, embed, width)
            assert narrow.shape == (2, 3, width, model.config.hidden_size)
            torch.testing.assert_close(narrow, whole[:, :, :width], rtol=1e-5, atol=1e-6)
        assert torch.equal(drafter.train_hidden(feats, n, first, starts, embed, 4), whole)


def test_drafter_file_round_trip_and_wrong_target(tmp_path):
    model = tiny_model()
    drafter = drafter_for(model)
    path = save_drafter(drafter, tmp_path / "d.safetensors", dtype=torch.float32)
    config = read_drafter_config(path)
    assert config.feature_layers == [0, 1] and config.block_size == 4
    assert config.target_fingerprint == fingerprint(model)
    back = load_drafter(path, model)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    other = tiny_model(seed=1)
    with pytest.raises(CloverError, match="trained on 'tiny'"):
        load_drafter(path, other)
    # the same checkpoint at another precision is the same target
    assert fingerprint(model.to(torch.bfloat16)) == config.target_fingerprint
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(CloverError, match="not a Clover drafter"):
        read_drafter_config(tmp_path / "junk.safetensors")
    # a file of the earlier layout (a learned [MASK] vector) is named as such
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    state["mask_embedding"] = torch.zeros(model.config.hidden_size)
    meta = {"format": "pt", "clover_drafter": json.dumps(asdict(config))}
    save_file(state, str(tmp_path / "old.safetensors"), metadata=meta)
    with pytest.raises(CloverError, match="earlier Clover"):
        load_drafter(tmp_path / "old.safetensors", model)


@pytest.fixture(scope="module")
def data(tiny_checkpoint, tmp_path_factory):
    from clover.data.distill import distill

    out = tmp_path_factory.mktemp("distill-drafter")
    distill(str(tiny_checkpoint), out, 40, max_tokens=16, batch_size=8, top_k=4,
            dtype="float32", progress=False)  # fmt: skip
    return out


def drafter_config(tiny_checkpoint, data, out, **kw):
    from clover.train.drafter import DrafterTrainConfig

    base = dict(target=str(tiny_checkpoint), data=str(data), out=str(out), target_dtype="float32",
                block_size=4, blocks_per_sequence=3, batch_size=4, steps=8, lr=3e-3, warmup=1,
                eval_every=4, save_every=2, eval_examples=8, seed=1)  # fmt: skip
    return DrafterTrainConfig(**{**base, **kw})


@pytest.mark.parametrize("loss, chain", [("kl", False), ("ce", False), ("kl", True)])
def test_drafter_training_learns_and_writes_a_loadable_file(tiny_checkpoint, data, tmp_path, loss,
                                                            chain):  # fmt: skip
    from clover.engine import LLM
    from clover.train.drafter import train_drafter

    cfg = drafter_config(tiny_checkpoint, data, tmp_path / "run", steps=16, loss=loss, chain=chain)
    last = train_drafter(cfg, progress=False)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 16 and lines[-1]["loss"] < lines[0]["loss"]
    assert "accepted" in last["heldout"]
    target = LLM(str(tiny_checkpoint), progress=False).model
    drafter = load_drafter(tmp_path / "run" / "drafter.safetensors", target)
    assert drafter.config.info["steps"] == 16 and drafter.config.chain == chain


def test_a_drafter_narrower_than_its_target(tiny_checkpoint, data, tmp_path):
    from clover.engine import LLM
    from clover.train.drafter import train_drafter

    target = LLM(str(tiny_checkpoint), progress=False).model
    width = target.config.intermediate_size // 2
    cfg = drafter_config(tiny_checkpoint, data, tmp_path / "run", steps=4, intermediate_size=width)
    train_drafter(cfg, progress=False)
    drafter = load_drafter(tmp_path / "run" / "drafter.safetensors", target)
    assert drafter.config.intermediate_size == width
    assert drafter.layers[0].mlp.up_proj.weight.shape[0] == width
    with pytest.raises(CloverError, match="intermediate_size"):
        drafter_config(tiny_checkpoint, data, tmp_path / "bad", intermediate_size=-1)


def test_data_weights_repeat_a_sources_training_answers(tiny_checkpoint, data, tmp_path):
    """`data_weights` [1, 3]: the second directory's training answers come three times an
    epoch, its held-out answers once; a run on the mix trains, and the target's features are
    made once per answer however often it comes."""
    import shutil

    from safetensors import safe_open

    from clover.train.drafter import load_sets, train_drafter

    other = tmp_path / "other"
    shutil.copytree(data, other)
    one = drafter_config(tiny_checkpoint, data, tmp_path / "one", eval_examples=1000)
    train1, held1, _ = load_sets(one)
    dirs = [str(data), str(other)]
    mix = replace(drafter_config(tiny_checkpoint, data, tmp_path / "mix", steps=4),
                  data=dirs, data_weights=[1, 3], eval_examples=1000)  # fmt: skip
    train, held, _ = load_sets(mix)
    assert len(train) == 4 * len(train1) and len(held) == 2 * len(held1)
    assert train[len(train1) :] == [r for r in train1 for _ in range(3)]
    train_drafter(mix, progress=False)
    parts = list((tmp_path / "mix" / "features").glob("part-*.safetensors"))
    ids = [k for p in parts for k in safe_open(str(p), framework="pt").keys()]
    assert len(ids) == len(set(ids)) == len({r["id"] for r in train + held})
    for bad in ([1], [1, 0], [1, 1.5]):
        with pytest.raises(CloverError, match="data_weights"):
            replace(one, data=dirs, data_weights=bad)


def test_drafter_training_resumes_exactly(tiny_checkpoint, data, tmp_path):
    """Stopped and continued = run through, across epochs (the continued run recomputes the
    target features the first one had kept)."""
    from clover.train.drafter import train_drafter

    kw = {"steps": 24, "batch_size": 8, "eval_every": 12}  # ~5 epochs of the 38 examples
    train_drafter(drafter_config(tiny_checkpoint, data, tmp_path / "full", **kw), progress=False)
    part = drafter_config(tiny_checkpoint, data, tmp_path / "part", **kw)
    train_drafter(part, progress=False, until=12)
    train_drafter(part, progress=False)

    def losses(d):
        lines = (tmp_path / d / "metrics.jsonl").read_text().splitlines()
        return [round(json.loads(x)["loss"], 5) for x in lines]

    assert losses("full") == losses("part")


def test_export_in_the_speculators_format(tmp_path):
    """The written config carries the format's keys (speculators_model_type,
    speculators_config with algorithm / proposals / verifier, block size, mask token, feature
    layer ids) and the weights its names; the CLI takes a drafter file."""
    from safetensors.torch import load_file

    from clover.cli import main

    model = tiny_model()
    path = save_drafter(drafter_for(model), tmp_path / "d.safetensors", dtype=torch.float32)
    assert main(["export", str(path), str(tmp_path / "spec")]) == 0
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    # feature layers 0 and 1 (their outputs) named by the layers whose input they are
    assert config["aux_hidden_state_layer_ids"] == [1, 2] and config["block_size"] == 4
    spec = config["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3}]
    assert spec["verifier"]["name_or_path"] == "tiny"
    layer = config["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 2 and layer["hidden_size"] == model.config.hidden_size
    names = set(load_file(str(tmp_path / "spec" / "model.safetensors")))
    # exactly the tensors speculators 0.9.0's DFlashDraftModel holds, less those its loader
    # takes from the verifier (embed_tokens, lm_head, verifier_lm_head, verifier_norm):
    # compared with the package itself in a scratch venv (issue notes, 2026-12-01)
    layer = {f"layers.{i}.{n}.weight" for i in (0, 1) for n in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
        "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}  # fmt: skip
    assert names == {"fc.weight", "hidden_norm.weight", "norm.weight"} | layer
    with pytest.raises(CloverError, match="not empty"):
        from clover.models.drafter import export_speculators

        export_speculators(path, tmp_path / "spec", ["LlamaForCausalLM"])
    chain = save_drafter(drafter_for(tiny_model(), chain=True), tmp_path / "chain.safetensors")
    with pytest.raises(CloverError, match="only block drafters export"):
        export_speculators(chain, tmp_path / "chain-spec", ["LlamaForCausalLM"])
    assert not (tmp_path / "chain-spec").exists()  # refused before anything is written


def attached(model, **kw):
    """`model`'s runtime with a fresh drafter (what `LLM(drafter=F)` holds)."""
    from clover.decoding.runtime import Runtime

    return Runtime(model, drafter_for(model, **kw))


def decoded(model, prompts, policy, max_new_tokens):
    """Each prompt's result after decoding them together with `policy` ("ar": plain AR)."""
    from clover.decoding.loop import generate
    from clover.decoding.policies import make_policy

    results = []
    policy = make_policy("ar") if policy == "ar" else policy
    for _ in generate(model, prompts, policy, max_new_tokens=max_new_tokens, results=results):
        pass
    return results


def answer_in_batch(runtime, policy, prompt, join=None, max_new_tokens=16):
    """`prompt`'s result decoded with `policy` in a `BatchDecoder` of `runtime`; with `join`,
    a running `ar` row (6 tokens, one step in) that the drafting row joins."""
    from clover.decoding.loop import BatchDecoder
    from clover.decoding.policies import make_policy

    batch = BatchDecoder(runtime)
    rows = []
    if join is not None:
        rows.append(batch.add(join, make_policy("ar"), max_new_tokens=6))
        batch.step()
    rows.append(batch.add(prompt, policy, max_new_tokens=max_new_tokens))
    while batch.active:
        batch.step()
    return rows[-1].result


@pytest.mark.parametrize("draft", ["drafter", "drafter+lookup"])
@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("chain", [False, True])
def test_drafter_drafts_are_lossless_batched(draft, adaptive, chain):
    """self_spec with drafter drafts: float32 greedy answers token-identical to ar, rows of
    different lengths decoded together, each with its own draft length (adaptive: from this
    machine's pass costs and the row's acceptance; else block_size - 1); block and chain
    drafters."""
    from clover.decoding.policies import SelfSpec

    model = attached(tiny_model(seed=3), chain=chain)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
    ar = decoded(model, prompts, "ar", 24)
    spec = decoded(model, prompts, SelfSpec(block_size=4, draft=draft, adaptive=adaptive), 24)
    assert [r.tokens for r in spec] == [r.tokens for r in ar]
    if not adaptive:  # every pass after the first verifies a drafter draft (or a lookup)
        assert any("drafter" in r.drafts for r in spec)
        assert all(sum(d[0] for d in r.drafts.values()) >= len(r.tokens) // 2 for r in spec)
    # adaptive on a tiny model: a drafter pass costs about what a target pass does, so the
    # rows mostly take AR steps (test_costs.py tests the choice itself)


def test_drafter_lookup_store_drafts_are_lossless_batched():
    """drafter+lookup+store: a context match, else the n-gram store, else the drafter drafts;
    float32 greedy answers stay ar's, batched, with store and drafter drafts both verified."""
    from clover.decoding.policies import SelfSpec

    model = attached(tiny_model(seed=3))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
    ar = decoded(model, prompts, "ar", 24)
    store = model.ngram_store()
    store.add(prompts[1] + ar[1].tokens)  # the store knows one answer, and a wrong copy of one
    store.add(prompts[2] + [t + 1 for t in ar[2].tokens])
    policy = SelfSpec(block_size=4, draft="drafter+lookup+store", adaptive=False)
    spec = decoded(model, prompts, policy, 24)
    assert [r.tokens for r in spec] == [r.tokens for r in ar]
    assert any("store" in r.drafts for r in spec) and any("drafter" in r.drafts for r in spec)
    assert spec[1].drafts["store"][1] > 0  # the known answer's drafts were kept


def test_drafter_passes_only_where_no_context_match_drafts(monkeypatch):
    """drafter+lookup: a context match takes the next pass, so the drafter does not draft for
    it (a drafter pass whose draft is thrown away costs as much as one that is verified):
    every drafter draft taken is verified, and lookup drafts still run."""
    from clover.decoding import spec_row as rows
    from clover.decoding.policies import SelfSpec

    taken, verified = [0], [0]
    take, update = rows.SpecRow.take_drafts, rows.SpecRow.update

    def counting_take(self, logits, sampling, drawn=None):
        taken[0] += 1
        return take(self, logits, sampling, drawn)

    def counting_update(self, logits, sampling, eos, *sampled):
        if self.draft and not self._from_context:
            verified[0] += 1
        return update(self, logits, sampling, eos, *sampled)

    monkeypatch.setattr(rows.SpecRow, "take_drafts", counting_take)
    monkeypatch.setattr(rows.SpecRow, "update", counting_update)
    model = attached(tiny_model(seed=3))
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 9, 10, 9, 10]]
    ar = decoded(model, prompts, "ar", 32)
    policy = SelfSpec(block_size=4, draft="drafter+lookup", adaptive=False)
    spec = decoded(model, prompts, policy, 32)
    assert [r.tokens for r in spec] == [r.tokens for r in ar]
    assert all(r.drafts.get("lookup", [0])[0] > 0 for r in spec)
    assert taken[0] > 0 and taken[0] == verified[0]


def test_adaptive_rows_draft_in_a_batch_only_where_batched_passes_pay(monkeypatch):
    """Rows whose draft lengths follow the measured costs take drafter drafts in a batch only
    where the batched passes' costs say a common length pays: each draft widens every row's
    pass. With costs that make drafting pay alone, one row drafts; three rows together do not
    while batched passes cost their width, and do where they are nearly free; answers stay
    ar's every time."""
    from clover.decoding.costs import PassCosts
    from clover.decoding.policies import SelfSpec
    from clover.decoding.runtime import Runtime

    free = PassCosts({1: 10.0, 33: 10.5}, {1: 0.01, 16: 0.02})  # wide passes nearly free
    monkeypatch.setattr(Runtime, "pass_costs", lambda self, drafter=False: free)
    model = attached(tiny_model(seed=3))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
    policy = SelfSpec(block_size=4, draft="drafter", adaptive=True)
    ar = decoded(model, prompts, "ar", 16)
    one, many = decoded(model, prompts[:1], policy, 16), decoded(model, prompts, policy, 16)
    assert one[0].tokens == ar[0].tokens and [r.tokens for r in many] == [r.tokens for r in ar]
    assert one[0].drafts.get("drafter", [0])[0] > 0
    assert all("drafter" not in r.drafts for r in many)
    rows = {n: {w: 10.0 * n * w for w in range(1, 6)} for n in (2, 4, 8)}  # width costs all
    monkeypatch.setattr(Runtime, "pass_costs", lambda self, drafter=False: PassCosts(
        free.verify_ms, free.draft_ms, rows, {}))  # fmt: skip
    assert all("drafter" not in r.drafts for r in decoded(model, prompts, policy, 16))
    cheap = {n: {w: 10.0 + 0.1 * n * w for w in range(1, 6)} for n in (2, 4, 8)}
    monkeypatch.setattr(Runtime, "pass_costs", lambda self, drafter=False: PassCosts(
        free.verify_ms, free.draft_ms, cheap, {}))  # fmt: skip
    batched = decoded(model, prompts, policy, 16)
    assert [r.tokens for r in batched] == [r.tokens for r in ar]
    assert sum(r.drafts.get("drafter", [0])[0] > 0 for r in batched) >= 2
    monkeypatch.setattr(Runtime, "pass_costs", lambda self, drafter=False: free)
    # rows that never draft never pay the drafter's context pass (their prompts, prefilled by
    # the batch's first step, included)
    from clover.models.drafter import Drafter

    calls, commit = [0], Drafter.commit
    monkeypatch.setattr(Drafter, "commit", lambda *a: (calls.__setitem__(0, calls[0] + 1),
                                                       commit(*a))[1])  # fmt: skip
    assert [r.tokens for r in decoded(model, prompts, policy, 16)] == [r.tokens for r in ar]
    assert calls[0] == 0


def test_rows_that_do_not_draft_keep_their_features_until_they_do(monkeypatch):
    """The drafter's context is committed lazily: a row's features wait until it drafts (or
    until BACKLOG tokens wait), and its drafts then equal those of a runner that committed
    at every step."""
    from clover.decoding.drafting import DrafterRunner

    model = tiny_model()
    drafter = drafter_for(model)
    F = 2 * model.config.hidden_size
    torch.manual_seed(0)
    steps = [(torch.randn(2, 5, F), torch.tensor(c)) for c in ([3, 5], [0, 2], [5, 1])]
    eager, lazy = DrafterRunner(model, drafter), DrafterRunner(model, drafter)
    for r in (eager, lazy):
        r.add_row()
        r.add_row()
    for i, (feats, counts) in enumerate(steps):
        eager.commit(feats, counts)
        lazy.commit(feats, counts, [False, i == 2])
    assert eager.cache.lengths.tolist() == [8, 8] and lazy.cache.lengths.tolist() == [0, 8]
    assert lazy.waiting == [8, 0] and sum(len(f) for f in lazy.waiting_features(0)) == 8
    lazy.commit(torch.zeros(2, 1, F), torch.tensor([0, 0]), [True, False])
    assert lazy.cache.lengths.tolist() == [8, 8] and lazy.waiting == [0, 0]
    first = torch.tensor([5, 9])
    torch.testing.assert_close(lazy.draft(first, 4), eager.draft(first, 4))
    # a long backlog is committed without waiting for a draft
    monkeypatch.setattr(DrafterRunner, "BACKLOG", 4)
    capped = DrafterRunner(model, drafter)
    capped.add_row()
    capped.add_row()
    capped.commit(*steps[0], [False, False])
    assert capped.cache.lengths.tolist() == [0, 5] and capped.waiting == [3, 0]
    capped.select([1])
    assert capped.cache.lengths.tolist() == [5] and capped.waiting_features(0) == []
    assert capped.waiting == [0]


def test_waiting_features_follow_their_rows_as_rows_join_and_leave():
    """The batch's shelf of waiting features (one entry a pass) gives each row its own,
    in order, after rows joined and left; entries no row waits on are dropped; the drafts
    equal a runner's that committed every pass at once."""
    from clover.decoding.drafting import DrafterRunner

    model = tiny_model()
    drafter = drafter_for(model)
    F = 2 * model.config.hidden_size
    torch.manual_seed(1)
    eager, lazy = DrafterRunner(model, drafter), DrafterRunner(model, drafter)
    for r in (eager, lazy):
        r.add_row()
        r.add_row()
    passes = [(torch.randn(2, 3, F), [3, 2]), (torch.randn(3, 2, F), [2, 0, 1]),
              (torch.randn(2, 4, F), [4, 3])]  # fmt: skip
    eager.commit(*passes[0])
    lazy.commit(*passes[0], [False, False])
    for r in (eager, lazy):  # a third row joins
        r.add_row()
    eager.commit(*passes[1])
    lazy.commit(*passes[1], [False, False, False])
    for r in (eager, lazy):  # the first row leaves
        r.select([1, 2])
    eager.commit(*passes[2])
    lazy.commit(*passes[2], [True, False])  # the second row drafts now, the third waits
    assert lazy.cache.lengths.tolist() == [6, 0] and lazy.waiting == [0, 4]
    assert len(lazy.shelf) == 2  # the first pass: no running row waits on it
    assert torch.equal(torch.cat(lazy.waiting_features(1)),
                       torch.cat([passes[1][0][2, :1], passes[2][0][1, :3]]))  # fmt: skip
    lazy.commit(torch.zeros(2, 1, F), [0, 0], [False, True])
    assert lazy.cache.lengths.tolist() == eager.cache.lengths.tolist() == [6, 4]
    assert lazy.waiting == [0, 0] and lazy.shelf == []
    first = torch.tensor([5, 9])
    torch.testing.assert_close(lazy.draft(first, 4), eager.draft(first, 4))


def test_a_batch_where_no_length_pays_skips_asking_each_row(monkeypatch):
    """Where no common draft length could pay for the batch even with every adaptive row
    drafting its longest, the rows are not asked (`DrafterRunner._batch_idle`); their drafts,
    kept drafts and verify passes are the same as when every row is asked, at costs where the
    batch drafts on some steps and not on others."""
    from clover.decoding.costs import PassCosts
    from clover.decoding.drafting import DrafterRunner
    from clover.decoding.policies import SelfSpec
    from clover.decoding.runtime import Runtime

    rows = {n: {w: 10.0 + 1.2 * n * (w - 1) for w in range(1, 6)} for n in (2, 4, 8)}
    costs = PassCosts({1: 10.0, 33: 12.0}, {1: 0.5, 16: 1.0}, rows, {})
    monkeypatch.setattr(Runtime, "pass_costs", lambda self, drafter=False: costs)
    model = attached(tiny_model(seed=3))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
    policy = SelfSpec(block_size=4, draft="drafter", adaptive=True)
    idle, real = [], DrafterRunner._batch_idle
    monkeypatch.setattr(DrafterRunner, "_batch_idle",
                        staticmethod(lambda *a: idle.append(real(*a)) or idle[-1]))  # fmt: skip
    skipping = decoded(model, prompts, policy, 24)
    assert True in idle and False in idle  # both kinds of step
    monkeypatch.setattr(DrafterRunner, "_batch_idle", staticmethod(lambda *a: False))
    model.forget_acceptance()  # the second run starts from the same estimates
    asking = decoded(model, prompts, policy, 24)
    for a, b in zip(skipping, asking):
        assert (a.tokens, a.drafts, a.accepted, a.nfe) == (b.tokens, b.drafts, b.accepted, b.nfe)


@pytest.mark.parametrize("chain, tree", [(False, 0), (True, 6), (False, 6)])
def test_drafter_rows_joining_a_running_batch_and_the_prefix_cache(chain, tree):
    """A drafting row that joins a running batch prefills alone (its drafter context from
    that pass); with a prefix cache, a warm request gives the cold one's tokens (trees of
    drafts: the committed ids the cache saves are the kept branch's)."""
    from clover.decoding.policies import SelfSpec
    from clover.decoding.prefix_cache import PrefixCache
    from clover.decoding.runtime import Runtime

    model = attached(tiny_model(seed=4), chain=chain)
    policy = SelfSpec(block_size=4, draft="drafter", adaptive=False, tree=tree)

    def answer(prompt, prefix=None, join=None):
        runtime = Runtime(model.model, model.drafter, prefix)
        return answer_in_batch(runtime, policy, prompt, join).tokens

    prompt = [7, 8, 9, 10, 11, 12, 13, 14]
    cold = answer(prompt)
    assert cold == decoded(model, [prompt], "ar", 16)[0].tokens
    assert answer(prompt, join=[20, 21, 22]) == cold
    cache = PrefixCache(64 * 2**20)
    assert answer(prompt, cache) == cold
    assert answer(prompt, cache) == cold  # warm: its prefix from the cache


def test_drafter_draft_without_a_drafter_is_a_clear_error():
    from clover.decoding.loop import generate
    from clover.decoding.policies import SelfSpec

    with pytest.raises(CloverError, match="--drafter"):
        list(generate(tiny_model(), [[5, 6]], SelfSpec(block_size=4, draft="drafter"),
                      max_new_tokens=4))  # fmt: skip


def test_drafter_time_box_ends_the_schedule_in_time(tiny_checkpoint, data, tmp_path):
    """max_minutes: the cosine schedule is refitted to end inside the box (at the recent pace),
    the run stops there and writes the drafter."""
    from clover.train.drafter import lr_at, train_drafter

    cfg = drafter_config(tiny_checkpoint, data, tmp_path / "box", steps=100_000, max_minutes=0.15)
    last = train_drafter(cfg, progress=False)
    assert 10 < last["step"] < 100_000 and last["seconds"] < 0.15 * 60 * 1.5
    lines = [json.loads(x) for x in (tmp_path / "box" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["lr"] < 0.2 * cfg.lr  # the schedule came down to its end
    assert (tmp_path / "box" / "drafter.safetensors").is_file()
    assert lr_at(0, cfg) > 0
    # a box the run does not reach leaves its step count as it was (it ran one over)
    cfg = drafter_config(tiny_checkpoint, data, tmp_path / "roomy", steps=20, max_minutes=30)
    assert train_drafter(cfg, progress=False)["step"] == 20


def test_an_int4_drafter_drafts_like_the_float_one():
    """Beside an int4 target the loader packs the drafter's linears in 4 bits too."""
    import copy

    from clover import kernels
    from clover.quant import Int4Linear, quantize_linears

    if kernels.load() is None:
        pytest.skip("no C++ compiler here")
    model = tiny_model()
    drafter = drafter_for(model)
    q = quantize_linears(copy.deepcopy(drafter))
    assert isinstance(q.layers[0].mlp.down_proj, Int4Linear) and isinstance(q.fc, Int4Linear)
    feats = torch.randn(1, 7, 2 * model.config.hidden_size)
    with torch.no_grad():
        a, b = drafter.make_cache(1), q.make_cache(1)
        drafter.commit(feats, torch.tensor([7]), a)
        q.commit(feats, torch.tensor([7]), b)
        ha = drafter.block_hidden(torch.tensor([5]), model.model.embed_tokens, a)
        hb = q.block_hidden(torch.tensor([5]), model.model.embed_tokens, b)
    assert float((ha - hb.float()).abs().max()) < 0.1 * float(ha.abs().max())


def test_init_from_target_starts_the_drafter_as_the_target_s_last_layer():
    """init: target: drafter layer = the target's last layer (weights read through any linear,
    int4 included); its context keys/values = that layer's own from the feature of the layer
    before; the q/k norms keep the heads' scale."""
    from clover.models.drafter import init_from_target, linear_weight
    from clover.quant import Int4Linear

    model = tiny_model(num_hidden_layers=3)
    drafter = new_drafter(model, "tiny", feature_layers=[0, 1], num_hidden_layers=1)
    ids = torch.randint(4, 64, (2, 9))
    with torch.no_grad():
        _, feats = model(ids, capture=(0, 1))
    assert init_from_target(drafter, model, feats) == [2]
    last = model.model.layers[2]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert torch.equal(getattr(drafter.layers[0].self_attn, name).weight,
                           getattr(last.self_attn, name).weight), name  # fmt: skip
    assert torch.equal(drafter.layers[0].mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert torch.equal(drafter.norm.weight, model.model.norm.weight)
    D = model.config.hidden_size
    with torch.no_grad():
        ctx = drafter.context(feats)
        torch.testing.assert_close(ctx, last.input_layernorm(feats[..., D:]))
        a = drafter.layers[0].self_attn
        raw = a.q_proj(ctx).view(2, 9, a.nq, a.dh)
        normed = a.q_norm(raw)
        scale = lambda x: float(x.pow(2).mean(-1).sqrt().mean())  # noqa: E731
        assert abs(scale(normed) - scale(raw)) < 1e-4 * scale(raw)
    # a 4-bit linear's weight read through its outputs
    lin = torch.nn.Linear(64, 32, bias=True)
    q = Int4Linear(lin)
    w, b = linear_weight(q, 64)
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(x @ w.t() + b, q(x).float(), rtol=0.02, atol=0.02)
        assert float((w - lin.weight).abs().max()) < 0.1 * float(lin.weight.abs().max())
    # another width than the target's cannot start from its layers
    narrow = new_drafter(model, "tiny", feature_layers=[0, 1], intermediate_size=16)
    with pytest.raises(CloverError, match="width, heads and MLP"):
        init_from_target(narrow, model, feats)


def test_drafter_training_from_a_drafter_file_and_on_the_first_positions(tiny_checkpoint, data,
                                                                         tmp_path):  # fmt: skip
    """init: <file> starts from its weights and draft vocabulary (at lr 0 the written drafter
    is the file's); another shape or no file is a clear error; loss_positions trains on the
    first drafts only while the held-out measure still reads whole blocks."""
    from clover.train.drafter import train_drafter

    cfg = drafter_config(tiny_checkpoint, data, tmp_path / "a", steps=6, layers=1,
                         feature_layers=[0], loss_positions=2, eval_every=6)  # fmt: skip
    last = train_drafter(cfg, progress=False)
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all(x["accepted"] <= 2 for x in lines) and lines[-1]["loss"] < lines[0]["loss"]
    assert "accepted" in last["heldout"]
    first = tmp_path / "a" / "drafter.safetensors"
    again = drafter_config(tiny_checkpoint, data, tmp_path / "b", steps=2, layers=1, lr=0.0,
                           feature_layers=[0], init=str(first), draft_vocab=0)  # fmt: skip
    train_drafter(again, progress=False)
    start = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["step"] == 0 and "first_token" in start["heldout"]  # the file, measured first
    a, b = load_drafter(first), load_drafter(tmp_path / "b" / "drafter.safetensors")
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name
    assert (a.vocab is None) == (b.vocab is None)
    if a.vocab is not None:
        assert torch.equal(a.vocab, b.vocab)
    # a stopped run started from a file continues with the file's draft vocabulary, not the
    # one its config would make from the data
    small = drafter_config(tiny_checkpoint, data, tmp_path / "s", steps=2, layers=1,
                           feature_layers=[0], draft_vocab=32)  # fmt: skip
    train_drafter(small, progress=False)
    small_file = tmp_path / "s" / "drafter.safetensors"
    more = drafter_config(tiny_checkpoint, data, tmp_path / "m", steps=4, layers=1,
                          feature_layers=[0], draft_vocab=48, init=str(small_file))  # fmt: skip
    train_drafter(more, progress=False, until=2)
    train_drafter(more, progress=False)
    want = load_drafter(small_file).vocab
    assert want is not None and len(want) == 32
    assert torch.equal(load_drafter(tmp_path / "m" / "drafter.safetensors").vocab, want)
    # a deeper drafter grows from the file: its layers first, the added one a no-op at the
    # start (lr 0: the written file drafts as the first one does), and a file never shrinks
    deep = drafter_config(tiny_checkpoint, data, tmp_path / "c", steps=1, layers=2, lr=0.0,
                          feature_layers=[0], init=str(first))  # fmt: skip
    train_drafter(deep, progress=False)
    grown = load_drafter(tmp_path / "c" / "drafter.safetensors")
    assert grown.config.num_hidden_layers == 2
    assert not grown.layers[1].self_attn.o_proj.weight.any()
    assert grown.layers[1].self_attn.q_proj.weight.any()  # trainable, not zeroed
    feats = torch.randn(2, 7, grown.config.hidden_size)
    embed = torch.nn.Embedding(grown.config.vocab_size, grown.config.hidden_size)
    n, tok, at = torch.tensor([7, 5]), torch.tensor([[3], [4]]), torch.tensor([[7], [5]])
    with torch.no_grad():
        torch.testing.assert_close(grown.train_hidden(feats, n, tok, at, embed),
                                   a.train_hidden(feats, n, tok, at, embed))  # fmt: skip
    grown_file = str(tmp_path / "c" / "drafter.safetensors")
    shallow = drafter_config(tiny_checkpoint, data, tmp_path / "e", steps=1, layers=1,
                             feature_layers=[0], init=grown_file)  # fmt: skip
    with pytest.raises(CloverError, match="num_hidden_layers 2"):
        train_drafter(shallow, progress=False)
    other = drafter_config(tiny_checkpoint, data, tmp_path / "f", steps=1, layers=1,
                           feature_layers=[0], init=str(first), chain=True)  # fmt: skip
    with pytest.raises(CloverError, match="chain False"):
        train_drafter(other, progress=False)
    gone = drafter_config(tiny_checkpoint, data, tmp_path / "d", steps=2, layers=1,
                          feature_layers=[0], init=str(tmp_path / "none.safetensors"))  # fmt: skip
    with pytest.raises(CloverError, match="no drafter file"):
        train_drafter(gone, progress=False)
    with pytest.raises(CloverError, match="loss_positions"):
        drafter_config(tiny_checkpoint, data, tmp_path / "x", loss_positions=-1)


def test_drafter_training_from_the_target_s_layers(tiny_checkpoint, data, tmp_path):
    """init: target trains from another start than random (which start is closer depends on the
    target: on SmolLM2-135M the copy starts further, README "Train a drafter"; on this tiny
    random target the two first losses differ in the fourth digit)."""
    from clover.train.drafter import train_drafter

    losses = {}
    for init in ("random", "target"):
        cfg = drafter_config(tiny_checkpoint, data, tmp_path / init, steps=2, init=init,
                             feature_layers=[0], layers=1, eval_every=100)  # fmt: skip
        train_drafter(cfg, progress=False)
        first = (tmp_path / init / "metrics.jsonl").read_text().splitlines()[0]
        losses[init] = json.loads(first)["loss"]
    assert all(math.isfinite(v) for v in losses.values())
    assert losses["target"] != losses["random"]
    with pytest.raises(CloverError, match="init must be"):
        drafter_config(tiny_checkpoint, data, tmp_path / "x", init="copy")


def test_an_int4_drafter_takes_rows_of_different_lengths():
    """Its k (after the float32 q/k norm) and v (bfloat16 from the 4-bit linear) are cast to
    the cache's dtype apart: rows of unequal lengths write through an indexed put, which
    refuses mixed dtypes (a batch-8 bench crashed there)."""
    import copy

    from clover import kernels
    from clover.quant import quantize_linears

    if kernels.load() is None:
        pytest.skip("no C++ compiler here")
    model = tiny_model()
    q = quantize_linears(copy.deepcopy(drafter_for(model)))
    feats = torch.randn(2, 7, 2 * model.config.hidden_size)
    with torch.no_grad():
        cache = q.make_cache(2)
        q.commit(feats, torch.tensor([7, 4]), cache)
        q.commit(feats[:, :2], torch.tensor([1, 2]), cache)
        h = q.block_hidden(torch.tensor([5, 6]), model.model.embed_tokens, cache)
    assert torch.equal(cache.lengths, torch.tensor([8, 6])) and bool(torch.isfinite(h).all())


def test_draft_vocabulary_takes_the_answers_tokens_then_the_lowest_ids():
    from clover.train.drafter import DrafterTrainConfig, draft_vocabulary

    records = [{"answer_ids": [40, 40, 41, 63, 40, 41]}, {"answer_ids": [50]}]
    ids = draft_vocabulary(records, 64, 16)
    assert ids.tolist() == sorted([40, 41, 63, 50] + list(range(12)))
    assert draft_vocabulary(records, 64, 2).tolist() == [40, 41]  # the most used first
    assert draft_vocabulary(records, 64, 0) is None and draft_vocabulary(records, 64, 64) is None
    with pytest.raises(CloverError, match="multiple of 16"):
        DrafterTrainConfig(target="t", data="d", out="o", draft_vocab=100)


@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("head", [None, "int4", "int8"])
def test_a_draft_vocabulary_drafts_only_from_it(head, chain, tmp_path):
    """With a draft vocabulary the drafter's logits are the whole head's for those ids (the
    quantized head's own levels, not rounded again) and -inf elsewhere; the file keeps it. A
    chain drafter's positions (written in place, position by position) too, both runners fed
    the same drafts."""
    from clover import kernels
    from clover.decoding.drafting import DrafterRunner
    from clover.quant import quantize_model

    if head and kernels.load() is None:
        pytest.skip("no C++ compiler here")
    model = tiny_model()
    if head:
        quantize_model(model, "int4", head=head)
    drafter = drafter_for(model, chain=chain)
    vocab = torch.arange(1, 64, 2)  # 32 ids
    drafter.set_vocab(vocab)
    path = save_drafter(drafter, tmp_path / "d.safetensors", dtype=torch.float32)
    back = load_drafter(path, model)
    assert torch.equal(back.vocab, vocab) and back.config.draft_vocab == 32
    feats = torch.randn(1, 6, 2 * model.config.hidden_size)
    made = DrafterRunner.vocab_head(model, back)  # made once (a `Runtime` keeps it)
    full, part = DrafterRunner(model, back, made), DrafterRunner(model, back, made)
    assert full.head is part.head is not None
    full.head = None  # the whole head: the reference
    for r in (full, part):
        r.add_row()
        r.commit(feats, torch.tensor([6]))
    forced = torch.tensor([[7, 3, 11]])
    pick = lambda i, lg: forced[:, i]  # noqa: E731
    a, b = full.draft(torch.tensor([5]), 4, pick), part.draft(torch.tensor([5]), 4, pick)
    others = torch.ones(64, dtype=torch.bool)
    others[vocab] = False
    assert bool(torch.isinf(b[..., others]).all())
    torch.testing.assert_close(b[..., vocab], a[..., vocab], rtol=0, atol=1e-5)
    # a file whose config and tensors disagree is refused by name
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    del state["draft_vocab"]
    meta = {"format": "pt", "clover_drafter": json.dumps(asdict(read_drafter_config(path)))}
    save_file(state, str(tmp_path / "bad.safetensors"), metadata=meta)
    with pytest.raises(CloverError, match="draft vocabulary of 32"):
        load_drafter(tmp_path / "bad.safetensors", model)
    with pytest.raises(CloverError, match="multiple of 16"):
        drafter.set_vocab(torch.arange(10))


def test_draft_vocabulary_drafts_are_lossless():
    from clover.decoding.policies import SelfSpec

    model = attached(tiny_model(seed=3))
    model.drafter.set_vocab(torch.arange(0, 64, 2)[:32])
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 10]]
    ar = decoded(model, prompts, "ar", 20)
    spec = decoded(model, prompts, SelfSpec(block_size=4, draft="drafter", adaptive=False), 20)
    assert [r.tokens for r in spec] == [r.tokens for r in ar]
    assert any("drafter" in r.drafts for r in spec)


def test_training_sets_the_draft_vocabulary_and_a_finished_run_rewrites_its_file(
    tiny_checkpoint, data, tmp_path
):
    """A run writes its draft vocabulary; running a finished run again trains nothing more and
    rewrites its file in the current format (here: with a vocabulary it did not have)."""
    from clover.train.drafter import train_drafter

    out = tmp_path / "run"
    train_drafter(drafter_config(tiny_checkpoint, data, out, draft_vocab=0), progress=False)
    path = out / "drafter.safetensors"
    assert read_drafter_config(path).draft_vocab == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    again = train_drafter(drafter_config(tiny_checkpoint, data, out, draft_vocab=64),
                          progress=False)  # fmt: skip
    assert again == {"step": 8, "rewritten": str(path)}
    assert (out / "metrics.jsonl").read_text().splitlines() == lines
    config = read_drafter_config(path)
    assert config.draft_vocab == 64 and config.info["steps"] == 8
    assert len(load_drafter(path).vocab) == 64
    # loaded with its target, its LM-head rows are made with the model, not in a first answer
    from clover.engine import LLM

    llm = LLM(str(tiny_checkpoint), dtype="float32", progress=False, drafter=str(path))
    assert llm.runtime._vocab_head is not None  # made at load, not in the first answer


def test_cli_info_reads_a_drafter_file(tmp_path, capsys):
    """`clover info FILE.safetensors` describes a drafter from its header; a safetensors file
    that is no drafter or adapter is named as such."""
    from safetensors.torch import save_file

    from clover.cli import main

    model = tiny_model()
    drafter = drafter_for(model)
    drafter.set_vocab(torch.arange(16))
    drafter.config.info = {"steps": 7}
    path = save_drafter(drafter, tmp_path / "d.safetensors")
    assert main(["info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "drafter" and info["draft_vocab"] == 16 and info["trained.steps"] == 7
    assert info["params"] == sum(p.numel() for p in drafter.parameters())
    assert main(["info", str(path)]) == 0
    assert "feature_layers" in capsys.readouterr().out
    meta = {"format": "pt", "clover_adapter": json.dumps({"rank": 4, "info": {"steps": 3}})}
    save_file({"a": torch.zeros(2, 3)}, str(tmp_path / "a.safetensors"), metadata=meta)
    assert main(["info", str(tmp_path / "a.safetensors"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    got = (info["kind"], info["rank"], info["params"], info["trained.steps"])
    assert got == ("adapter", 4, 6, 3)
    save_file({"x": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    assert main(["info", str(tmp_path / "w.safetensors")]) == 1
    assert "neither a Clover drafter nor" in capsys.readouterr().err


@pytest.mark.parametrize("loss", ["kl", "ce"])
def test_loss_over_the_draft_vocabulary(tiny_checkpoint, data, tmp_path, loss):
    """The loss over a subset of the head's rows: with every row it is the whole head's loss
    (the id -> row mapping is exact); with a subset it stays finite; a run with loss_vocab:
    draft learns."""
    from clover.engine import LLM
    from clover.train.drafter import (
        drafter_loss,
        fixed_starts,
        head_weight,
        load_sets,
        target_features,
        train_drafter,
    )

    cfg = drafter_config(tiny_checkpoint, data, tmp_path / "x", loss=loss)
    target = LLM(str(tiny_checkpoint), progress=False).model
    train, _, _ = load_sets(cfg)
    drafter = new_drafter(target, "tiny", num_hidden_layers=1, block_size=4)
    chunk = train[:4]
    feats, n, ids = target_features(target, chunk, drafter.config.feature_layers, cfg.max_len)
    batch = {"feats": feats, "n": n, "ids": ids, "starts": fixed_starts(chunk, n, 3),
             "records": chunk}  # fmt: skip
    head = head_weight(target)
    V = head.shape[0]
    whole, info = drafter_loss(drafter, target, head, batch, cfg)
    order = torch.randperm(V)  # rows in any order map back to their ids
    same, info2 = drafter_loss(drafter, target, head[order], batch, cfg, order)
    torch.testing.assert_close(same, whole, rtol=1e-4, atol=1e-5)
    assert info2["accepted"] == info["accepted"]
    rows = torch.arange(0, V, 5)
    part, _ = drafter_loss(drafter, target, head[rows], batch, cfg, rows)
    assert bool(torch.isfinite(part))
    run = drafter_config(tiny_checkpoint, data, tmp_path / "run", loss=loss, steps=16,
                         draft_vocab=64, loss_vocab="draft")  # fmt: skip
    train_drafter(run, progress=False)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # each step's loss is its own batch's: the first and last four steps, not one batch each
    first, last = (sum(x["loss"] for x in part) / 4 for part in (lines[:4], lines[-4:]))
    assert last < first, (first, last)


def test_warm_cache_keeps_the_features_a_training_batch_computes(tiny_checkpoint, data):
    """The pass before the first step (records of similar lengths together) keeps, per record,
    the features its own padded training batch computes; a budget that can't hold them all
    leaves the cache to the first epoch."""
    from clover.engine import LLM
    from clover.train.drafter import FeatureCache, load_sets, target_features, warm_cache

    target = LLM(str(tiny_checkpoint), dtype="float32", progress=False).model
    cfg = drafter_config(tiny_checkpoint, data, "unused")
    train, _, _ = load_sets(cfg)
    layers = [0, 1]
    cache = FeatureCache(1.0)
    assert warm_cache(target, train, layers, cfg.max_len, cache, tokens=64)
    assert set(cache.rows) == {r["id"] for r in train}
    batch = train[:5]  # one training batch: padded to its longest record
    feats, n, _ = target_features(target, batch, layers, cfg.max_len)
    for i, r in enumerate(batch):
        kept = cache.get(r["id"])
        assert kept.shape[0] == int(n[i])
        torch.testing.assert_close(kept.float(), feats[i, : int(n[i])], atol=2e-2, rtol=1e-2)
    small = FeatureCache(cache.used / 2e9)
    assert not warm_cache(target, train, layers, cfg.max_len, small) and not small.rows


def test_kept_features_are_read_back_instead_of_running_the_target(
    tiny_checkpoint, data, tmp_path, monkeypatch
):
    """warm_cache(keep=DIR) saves each pass's features; a resumed run reads them (the target
    does not run) and gets the same tensors; features of other layers are made again."""
    from clover.engine import LLM
    from clover.train import drafter as training

    target = LLM(str(tiny_checkpoint), dtype="float32", progress=False).model
    cfg = drafter_config(tiny_checkpoint, data, "unused")
    train, _, _ = training.load_sets(cfg)
    first = training.FeatureCache(1.0)
    keep = tmp_path / "features"
    assert training.warm_cache(target, train, [0, 1], cfg.max_len, first, tokens=64, keep=keep,
                               dtype="float32")  # fmt: skip
    assert len(list(keep.glob("part-*.safetensors"))) > 1
    calls = []
    real = training.target_features
    counted = lambda *a, **k: calls.append(1) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(training, "target_features", counted)
    again = training.FeatureCache(1.0)
    assert training.warm_cache(target, train, [0, 1], cfg.max_len, again, keep=keep,
                               dtype="float32")  # fmt: skip
    assert not calls and set(again.rows) == set(first.rows)
    assert all(torch.equal(again.get(k), first.get(k)) for k in first.rows)
    other = training.FeatureCache(1.0)  # other layers: the kept ones are replaced
    assert training.warm_cache(target, train, [1], cfg.max_len, other, keep=keep,
                               dtype="float32")  # fmt: skip
    assert calls and other.get(train[0]["id"]).shape[-1] == target.config.hidden_size
    assert json.loads((keep / "meta.json").read_text())["layers"] == [1]


def test_drafter_curve_chains_a_continued_run(tmp_path):
    """clover.train.curve: steps and minutes add up across runs, the feature pass is the time
    before the first step at the steps' pace, a resumed run's repeated steps count once."""
    from clover.errors import CloverError
    from clover.train.curve import curve

    for name, offset, init in (("a", 600.0, "random"), ("b", 300.0, "a/drafter.safetensors")):
        run = tmp_path / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"init": init}))
        lines = [{"step": s, "loss": 5.0 - s / 100, "accepted": s / 100,
                  "seconds": offset + 2.0 * s} for s in range(1, 201)]  # fmt: skip
        lines[99]["heldout"] = {"accepted": 0.5}
        lines[-1]["heldout"] = {"accepted": 0.75}
        lines[-1]["heldout_kinds"] = {"accepted": 0.25}
        lines.insert(50, dict(lines[45]))  # a resumed run repeats steps after its checkpoint
        if init != "random":  # a run from a file measures the file first
            lines.insert(0, {"step": 0, "heldout": {"accepted": 0.7, "first_token": 0.6},
                             "heldout_kinds": {"accepted": 0.2}})  # fmt: skip
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = curve([tmp_path / "a", tmp_path / "b"])
    assert out["steps"] == 400 and out["minutes"] == round((1000 + 700) / 60, 1)
    assert [r["seconds_before_first_step"] for r in out["runs"]] == [600, 300]
    assert [e["step"] for e in out["evals"]] == [100, 200, 200, 300, 400]
    assert out["evals"][-1]["heldout_kinds"] == 0.25 and out["evals"][1]["heldout"] == 0.75
    start = out["evals"][2]
    assert start["start"] and start["heldout_first_token"] == 0.6 and start["run"] == 1
    assert start["minutes"] == round(1000 / 60, 1)
    assert len(out["loss_by_100_steps"]) == 4
    with pytest.raises(CloverError, match="not a drafter run"):
        curve([tmp_path / "none"])


def test_store_guesses_give_way_to_a_drafter_that_pays_more():
    """drafter+lookup+store with adaptive lengths: where the row's own text has no match, the
    n-gram store's guess is taken only while its measured acceptance pays more tokens per ms
    than the drafter's; else the drafter drafts (and its pass is asked for). A context match
    still comes first."""
    from clover.decoding.costs import PassCosts
    from clover.decoding.policies import SelfSpec
    from clover.decoding.spec_row import SpecRow
    from clover.decoding.store import NgramStore

    policy = SelfSpec(block_size=8, draft="drafter+lookup+store", adaptive=True)
    row = SpecRow(0, [1, 2, 3], 32, policy, torch.Generator().manual_seed(0))
    src = row.sources  # where its drafts come from (decoding/sources.py)
    src.costs, row.eos = PassCosts({1: 10.0, 8: 12.0}, {1: 0.5, 8: 1.0}), {2}
    src.store = NgramStore()
    src.store.add([40, 41, 42, 43, 44, 45, 46, 47])
    row._append([9, 40, 41])  # no match in the row's own text; the store continues 40 41
    good, bad = [0.9] * 7, [0.1] * 7
    src.acceptance["store"].p, src.acceptance["drafter"].p = list(good), list(bad)
    assert row._lookup()[:3] == [42, 43, 44] and row.drafter_length() == 0
    src.acceptance["store"].p, src.acceptance["drafter"].p = list(bad), list(good)
    assert row._lookup() == [] and row.drafter_length() > 0
    row._append([5, 9, 40])  # now the row's own text continues 9 40 with 41: lookup wins
    assert row._lookup()[:1] == [41] and src.last == "lookup" and row.drafter_length() == 0


def test_copy_leans_and_training_as_the_decoder_drafts(tiny_checkpoint, data, tmp_path):
    """copy_leans gives, per block start, the decoder's lean at each depth (the follower of the
    committed tokens + the block's own tokens before it; copy_lean_rows as head rows);
    lean_to_copies adds the bonus there
    (a large one decides the arg-max; where nothing leans the distribution is unchanged); a
    chain drafter trains with `copy_bonus`."""
    from clover.train.drafter import copy_lean_rows, copy_leans, lean_to_copies, train_drafter

    tokens = [7, 8, 9, 7, 8, 5, 6, 7]
    # start 4 ([7 8 9 7 8] committed): (7, 8) was followed by 9; then (8, 5), (5, 6) never.
    # start 3 ([7 8 9 7]): (8, 9, 7) has no follower yet; with the draft 8, (7, 8) -> 9.
    # start 6: nothing repeats, and the block runs past the end
    assert copy_leans(tokens, [4, 3, 6], 3) == [[9, None, None], [None, 9, None],
                                                [None, None, None]]  # fmt: skip
    ids = torch.tensor([tokens, tokens])
    n, starts = torch.tensor([8, 8]), torch.tensor([[4, 3], [6, 4]])
    logp = torch.randn(2, 2, 3, 12).log_softmax(-1)
    leaned = lean_to_copies(logp, copy_lean_rows(ids, n, starts, 3, None), 50.0)
    assert int(leaned[0, 0, 0].argmax()) == 9 and int(leaned[0, 1, 1].argmax()) == 9
    torch.testing.assert_close(leaned[0, 0, 1], logp[0, 0, 1])  # nothing leans there
    torch.testing.assert_close(leaned[1, 0], logp[1, 0])
    index = torch.full((12,), -1)
    index[torch.tensor([5, 7, 9])] = torch.tensor([0, 1, 2])  # a head of 3 rows
    small = lean_to_copies(logp[..., :3], copy_lean_rows(ids, n, starts, 3, index), 50.0)
    assert int(small[0, 0, 0].argmax()) == 2 and int(small[1, 1, 0].argmax()) == 2
    cfg = drafter_config(tiny_checkpoint, data, tmp_path / "lean", steps=3, chain=True,
                         copy_bonus=4.0, eval_every=3)  # fmt: skip
    last = train_drafter(cfg, progress=False)
    assert math.isfinite(last["loss"]) and "accepted" in last["heldout"]


# --- trees of drafts ---------------------------------------------------------------------------


def test_a_tree_pass_gives_each_branch_what_its_own_chain_gives():
    """One pass over a tree of tokens (each seeing the prefix and its own ancestors, at the
    position of its depth) gives every token the hidden state a causal pass over its branch
    alone gives; a chain's parents give the causal layout exactly."""
    from clover.models.layout import cached_layout, tree_parts

    model = tiny_model(seed=3)
    prefix = [5, 6, 7, 8, 9]
    # root 10, then 11 and 12 both after 10, 13 after 11, 14 after 12
    tokens, parents = [10, 11, 12, 13, 14], [-1, 0, 0, 1, 2]
    cache = model.make_cache(1)
    model(torch.tensor([prefix]), cache, "causal")
    T = len(tokens)
    with torch.no_grad():
        tree = model(torch.tensor([tokens]), cache, "block", n_commit=T,
                     tree=torch.tensor([parents]))[0]  # fmt: skip
    for node, branch in {1: [10, 11], 2: [10, 12], 3: [10, 11, 13], 4: [10, 12, 14]}.items():
        with torch.no_grad():
            alone = model(torch.tensor([prefix + branch]), None, "causal")[0, -1]
        assert torch.allclose(tree[node], alone, atol=1e-5), node
    depth, sees = tree_parts(torch.tensor([[-1, 0, 1, 2]]))
    assert depth.tolist() == [[0, 1, 2, 3]] and torch.equal(sees[0], torch.ones(4, 4).tril().bool())
    n, lengths = torch.tensor([4]), torch.tensor([7])
    chain = cached_layout(n, torch.tensor([0]), lengths, 4, torch.tensor([[-1, 0, 1, 2]]))
    plain = cached_layout(n, torch.tensor([0]), lengths, 4)
    assert torch.equal(chain.mask, plain.mask) and torch.equal(chain.positions, plain.positions)
    with pytest.raises(ValueError, match="before it"):
        tree_parts(torch.tensor([[-1, 2, 0]]))


def test_leaf_tree_keeps_the_likeliest_branches():
    from clover.decoding.trees import leaf_tree

    logp = torch.full((3, 6), -30.0)
    logp[0, 1], logp[0, 2] = math.log(0.6), math.log(0.4)  # depth 0: 1 (0.6) or 2 (0.4)
    logp[1, 3], logp[1, 4] = math.log(0.9), math.log(0.1)  # after 1: 3 (0.9) or 4
    logp[2, 5], logp[2, 0] = math.log(0.5), math.log(0.5)  # after 1 3: 5 or 0 (a tie)
    tokens, parents = leaf_tree(logp, [1, 3, 5], nodes=4)
    # branch values: 1 0.6, 1-3 0.54, 2 0.4, 1-3-5 0.27 = 1-3-0 0.27, 1-4 0.06
    assert tokens == [1, 2, 3] + tokens[3:] and len(tokens) == 4
    assert parents[:3] == [-1, -1, 0] and parents[3] == 2 and tokens[3] in (5, 0)
    assert leaf_tree(logp, [1, 3, 5], nodes=3) == ([1, 2, 3], [-1, -1, 0])
    assert leaf_tree(logp, [1, 3, 5], nodes=1) == ([1], [-1])
    tokens, parents = leaf_tree(logp, [1, 3, 5], nodes=100, widest=2)  # at most 1 other a depth
    assert sorted(tokens) == [0, 1, 2, 3, 4, 5] and parents == [-1, -1, 0, 0, 2, 2]
    assert leaf_tree(logp, [], nodes=4) == ([], [])


@pytest.mark.parametrize("draft", ["drafter", "drafter+lookup"])
@pytest.mark.parametrize("chain", [False, True])
def test_tree_drafts_are_lossless_batched(draft, chain, monkeypatch):
    """self_spec verifying trees of drafter drafts: float32 greedy answers token-identical to
    ar, rows of different lengths together (with a sampling row, which drafts chains);
    branches other than the first are kept (their cache entries move up behind the root)."""
    from clover.decoding.policies import SelfSpec
    from clover.models.cache import KVCache

    moved = []
    compact = KVCache.compact
    monkeypatch.setattr(KVCache, "compact", lambda self, *a: (moved.append(a), compact(self, *a)))
    kept = []
    from clover.decoding import spec_row

    verify = spec_row.verify_tree
    monkeypatch.setattr(spec_row, "verify_tree", lambda *a: kept.append(verify(*a)) or kept[-1])
    from clover.decoding import spec_row as rows
    from clover.decoding.drafting import DrafterRunner

    if draft == "drafter+lookup":  # context copies come from the lookup, not a chain's lean
        monkeypatch.setattr(DrafterRunner, "COPY_BONUS", 0.0)
    grafted = []
    graft = rows.graft
    monkeypatch.setattr(rows, "graft", lambda *a: grafted.append((a, graft(*a))) or grafted[-1][1])
    model = attached(tiny_model(seed=3), chain=chain)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
    ar = decoded(model, prompts, "ar", 24)
    policy = SelfSpec(block_size=4, draft=draft, adaptive=False, tree=9)
    spec = decoded(model, prompts, policy, 24)
    assert [r.tokens for r in spec] == [r.tokens for r in ar]
    assert kept and any(path for path, _ in kept)  # trees were verified, drafts kept
    # with lookup, context matches joined trees as branches (some beside the drafter's)
    assert bool(grafted) == (draft == "drafter+lookup")
    assert draft == "drafter" or any(len(out[0]) > len(a[0]) for a, out in grafted)
    assert moved  # some kept branch was not the tree's first
    # no deeper than the chain, or than a long context match (the next test)
    assert max(max(r.accepted, default=0) for r in spec) <= (3 if draft == "drafter" else 32)


def test_graft_joins_a_chain_to_a_tree_as_one_more_branch():
    from clover.decoding.trees import graft

    tokens, parents = [4, 5, 6, 7], [-1, -1, 0, 2]  # 4 -> 6 -> 7 and 5
    assert graft(tokens, parents, [4, 6, 7]) == (tokens, parents)  # already a branch
    # follows 4 -> 6, then goes on from 6 as new nodes; the tree's nodes keep their places
    assert graft(tokens, parents, [4, 6, 9, 4]) == ([4, 5, 6, 7, 9, 4], [-1, -1, 0, 2, 2, 4])
    assert graft(tokens, parents, [8]) == ([4, 5, 6, 7, 8], [-1, -1, 0, 2, -1])
    assert graft([], [], [3, 3]) == ([3, 3], [-1, 0])
    assert graft(tokens, parents, []) == (tokens, parents)


def test_a_tree_takes_a_long_context_match_past_the_block(monkeypatch):
    """A fixed tree row (drafter+lookup) grafts a long context match as far as it goes (up to
    NgramIndex.LONG), not only block_size - 1 tokens: its pass is as wide as the tree plus the
    match anyway. Float32 answers stay ar's; passes keep more than the block's 3 drafts."""
    from clover.decoding import spec_row as rows
    from clover.decoding.drafting import DrafterRunner
    from clover.decoding.policies import SelfSpec

    monkeypatch.setattr(DrafterRunner, "COPY_BONUS", 0.0)
    grafted = []
    graft = rows.graft
    monkeypatch.setattr(rows, "graft", lambda *a: grafted.append(len(a[2])) or graft(*a))
    model = attached(tiny_model(seed=3), chain=True)  # its answers repeat an 11-token cycle
    cycle = list(range(5, 15))
    prompts = [cycle * 2 + cycle[:3], [9, 10]]
    ar = decoded(model, prompts, "ar", 40)
    policy = SelfSpec(block_size=4, draft="drafter+lookup", adaptive=False, tree=9)
    spec = decoded(model, prompts, policy, 40)
    assert [r.tokens for r in spec] == [r.tokens for r in ar]
    assert max(grafted) > 3 and max(max(r.accepted, default=0) for r in spec) > 3


def test_tree_drafts_are_refused_where_they_cannot_run():
    from clover.bench.common import DecoderConfig
    from clover.decoding.loop import generate
    from clover.decoding.policies import SelfSpec
    from tests.test_clover_arch import tiny

    name = "self_spec:16:drafter:fixed:tree15"
    config = DecoderConfig.parse(name)
    assert (config.tree, config.adaptive, config.name) == (15, False, name)
    assert DecoderConfig.parse("self_spec:16:drafter:tree31").adaptive
    for bad in ("self_spec:16:lookup:tree15", "self_spec:16:drafter:tree", "self_spec:4:drafter:x"):
        with pytest.raises(CloverError):
            DecoderConfig.parse(bad)
    with pytest.raises(CloverError, match="from a drafter"):
        SelfSpec(block_size=4, draft="lookup", tree=4)
    hybrid = tiny()  # Gated DeltaNet layers: a recurrent state follows one sequence
    with pytest.raises(CloverError, match="recurrent"):
        for _ in generate(hybrid, [[5, 6, 7]], SelfSpec(block_size=4, draft="drafter", tree=4),
                          max_new_tokens=4):  # fmt: skip
            pass


def test_a_grown_tree_drafts_after_each_branch_what_its_chain_drafts(monkeypatch):
    """A chain drafter's tree (one pass per depth over the frontier, each draft seeing only its
    own ancestors in the block): every drafted-after node's children are the top tokens the
    chain drafter gives after that node's branch drafted as a chain."""
    from clover.decoding.drafting import DrafterRunner

    runtime = attached(tiny_model(seed=3), chain=True)
    model = runtime.model
    runner = DrafterRunner(model, runtime.drafter)
    monkeypatch.setattr(DrafterRunner, "FRONTIER", 3)
    with torch.no_grad():
        _, feats = model(torch.tensor([[5, 6, 7, 8, 9]]), None, "causal", capture=runner.layers)
    runner.add_row()
    runner.commit(feats, torch.tensor([5]))
    first = torch.tensor([10])
    ((tokens, parents),) = runner.draft_tree(first, 3, [50])
    assert len(tokens) == 3 + 9 + 9  # the root's 3, 3 each after the 3 + the best 3 of 9
    assert all(p < i for i, p in enumerate(parents))
    for node in [-1, *range(len(tokens))]:
        children = {t for t, p in zip(tokens, parents) if p == node}
        if not children:
            continue
        branch, at = [], node
        while at >= 0:
            branch.insert(0, tokens[at])
            at = parents[at]
        reads = branch + [0]  # the chain reads the branch's tokens, then anything
        forced = runner.draft(first, len(branch) + 2, lambda i, _, r=reads: torch.tensor([r[i]]))
        assert children == set(forced[0, len(branch)].topk(3).indices.tolist()), branch
    ((small, up),) = runner.draft_tree(first, 3, [4], [2])  # 4 nodes, 2 deep
    assert len(small) == 4 and all(p < 0 or up[p] < 0 for p in up)


def test_a_grown_tree_scores_its_draft_vocabulary_as_the_whole_vocabulary(monkeypatch):
    """With a draft vocabulary a tree grows from the head's rows of those ids only; the
    reference scores the whole vocabulary with every other id at -inf (the chain's logits):
    the same tree, the copy lean and the mask id included (a lean to an id outside the draft
    vocabulary changes nothing)."""
    from clover.decoding.drafting import DrafterRunner

    model = tiny_model(seed=3)
    drafter = drafter_for(model, chain=True)
    vocab = torch.tensor(sorted({3, *range(0, 62, 2)}))  # 32 ids, the mask id (3) among them
    drafter.set_vocab(vocab)
    monkeypatch.setattr(DrafterRunner, "FRONTIER", 4)
    part, full = DrafterRunner(model, drafter), DrafterRunner(model, drafter)
    full.head = None  # ids map to themselves
    monkeypatch.setattr(full, "_head_logits", part._logits)  # -inf outside the vocabulary
    with torch.no_grad():
        _, feats = model(torch.tensor([[5, 6, 7, 8, 9]]), None, "causal", capture=part.layers)
    leans = {0: 4, 1: 7, 2: 10}  # by branch length: in, outside, in the draft vocabulary
    mask_id = int(model.config.mask_token_id)
    assert mask_id in vocab.tolist()
    trees = []
    for r in (part, full):
        r.add_row()
        r.commit(feats, torch.tensor([5]))
        trees.append(r.draft_tree(torch.tensor([10]), 4, [20], None,
                                  lambda b, branch: leans.get(len(branch)), mask_id))  # fmt: skip
    assert trees[0] == trees[1]
    ((tokens, _),) = trees[0]
    assert len(tokens) == 20 and set(tokens) <= set(vocab.tolist()) - {mask_id}


def test_a_grown_tree_drafts_only_after_drafts_it_can_still_keep(monkeypatch):
    """Growing stops at drafts worth less than a row's nodes-th likeliest so far (nor are their
    children ever kept): the same trees as drafting after the FRONTIER likeliest of every depth,
    two rows of different sizes together, in fewer and narrower drafter passes."""
    from clover.decoding.drafting import DrafterRunner

    runtime = attached(tiny_model(seed=3), chain=True)
    model = runtime.model
    monkeypatch.setattr(DrafterRunner, "FRONTIER", 4)
    with torch.no_grad():
        _, feats = model(torch.tensor([[5, 6, 7, 8, 9]] * 2), None, "causal", capture=(0, 1))
    widths, trees = [], []
    tree_pass = DrafterRunner._tree_pass
    monkeypatch.setattr(DrafterRunner, "_tree_pass",
                        lambda self, t, chosen, *a: widths[-1].append(len(chosen[0]))
                        or tree_pass(self, t, chosen, *a))  # fmt: skip
    from clover.decoding import drafting

    floor = drafting.floor
    for prune in (False, True):
        if not prune:  # the reference: every depth's FRONTIER likeliest draft after themselves
            monkeypatch.setattr(drafting, "floor", lambda *a: float("-inf"))
        else:
            monkeypatch.setattr(drafting, "floor", floor)
        runner = DrafterRunner(model, runtime.drafter)
        for _ in range(2):
            runner.add_row()
        runner.commit(feats, torch.tensor([5, 4]))
        widths.append([])
        trees.append(runner.draft_tree(torch.tensor([10, 11]), 5, [6, 12], [5, 3]))
    assert trees[0] == trees[1]
    assert all(len(tokens) == n for (tokens, _), n in zip(trees[1], [6, 12]))
    assert sum(widths[1]) < sum(widths[0]), widths


@pytest.mark.parametrize("chain, mlp", [(False, 256), (True, 256), (True, 96)])
def test_an_int4_drafter_runs_fused_as_its_modules(chain, mlp, monkeypatch):
    """With int4 linears in Clover's kernels a drafter pass takes the fused layers (q/k norms
    included): the modules' hidden states, two rows of different contexts, block passes, a
    chain's passes over scratch slots and a grown tree's (each draft seeing only its own
    ancestors' slots among them); also with an MLP narrower than the target's."""
    import copy

    from clover import kernels
    from clover.quant import quantize_linears

    if kernels.load() is None:
        pytest.skip("no C++ compiler here")
    model = tiny_model(hidden_size=128, intermediate_size=256)
    drafter = drafter_for(model, chain=chain, intermediate_size=mlp)
    with torch.no_grad():  # sharper q/k norms: attention that a wrong norm would move
        for layer in drafter.layers:
            layer.self_attn.q_norm.weight.mul_(3)
            layer.self_attn.k_norm.weight.mul_(3)
    fast = quantize_linears(copy.deepcopy(drafter))
    ref = copy.deepcopy(fast)
    object.__setattr__(ref, "fused_layers", lambda cache: None)  # the modules: the reference
    embed = model.model.embed_tokens
    feats = torch.randn(2, 7, 2 * model.config.hidden_size)
    outs = []
    with torch.no_grad():
        for d in (fast, ref):
            cache = d.make_cache(2)
            d.commit(feats, torch.tensor([7, 4]), cache)
            assert (d.fused_layers(cache) is not None) == (d is fast)
            if chain:
                first = d.chain_hidden(torch.tensor([[5, 5], [6, 6]]), 0, embed, cache)
                outs.append(torch.cat([first, d.chain_hidden(torch.tensor([[9], [11]]), 2,
                                                             embed, cache)], 1))  # fmt: skip
            else:
                outs.append(d.block_hidden(torch.tensor([5, 6]), embed, cache, 4))
    a, b = (o.float() for o in outs)
    assert float((a - b).abs().max()) < 0.03 * float(b.abs().max())
    if not chain:
        return
    from clover.decoding.drafting import DrafterRunner

    gaps = []
    tree_pass = DrafterRunner._tree_pass

    def both(self, *args):  # each tree pass fused, then again through the modules
        h = tree_pass(self, *args)
        object.__setattr__(self.drafter, "fused_layers", lambda cache: None)
        try:
            want = tree_pass(self, *args)
        finally:
            del self.drafter.__dict__["fused_layers"]
        gaps.append(float((h.float() - want.float()).abs().max()) / float(want.abs().max()))
        return h

    monkeypatch.setattr(DrafterRunner, "_tree_pass", both)
    monkeypatch.setattr(DrafterRunner, "FRONTIER", 3)
    runner = DrafterRunner(model, fast)
    for _ in range(2):
        runner.add_row()
    runner.commit(feats, torch.tensor([7, 4]))
    runner.draft_tree(torch.tensor([5, 6]), 4, [12, 12])
    assert len(gaps) >= 2 and max(gaps) < 0.03, gaps


def test_a_registry_entry_s_drafter_loads_with_its_model_and_drafts_by_default(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """A registry entry that ships a drafter (the coder 0.5B's) attaches it when the model
    loads, and its default decoder (self_spec, drafter+lookup) gives ar's answers with the
    drafter's drafts in them; a drafter the caller names replaces the shipped one, and a
    shipped drafter of another target is refused as any drafter file is."""
    from pathlib import Path

    from clover.checkpoints import loader
    from clover.checkpoints.registry import ModelEntry, ResolvedModel
    from clover.engine import LLM

    target = LLM(str(tiny_checkpoint), progress=False).model
    shipped = save_drafter(drafter_for(target), tmp_path / "shipped.safetensors", torch.float32)
    mine = save_drafter(drafter_for(target), tmp_path / "mine.safetensors", torch.float32)
    wrong = save_drafter(drafter_for(tiny_model(seed=1)), tmp_path / "wrong.safetensors",
                         torch.float32)  # fmt: skip

    class Entry(ModelEntry):
        @property
        def drafter_path(self) -> Path:
            return tmp_path / self.drafter

    entry = Entry(name="tiny-shipped", package="none", module="none", filename="none",
                  description="test", license="MIT", drafter=shipped.name,
                  decoding={"default_decoder": "self_spec", "block_size": 4,
                            "draft": "drafter+lookup"})  # fmt: skip
    resolved = ResolvedModel("tiny-shipped", Path(tiny_checkpoint), "hf", entry)
    monkeypatch.setattr(loader, "resolve", lambda name, progress=True: resolved)
    llm = LLM("tiny-shipped", progress=False, dtype="float32")
    assert llm.drafter == str(shipped) and llm.runtime.drafter is not None
    prompts = ["abcabcabc", "hello there"]
    default = llm.generate(prompts, max_tokens=20, adaptive=False)
    ar = llm.generate(prompts, max_tokens=20, decoder="ar")
    assert [c.token_ids for c in default] == [c.token_ids for c in ar]
    assert any("drafter" in c.drafts for c in default)
    assert LLM("tiny-shipped", progress=False, drafter=str(mine)).drafter == str(mine)
    # "none": not even the shipped one; the default drafts from context lookup instead
    bare = LLM("tiny-shipped", progress=False, dtype="float32", drafter="none")
    assert bare.drafter is None and bare.runtime.drafter is None
    assert bare.config.draft == "lookup"
    assert [c.token_ids for c in bare.generate(prompts, max_tokens=20)] == [
        c.token_ids for c in ar]  # fmt: skip
    bad = ResolvedModel("tiny-shipped", Path(tiny_checkpoint), "hf",
                        replace(entry, drafter=wrong.name))  # fmt: skip
    monkeypatch.setattr(loader, "resolve", lambda name, progress=True: bad)
    with pytest.raises(CloverError, match="this drafter was trained on"):
        LLM("tiny-shipped", progress=False)


def test_kind_report_measures_each_never_trained_answer_by_kind(tiny_checkpoint, data, tmp_path):
    """kind_sets takes every held-out answer and every answer of `heldout_kinds`, a cap per
    kind; kind_report gives each drafter `evaluate` on each kind's answers (the same
    features) and the answer-weighted means over trained and never-trained kinds."""
    from clover.data.distill import load_examples
    from clover.engine import LLM
    from clover.train.drafter import (
        FeatureCache,
        evaluate,
        kind_report,
        kind_sets,
        loss_head,
        train_drafter,
        warm_cache,
    )

    records = load_examples(data)
    unseen = next(r["kind"] for r in records if r["split"] == "train")
    cfg = drafter_config(tiny_checkpoint, data, tmp_path / "run", steps=4, heldout_kinds=[unseen])
    train_drafter(cfg, progress=False)
    target = LLM(str(tiny_checkpoint), dtype="float32", progress=False).model
    trained = load_drafter(tmp_path / "run" / "drafter.safetensors", target)
    fresh = new_drafter(target, "tiny", block_size=4)
    sets = kind_sets(cfg, per_kind=1000)
    expect = {r["id"] for r in records
              if r["answer_ids"] and (r["kind"] == unseen or r["split"] != "train")}  # fmt: skip
    assert {r["id"] for rs in sets.values() for r in rs} == expect
    assert any(r["split"] == "train" for r in sets[unseen])
    assert all(len(rs) <= 1 for rs in kind_sets(cfg, per_kind=1).values())
    report = kind_report({"trained": trained, "fresh": fresh}, target, cfg, sets)
    assert report["kinds"][unseen] == {"answers": len(sets[unseen]), "trained_kind": False}
    assert sum(k["trained_kind"] for k in report["kinds"].values()) == len(sets) - 1
    cache = FeatureCache(1.0)
    warm_cache(target, [r for rs in sets.values() for r in rs], trained.config.feature_layers,
               cfg.max_len, cache)  # fmt: skip
    for name, drafter in (("trained", trained), ("fresh", fresh)):
        head, rows = loss_head(target, drafter, cfg)
        got = report["drafters"][name]
        for kind, rs in sets.items():
            assert got["by_kind"][kind] == evaluate(drafter, target, head, rs, cfg, rows, cache)
        assert got["never_trained_kinds"] == got["by_kind"][unseen]
        kinds = [k for k in sets if k != unseen]
        n = sum(len(sets[k]) for k in kinds)
        mean = sum(got["by_kind"][k]["accepted"] * len(sets[k]) for k in kinds) / n
        assert got["trained_kinds"]["accepted"] == pytest.approx(mean, abs=1e-4)
    other = new_drafter(target, "tiny", block_size=4, feature_layers=[0])
    with pytest.raises(CloverError, match="different target layers"):
        kind_report({"a": trained, "b": other}, target, cfg, sets)
