"""`clover train drafter --config YAML`: a block-diffusion drafter (models/drafter.py) for a
target, on the distilled answers of `clover data distill`.

Per step: a batch of prompt + answer sequences goes through the frozen target once, without
gradients, keeping the outputs of `feature_layers` at every position (the same int4 target that
will verify the drafts, so the drafter learns the features it will see). Blocks start at random
answer positions p (the block is [token p, MASK x (B - 1)] over the context < p); the drafter's
outputs at block positions i >= 1 are scored against the teacher at p + i: KL to its top-k
distribution (`loss: kl`) or cross-entropy on its greedy token (`ce`), weighted
exp(-(i - 1) / decay) so the first drafts, which decide acceptance, weigh most. A chain drafter
(`chain: true`) reads the answer's tokens p .. p + B - 2 at positions 1 .. B - 1 instead of
[MASK] (teacher forcing; causal inside the block). Gradients reach the drafter only (the
target's embedding table and LM head are frozen and shared).

Held-out measure: the mean accepted length of greedy drafts (leading drafted tokens equal to
the teacher's), on held-out prompts, and separately on held-out *kinds* (`heldout_kinds`: kinds
never trained on), at fixed block starts. Checkpoints are atomic (`checkpoint/state.pt` plus the
drafter file); a rerun continues from them; `max_minutes` boxes the run (the cosine schedule is
refitted to end in the box) and the drafter is written when it ends.
"""

from __future__ import annotations

import collections
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from clover.checkpoints.loader import bf16_fast
from clover.data.distill import load_examples
from clover.decoding.store import NgramIndex
from clover.engine import LLM
from clover.errors import CloverError
from clover.models.drafter import (
    Drafter,
    fingerprint,
    init_from_target,
    load_drafter,
    new_drafter,
    read_drafter_config,
    save_drafter,
)


