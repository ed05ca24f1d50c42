"""Mixture-of-experts feed-forward: softmax router, top-k (renormalised when the family says
so), optionally one gated shared expert (Qwen3-Next / 3.5; Qwen3-MoE has none: width 0).

Experts are stored stacked (`gate_up` [E, 2I, D], `down` [E, D, I]) so a checkpoint with
per-expert tensors or transformers' fused ones maps onto the same module (`sanitize_experts`;
`unstack_experts` writes them back in a published layout). The fast
path runs only the experts that received tokens: the (token, expert) pairs sorted by expert
and two grouped matmuls (`torch._grouped_mm`, where this PyTorch has it for the device and
dtype), else a loop over the experts that got tokens. The loop costs a GPU one host sync and
a few kernel launches per expert (a 33-token block at top-8 of 256 reaches ~150 experts a
layer); the grouped path syncs never.
`forward_dense` runs every expert on every token and weights them by the routing, the
reference the tests compare against.

Block expert coreset (optional, `coreset` > 0): during a block preview all block positions of a
row route inside one subset of `coreset` experts chosen for the block (the highest summed
router probability over its positions), so one denoising step touches `coreset` experts
instead of up to min(E, k * B). Commit passes always route per token, so the cached prefix is
exactly what per-token routing gives.

Expert parallelism: with `ep_group` set (torch.distributed), each rank holds the experts
`rank::world` and computes their contribution for every token; an all-reduce sums them. The
shared expert and the router are replicated.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from clover.errors import CloverError
from clover.quant import int8_matmul, int8_rows


class MoE(nn.Module):
    def __init__(
        self, hidden: int, experts: int, top_k: int, width: int, shared_width: int, norm_topk: bool
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.width, self.norm_topk = experts, top_k, width, norm_topk
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * width, hidden) * hidden**-0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, width) * width**-0.5)
        self.shared_width = shared_width
        if shared_width:
            self.shared_gate_proj = nn.Linear(hidden, shared_width, bias=False)
            self.shared_up_proj = nn.Linear(hidden, shared_width, bias=False)
            self.shared_down_proj = nn.Linear(shared_width, hidden, bias=False)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.ep_group = None  # torch.distributed group for expert parallelism
        self.local_index: dict[int, int] | None = None  # global -> local expert (EP shard)
        self.int8: tuple | None = None  # (gate_up q, scale, down q, scale) once quantized
        self.grouped = True  # the grouped-matmul path where it runs (False: the expert loop)

    def route(
        self, x: torch.Tensor, block: torch.Tensor | None = None, coreset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k], expert ids [N, k]).

        block [N] (optional): group id per token for the coreset (-1 = per-token routing).
        """
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [N, E]
        if coreset and block is not None and bool((block >= 0).any()):
            allowed = torch.ones_like(probs, dtype=torch.bool)
            for gid in block.unique().tolist():
                if gid < 0:
                    continue
                rows = block == gid
                keep = probs[rows].sum(0).topk(min(coreset, self.num_experts)).indices
                mask = torch.zeros(self.num_experts, dtype=torch.bool)
                mask[keep] = True
                allowed[rows] = mask
            probs = probs.masked_fill(~allowed, 0.0)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-20)
        return weights, ids

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        i = self.local_index[e] if self.local_index is not None else e
        if self.int8 is not None:  # weight-only int8 experts (clover.quant)
            gu_q, gu_s, d_q, d_s = self.int8
            gate, up = int8_matmul(x, gu_q[i], gu_s[i]).chunk(2, dim=-1)
            return int8_matmul(F.silu(gate) * up, d_q[i], d_s[i])
        gate, up = F.linear(x, self.gate_up[i]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down[i])

    def quantize_experts_int8(self) -> None:

        gu_q, gu_s = int8_rows(self.gate_up.detach())
        d_q, d_s = int8_rows(self.down.detach())
        self.int8 = (gu_q, gu_s, d_q, d_s)
        del self.gate_up, self.down

    def shard(self, rank: int, world: int, group: object = None) -> None:
        """Expert parallelism: keep experts rank::world; outputs are summed across `group`."""
        local = list(range(rank, self.num_experts, world))
        self.gate_up = nn.Parameter(self.gate_up.detach()[local].clone())
        self.down = nn.Parameter(self.down.detach()[local].clone())
        self.local_index = {e: i for i, e in enumerate(local)}
        self.ep_group = group

    def _shared(self, x: torch.Tensor) -> torch.Tensor | float:
        if not self.shared_width:
            return 0.0
        h = F.silu(self.shared_gate_proj(x)) * self.shared_up_proj(x)
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_down_proj(h)

    def forward(
        self, x: torch.Tensor, block: torch.Tensor | None = None, coreset: int = 0
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; block [B, T] group ids for the coreset (-1: per token)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.route(flat, None if block is None else block.reshape(-1), coreset)
        if self.grouped and self._grouped_fits(flat):
            out = self._forward_grouped(flat, weights, ids)
        else:
            out = self._forward_loop(flat, weights, ids)
        if self.local_index is not None:
            import torch.distributed as dist  # absent from some torch builds

            dist.all_reduce(out, group=self.ep_group)  # every rank adds its experts' share
        if self.shared_width:
            out = out + self._shared(flat).float()
        return out.to(x.dtype).reshape(shape)

    def _forward_loop(
        self, flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(flat, dtype=torch.float32)
        for e in ids.unique().tolist():
            if self.local_index is not None and e not in self.local_index:
                continue  # another rank holds it
            tok, slot = (ids == e).nonzero(as_tuple=True)
            y = self._expert(e, flat[tok]).float() * weights[tok, slot, None]
            out.index_add_(0, tok, y)
        return out

    def _grouped_fits(self, flat: torch.Tensor) -> bool:
        """The grouped path: every expert here (no EP shard), unquantized, rows of 16-byte
        multiples (the kernel's stride rule), and a PyTorch that runs it on this device."""
        if self.int8 is not None or self.local_index is not None:
            return False
        per = 16 // self.gate_up.element_size()
        if flat.dtype != self.gate_up.dtype or any(n % per for n in (flat.shape[1], self.width)):
            return False
        return _grouped_mm_works(flat.device.type, flat.dtype)

    def _forward_grouped(
        self, flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The (token, expert) pairs sorted by expert, one grouped matmul per projection."""
        pairs = ids.reshape(-1)
        order = pairs.argsort(stable=True)
        tok = order // self.top_k
        ends = torch.bincount(pairs, minlength=self.num_experts).cumsum(0).to(torch.int32)
        gate_up = torch._grouped_mm(flat[tok], self.gate_up.transpose(1, 2), offs=ends)
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=ends)
        out = torch.zeros_like(flat, dtype=torch.float32)
        return out.index_add_(0, tok, y.float() * weights.reshape(-1)[order, None])

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        """Reference: every expert on every token, weighted by the (top-k) routing."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.route(flat)
        dense = torch.zeros(flat.shape[0], self.num_experts)
        dense.scatter_(1, ids, weights)
        all_out = torch.stack([self._expert(e, flat) for e in range(self.num_experts)], 1)
        out = (all_out.float() * dense[..., None]).sum(1)
        if self.shared_width:
            out = out + self._shared(flat).float()
        return out.to(x.dtype).reshape(shape)


@functools.cache
def _grouped_mm_works(device: str, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs here and agrees with plain matmuls (PyTorch 2.8
    brought it for some GPUs; later versions for the CPU); probed once on tiny operands."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(12, 16, generator=g).to(device, dtype)
        w = torch.randn(3, 32, 16, generator=g).to(device, dtype)
        ends = torch.tensor([4, 4, 12], dtype=torch.int32, device=device)  # one expert empty
        got = torch._grouped_mm(x, w.transpose(1, 2), offs=ends).float()
        want = torch.cat([x[:4] @ w[0].T, x[4:] @ w[2].T]).float()
        return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def shard_experts(model: nn.Module, group: object = None) -> int:
    """Expert parallelism over torch.distributed: each rank keeps experts rank::world of every
    MoE layer and the layers all-reduce their outputs. Same code with gloo (CPU) or NCCL (one
    GPU per rank). Returns how many MoE layers were sharded."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in layers:
        moe.shard(rank, world, group)
    return len(layers)


# --- checkpoint names -------------------------------------------------------------------------

# transformers' names (after `.mlp.`) -> ours
_RENAMES = {
    "gate.weight": "router.weight",
    "shared_expert.gate_proj.weight": "shared_gate_proj.weight",
    "shared_expert.up_proj.weight": "shared_up_proj.weight",
    "shared_expert.down_proj.weight": "shared_down_proj.weight",
    "experts.gate_up_proj": "gate_up",  # transformers 5's fused experts [E, 2I, D]
    "experts.down_proj": "down",  # [E, D, I]
}


def sanitize_experts(weights: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """MoE tensors in any published layout -> `MoE`'s: the router (`mlp.gate`), the shared
    expert, and experts either per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`,
    stacked here), fused (`mlp.experts.gate_up_proj` / `down_proj`) or already ours."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in weights.items():
        prefix, sep, rest = name.partition(".mlp.")
        if not sep:
            out[name] = t
            continue
        if rest.startswith("experts.") and rest.count(".") == 3:  # experts.{e}.{proj}.weight
            _, e, proj, _ = rest.split(".")
            per_expert.setdefault(prefix, {}).setdefault(int(e), {})[proj] = t
            continue
        out[f"{prefix}.mlp.{_RENAMES.get(rest, rest)}"] = t
    for prefix, experts in per_expert.items():
        if sorted(experts) != list(range(num_experts)):
            raise CloverError(
                f"{prefix}.mlp: experts {sorted(experts)[:5]}... are not 0..{num_experts - 1}"
            )
        try:
            gate_up = [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in experts]
            down = [experts[e]["down_proj"] for e in sorted(experts)]
        except KeyError as e:
            raise CloverError(f"{prefix}.mlp: an expert lacks {e.args[0]}") from None
        out[f"{prefix}.mlp.gate_up"] = torch.stack(gate_up)
        out[f"{prefix}.mlp.down"] = torch.stack(down)
    return out


def unstack_experts(state: dict[str, torch.Tensor], fused: bool = False) -> dict[str, torch.Tensor]:
    """Ours -> transformers' names: per-expert tensors (Qwen3-MoE files), or with `fused` the
    `experts.gate_up_proj` / `experts.down_proj` form (Qwen3.5 files)."""
    back = {ours: theirs for theirs, ours in _RENAMES.items()}
    out = {}
    for name, t in state.items():
        prefix, sep, rest = name.partition(".mlp.")
        if not sep or rest not in back:
            out[name] = t
        elif rest in ("gate_up", "down") and not fused:
            for e, w in enumerate(t):
                if rest == "gate_up":
                    gate, up = w.chunk(2)
                    out[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = gate
                    out[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = up
                else:
                    out[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = w
        else:
            out[f"{prefix}.mlp.{back[rest]}"] = t
    return out
