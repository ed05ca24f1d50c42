"""`clover train adapt`: AR -> block-diffusion adaptation on distilled data.

Each training sequence is the engine's training layout (`training_layout`): [prompt + clean
answer | noisy answer], the noisy copy masked block by block with a ratio t ~ U(0, 1) per
block. Losses, all with the engine's token shift (position i predicted from the output at
i - 1; a block's first position from the clean prefix, exactly as decoding does):
- masked loss on the noisy answer positions that are [MASK] (CE on the teacher's token, or KL
  to the teacher's top-k distribution),
- AR loss on the clean answer (weight `ar_weight`), so the commit pass and self-speculation
  keep a good causal model.
Noise (`noise`): `two_copies` puts each example twice in a step with complementary masks
(every answer token is a target once per step); `complement_epochs` uses one copy whose mask
is the complement of the same example's mask in the previous epoch; `independent` draws a
fresh mask each time. `full_mask_prob` is the chance a block is masked entirely (what a
self-speculative draft sees). `confidence_weight` adds the entropy of correct predictions, a
term that rewards confident (so parallel) commits.

What is trained (`trainable`): `adapter` (the recipe we ship: a draft adapter, see
`clover.models.adapter`; the base stays frozen and exact for committed tokens, so there is no
AR loss and the clean sequence runs once without gradients, its cache read by the noisy
copies), `full`, or `last:N` layers + the final norm (whole-sequence training layout, with
the AR loss). The [MASK] input is the `mask_token_id` row (SmolLM2: `<|endoftext|>`'s trained
row), the stated init; an adapter learns its own copy of it.

Engineering: YAML config, seed, grad accumulation, cosine LR with warmup, bf16 autocast,
trainable subsets (`full`, `last:N` layers + norms + embeddings), JSONL metrics, a progress
bar with loss / tokens/s / ETA, periodic held-out loss, atomic checkpoints with optimizer,
scheduler, data position and RNG states, so `--resume` continues exactly.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from clover.checkpoints import loader
from clover.checkpoints.hf_dir import save_checkpoint
from clover.data.distill import load_examples
from clover.engine import LLM
from clover.errors import CloverError
from clover.models.adapter import (
    AdapterConfig,
    adapter_state,
    attach_adapter,
    load_adapter,
    read_adapter_config,
    save_adapter,
)
from clover.models.layout import noisy_layout, training_layout

NOISE = ("two_copies", "complement_epochs", "independent")


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
    ar_weight: float = 0.5  # full / last:N only (an adapter leaves the causal path exact)
    noise: str = "two_copies"
    full_mask_prob: float = 0.0
    confidence_weight: float = 0.0
    max_len: int = 384
    autocast_bf16: bool = False
    trainable: str = "adapter"  # "adapter", "full" or "last:N"
    rank: int = 32  # adapter only
    alpha: float = 32.0
    adapter_layers: str = "all"  # "all" or "last:N"
    mask_embedding: bool = True  # learn the [MASK] vector (needs gradients down to the input)
    targets: list[str] | None = None  # None: every projection
    init_adapter: str | None = None  # continue from an adapter file (e.g. the shipped one)
    eval_block: int = 4  # held-out draft acceptance is measured at this block size
    seed: int = 0
    eval_every: int = 50
    save_every: int = 50
    eval_examples: int = 32
    device: str = "cpu"  # "cuda" on a GPU: the same code
    # a time box: from 10 timed steps on (refitted every 50) the schedule is shortened to end,
    # and the adapter to be written, within this many minutes; past it the run stops and writes it
    max_minutes: float | None = None

    def __post_init__(self) -> None:
        if self.loss not in ("kl", "ce"):
            raise CloverError(f"loss must be kl or ce, got {self.loss!r}")
        if any(b < 1 for b in self.block_sizes) or not self.block_sizes:
            raise CloverError("block_sizes must be positive")
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise CloverError("steps, batch_size and grad_accum must be >= 1")
        if not (self.trainable in ("full", "adapter") or self.trainable.startswith("last:")):
            raise CloverError(f"trainable must be adapter, full or last:N: {self.trainable!r}")
        if self.noise not in NOISE:
            raise CloverError(f"noise must be one of {', '.join(NOISE)}, got {self.noise!r}")
        if not 0 <= self.full_mask_prob <= 1:
            raise CloverError("full_mask_prob must be in [0, 1]")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise CloverError(f"max_minutes must be > 0, got {self.max_minutes!r}")
        if not (self.adapter_layers == "all" or self.adapter_layers.startswith("last:")):
            raise CloverError(f"adapter_layers must be all or last:N: {self.adapter_layers!r}")

    @property
    def copies(self) -> int:
        return 2 if self.noise == "two_copies" else 1

    @classmethod
    def from_yaml(cls, path: Path, **overrides: object) -> TrainConfig:
        import yaml  # pyyaml comes with transformers; only for run configs

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


def draw_mask(n_answer: int, block: int, cfg: TrainConfig, rng: random.Random) -> list[bool]:
    """Per block: fully masked with probability full_mask_prob, else ratio t ~ U(0, 1);
    at least one masked position per block."""
    masked = []
    for start in range(0, n_answer, block):
        n = min(block, n_answer - start)
        t = 1.0 if rng.random() < cfg.full_mask_prob else rng.random()
        m = [rng.random() < t for _ in range(n)]
        if not any(m):
            m[rng.randrange(n)] = True
        masked += m
    return masked


def example_masks(
    ex: dict, n: int, block: int, cfg: TrainConfig, rng: random.Random, epoch: int
) -> list[list[bool]]:
    """The noisy copies of one example (1 or 2 masks over its n answer tokens)."""
    if cfg.noise == "complement_epochs":  # the same draw for epochs 2k and 2k + 1, flipped
        own = random.Random(f"{cfg.seed}:{ex['id']}:{epoch // 2}:{block}")
        m = draw_mask(n, block, cfg, own)
        if epoch % 2:
            m = [not x for x in m] if not all(m) else m
        return [m]
    m = draw_mask(n, block, cfg, rng)
    if cfg.noise == "two_copies":
        comp = [not x for x in m]
        return [m, comp] if any(comp) else [m, m]
    return [m]


def make_batch(
    examples: list[dict],
    cfg: TrainConfig,
    mask_id: int,
    rng: random.Random,
    pad_id: int,
    epochs: list[int] | None = None,
    block: int | None = None,
) -> dict:
    """Examples -> tensors for one micro-batch.

    clean [B, C] (prompt + answer, padded), noisy [B, copies * A] (the masked copies side by
    side), is_masked [B, copies, A], target [B, A] (-1 = padding), teacher top-k [B, A, k].
    """
    block = block or rng.choice(cfg.block_sizes)
    rows = []
    for i, ex in enumerate(examples):
        prompt = ex["prompt_ids"][-(cfg.max_len // 2) :]
        answer = ex["answer_ids"][: cfg.max_len - len(prompt)]
        topk = (ex["topk_ids"][: len(answer)], ex["topk_logprobs"][: len(answer)])
        epoch = epochs[i] if epochs else 0
        rows.append((prompt, answer, topk, example_masks(ex, len(answer), block, cfg, rng, epoch)))
    B, copies = len(rows), len(rows[0][3])
    C = max(len(p) + len(a) for p, a, _, _ in rows)
    A = max(len(a) for _, a, _, _ in rows)
    clean = torch.full((B, C), pad_id, dtype=torch.long)
    noisy = torch.full((B, copies * A), pad_id, dtype=torch.long)
    is_masked = torch.zeros(B, copies, A, dtype=torch.bool)
    target = torch.full((B, A), -1, dtype=torch.long)
    k = len(rows[0][2][0][0]) if rows[0][2][0] else 1
    top_ids = torch.zeros(B, A, k, dtype=torch.long)
    top_lp = torch.full((B, A, k), -1e4)
    prompt_lens = torch.zeros(B, dtype=torch.long)
    answer_lens = torch.zeros(B, dtype=torch.long)
    for b, (prompt, answer, (tids, tlp), masks) in enumerate(rows):
        P, n = len(prompt), len(answer)
        prompt_lens[b], answer_lens[b] = P, n
        clean[b, : P + n] = torch.tensor(prompt + answer)
        for c, masked in enumerate(masks):
            noisy[b, c * A : c * A + n] = torch.tensor(
                [mask_id if m else t for t, m in zip(answer, masked)]
            )
            is_masked[b, c, :n] = torch.tensor(masked)
        target[b, :n] = torch.tensor(answer)
        if tids:
            top_ids[b, :n] = torch.tensor(tids)
            top_lp[b, :n] = torch.tensor(tlp)
    tensors = {
        "clean": clean,
        "noisy": noisy,
        "prompt_lens": prompt_lens,
        "answer_lens": answer_lens,
        "clean_len": C,
        "ans_len": A,
        "copies": copies,
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


def noisy_over_clean(model: torch.nn.Module, batch: dict, autocast: object) -> torch.Tensor:
    """The split training pass: the clean sequence once into a cache without gradients (the
    base is frozen), then the batch's noisy copies over it. -> hidden [B, copies * A, D]."""
    B, A, C, bs = batch["clean"].shape[0], batch["ans_len"], batch["clean_len"], batch["block"]
    with torch.no_grad(), autocast:
        cache = model.make_cache(B)
        model(batch["clean"], cache)
    layout = noisy_layout(batch["prompt_lens"], C, A, bs, batch["answer_lens"], batch["copies"])
    with autocast:
        return model.forward_over_prefix(batch["noisy"], cache, layout)