@dataclass
class DrafterTrainConfig:
    target: str  # the model the drafter drafts for (name, GGUF file or HF directory)
    data: str | list[str]  # `clover data distill` output dir(s)
    out: str
    # how many times each data dir's training answers come in an epoch, one int >= 1 per dir
    # (None: once each): a mix that leans on one source (its held-out answers count once)
    data_weights: list[int] | None = None
    target_dtype: str = "int4"  # what the target runs at when it verifies: its features
    layers: int = 1  # drafter layers
    # the drafter's MLP width; 0: the target's. A narrower MLP drafts and trains faster, which
    # matters for bigger targets (the 1.5B's 8,960 is most of a one-layer drafter's bytes)
    intermediate_size: int = 0
    feature_layers: list[int] | None = None  # None: early / middle / late
    block_size: int = 16
    blocks_per_sequence: int = 8
    batch_size: int = 4  # sequences per step
    steps: int = 2000
    lr: float = 5e-4
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    loss: str = "kl"  # "kl" to the teacher's top-k, or "ce" on its greedy tokens
    decay: float = 4.0  # position weight exp(-(i - 1) / decay)
    max_len: int = 512
    heldout_kinds: list[str] = field(default_factory=list)  # never trained on; measured apart
    eval_every: int = 100
    save_every: int = 100
    eval_examples: int = 48
    seed: int = 0
    device: str = "cpu"
    max_minutes: float | None = None
    drafter_file: str | None = None  # default: <out>/drafter.safetensors
    feature_cache_gb: float = 4.0  # the target's features kept across epochs; 0: none
    # and saved in <out>/features as they are made (when the budget holds all of them), so a
    # resumed run reads them instead of running the target again (the target's pass is the
    # longest part of a first epoch on a CPU)
    keep_features: bool = True
    # "target": the drafter's layers start as copies of the target's last layers
    # (models/drafter.py `init_from_target`); "random": from scratch; or a drafter file
    # (`*.safetensors`, for this target, of the same shape): its weights and draft vocabulary,
    # with a fresh optimizer and schedule (to train a finished drafter further or on new data)
    init: str = "random"
    # score only the first this-many drafted positions of each block (0: all B - 1). The last
    # layer then runs its queries, output projection and MLP for those positions only (for
    # one layer, most of a step's work): 8 of 15 halves that work, and leaves out positions
    # that weigh exp(-8 / decay) or less (0.14 at decay 4) and that drafts rarely reach
    loss_positions: int = 0
    # draft from this many token ids (`draft_vocabulary`), a multiple of 16; 0, or the
    # target's vocabulary size or more: from all of it. Training's loss reads all of it
    draft_vocab: int = 16384
    # the loss over the whole vocabulary ("all"), or over the draft vocabulary only ("draft":
    # the head's cost in a step shrinks with it; the drafter then knows nothing of the other
    # tokens, which matters only where it runs with the whole head: a speculators export)
    loss_vocab: str = "all"
    # a chain drafter (models/drafter.py): drafts token by token, each position reading the
    # token before it, trained on the answer's own tokens there
    chain: bool = False
    # a chain drafter trained as it drafts: the decoder's lean to context copies
    # (`DrafterRunner.COPY_BONUS`) added to its logits in the loss and the held-out measure
    # (0: trained without it)
    copy_bonus: float = 0.0

    def __post_init__(self) -> None:
        if self.loss not in ("kl", "ce"):
            raise CloverError(f"loss must be kl or ce, got {self.loss!r}")
        if self.init not in ("random", "target") and not str(self.init).endswith(".safetensors"):
            raise CloverError(
                f"init must be random, target or a drafter file (.safetensors), got {self.init!r}"
            )
        if not isinstance(self.loss_positions, int) or self.loss_positions < 0:
            raise CloverError(f"loss_positions must be an int >= 0, got {self.loss_positions!r}")
        if not isinstance(self.intermediate_size, int) or self.intermediate_size < 0:
            raise CloverError(
                f"intermediate_size must be an int >= 0, got {self.intermediate_size!r}"
            )
        if not 1 <= self.layers <= 8:
            raise CloverError("layers must be 1..8 (a drafter is a few layers)")
        if self.steps < 1 or self.batch_size < 1 or self.blocks_per_sequence < 1:
            raise CloverError("steps, batch_size and blocks_per_sequence must be >= 1")
        if self.block_size < 2 or self.decay <= 0:
            raise CloverError("block_size must be >= 2 and decay > 0")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise CloverError(f"max_minutes must be > 0, got {self.max_minutes!r}")
        if self.loss_vocab not in ("all", "draft"):
            raise CloverError(f"loss_vocab must be all or draft, got {self.loss_vocab!r}")
        weights = self.data_weights
        if weights is not None and (
            len(weights) != len(self.data_dirs)
            or not all(isinstance(w, int) and w >= 1 for w in weights)
        ):
            raise CloverError(
                f"data_weights must be one int >= 1 per data dir ({len(self.data_dirs)}), "
                f"got {weights!r}"
            )
        if not isinstance(self.draft_vocab, int) or self.draft_vocab < 0 or self.draft_vocab % 16:
            raise CloverError(
                f"draft_vocab must be 0 or a multiple of 16, not {self.draft_vocab!r}"
            )

    @classmethod
    def from_yaml(cls, path: Path, **overrides: object) -> DrafterTrainConfig:
        import yaml  # pyyaml comes with transformers; only for run configs

        try:
            d = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise CloverError(f"cannot read config {path}: {e}") from None
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise CloverError(f"{path}: unknown key(s) {', '.join(unknown)}")
        return cls(**{**d, **{k: v for k, v in overrides.items() if v is not None}})

    @property
    def data_dirs(self) -> list[Path]:
        return [Path(d) for d in ([self.data] if isinstance(self.data, str) else self.data)]


