"""Expert parallelism on CPU: 2 processes, gloo, same logits as one process."""

import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from clover.models.clover import CloverModel, preset_config
from clover.models.moe import shard_experts


def _worker(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = CloverModel(preset_config("clover-tiny", vocab_size=96)).eval()
        ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            single = model.logits(model(ids))
            n = shard_experts(model)
            held = sum(m.gate_up.shape[0] for m in model.modules() if hasattr(m, "local_index"))
            cache = model.make_cache(2)
            model(ids[:, :8], cache)
            sharded = torch.cat(
                [model.logits(model(ids[:, :8])), model.logits(model(ids[:, 8:], cache))], 1
            )
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"diff": float((single - sharded).abs().max()), "layers": n, "held": held}, f)
    finally:
        dist.destroy_process_group()


def test_two_process_expert_parallel_matches_single_process(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(2, init, out), nprocs=2, join=True)
    results = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    for r in results:
        assert r["diff"] < 1e-4
        assert r["layers"] == 4
        assert r["held"] == 4 * 4  # 8 experts per layer, half on each rank