def compute_loss(
    model: torch.nn.Module, batch: dict, cfg: TrainConfig
) -> tuple[torch.Tensor, dict]:
    """-> (total loss, {"masked", "ar", "confident": floats, "tokens": int})."""
    dev = batch["clean"].device
    B, A, C, bs = batch["clean"].shape[0], batch["ans_len"], batch["clean_len"], batch["block"]
    copies = batch["copies"]
    j = torch.arange(A, device=dev)[None, :].expand(B, A)
    P = batch["prompt_lens"][:, None]
    valid = batch["target"] >= 0
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16)
    if cfg.trainable == "adapter":
        hidden = noisy_over_clean(model, batch, autocast)  # [B, copies * A, D]
        # a block's first position is predicted by the base's causal output: no gradient
        sel = batch["is_masked"] & (valid & (j % bs != 0))[:, None, :]  # [B, copies, A]
        bm, cm, jm = torch.nonzero(sel, as_tuple=True)
        states = hidden[bm, cm * A + jm - 1]
        ar_hidden = None
    else:
        # duplicate rows per copy: [B * copies, C + A] whole sequences
        ids = torch.cat([batch["clean"].repeat_interleave(copies, 0),
                         batch["noisy"].view(B * copies, A)], 1)  # fmt: skip
        rep = batch["prompt_lens"].repeat_interleave(copies, 0)
        layout = training_layout(rep, C, A, bs, batch["answer_lens"].repeat_interleave(copies, 0))
        with autocast:
            hidden = model(ids, mode="train", layout=layout).view(B, copies, C + A, -1)
        sel = batch["is_masked"] & valid[:, None, :]
        bm, cm, jm = torch.nonzero(sel, as_tuple=True)
        # token shift: a block's first position reads the clean prefix, the others the copy
        src = torch.where(jm % bs == 0, batch["prompt_lens"][bm] + jm - 1, C + jm - 1)
        states = hidden[bm, cm, src]
        ba, ja = torch.nonzero(valid, as_tuple=True)
        ar_hidden = (hidden[ba, 0, (P + j - 1)[ba, ja]], ba, ja)
    targets = (batch["target"][bm, jm], batch["top_ids"][bm, jm], batch["top_lp"][bm, jm])
    logits = model.logits(states)
    masked = _loss(logits, *targets, cfg.loss)
    total = masked
    confident = torch.zeros(())
    if cfg.confidence_weight and len(logits):
        logp = logits.float().log_softmax(-1)
        right = logp.argmax(-1) == targets[0]
        if bool(right.any()):
            entropy = -(logp.exp() * logp).sum(-1)
            confident = entropy[right].mean()
            total = total + cfg.confidence_weight * confident
    ar = torch.zeros(())
    if ar_hidden is not None:
        h, ba, ja = ar_hidden
        ar = _loss(model.logits(h), batch["target"][ba, ja], batch["top_ids"][ba, ja],
                   batch["top_lp"][ba, ja], cfg.loss)  # fmt: skip
        total = total + cfg.ar_weight * ar
    stats = {"masked": float(masked.detach()), "ar": float(ar.detach()),
             "confident": float(confident.detach())}  # fmt: skip
    return total, {**stats, "tokens": int(valid.sum())}