def lr_at(step: int, cfg: DrafterTrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (
        cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


# --- data -----------------------------------------------------------------------------------


def usable_examples(data_dir: Path, max_len: int) -> list[dict]:
    """A distilled directory's records a run can score: an answer, and room for it after the
    prompt within `max_len`."""
    return [r for r in load_examples(data_dir)
            if r["answer_ids"] and len(r["prompt_ids"]) + 2 <= max_len]  # fmt: skip


def load_sets(cfg: DrafterTrainConfig) -> tuple[list[dict], list[dict], list[dict]]:
    """(train, held-out prompts of trained kinds, held-out kinds); a training answer comes as
    many times as its directory's weight (`data_weights`)."""

    train, heldout, unseen = [], [], []
    for d, weight in zip(cfg.data_dirs, cfg.data_weights or [1] * len(cfg.data_dirs)):
        for r in usable_examples(d, cfg.max_len):
            if r["kind"] in cfg.heldout_kinds:
                unseen.append(r)
            elif r["split"] == "train":
                train += [r] * weight
            else:
                heldout.append(r)
    if not train:
        raise CloverError(f"{cfg.data}: no training examples (run `clover data distill`)")
    return train, heldout[: cfg.eval_examples], unseen[: cfg.eval_examples]


def draft_vocabulary(records: list[dict], vocab_size: int, size: int) -> torch.Tensor | None:
    """The `size` token ids a drafter drafts from: the training answers' tokens, most used
    first, then the lowest ids not yet in (a BPE vocabulary's first merges are its most common
    pieces: they cover tokens the answers never used). Sorted; None for the whole vocabulary."""
    if size <= 0 or size >= vocab_size:
        return None
    counts = collections.Counter(t for r in records for t in r["answer_ids"] if t < vocab_size)
    chosen = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))][:size]
    taken = set(chosen)
    chosen += [t for t in range(vocab_size) if t not in taken][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


class FeatureCache:
    """The frozen target's features by record id (bfloat16), up to a byte budget: its
    features are the same every epoch, and a target pass over a batch costs more than the
    drafter's whole step."""

    def __init__(self, budget_gb: float) -> None:
        self.budget, self.used, self.rows = budget_gb * 1e9, 0, {}

    def get(self, key: str) -> torch.Tensor | None:
        return self.rows.get(key)

    def put(self, key: str, feats: torch.Tensor) -> None:
        t = feats.to(torch.bfloat16)
        if self.used + t.numel() * 2 <= self.budget:
            self.rows[key] = t
            self.used += t.numel() * 2


def target_features(
    target: torch.nn.Module, records: list[dict], layers: list[int], max_len: int,
    cache: FeatureCache | None = None,
) -> tuple:  # fmt: skip
    """One causal pass of the frozen target over each prompt + answer (right-padded) ->
    (features [N, L, k * D] (bfloat16 values in float32), lengths [N], ids [N, L]); from
    `cache` when every record of the batch is there."""
    seqs = [(r["prompt_ids"] + r["answer_ids"])[:max_len] for r in records]
    L = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (L - len(s)) for s in seqs])
    n = torch.tensor([len(s) for s in seqs])
    kept = [cache.get(r["id"]) for r in records] if cache is not None else [None]
    if all(k is not None for k in kept):
        feats = torch.zeros(len(records), L, kept[0].shape[-1])
        for i, k in enumerate(kept):
            feats[i, : k.shape[0]] = k.float()
        return feats, n, ids
    with torch.inference_mode():
        _, feats = target(ids, n_valid=n, capture=tuple(layers))
    # rounded to bfloat16 whether kept or not: a resumed run (its cache empty) sees the same
    # numbers as the run it continues
    feats = feats.to(torch.bfloat16).float()
    if cache is not None:
        for i, r in enumerate(records):
            cache.put(r["id"], feats[i, : int(n[i])])
    return feats, n, ids


def warm_cache(
    target: torch.nn.Module, records: list[dict], layers: list[int], max_len: int,
    cache: FeatureCache, tokens: int = 4096, progress: bool = False, keep: Path | None = None,
    dtype: str = "",
) -> bool:  # fmt: skip
    """Fill `cache` with every record's features before the first step, when its budget holds
    them all: the target runs over records of similar lengths together (random training
    batches of a distilled set carry much padding) in passes of about `tokens` tokens.
    `keep`: a directory where each pass's features are saved as they come (bfloat16, the kept
    layers' hidden states of every token) and read back by a resumed run instead of running
    the target again; features made for another target, `dtype` (the target's load), layers
    or length are replaced.
    Returns whether it did; otherwise the first epoch fills the cache as it goes."""
    width = len(layers) * target.config.hidden_size
    lengths = {r["id"]: min(max_len, len(r["prompt_ids"]) + len(r["answer_ids"])) for r in records}
    missing = sum(n for key, n in lengths.items() if cache.get(key) is None)
    if cache.used + missing * width * 2 > cache.budget:
        return False
    if keep is not None:
        meta = {"target": fingerprint(target), "dtype": dtype, "layers": list(layers),
                "max_len": max_len}  # fmt: skip
        _read_kept(keep, meta, cache, set(lengths))
    todo = list({r["id"]: r for r in records if cache.get(r["id"]) is None}.values())
    todo.sort(key=lambda r: lengths[r["id"]])
    bar = None
    if progress and todo:
        bar = tqdm(total=len(todo), desc="target features", unit="record")
    i = 0
    while i < len(todo):
        j = i + 1
        while j < len(todo) and (j + 1 - i) * lengths[todo[j]["id"]] <= tokens:
            j += 1
        target_features(target, todo[i:j], layers, max_len, cache)
        if keep is not None:
            part = {r["id"]: cache.get(r["id"]).contiguous() for r in todo[i:j]}
            tmp = keep / f".part-{todo[i]['id']}.tmp"
            save_file(part, str(tmp))
            tmp.replace(keep / f"part-{todo[i]['id']}.safetensors")
        if bar is not None:
            bar.update(j - i)
        i = j
    if bar is not None:
        bar.close()
    return True


