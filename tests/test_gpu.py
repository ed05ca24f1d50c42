"""The drafter's road on a CUDA device: distil, train, draft, verify (skipped without one; CI
has none). Run it first on a lent GPU machine, before a long job there:
`python -m pytest -q tests/test_gpu.py` (scripts/gpu_adapt.sh's first call does).
CLOVER_TEST_DEVICE=cpu rehearses them here."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import tiny_model
from tests.test_drafter import decoded, drafter_config, drafter_for

DEV = os.environ.get("CLOVER_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEV.startswith("cuda") and not torch.cuda.is_available(), reason="no CUDA device"
)


@pytest.mark.parametrize("adaptive", [True, False])
def test_drafter_drafts_are_lossless_on_cuda(adaptive):
    """float32 on the GPU: drafter+lookup answers token-identical to ar, batched rows; adaptive
    measures the GPU's pass costs (clover.decoding.costs) on the way."""
    from clover.decoding.policies import SelfSpec
    from clover.decoding.runtime import Runtime

    net = tiny_model(seed=3).to(DEV)
    model = Runtime(net, drafter_for(net).to(DEV))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
    ar = decoded(model, prompts, "ar", 24)
    policy = SelfSpec(block_size=4, draft="drafter+lookup", adaptive=adaptive)
    spec = decoded(model, prompts, policy, 24)
    assert [r.tokens for r in spec] == [r.tokens for r in ar]
    if not adaptive:
        assert any("drafter" in r.drafts for r in spec)


def test_distil_train_and_draft_on_cuda(tiny_checkpoint, tmp_path):
    """The teacher answers on the GPU, the drafter trains there (target features and all), and
    the file it writes drafts for the target loaded on the GPU, lossless."""
    from clover.data.distill import distill
    from clover.engine import LLM
    from clover.train.drafter import train_drafter

    data = tmp_path / "distill"
    counts = distill(str(tiny_checkpoint), data, 24, max_tokens=16, batch_size=8, top_k=4,
                     dtype="float32", device=DEV, progress=False)  # fmt: skip
    assert counts["written"] >= 20
    from clover.data.distill import load_examples

    for r in load_examples(data / "distill.jsonl"):  # rows joined mid-run: their own top-1s
        written = r["answer_ids"][: len(r["answer_ids"]) - (r["finish_reason"] == "stop")]
        assert [row[0] for row in r["topk_ids"][: len(written)]] == written
    cfg = drafter_config(tiny_checkpoint, data, tmp_path / "run", steps=8, device=DEV)
    last = train_drafter(cfg, progress=False)
    assert "accepted" in last["heldout"]
    llm = LLM(str(tiny_checkpoint), dtype="float32", device=DEV, progress=False,
              drafter=tmp_path / "run" / "drafter.safetensors")  # fmt: skip
    assert next(llm.model.parameters()).device.type == torch.device(DEV).type
    prompts = ["hello there", "count: 1 2 3 1 2 3"]
    ar = llm.generate(prompts, decoder="ar", max_tokens=16)
    spec = llm.generate(prompts, decoder="self_spec", block_size=4, draft="drafter",
                        adaptive=False, max_tokens=16)  # fmt: skip
    assert [c.token_ids for c in spec] == [c.token_ids for c in ar]


def test_joining_rows_and_grouped_experts_on_cuda():
    """Prompts joining a running batch in one shared pass (`BatchDecoder.joining`) answer as
    alone on the device; the MoE's grouped-matmul path equals its expert loop there."""
    from clover.decoding.loop import BatchDecoder
    from clover.decoding.policies import make_policy
    from clover.models.moe import MoE, _grouped_mm_works

    model = tiny_model(seed=3).to(DEV)
    policy = make_policy("ar")
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [18]]
    alone = [decoded(model, [p], "ar", 16)[0].tokens for p in prompts]
    batch = BatchDecoder(model)
    rows = [batch.add(prompts[0], policy, max_new_tokens=16)]
    batch.step()
    with batch.joining():
        rows += [batch.add(p, policy, max_new_tokens=16) for p in prompts[1:]]
    while batch.active:
        batch.step()
    assert [r.result.tokens for r in rows] == alone
    dtype = torch.bfloat16 if torch.device(DEV).type == "cuda" else torch.float32
    if not _grouped_mm_works(torch.device(DEV).type, dtype):
        pytest.skip(f"torch._grouped_mm does not run on {DEV} in {dtype}")
    torch.manual_seed(0)
    moe = MoE(hidden=64, experts=32, top_k=4, width=32, shared_width=32, norm_topk=True)
    moe = moe.to(DEV, dtype)
    x = torch.randn(2, 33, 64, device=DEV, dtype=dtype)
    with torch.no_grad():
        assert moe._grouped_fits(x.reshape(-1, 64))
        fast = moe(x).float()
        moe.grouped = False
        loop = moe(x).float()
    torch.testing.assert_close(fast, loop, atol=3e-2, rtol=3e-2)