def draft_acceptance(model: torch.nn.Module, batch: dict, cfg: TrainConfig) -> dict:
    """Fully masked blocks (what a self_spec draft sees): per block, how many leading drafted
    positions (1..B-1) equal the teacher's token -> mean run ("accept": drafts a self_spec
    pass would keep) and per-position accuracy. batch: from make_batch with full masks."""
    B, bs = batch["clean"].shape[0], batch["block"]
    with torch.no_grad():
        hidden = noisy_over_clean(model, batch, contextlib.nullcontext())  # one copy: [B, A, D]
        pred = model.logits(hidden[:, :-1]).argmax(-1)  # [B, A-1]: predicts positions 1..A-1
    right = pred == batch["target"][:, 1:]
    runs, hits, n = [], 0, 0
    for b in range(B):
        L = int(batch["answer_lens"][b])
        for start in range(0, L, bs):
            run, counting = 0, True
            for p in range(start + 1, min(start + bs, L)):
                ok = bool(right[b, p - 1])
                hits, n = hits + ok, n + 1
                counting = counting and ok
                run += counting
            runs.append(run)
    accept = sum(runs) / max(len(runs), 1)
    return {"accept": round(accept, 4), "pos_acc": round(hits / max(n, 1), 4)}


# --- the run --------------------------------------------------------------------------------