def _read_kept(keep: Path, meta: dict, cache: FeatureCache, wanted: set[str]) -> None:
    """Kept features of `wanted` records into `cache`; a directory made for other features
    (its meta.json says what they were) is emptied."""

    keep.mkdir(parents=True, exist_ok=True)
    path = keep / "meta.json"
    if path.exists() and json.loads(path.read_text()) != meta:
        print(f"{keep}: features made for {path.read_text().strip()}; made again", flush=True)
        for f in keep.glob("part-*.safetensors"):
            f.unlink()
    path.write_text(json.dumps(meta) + "\n")
    for f in sorted(keep.glob("part-*.safetensors")):
        with safe_open(str(f), framework="pt") as part:
            for key in part.keys():
                if key in wanted and cache.get(key) is None:
                    cache.put(key, part.get_tensor(key))


def block_starts(records: list[dict], n: torch.Tensor, S: int, rng: random.Random) -> torch.Tensor:
    """[N, S] positions p where a block begins: its first token is an answer token (or the
    first one the target writes) with at least one token after it to predict."""
    out = []
    for r, length in zip(records, n.tolist()):
        lo, hi = len(r["prompt_ids"]), length - 2  # p + 1 <= length - 1
        out.append([rng.randint(lo, hi) if hi >= lo else lo for _ in range(S)])
    return torch.tensor(out)


def fixed_starts(records: list[dict], n: torch.Tensor, S: int) -> torch.Tensor:
    """Block starts drawn once per record (seeded by its id): the same blocks at every
    evaluation, spread as decoding meets them (evenly spaced starts would favour the first
    answer tokens and overstate what decoding keeps)."""
    out = []
    for r, length in zip(records, n.tolist()):
        rng = random.Random(r["id"])
        lo, hi = len(r["prompt_ids"]), max(len(r["prompt_ids"]), length - 2)
        out.append([rng.randint(lo, hi) for _ in range(S)])
    return torch.tensor(out)


# --- loss -----------------------------------------------------------------------------------


def head_weight(target: torch.nn.Module) -> torch.Tensor:
    """The target's LM head [V, D] (dequantized if it was quantized), in bfloat16 where the
    device multiplies it fast (`bf16_fast`), else float32."""

    head = getattr(target, "quantized_head", None)
    if head is not None and hasattr(head, "dequantized_weight"):
        weight = head.dequantized_weight()
    else:
        weight = target.head_weight().detach()
    return weight.to(torch.bfloat16 if bf16_fast(weight.device) else torch.float32)


