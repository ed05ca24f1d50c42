"""`clover train adapt`: AR -> block-diffusion adaptation on distilled data.

Each training sequence is the engine's training layout (`training_layout`): [prompt + clean
answer | noisy answer], the noisy copy masked block by block with a ratio t ~ U(0, 1) per
block. Losses, all with the engine's token shift (position i predicted from the output at
i - 1; a block's first position from the clean prefix, exactly as decoding does):
- masked loss on the noisy answer positions that are [MASK] (CE on the teacher's token, or KL
  to the teacher's top-k distribution),
- AR loss on the clean answer (weight `ar_weight`), so the commit pass and self-speculation
  keep a good causal model.
`complementary` puts each example twice in the batch with complementary masks, so every answer
token is a target once per step. The [MASK] embedding is the model's `mask_token_id` row; for
SmolLM2 that is `<|endoftext|>`'s trained row, its stated init.

Engineering: YAML config, seed, grad accumulation, cosine LR with warmup, bf16 autocast,
trainable subsets (`full`, `last:N` layers + norms + embeddings), JSONL metrics, a progress
bar with loss / tokens/s / ETA, periodic held-out loss, atomic checkpoints with optimizer,
scheduler, data position and RNG states, so `--resume` continues exactly.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from clover.errors import CloverError
from clover.models.layout import training_layout


@dataclass
class TrainConfig:
    data: str
    out: str
    base: str = "smollm2-135m"
    steps: int = 200
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 5e-5
    warmup: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    block_sizes: list[int] = field(default_factory=lambda: [8])
    loss: str = "kl"  # "kl" to the teacher's top-k, or "ce" on its tokens
    ar_weight: float = 0.5
    complementary: bool = True
    max_len: int = 384
    autocast_bf16: bool = False
    trainable: str = "full"  # "full" or "last:N"
    seed: int = 0
    eval_every: int = 50
    save_every: int = 50
    eval_examples: int = 32
    device: str = "cpu"  # "cuda" on a GPU: the same code

    def __post_init__(self) -> None:
        if self.loss not in ("kl", "ce"):
            raise CloverError(f"loss must be kl or ce, got {self.loss!r}")
        if any(b < 1 for b in self.block_sizes) or not self.block_sizes:
            raise CloverError("block_sizes must be positive")
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise CloverError("steps, batch_size and grad_accum must be >= 1")
        if not (self.trainable == "full" or self.trainable.startswith("last:")):
            raise CloverError(f"trainable must be full or last:N, got {self.trainable!r}")

    @classmethod
    def from_yaml(cls, path: Path, **overrides: object) -> TrainConfig:
        import yaml

        try:
            d = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise CloverError(f"cannot read config {path}: {e}") from None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CloverError(f"{path}: unknown key(s) {', '.join(unknown)}")
        return cls(**{**d, **{k: v for k, v in overrides.items() if v is not None}})


# --- batches --------------------------------------------------------------------------------


def make_batch(
    examples: list[dict], cfg: TrainConfig, mask_id: int, rng: random.Random, pad_id: int
) -> dict:
    """Examples -> tensors for one micro-batch (each example twice when complementary)."""
    block = rng.choice(cfg.block_sizes)
    rows = []
    for ex in examples:
        prompt = ex["prompt_ids"][-(cfg.max_len // 2) :]
        answer = ex["answer_ids"][: cfg.max_len - len(prompt)]
        topk = (ex["topk_ids"][: len(answer)], ex["topk_logprobs"][: len(answer)])
        masked = []
        for start in range(0, len(answer), block):  # ratio per block, at least one masked
            n = min(block, len(answer) - start)
            t = rng.random()
            m = [rng.random() < t for _ in range(n)]
            if not any(m):
                m[rng.randrange(n)] = True
            masked += m
        rows.append((prompt, answer, topk, masked))
        if cfg.complementary:
            comp = [not m for m in masked]
            if any(comp):
                rows.append((prompt, answer, topk, comp))
    B = len(rows)
    clean_len = max(len(p) + len(a) for p, a, _, _ in rows)
    ans_len = max(len(a) for _, a, _, _ in rows)
    ids = torch.full((B, clean_len + ans_len), pad_id, dtype=torch.long)
    is_masked = torch.zeros(B, ans_len, dtype=torch.bool)
    target = torch.full((B, ans_len), -1, dtype=torch.long)
    k = len(rows[0][2][0][0]) if rows[0][2][0] else 1
    top_ids = torch.zeros(B, ans_len, k, dtype=torch.long)
    top_lp = torch.full((B, ans_len, k), -1e4)
    prompt_lens = torch.zeros(B, dtype=torch.long)
    answer_lens = torch.zeros(B, dtype=torch.long)
    for b, (prompt, answer, (tids, tlp), masked) in enumerate(rows):
        P, A = len(prompt), len(answer)
        prompt_lens[b], answer_lens[b] = P, A
        ids[b, : P + A] = torch.tensor(prompt + answer)
        noisy = [mask_id if m else t for t, m in zip(answer, masked)]
        ids[b, clean_len : clean_len + A] = torch.tensor(noisy)
        is_masked[b, :A] = torch.tensor(masked)
        target[b, :A] = torch.tensor(answer)
        if tids:
            top_ids[b, :A] = torch.tensor(tids)
            top_lp[b, :A] = torch.tensor(tlp)
    tensors = {
        "ids": ids,
        "prompt_lens": prompt_lens,
        "answer_lens": answer_lens,
        "clean_len": clean_len,
        "ans_len": ans_len,
        "block": block,
        "is_masked": is_masked,
        "target": target,
        "top_ids": top_ids,
        "top_lp": top_lp,
    }
    device = torch.device(cfg.device)
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in tensors.items()}


def _loss(logits: torch.Tensor, target: torch.Tensor, tid: torch.Tensor, tlp: torch.Tensor,
          kind: str) -> torch.Tensor:  # fmt: skip
    logp = logits.float().log_softmax(-1)
    if kind == "ce":
        return F.nll_loss(logp, target)
    p = tlp.softmax(-1)  # teacher top-k, renormalised
    return (p * (p.clamp_min(1e-12).log() - logp.gather(-1, tid))).sum(-1).mean()


def compute_loss(model: object, batch: dict, cfg: TrainConfig) -> tuple[torch.Tensor, dict]:
    """-> (total loss, {"masked": float, "ar": float, "tokens": int})."""
    layout = training_layout(
        batch["prompt_lens"], batch["clean_len"], batch["ans_len"], batch["block"],
        batch["answer_lens"],
    )  # fmt: skip
    dev = batch["ids"].device
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
        hidden = model(batch["ids"], mode="train", layout=layout)
    C, B_ = batch["clean_len"], batch["block"]
    P = batch["prompt_lens"][:, None]
    j = torch.arange(batch["ans_len"], device=dev)[None, :].expand_as(batch["target"])
    valid = batch["target"] >= 0
    # token shift: a block's first position reads the clean prefix, the others the noisy copy
    src = torch.where(j % B_ == 0, P + j - 1, C + j - 1)
    bm, jm = torch.nonzero(batch["is_masked"] & valid, as_tuple=True)
    masked_logits = model.logits(hidden[bm, src[bm, jm]])
    args = (batch["target"][bm, jm], batch["top_ids"][bm, jm], batch["top_lp"][bm, jm], cfg.loss)
    masked = _loss(masked_logits, *args)
    ba, ja = torch.nonzero(valid, as_tuple=True)
    ar_logits = model.logits(hidden[ba, (P + j - 1)[ba, ja]])
    ar = _loss(ar_logits, batch["target"][ba, ja], batch["top_ids"][ba, ja],
               batch["top_lp"][ba, ja], cfg.loss)  # fmt: skip
    total = masked + cfg.ar_weight * ar
    stats = {"masked": float(masked.detach()), "ar": float(ar.detach())}
    return total, {**stats, "tokens": int(valid.sum())}


# --- the run --------------------------------------------------------------------------------


def set_trainable(model: torch.nn.Module, spec: str) -> int:
    if spec == "full":
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        n = int(spec.split(":")[1])
        for p in model.parameters():
            p.requires_grad_(False)
        layers = model.model.layers
        for layer in list(layers)[-n:]:
            for p in layer.parameters():
                p.requires_grad_(True)
        for p in model.model.norm.parameters():
            p.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def save_state(out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    """Atomic: write a temp dir, then swap it in for `checkpoint/`."""
    tmp = out / ".checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainable = {k: v for k, v in model.state_dict().items()}
    torch.save({"model": trainable, "optimizer": opt.state_dict(), **state}, tmp / "state.pt")
    final = out / "checkpoint"
    old = out / ".checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def train(
    cfg: TrainConfig, resume: bool = False, progress: bool = True, until: int | None = None
) -> dict:
    """Run (or continue) the adaptation; `until` stops early at that step, as a killed or
    time-boxed run would, with the schedule of the full `cfg.steps`."""
    from clover.data.distill import load_examples
    from clover.engine import LLM

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(cfg.base, dtype="float32", progress=progress)
    model = llm.model.to(cfg.device)
    mask_id = model.config.mask_token_id
    if mask_id is None:
        raise CloverError(f"{cfg.base} has no mask_token_id to train with")
    pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else mask_id
    train_set = load_examples(Path(cfg.data), "train")
    heldout = load_examples(Path(cfg.data), "heldout")[: cfg.eval_examples]
    if not train_set:
        raise CloverError(f"{cfg.data}: no training examples")
    n_train = set_trainable(model, cfg.trainable)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    order: list[int] = []
    step = 0
    ckpt = out / "checkpoint" / "state.pt"
    if resume:
        if not ckpt.exists():
            raise CloverError(f"nothing to resume in {out}")
        state = torch.load(ckpt, weights_only=True, map_location=cfg.device)
        model.load_state_dict(state["model"])  # map_location: CPU tensors copy onto device
        opt.load_state_dict(state["optimizer"])
        step, order = state["step"], state["order"]
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"].cpu())
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    _trim_metrics(out / "metrics.jsonl", step)  # a killed run's steps after its checkpoint
    metrics = open(out / "metrics.jsonl", "a", encoding="utf-8")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc="adapt", unit="step")
    t0, seen_tokens = time.perf_counter(), 0
    model.train()
    last: dict = {}
    stop_at = min(cfg.steps, until or cfg.steps)
    while step < stop_at:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        info = {"masked": 0.0, "ar": 0.0, "tokens": 0}
        for _ in range(cfg.grad_accum):
            if len(order) < cfg.batch_size:  # a new epoch: reshuffle
                fresh = list(range(len(train_set)))
                rng.shuffle(fresh)
                order += fresh
            idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
            batch = make_batch([train_set[i] for i in idx], cfg, mask_id, rng, pad_id)
            loss, part = compute_loss(model, batch, cfg)
            (loss / cfg.grad_accum).backward()
            for key in ("masked", "ar"):
                info[key] += part[key] / cfg.grad_accum
            info["tokens"] += part["tokens"]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        seen_tokens += info["tokens"]
        rate = seen_tokens / (time.perf_counter() - t0)
        last = {"step": step, "lr": lr_at(step - 1, cfg), **info, "tokens_per_s": round(rate, 1)}
        if heldout and (step % cfg.eval_every == 0 or step == cfg.steps):
            last["heldout"] = evaluate(model, heldout, cfg, mask_id, pad_id)
        metrics.write(json.dumps(last) + "\n")
        metrics.flush()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(masked=f"{info['masked']:.3f}", ar=f"{info['ar']:.3f}",
                            tok_s=f"{rate:.0f}")  # fmt: skip
        if step % cfg.save_every == 0 or step == stop_at:
            state = {"step": step, "order": order, "rng": rng.getstate(),
                     "torch_rng": torch.get_rng_state()}  # fmt: skip
            save_state(out, model, opt, state)
    metrics.close()
    if bar is not None:
        bar.close()
    model.eval()
    if step >= cfg.steps:
        export_model(model.cpu(), llm, out / "model")
    return {"steps": step, "trainable_params": n_train, **last}


def export_model(model: torch.nn.Module, llm: object, target: Path) -> Path:
    """The adapted model as an HF-format directory that every command loads (atomic)."""
    from clover.weights import save_checkpoint

    config = model.config
    config.default_decoder = "low_confidence"
    # the weights are no longer the GGUF's 4-bit levels: `auto` must not re-quantize them
    config.extra.pop("gguf_file_type", None)
    files = []
    if llm.directory is not None:
        files = [Path(llm.directory) / n for n in ("tokenizer.json", "tokenizer_config.json")]
    return save_checkpoint(model, target, [f for f in files if f.exists()])


def _trim_metrics(path: Path, step: int) -> None:
    if not path.exists():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    path.write_text("".join(x + "\n" for x in keep), encoding="utf-8")


def evaluate(model: object, examples: list[dict], cfg: TrainConfig, mask_id: int,
             pad_id: int) -> dict:  # fmt: skip
    """Held-out losses with a fixed mask draw (comparable across steps)."""
    rng = random.Random(1234)
    was = model.training
    model.eval()
    total = {"masked": 0.0, "ar": 0.0}
    n = 0
    with torch.no_grad():
        for start in range(0, len(examples), cfg.batch_size):
            batch = make_batch(examples[start : start + cfg.batch_size], cfg, mask_id, rng, pad_id)
            _, part = compute_loss(model, batch, cfg)
            total["masked"] += part["masked"]
            total["ar"] += part["ar"]
            n += 1
    model.train(was)
    return {k: round(v / max(n, 1), 4) for k, v in total.items()}