def set_trainable(model: torch.nn.Module, cfg: TrainConfig) -> int:
    """Freeze / attach what the recipe trains; -> number of trainable parameters."""
    spec = cfg.trainable
    for p in model.parameters():
        p.requires_grad_(spec == "full")
    if spec == "adapter":
        n_layers = len(model.model.layers)
        layers = None
        if cfg.adapter_layers != "all":
            n = int(cfg.adapter_layers.split(":")[1])
            layers = list(range(max(n_layers - n, 0), n_layers))
        targets = cfg.targets or AdapterConfig().targets
        config = AdapterConfig(rank=cfg.rank, alpha=cfg.alpha, targets=targets, layers=layers,
                               mask_embedding=cfg.mask_embedding)  # fmt: skip
        if cfg.init_adapter:
            config = read_adapter_config(Path(cfg.init_adapter))
            load_adapter(model, Path(cfg.init_adapter))
        else:
            attach_adapter(model, config)
        for p in adapter_state(model).values():
            p.requires_grad_(True)
    elif spec != "full":
        n = int(spec.split(":")[1])
        for layer in list(model.model.layers)[-n:]:
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
    if getattr(model, "draft_adapter", None) is not None:  # the base is frozen: adapter only
        trainable = {k: v.detach() for k, v in adapter_state(model).items()}
    else:
        trainable = dict(model.state_dict())
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

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(cfg.base, dtype="float32", progress=progress)
    model = llm.model.to(cfg.device)
    # every tensor the loop makes (caches, layouts, masks) must be on the model's device
    with torch.device(cfg.device):
        return _train(cfg, llm, model, resume, progress, until)