def loss_head(target: torch.nn.Module, drafter: Drafter,
              cfg: DrafterTrainConfig) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(the head the loss and the evaluation score with, the draft vocabulary's ids or None):
    with `loss_vocab: draft` and a draft vocabulary, only the head's rows it drafts from."""
    head, rows = head_weight(target), None
    if cfg.loss_vocab == "draft" and drafter.vocab is not None:
        rows = drafter.vocab.to(head.device)
        head = head.index_select(0, rows).contiguous()
    return head, rows


def head_index(rows: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """token id -> its row of a head made of `rows` (-1: not there); None for the whole head."""
    if rows is None:
        return None
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[rows.cpu()] = torch.arange(len(rows))
    return index


def teacher_forced(drafter: Drafter, target: torch.nn.Module, head: torch.Tensor,
                   feats: torch.Tensor, n: torch.Tensor, ids: torch.Tensor, starts: torch.Tensor,
                   B: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The drafter over blocks of B positions at starts [N, S] of the sequences ids [N, L]
    (their target features, n[i] real), a chain drafter reading each sequence's own tokens
    (teacher forcing) -> (log-probs [N, S, B-1, V'] over `head`'s rows, the positions
    [N, S, B-1] they predict, the sequence's tokens there (clamped past its end))."""
    N, S = starts.shape
    first = ids.gather(1, starts)
    before = None
    if drafter.config.chain:
        at = starts[..., None] + torch.arange(drafter.config.block_size - 1)  # [N, S, B-1]
        before = ids.gather(1, at.clamp(max=ids.shape[1] - 1).reshape(N, -1)).reshape(at.shape)
    h = drafter.train_hidden(feats, n, first, starts, target.embed_rows, B,
                             before)  # [N,S,B,D]  # fmt: skip
    # the head in bfloat16 where that is fast (`bf16_fast`), since it is most of a step
    # (N * S * (B - 1) positions x the vocabulary)
    logp = F.linear(h[:, :, 1:].to(head.dtype), head).float().log_softmax(-1)  # [N,S,B-1,V]
    pos = starts[..., None] + torch.arange(1, B)  # [N, S, B-1] positions predicted
    labels = ids.gather(1, pos.clamp(max=ids.shape[1] - 1).reshape(N, -1)).reshape(N, S, B - 1)
    return logp, pos, labels


def copy_leans(tokens: list[int], starts: list[int], depth: int) -> list[list[int | None]]:
    """Per block start p in a sequence's `tokens`: the token a chain drafter's draft at each
    of `depth` positions leans to in the decoder (`NgramIndex.follower` over tokens[: p + 1],
    the drafts before it being the sequence's own tokens p + 1 ..); None past its end."""

    index, done, out = NgramIndex([]), 0, {}
    for p in sorted(set(starts)):
        index.extend(tokens[done : p + 1])
        done = p + 1
        out[p] = [index.follower(tokens[p + 1 : p + 1 + j]) if p + 1 + j < len(tokens) else None
                  for j in range(depth)]  # fmt: skip
    return [out[p] for p in starts]


def copy_lean_rows(ids: torch.Tensor, n: torch.Tensor, starts: torch.Tensor, depth: int,
                   index: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """The head row [N, S, depth] each draft of the blocks at starts [N, S] of the sequences
    ids [N, L] (n[i] real) leans to (`copy_leans`; `index`: token id -> head row), -1 where
    none does."""
    N, S = starts.shape
    lean = torch.full((N, S, depth), -1, dtype=torch.long)
    for i in range(N):
        rows = copy_leans(ids[i, : int(n[i])].tolist(), starts[i].tolist(), depth)
        lean[i] = torch.tensor([[-1 if t is None else t for t in r] for r in rows])
    if index is not None:
        lean = torch.where(lean >= 0, index[lean.clamp(min=0)], -1)
    return lean


def lean_to_copies(logp: torch.Tensor, lean: torch.Tensor, bonus: float) -> torch.Tensor:
    """logp [..., V'] -> the same with `bonus` added at the head rows `lean` [...] (-1: none;
    `copy_lean_rows`), renormalised."""
    add = torch.where(lean >= 0, bonus, 0.0).to(logp.device)[..., None]
    return logp.scatter_add(-1, lean.clamp(min=0).to(logp.device)[..., None], add).log_softmax(-1)


def drafter_loss(drafter: Drafter, target: torch.nn.Module, head: torch.Tensor, batch: dict,
                 cfg: DrafterTrainConfig, rows: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """head: the LM head's rows [n, D] the loss reads; rows: their token ids (None: the whole
    head). Teacher tokens outside `rows` are left out of the loss (the teacher's top-k
    renormalised over the rest); a position with none of them left weighs nothing."""
    feats, n, ids, starts, records = (batch[k] for k in ("feats", "n", "ids", "starts", "records"))
    N, S = starts.shape
    # B: the block positions scored (the first is the verified token), all of the block's or
    # the first 1 + loss_positions
    B = drafter.config.block_size
    if cfg.loss_positions:
        B = min(B, cfg.loss_positions + 1)
    logp, pos, labels = teacher_forced(drafter, target, head, feats, n, ids, starts, B)
    valid = pos < n[:, None, None]
    weight = torch.exp(-(torch.arange(B - 1).float()) / cfg.decay)[None, None] * valid
    index = head_index(rows, drafter.config.vocab_size)
    if cfg.copy_bonus and drafter.config.chain:
        lean = copy_lean_rows(ids, n, starts, B - 1, index)
        logp = lean_to_copies(logp, lean, cfg.copy_bonus)
    if cfg.loss == "ce":
        at = labels if index is None else index[labels]
        per = -logp.gather(-1, at.clamp(min=0)[..., None])[..., 0]
        if index is not None:
            weight = weight * (at >= 0)
    else:  # KL(teacher top-k || drafter) at each answer position
        k = len(records[0]["topk_ids"][0])
        tid = torch.zeros(N, S, B - 1, k, dtype=torch.long)
        tlp = torch.full((N, S, B - 1, k), -1e9)
        for i, r in enumerate(records):
            P = len(r["prompt_ids"])
            ti, tl = torch.tensor(r["topk_ids"]), torch.tensor(r["topk_logprobs"])
            a = (pos[i] - P).clamp(0, len(r["topk_ids"]) - 1)  # answer index predicted
            tid[i], tlp[i] = ti[a], tl[a]
        if index is not None:  # the teacher over the tokens the head has
            tid = index[tid]
            tlp = tlp.masked_fill(tid < 0, -1e9)
            weight = weight * (tid >= 0).any(-1)
            tid = tid.clamp(min=0)
        tp = tlp.log_softmax(-1)
        per = (tp.exp() * (tp - logp.gather(-1, tid))).sum(-1)
    loss = (per * weight).sum() / weight.sum().clamp(min=1)
    with torch.no_grad():
        if rows is not None:
            drafted = rows.to(logp.device)[logp.argmax(-1)]
        elif drafter.vocab is None:
            drafted = logp.argmax(-1)
        else:  # as it will draft: from its draft vocabulary only
            vocab = drafter.vocab.to(logp.device)
            drafted = vocab[logp.index_select(-1, vocab).argmax(-1)]
        hits = (drafted == labels) & valid
        run = hits.long().cumprod(-1).sum(-1).float()  # leading drafts the teacher agrees with
    return loss, {
        "loss": float(loss.detach()),
        "accepted": float(run.mean()),
        "top1": float(hits[..., 0].float().mean()),
    }


def evaluate(drafter: Drafter, target: torch.nn.Module, head: torch.Tensor, records: list[dict],
             cfg: DrafterTrainConfig, rows: torch.Tensor | None = None,
             cache: FeatureCache | None = None) -> dict:  # fmt: skip
    """Mean accepted draft length (greedy drafts vs the teacher's tokens) at fixed blocks;
    `cache` keeps the held-out records' features too (the target pass is most of an
    evaluation)."""
    if not records:
        return {}
    drafter.eval()
    runs, first = [], []
    with torch.no_grad():
        for i in range(0, len(records), cfg.batch_size):
            chunk = records[i : i + cfg.batch_size]
            feats, n, ids = target_features(
                target, chunk, drafter.config.feature_layers, cfg.max_len, cache
            )
            starts = fixed_starts(chunk, n, cfg.blocks_per_sequence)
            batch = {"feats": feats, "n": n, "ids": ids, "starts": starts, "records": chunk}
            every = replace(cfg, loss="ce", loss_positions=0)  # drafts as long as the block
            _, info = drafter_loss(drafter, target, head, batch, every, rows)
            runs.append(info["accepted"])
            first.append(info["top1"])
    drafter.train()
    return {
        "accepted": round(sum(runs) / len(runs), 4),
        "first_token": round(sum(first) / len(first), 4),
    }


def kind_sets(cfg: DrafterTrainConfig, per_kind: int) -> dict[str, list[dict]]:
    """Every answer a run on `cfg` never trains on, by prompt kind, the first `per_kind` of
    each: the held-out answers of trained kinds and all answers of `heldout_kinds`."""
    out: dict[str, list[dict]] = {}
    for d in cfg.data_dirs:
        for r in usable_examples(d, cfg.max_len):
            if r["kind"] in cfg.heldout_kinds or r["split"] != "train":
                kind = out.setdefault(r["kind"], [])
                if len(kind) < per_kind:
                    kind.append(r)
    return out


def kind_report(drafters: dict[str, Drafter], target: torch.nn.Module, cfg: DrafterTrainConfig,
                sets: dict[str, list[dict]], progress: bool = False) -> dict:  # fmt: skip
    """Held-out acceptance by prompt kind (`evaluate` over each kind's answers in `sets`) for
    each drafter, and over all trained kinds and all `heldout_kinds` (weighted by answers).
    The target's features are made once for every drafter."""
    cache = FeatureCache(float("inf"))
    every = [r for rs in sets.values() for r in rs]
    layers = {tuple(d.config.feature_layers) for d in drafters.values()}
    if len(layers) != 1:
        raise CloverError(f"the drafters read different target layers: {sorted(layers)}")
    warm_cache(target, every, list(layers.pop()), cfg.max_len, cache, progress=progress)
    kinds = {k: {"answers": len(rs), "trained_kind": k not in cfg.heldout_kinds}
             for k, rs in sorted(sets.items())}  # fmt: skip
    report: dict = {"kinds": kinds, "drafters": {}}
    for name, drafter in drafters.items():
        head, rows = loss_head(target, drafter, cfg)
        by_kind = {k: evaluate(drafter, target, head, sets[k], cfg, rows, cache) for k in kinds}
        groups = {}
        for group, trained in (("trained_kinds", True), ("never_trained_kinds", False)):
            ks = [k for k in kinds if kinds[k]["trained_kind"] == trained]
            n = sum(kinds[k]["answers"] for k in ks)
            if n:
                groups[group] = {m: round(sum(by_kind[k][m] * kinds[k]["answers"] for k in ks)
                                          / n, 4) for m in ("accepted", "first_token")}  # fmt: skip
        report["drafters"][name] = {**groups, "by_kind": by_kind}
    return report


# --- the run --------------------------------------------------------------------------------


def _save(
    out: Path, drafter: Drafter, opt: torch.optim.Optimizer, state: dict, cfg: DrafterTrainConfig
) -> None:

    tmp = out / ".checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(
        {"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), **state}, tmp / "state.pt"
    )
    final, old = out / "checkpoint", out / ".checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.replace(old)
    tmp.replace(final)
    shutil.rmtree(old, ignore_errors=True)
    save_drafter(drafter, Path(cfg.drafter_file or out / "drafter.safetensors"))


def start_from_file(drafter: Drafter, target: torch.nn.Module, path: Path) -> None:
    """`init: <drafter file>`: the drafter takes the file's weights and draft vocabulary; the
    file must be a drafter of this target (its fingerprint) of the same shape, or of fewer
    layers (grown: its layers come first, and each added layer starts with zero output
    projections, so the grown drafter starts as the file's function)."""

    if not path.is_file():
        raise CloverError(f"init: no drafter file at {path}")
    other = load_drafter(path, target)
    c, o = drafter.config, other.config
    shape = ("block_size", "feature_layers", "hidden_size", "head_dim", "intermediate_size",
             "num_attention_heads", "num_key_value_heads", "chain")  # fmt: skip
    differ = [f"{k} {getattr(o, k)} (config: {getattr(c, k)})" for k in shape
              if getattr(o, k) != getattr(c, k)]  # fmt: skip
    if o.num_hidden_layers > c.num_hidden_layers:
        differ.insert(0, f"num_hidden_layers {o.num_hidden_layers} (config: "
                         f"{c.num_hidden_layers}; a file can only grow)")  # fmt: skip
    if differ:
        raise CloverError(f"init: {path} is another shape of drafter: {', '.join(differ)}")
    missing, _ = drafter.load_state_dict({k: v.float() for k, v in other.state_dict().items()},
                                         strict=False)  # fmt: skip
    added = range(o.num_hidden_layers, c.num_hidden_layers)
    grown = {k for k in drafter.state_dict() if k.startswith(tuple(f"layers.{i}." for i in added))}
    if set(missing) != grown:
        raise CloverError(f"init: {path} lacks weights this drafter needs: {sorted(missing)}")
    with torch.no_grad():
        for i in added:  # residual branches that add nothing yet
            drafter.layers[i].self_attn.o_proj.weight.zero_()
            drafter.layers[i].mlp.down_proj.weight.zero_()
    drafter.set_vocab(other.vocab)


def train_drafter(cfg: DrafterTrainConfig, progress: bool = True, until: int | None = None) -> dict:
    """Train (or continue) a drafter; `until` stops at that step as a killed run would."""

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(cfg.target, dtype=cfg.target_dtype, progress=progress, device=cfg.device)
    with torch.device(cfg.device):  # every tensor the run makes lands beside the target
        return _train_drafter(cfg, llm.model, out, progress, until)


def _train_drafter(cfg: DrafterTrainConfig, target: torch.nn.Module, out: Path, progress: bool,
                   until: int | None) -> dict:  # fmt: skip

    for p in target.parameters():
        p.requires_grad_(False)
    train, heldout, unseen = load_sets(cfg)
    torch.manual_seed(cfg.seed)
    overrides = {"num_hidden_layers": cfg.layers, "block_size": cfg.block_size,
                 "chain": cfg.chain}  # fmt: skip
    if cfg.feature_layers:
        overrides["feature_layers"] = list(cfg.feature_layers)
    if cfg.intermediate_size:
        overrides["intermediate_size"] = cfg.intermediate_size
    drafter = new_drafter(target, cfg.target, **overrides).float().to(cfg.device).train()
    drafter.set_vocab(draft_vocabulary(train, drafter.config.vocab_size, cfg.draft_vocab))
    ckpt = out / "checkpoint" / "state.pt"
    if cfg.init.endswith(".safetensors"):  # its draft vocabulary in a resumed run too (a
        start_from_file(drafter, target, Path(cfg.init))  # checkpoint's weights replace its own)
    head, rows = loss_head(target, drafter, cfg)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    step, order, elapsed = 0, [], 0.0
    if cfg.init == "target" and not ckpt.exists():  # calibrated on the first training batch
        first = [train[i] for i in range(min(len(train), cfg.batch_size))]
        feats, _, _ = target_features(target, first, drafter.config.feature_layers, cfg.max_len)
        init_from_target(drafter, target, feats)
    if ckpt.exists():  # continue: the drafter, optimizer, data order and schedule
        state = torch.load(ckpt, weights_only=False, map_location=cfg.device)
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        step, order, elapsed = state["step"], state["order"], state.get("elapsed", 0.0)
        cfg = replace(cfg, steps=state.get("steps", cfg.steps))
        rng.setstate(state["rng"])
        if state.get("feature_layers") != drafter.config.feature_layers:
            raise CloverError(
                f"{out}: the checkpoint was made with feature layers "
                f"{state.get('feature_layers')}, not {drafter.config.feature_layers}"
            )
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    metrics = open(out / "metrics.jsonl", "a", encoding="utf-8")
    bar = None
    if progress:
        bar = tqdm(total=cfg.steps, initial=step, desc="drafter", unit="step")
    features = FeatureCache(cfg.feature_cache_gb)
    start = time.perf_counter() - elapsed
    recent: collections.deque = collections.deque(maxlen=51)  # seconds at the last steps
    planned = cfg.steps if step == 0 else max(cfg.steps, state.get("planned", cfg.steps))
    stop_at = min(cfg.steps, until or cfg.steps)
    if step < stop_at:  # the box counts this pass too
        keep = out / "features" if cfg.keep_features else None
        warm_cache(target, train + heldout + unseen, drafter.config.feature_layers, cfg.max_len,
                   features, progress=progress, keep=keep, dtype=cfg.target_dtype)  # fmt: skip
    last: dict = {}
    if step == 0 and stop_at > 0 and cfg.init not in ("random", "target"):
        # where a drafter trained before starts on this data: the curve's first point
        start_point = {"step": 0, "heldout": evaluate(drafter, target, head, heldout, cfg, rows,
                                                      features),
                       "heldout_kinds": evaluate(drafter, target, head, unseen, cfg, rows,
                                                 features)}  # fmt: skip
        metrics.write(json.dumps(start_point) + "\n")
        metrics.flush()
    while step < stop_at:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        if len(order) < cfg.batch_size:
            fresh = list(range(len(train)))
            rng.shuffle(fresh)
            order += fresh
        chunk = [train[i] for i in order[: cfg.batch_size]]
        order = order[cfg.batch_size :]
        layers = drafter.config.feature_layers
        feats, n, ids = target_features(target, chunk, layers, cfg.max_len, features)
        starts = block_starts(chunk, n, cfg.blocks_per_sequence, rng)
        batch = {"feats": feats, "n": n, "ids": ids, "starts": starts, "records": chunk}
        loss, info = drafter_loss(drafter, target, head, batch, cfg, rows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        now = time.perf_counter() - start
        recent.append(now)
        if cfg.max_minutes is not None and len(recent) > 10 and step % 10 == 0:
            # refit the schedule to end in the box, at the pace of the last 50 steps (a first
            # epoch that runs the target too is slower than later ones reading its features)
            pace = (recent[-1] - recent[0]) / (len(recent) - 1)
            fit = step + int((cfg.max_minutes * 60 - now) / pace)
            cfg = replace(cfg, steps=max(step, min(planned, fit)))
            stop_at = min(cfg.steps, until or cfg.steps)
        last = {"step": step, "lr": lr_at(step - 1, cfg), **info, "seconds": round(now, 1)}
        if step % cfg.eval_every == 0 or step == stop_at:
            last["heldout"] = evaluate(drafter, target, head, heldout, cfg, rows, features)
            last["heldout_kinds"] = evaluate(drafter, target, head, unseen, cfg, rows, features)
        metrics.write(json.dumps(last) + "\n")
        metrics.flush()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{info['loss']:.3f}", acc=f"{info['accepted']:.2f}")
        if step % cfg.save_every == 0 or step == stop_at:
            state = {
                "planned": planned,
                "step": step,
                "order": order,
                "steps": cfg.steps,
                "rng": rng.getstate(),
                "elapsed": now,
                "feature_layers": drafter.config.feature_layers,
            }
            drafter.config.info = {
                "steps": step,
                "seconds": round(now),
                "data": [str(d) for d in cfg.data_dirs],
                "loss": cfg.loss,
                "heldout": last.get("heldout"),
                "heldout_kinds": last.get("heldout_kinds"),
            }
            _save(out, drafter, opt, state, cfg)
    if bar is not None:
        bar.close()
    metrics.close()
    if not last and step:  # a finished run again: its drafter file rewritten in this format
        path = Path(cfg.drafter_file or out / "drafter.safetensors")
        if path.exists():
            drafter.config.info = read_drafter_config(path).info
        save_drafter(drafter, path)
        last = {"step": step, "rewritten": str(path)}
    return last
