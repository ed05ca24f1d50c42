import json

import pytest
import torch

from clover.cli import main
from clover.data.distill import distill
from clover.errors import CloverError
from clover.train.adapt import TrainConfig, train


@pytest.fixture(scope="module")
def data(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill")
    distill(str(tiny_checkpoint), out, 40, max_tokens=12, batch_size=8, top_k=4,
            dtype="float32", progress=False)  # fmt: skip
    return out


def config(tiny_checkpoint, data, out, **kw):
    base = dict(data=str(data), out=str(out), base=str(tiny_checkpoint), steps=6, batch_size=4,
                lr=3e-3, warmup=1, block_sizes=[4], eval_every=3, save_every=2, seed=1)  # fmt: skip
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("loss", ["kl", "ce"])
def test_training_lowers_the_masked_loss(tiny_checkpoint, data, tmp_path, loss):
    cfg = config(tiny_checkpoint, data, tmp_path / "run", steps=12, loss=loss)
    train(cfg, progress=False)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 12
    # the held-out loss (fixed examples) falls; one training batch's loss against another's is
    # noise at this size
    evals = [x["heldout"]["masked"] for x in lines if "heldout" in x]
    last = lines[-1]
    assert len(evals) == 4 and evals[-1] < evals[0]
    assert "heldout" in last and last["tokens_per_s"] > 0
    assert "accept" in last["heldout"] and 0 <= last["heldout"]["pos_acc"] <= 1
    from clover.engine import LLM

    adapter = tmp_path / "run" / "adapter.safetensors"
    adapted = LLM(str(tiny_checkpoint), progress=False, adapter=adapter)
    assert adapted.generate("hello", max_tokens=4)[0].output_tokens <= 4
    # the causal path is the base model's: self_spec returns exactly the base's AR answer
    base = LLM(str(tiny_checkpoint), progress=False)
    want = base.generate("hello", max_tokens=8, decoder="ar")[0].token_ids
    got = adapted.generate("hello", max_tokens=8, decoder="self_spec", block_size=3)[0]
    assert got.token_ids == want


def test_resume_continues_exactly(tiny_checkpoint, data, tmp_path):
    full = config(tiny_checkpoint, data, tmp_path / "full")
    train(full, progress=False)
    part = config(tiny_checkpoint, data, tmp_path / "part")
    train(part, progress=False, until=3)  # stopped after step 3 (checkpoint at 3)
    with open(tmp_path / "part" / "metrics.jsonl", "a") as f:  # a step lost to a kill
        f.write(json.dumps({"step": 4, "masked": 9.9}) + "\n")
    train(part, resume=True, progress=False)

    def curve(d):
        return [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]

    a, b = curve("full"), curve("part")
    assert [x["step"] for x in b] == list(range(1, 7))
    # same curve within tolerance: two fresh runs already differ by ~1e-5 (parallel CPU
    # kernels sum gradients of gathered rows in varying order), which later steps amplify
    for x, y in zip(a, b):
        assert x["masked"] == pytest.approx(y["masked"], rel=1e-3)
    sa = torch.load(tmp_path / "full" / "checkpoint" / "state.pt", weights_only=True)["model"]
    sb = torch.load(tmp_path / "part" / "checkpoint" / "state.pt", weights_only=True)["model"]
    assert all(torch.allclose(sa[k], sb[k], atol=1e-4) for k in sa)


def test_config_errors_and_cli(tiny_checkpoint, data, tmp_path):
    with pytest.raises(CloverError, match="loss"):
        config(tiny_checkpoint, data, tmp_path, loss="mse")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: x\nout: y\nwhat: 1\n")
    with pytest.raises(CloverError, match="unknown key"):
        TrainConfig.from_yaml(bad)
    good = tmp_path / "run.yaml"
    good.write_text(
        f"data: {data}\nout: {tmp_path / 'cli'}\nbase: {tiny_checkpoint}\nsteps: 2\n"
        "batch_size: 2\nblock_sizes: [2, 4]\ntrainable: last:1\n"
    )
    assert main(["train", "adapt", "--config", str(good), "--quiet"]) == 0
    assert (tmp_path / "cli" / "checkpoint" / "state.pt").exists()
    assert main(["train", "adapt", "--config", str(good), "--resume", "--quiet"]) == 0


def test_noise_modes_and_full_masks():
    import random

    from clover.train.adapt import example_masks

    ex = {"id": "x"}
    cfg = TrainConfig(data="d", out="o", noise="complement_epochs", seed=3)
    m0 = example_masks(ex, 11, 4, cfg, random.Random(0), epoch=0)
    m1 = example_masks(ex, 11, 4, cfg, random.Random(1), epoch=1)
    assert len(m0) == len(m1) == 1 and m1[0] == [not x for x in m0[0]]
    two = example_masks(ex, 11, 4, TrainConfig(data="d", out="o"), random.Random(0), 0)
    assert len(two) == 2 and all(a != b for a, b in zip(*two))
    full = TrainConfig(data="d", out="o", full_mask_prob=1.0, noise="independent")
    assert example_masks(ex, 11, 4, full, random.Random(0), 0) == [[True] * 11]
    with pytest.raises(CloverError, match="noise"):
        TrainConfig(data="d", out="o", noise="bogus")


def test_continued_adapter_keeps_its_history(tiny_checkpoint, data, tmp_path):
    from clover.models.adapter import read_adapter_config

    first = config(tiny_checkpoint, data, tmp_path / "a", steps=3, rank=4, alpha=8.0)
    train(first, progress=False)
    more = config(tiny_checkpoint, data, tmp_path / "b", steps=2, rank=16,
                  init_adapter=str(tmp_path / "a" / "adapter.safetensors"))  # fmt: skip
    train(more, progress=False)
    saved = read_adapter_config(tmp_path / "b" / "adapter.safetensors")
    assert saved.rank == 4 and saved.alpha == 8.0  # the continued file's shape, not the YAML's
    stages = saved.info["stages"]
    assert [s["steps"] for s in stages] == [3, 2] and saved.info["steps"] == 5
    assert all(s["answer_tokens"] > 0 for s in stages)
    assert "rank" in stages[0]["recipe"] and "rank" not in stages[1]["recipe"]
    assert stages[1]["recipe"]["init_adapter"].endswith("adapter.safetensors")


def test_time_box_shortens_the_schedule_and_writes_the_adapter(
    tiny_checkpoint, data, tmp_path, monkeypatch
):
    """max_minutes: after 10 timed steps the cosine schedule is refitted to end inside the
    box, and the run ends with an adapter file (a GPU lease is minutes, not steps). The clock
    is faked (1 s per reading) so the test does not depend on this machine's speed."""
    import itertools

    import clover.train.adapt as adapt

    roomy = train(config(tiny_checkpoint, data, tmp_path / "roomy", steps=4, max_minutes=60),
                  progress=False)  # fmt: skip
    assert roomy["steps"] == 4 and roomy["time_box_steps"] is None
    clock = itertools.count(0.0, 1.0)
    monkeypatch.setattr(adapt.time, "perf_counter", lambda: next(clock))
    cfg = config(tiny_checkpoint, data, tmp_path / "boxed", steps=500, max_minutes=1.0)
    out = train(cfg, progress=False)
    assert 11 <= out["steps"] < 500
    assert out["time_box_steps"] == out["steps"] or out["out_of_time"]
    assert (tmp_path / "boxed" / "adapter.safetensors").exists()
    state = torch.load(tmp_path / "boxed" / "checkpoint" / "state.pt", weights_only=True)
    assert state["step"] == out["steps"] and state["steps"] <= 500
    rows = (tmp_path / "boxed" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == out["steps"] and "heldout" in json.loads(rows[-1])
    with pytest.raises(CloverError, match="max_minutes"):
        config(tiny_checkpoint, data, tmp_path, max_minutes=0)


def test_bf16_autocast_only_where_the_cpu_has_bf16(monkeypatch, capsys):
    from clover.checkpoints import loader
    from clover.train.adapt import bf16_where_fast

    cfg = TrainConfig(base="b", data="d", out="o", autocast_bf16=True)
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: False)
    assert not bf16_where_fast(cfg, torch.device("cpu")).autocast_bf16
    assert "no bf16 instructions" in capsys.readouterr().err
    assert bf16_where_fast(cfg, torch.device("meta")).autocast_bf16  # not a CPU: as asked
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: True)
    assert bf16_where_fast(cfg, torch.device("cpu")).autocast_bf16
