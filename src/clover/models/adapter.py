"""Draft adapters: low-rank weight deltas that act only on the tokens of the block.

A block-diffusion model needs two skills: predicting masked positions in parallel (the block
pass) and predicting the next token (the causal pass that commits a block, verifies a draft and
builds the prefix cache). An AR checkpoint already has the second. A draft adapter adds the
first without touching it: every adapted projection computes `W x` for all tokens and adds
`scale * B A x` only for tokens of the block being denoised. So

- the committed path (prefill, AR steps, commit passes, the prefix cache) is bit-identical to
  the base model, and `self_spec` with an adapter returns exactly the base model's AR answer;
- training never back-propagates through the clean sequence: its pass runs once without
  gradients and the noisy copy reads its cache (`clover.train.adapt`);
- the file is small (rank r on each projection), so the repo ships it beside a base GGUF.

The [MASK] input gets its own learned vector, again only at block positions (initialised to the
base embedding of `mask_token_id`: the stated init). `layers` limits the adapter to some layers
(the "partial" recipe); rank and targets are in the config saved with the weights.

Which tokens are block tokens is set per forward by the model (`DiffusionLM.forward`) into the
shared `BlockTokens` the adapted modules read: a flat index into [B * T].
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from clover.errors import CloverError
from clover.files import atomic_write, read_header, read_safetensors

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class AdapterConfig:
    rank: int = 32
    alpha: float = 32.0  # the delta is scaled by alpha / rank
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    layers: list[int] | None = None  # None: every layer
    mask_embedding: bool = True  # a learned [MASK] input vector
    info: dict = field(default_factory=dict)  # provenance: base model, training summary

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise CloverError(f"adapter rank must be a positive integer, got {self.rank!r}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise CloverError(f"adapter targets {unknown or '[]'}: choose from {TARGETS}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class BlockTokens:
    """Shared by the adapted modules of one model: index [N] of block tokens in the flattened
    [B * T] input of the current forward, or None (no block tokens: the adapter is idle)."""

    def __init__(self) -> None:
        self.index: torch.Tensor | None = None
        self.span: tuple[int, int] | None = None  # the index as a range, when it is one
        self.ids: torch.Tensor | None = None  # input_ids [B, T] of the current forward

    def set(self, block: torch.Tensor | None, ids: torch.Tensor) -> None:
        """block: bool [B, T] (True = token of a block being denoised)."""
        self.clear()
        if block is None or not bool(block.any()):
            return
        self.index = block.reshape(-1).nonzero().squeeze(1)
        lo, hi = int(self.index[0]), int(self.index[-1]) + 1
        if hi - lo == len(self.index):  # batch 1, or a whole training pass: slice, no gather
            self.span = (lo, hi)
        self.ids = ids

    def clear(self) -> None:
        self.index, self.span, self.ids = None, None, None


class LoRALinear(nn.Module):
    """base(x) + scale * (x A^T) B^T on block tokens only. x [..., K] -> [..., N]."""

    def __init__(self, base: nn.Module, rank: int, scale: float, tokens: BlockTokens) -> None:
        super().__init__()
        self.base = base
        K, N = base.in_features, base.out_features
        self.in_features, self.out_features = K, N
        # float32 (master weights for training); a loaded model casts them to its dtype
        self.lora_a = nn.Parameter(torch.empty(rank, K))
        self.lora_b = nn.Parameter(torch.zeros(N, rank))  # 0: starts as the base
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = scale
        self.tokens = tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_delta(x, self.base(x))

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y = base(x) (computed by the caller, maybe in a packed matmul) -> y + the delta on
        block tokens (into y itself at inference)."""
        idx, span = self.tokens.index, self.tokens.span
        if idx is None:
            return y
        flat_x = x.reshape(-1, self.in_features)
        xs = flat_x[span[0] : span[1]] if span else flat_x.index_select(0, idx)
        h = xs.to(self.lora_a.dtype) @ self.lora_a.t()  # [N, r]
        if self.scale != 1.0:
            h = h * self.scale
        delta = (h @ self.lora_b.t()).to(y.dtype)
        flat = y.view(-1, self.out_features)  # y may be a column slice of a packed output
        if torch.is_grad_enabled() and delta.requires_grad:  # training: out of place
            if span == (0, flat.shape[0]):
                return (flat + delta).view(y.shape)
            if span:
                parts = [flat[: span[0]], flat[span[0] : span[1]] + delta, flat[span[1] :]]
                return torch.cat(parts).view(y.shape)
            return flat.index_add(0, idx, delta).view(y.shape)
        if span:  # inference: y is a fresh tensor, add into it
            flat[span[0] : span[1]] += delta
        else:
            flat.index_add_(0, idx, delta)
        return y