def bf16_where_fast(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """cfg without bfloat16 autocast where bfloat16 matmuls are slow (`bf16_fast`)."""

    if cfg.autocast_bf16 and not loader.bf16_fast(device):
        print("clover: this CPU has no bf16 instructions: training in float32 "
              "(autocast_bf16 off)", file=sys.stderr)  # fmt: skip
        return replace(cfg, autocast_bf16=False)
    return cfg


def _train(
    cfg: TrainConfig, llm: LLM, model: torch.nn.Module, resume: bool, progress: bool,
    until: int | None,
) -> dict:  # fmt: skip

    cfg = bf16_where_fast(cfg, next(model.parameters()).device)
    out = Path(cfg.out)
    mask_id = model.config.mask_token_id
    if mask_id is None:
        raise CloverError(f"{cfg.base} has no mask_token_id to train with")
    pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else mask_id
    train_set = load_examples(Path(cfg.data), "train")
    heldout = load_examples(Path(cfg.data), "heldout")[: cfg.eval_examples]
    if not train_set:
        raise CloverError(f"{cfg.data}: no training examples")
    if cfg.trainable == "adapter" and not hasattr(model, "make_layer_caches"):
        raise CloverError("adapter training needs a cached model")
    if cfg.trainable == "adapter" and cfg.autocast_bf16:
        model.to(torch.bfloat16)  # the frozen base: no per-call casts (the adapter stays fp32)
    torch.manual_seed(cfg.seed)  # before the adapter's random init
    n_train = set_trainable(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    order: list[list[int]] = []  # [example index, epoch] still to visit
    epoch, step = 0, 0
    ckpt = out / "checkpoint" / "state.pt"
    if resume:
        if not ckpt.exists():
            raise CloverError(f"nothing to resume in {out}")
        state = torch.load(ckpt, weights_only=True, map_location=cfg.device)
        if getattr(model, "draft_adapter", None) is not None:
            with torch.no_grad():
                for name, t in adapter_state(model).items():
                    t.copy_(state["model"][name])
        else:  # map_location: CPU tensors copy onto device
            model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, order, epoch = state["step"], state["order"], state.get("epoch", 0)
        cfg = replace(cfg, steps=state.get("steps", cfg.steps))  # a time box's schedule
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"].cpu())
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    _trim_metrics(out / "metrics.jsonl", step)  # a killed run's steps after its checkpoint
    metrics = open(out / "metrics.jsonl", "a", encoding="utf-8")
    bar = None
    if progress:
        bar = tqdm(total=cfg.steps, initial=step, desc="adapt", unit="step")
    t0, seen_tokens = time.perf_counter(), 0
    model.train()
    last: dict = {}
    stop_at = min(cfg.steps, until or cfg.steps)
    start_step, timed_from, out_of_time, boxed = step, 0.0, False, None
    deadline = None if cfg.max_minutes is None else t0 + 60 * cfg.max_minutes
    while step < stop_at:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        info = {"masked": 0.0, "ar": 0.0, "confident": 0.0, "tokens": 0}
        for _ in range(cfg.grad_accum):
            if len(order) < cfg.batch_size:  # a new epoch: reshuffle
                fresh = list(range(len(train_set)))
                rng.shuffle(fresh)
                order += [[i, epoch] for i in fresh]
                epoch += 1
            todo, order = order[: cfg.batch_size], order[cfg.batch_size :]
            examples = [train_set[i] for i, _ in todo]
            batch = make_batch(examples, cfg, mask_id, rng, pad_id, [e for _, e in todo])
            loss, part = compute_loss(model, batch, cfg)
            (loss / cfg.grad_accum).backward()
            for key in ("masked", "ar", "confident"):
                info[key] += part[key] / cfg.grad_accum
            info["tokens"] += part["tokens"]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        seen_tokens += info["tokens"]
        rate = seen_tokens / (time.perf_counter() - t0)
        last = {"step": step, "lr": lr_at(step - 1, cfg), **info, "tokens_per_s": round(rate, 1)}
        if heldout and (step % cfg.eval_every == 0 or step in (cfg.steps, stop_at)):
            last["heldout"] = evaluate(model, heldout, cfg, mask_id, pad_id)
        metrics.write(json.dumps(last) + "\n")
        metrics.flush()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(masked=f"{info['masked']:.3f}", ar=f"{info['ar']:.3f}",
                            tok_s=f"{rate:.0f}")  # fmt: skip
        if deadline is not None:
            now = time.perf_counter()
            if step == start_step + 1:  # the first step pays warm-up costs: time from here
                timed_from = now
            elif step - start_step >= 11 and (step - start_step - 11) % 50 == 0:
                # refitted every 50 steps: evals and slower steps later in a run count too
                # (a schedule fitted once from the first steps overruns its box)
                per_step = (now - timed_from) / (step - start_step - 1)
                fit = step + int(0.95 * (deadline - now) / per_step)
                if fit < cfg.steps:  # shorten the schedule (the cosine ends at the box)
                    cfg = replace(cfg, steps=max(fit, step))
                    stop_at = min(stop_at, cfg.steps)
                    boxed = cfg.steps
                    if bar is not None:
                        bar.total = cfg.steps
            out_of_time = now > deadline
        if step % cfg.save_every == 0 or step == stop_at or out_of_time:
            state = {"step": step, "order": order, "epoch": epoch, "rng": rng.getstate(),
                     "torch_rng": torch.get_rng_state(), "steps": cfg.steps}  # fmt: skip
            save_state(out, model, opt, state)
        if out_of_time:
            break
    metrics.close()
    if bar is not None:
        bar.close()
    model.eval()
    if step >= cfg.steps or out_of_time:
        if cfg.trainable == "adapter":
            adapter = model.draft_adapter.config
            adapter.info = adapter_provenance(adapter.info, cfg, step, tokens_seen(out))
            save_adapter(model.cpu(), out / "adapter.safetensors")
        else:
            export_model(model.cpu(), llm, out / "model")
    return {"steps": step, "trainable_params": n_train, "time_box_steps": boxed,
            "out_of_time": out_of_time, **last}  # fmt: skip


def tokens_seen(out: Path) -> int:
    """Answer tokens trained on in a run, from its metrics (a step replayed after a resume
    counts once)."""
    per_step = {}
    with open(out / "metrics.jsonl") as fh:
        for line in fh:
            row = json.loads(line)
            if "step" in row and "tokens" in row:
                per_step[row["step"]] = row["tokens"]
    return sum(per_step.values())


def adapter_provenance(info: dict, cfg: TrainConfig, steps: int, tokens: int) -> dict:
    """The adapter file's record of how it was made: one entry per training run ("stages"),
    so an adapter continued from another (`init_adapter`) keeps its whole history."""
    stages = list(info.get("stages", []))
    if not stages and "recipe" in info:  # an older file: one recipe, no stages
        stages = [{k: info[k] for k in ("steps", "data", "recipe") if k in info}]
    recipe = {k: v for k, v in asdict(cfg).items() if k not in ("data", "out", "device")}
    if cfg.init_adapter:  # shape settings come from the file it continued
        for key in ("rank", "alpha", "adapter_layers", "mask_embedding", "targets"):
            recipe.pop(key, None)
    stages.append({"steps": steps, "answer_tokens": tokens, "data": str(cfg.data),
                   "recipe": recipe})  # fmt: skip
    return {"base": cfg.base, "steps": sum(st["steps"] for st in stages), "stages": stages}


def export_model(model: torch.nn.Module, llm: LLM, target: Path) -> Path:
    """The adapted model as an HF-format directory that every command loads (atomic)."""

    config = model.config
    config.default_decoder = "low_confidence"
    # the trained weights are not the GGUF's 4-bit levels: `auto` must not re-quantize them
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


def evaluate(model: torch.nn.Module, examples: list[dict], cfg: TrainConfig, mask_id: int,
             pad_id: int) -> dict:  # fmt: skip
    """Held-out losses with a fixed mask draw (comparable across steps); and
    the draft acceptance at `eval_block` (see `draft_acceptance`), for every recipe."""
    rng = random.Random(1234)
    was = model.training
    model.eval()
    total = {"masked": 0.0, "ar": 0.0}
    accept = {"accept": 0.0, "pos_acc": 0.0}
    n = 0
    full = replace(cfg, full_mask_prob=1.0, noise="independent")
    with torch.no_grad():
        for start in range(0, len(examples), cfg.batch_size):
            chunk = examples[start : start + cfg.batch_size]
            batch = make_batch(chunk, cfg, mask_id, rng, pad_id)
            _, part = compute_loss(model, batch, cfg)
            total["masked"] += part["masked"]
            total["ar"] += part["ar"]
            if hasattr(model, "forward_over_prefix"):  # every recipe: comparable across them
                drafts = make_batch(chunk, full, mask_id, rng, pad_id, block=cfg.eval_block)
                for k, v in draft_acceptance(model, drafts, cfg).items():
                    accept[k] += v
            n += 1
    model.train(was)
    out = {k: round(v / max(n, 1), 4) for k, v in total.items()}
    if hasattr(model, "forward_over_prefix"):
        out.update({k: round(v / max(n, 1), 4) for k, v in accept.items()})
    return out