class DraftAdapter(nn.Module):
    """The adapter's own parameters (held by the LoRALinear modules it installs) + the
    [MASK] vector; attached to a model as `model.draft_adapter`."""

    def __init__(self, model: nn.Module, config: AdapterConfig, mask_token_id: int) -> None:
        super().__init__()
        self.config = config
        self.tokens = BlockTokens()
        self.mask_token_id = mask_token_id
        layers = model.model.layers
        chosen = range(len(layers)) if config.layers is None else config.layers
        for i in chosen:
            if not 0 <= i < len(layers):
                raise CloverError(f"adapter layer {i} outside the model's {len(layers)} layers")
            for module in layers[i].modules():
                for name, child in list(module.named_children()):
                    if name in config.targets and not isinstance(child, LoRALinear):
                        setattr(module, name, LoRALinear(child, config.rank, config.scale,
                                                         self.tokens))  # fmt: skip
        embed = model.model.embed_tokens
        self.mask_vector = None
        if config.mask_embedding:
            with torch.no_grad():
                row = model.embed_rows(torch.tensor([mask_token_id]))[0]
            self.mask_vector = nn.Parameter(row.detach().float().clone())
        self._hook = embed.register_forward_hook(self._embed_hook)

    def _embed_hook(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        # out [B, T, D]: the [MASK] inputs of block tokens get the learned vector
        if self.mask_vector is None or self.tokens.index is None:
            return out
        ids = self.tokens.ids.reshape(-1)
        sel = torch.zeros_like(ids, dtype=torch.bool)
        sel[self.tokens.index] = True
        sel &= ids == self.mask_token_id
        flat = out.reshape(-1, out.shape[-1])
        flat = torch.where(sel[:, None], self.mask_vector.to(out.dtype), flat)
        return flat.reshape(out.shape)


def attach_adapter(model: nn.Module, config: AdapterConfig) -> DraftAdapter:
    """Install a fresh (identity) adapter on a llama-family model; returns it."""
    if getattr(model, "draft_adapter", None) is not None:
        raise CloverError("the model already has a draft adapter")
    if not hasattr(model.model, "layers") or not hasattr(model.model, "embed_tokens"):
        raise CloverError("draft adapters need a model with model.layers and embed_tokens")
    mask_id = model.config.mask_token_id
    if mask_id is None:
        raise CloverError("a draft adapter needs the model's mask_token_id")
    adapter = DraftAdapter(model, config, mask_id)
    model.draft_adapter = adapter
    return adapter


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors, named as in the model (`...q_proj.lora_a`, `mask_vector`)."""
    out = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    adapter = model.draft_adapter
    if adapter.mask_vector is not None:
        out["mask_vector"] = adapter.mask_vector
    return out


def save_adapter(model: nn.Module, path: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the adapter as one safetensors file (config in its metadata), atomically."""

    path = Path(path)
    state = {n: t.detach().to(dtype).contiguous().cpu() for n, t in adapter_state(model).items()}
    meta = {"format": "pt", "clover_adapter": json.dumps(asdict(model.draft_adapter.config))}
    return atomic_write(path, lambda tmp: save_file(state, str(tmp), metadata=meta))


def read_adapter_config(path: Path) -> AdapterConfig:

    path = Path(path)
    try:
        d = json.loads(read_header(path)["__metadata__"]["clover_adapter"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CloverError(f"{path} is not a Clover adapter file: {e}") from None
    return AdapterConfig(**d)


def load_adapter(model: nn.Module, path: Path) -> DraftAdapter:
    """Attach the adapter stored at `path` to `model` (weights in the model's float dtype)."""

    config = read_adapter_config(path)
    adapter = attach_adapter(model, config)
    state = read_safetensors([Path(path)])
    own = adapter_state(model)
    if set(state) != set(own):
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise CloverError(f"{path}: adapter does not fit the model (missing {missing[:3]}, "
                          f"unexpected {extra[:3]})")  # fmt: skip
    with torch.no_grad():
        for name, param in own.items():
            if tuple(state[name].shape) != tuple(param.shape):
                raise CloverError(f"{path}: {name} has shape {tuple(state[name].shape)}, "
                                  f"the model needs {tuple(param.shape)}")  # fmt: skip
            param.copy_(state[name].to(param.dtype))
    return adapter


def keep_float32(model: nn.Module) -> None:
    """Adapter weights back to float32 after a model-wide cast: the adapter's matmuls are tiny
    (a few block tokens x rank), where CPU float32 kernels beat bfloat16 ones."""
    for t in adapter_state(model).values():
        t.data = t.data.float()


def adapter_params(model: nn.Module) -> int:
    return sum(t.numel() for t in adapter_state(model).values())
