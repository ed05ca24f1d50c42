"""The block-diffusion decoding loop, written once for every policy, batch size and model.

Each sequence (row) answers in blocks of `policy.block_size` positions that start all-[MASK].
A step runs one forward over, per row, the tokens still to be committed to the prefix (the
prompt, or the block just finished) followed by the current block, so committing block k and
the first denoising step of block k+1 share one pass. The policy then commits some masked
positions. A finished block becomes the prefix of the next.

Token shift (`config.shifted`): the token at position i is predicted from the output at i - 1,
so block position 0 is predicted by the last committed token, from a causal pass, exactly as
in AR decoding; a one-position block therefore *is* AR decoding, one forward per token.

An EOS committed mid-block ends the answer there: later positions are dropped (no more steps
are spent on them) and the answer ends once every position before the EOS is committed.

The loop sees token ids only and yields a `StepEvent` per step; CLI, server, benchmarks and
visualisers all consume that stream. NFE counts forward passes a row took part in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from clover.decoding.policies import Policy
from clover.decoding.sampling import SamplingParams, sample
from clover.errors import CloverError
from clover.models.base import DiffusionLM

MASKED = -1


@dataclass
class Commit:
    row: int
    index: int  # position in the answer (0 = first generated token)
    token: int
    step: int  # the row's denoising step that committed it (1-based)


@dataclass
class StepEvent:
    step: int  # global step of this generate call (1-based)
    commits: list[Commit]
    final: dict[int, list[int]]  # row -> tokens that just became final, in answer order
    finished: dict[int, str]  # row -> "stop" (EOS / stop condition) or "length"
    forward_rows: int  # rows in this step's forward pass (0: no pass was needed)
    forward_tokens: int  # input positions of that pass, padding included
    seconds: float


@dataclass
class RowResult:
    tokens: list[int] = field(default_factory=list)  # the answer, without the EOS
    steps: list[int] = field(default_factory=list)  # step that committed each token
    nfe: int = 0
    finish_reason: str | None = None

    @property
    def tpf(self) -> float:
        return len(self.tokens) / self.nfe if self.nfe else 0.0


class _Row:
    def __init__(self, index: int, prompt: list[int], max_new: int, gen: torch.Generator) -> None:
        self.index = index
        self.pending = list(prompt)  # tokens to commit causally at the next pass
        self.answer: list[int] = []  # committed blocks, in order
        self.answer_steps: list[int] = []
        self.block: list[int] = []  # current block, MASKED where not yet committed
        self.block_steps: list[int] = []
        self.emitted = 0  # answer tokens already reported as final
        self.max_new = max_new
        self.prefix_hidden: torch.Tensor | None = None  # output at the last committed token
        self.steps = 0
        self.result = RowResult()
        self.gen = gen

    def start_block(self, size: int, eos_hit: bool) -> str | None:
        """Move a finished block into the answer; return a finish reason or open a new block."""
        if self.block:
            self.answer += self.block
            self.answer_steps += self.block_steps
            self.pending = list(self.block)
            self.block, self.block_steps = [], []
        if eos_hit:
            return "stop"
        remaining = self.max_new - len(self.answer)
        if remaining <= 0:
            return "length"
        n = min(size, remaining)
        self.block, self.block_steps = [MASKED] * n, [0] * n
        return None

    def masked(self) -> list[int]:
        return [i for i, t in enumerate(self.block) if t == MASKED]

    def final_tokens(self) -> list[int]:
        """Answer tokens that can no longer change: the answer + the block's committed run."""
        run = 0
        while run < len(self.block) and self.block[run] != MASKED:
            run += 1
        return self.answer + self.block[:run]


def generate(
    model: DiffusionLM,
    prompts: list[list[int]],
    policy: Policy,
    *,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    eos_token_ids: list[int] | tuple[int, ...] = (),
    stop: Callable[[int, list[int]], bool] | None = None,
    results: list[RowResult] | None = None,
) -> Iterator[StepEvent]:
    """Decode every prompt (lists of token ids, any lengths); yields one event per step.

    stop(row, final_tokens) is called when a row's final tokens grow; True ends that row
    (stop strings live in the caller, which knows text). `results`, if given, is filled with
    one `RowResult` per prompt as rows finish.
    """
    config = model.config
    sampling = sampling or SamplingParams()
    if not prompts:
        return
    if any(len(p) == 0 for p in prompts):
        raise CloverError("empty prompt: give at least one token")
    if max_new_tokens < 1:
        raise CloverError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if policy.block_size > 1 or not config.shifted:
        if config.mask_token_id is None:
            raise CloverError(
                "this model has no mask_token_id, so it cannot decode blocks; use --decoder ar"
            )
    context = model.context_length
    longest = max(len(p) for p in prompts)
    if longest >= context:
        raise CloverError(
            f"prompt of {longest} tokens does not fit the model's context of {context} "
            "(prompt + generation)"
        )
    mask_id = config.mask_token_id if config.mask_token_id is not None else 0
    eos = set(eos_token_ids)
    device = next(model.parameters()).device
    rows = []
    for i, p in enumerate(prompts):
        gen = torch.Generator(device=device)
        gen.manual_seed((sampling.seed if sampling.seed is not None else 0) * 1_000_003 + i)
        # the answer may use what the context leaves; it then ends with reason "length"
        rows.append(_Row(i, p, min(max_new_tokens, context - len(p)), gen))
    if results is not None:
        results[:] = [r.result for r in rows]
    for r in rows:
        r.start_block(policy.block_size, eos_hit=False)
    cache = model.make_cache(len(rows))
    active = list(rows)  # cache row k belongs to active[k]
    step = 0
    while active:
        t0 = time.perf_counter()
        step += 1
        # 1. build the forward: per row, pending tokens + the block when its outputs are needed
        inputs, n_commit, block_in = [], [], []
        for r in active:
            masked = r.masked()
            need_block = any(p > 0 for p in masked) if config.shifted else bool(masked)
            blk = [mask_id if t == MASKED else t for t in r.block] if need_block else []
            inputs.append(r.pending + blk)
            n_commit.append(len(r.pending))
            block_in.append(need_block)
        T = max(len(x) for x in inputs)
        hidden = None
        n_fwd = sum(1 for x in inputs if x)
        if T:
            ids = torch.full((len(active), T), mask_id, dtype=torch.long, device=device)
            for k, x in enumerate(inputs):
                ids[k, : len(x)] = torch.tensor(x, dtype=torch.long)
            n_valid = torch.tensor([len(x) for x in inputs])
            with torch.inference_mode():
                hidden = model(
                    ids, cache, "block", n_commit=torch.tensor(n_commit), n_valid=n_valid
                )
        # 2. the output that predicts each masked position
        wanted, owners = [], []
        for k, r in enumerate(active):
            if inputs[k]:
                r.result.nfe += 1
            nc = n_commit[k]
            if nc and config.shifted:
                r.prefix_hidden = hidden[k, nc - 1]
            r.pending = []
            for p in r.masked():
                if config.shifted:
                    h = r.prefix_hidden if p == 0 else hidden[k, nc + p - 1]
                else:
                    h = hidden[k, nc + p]
                wanted.append(h)
                owners.append((r, p))
        # 3. sample, let the policy choose, commit
        event = StepEvent(step, [], {}, {}, n_fwd, T * len(active) if T else 0, 0.0)
        if wanted:
            with torch.inference_mode():
                logits = model.logits(torch.stack(wanted))  # [N, V]
                if config.mask_token_id is not None:
                    logits[:, config.mask_token_id] = float("-inf")  # [MASK] is never an answer
            tokens, conf = _sample_rows(logits, owners, sampling)
            start = 0
            while start < len(owners):
                r = owners[start][0]
                end = start
                while end < len(owners) and owners[end][0] is r:
                    end += 1
                r.steps += 1
                chosen = policy.select(conf[start:end])
                for j in torch.nonzero(chosen).flatten().tolist():
                    p = owners[start + j][1]
                    tok = int(tokens[start + j])
                    r.block[p], r.block_steps[p] = tok, r.steps
                    event.commits.append(Commit(r.index, len(r.answer) + p, tok, r.steps))
                start = end
        # 4. EOS, finished blocks, stop conditions
        keep = []
        for k, r in enumerate(active):
            reason = _advance(r, eos, policy.block_size)
            final = r.final_tokens()
            cut = _first_eos(final, eos)
            if cut is not None:
                final = final[:cut]
            new = final[r.emitted :]
            if new:
                event.final[r.index] = new
                r.emitted = len(final)
                if stop is not None and stop(r.index, final):
                    reason = "stop"
            if reason is None:
                keep.append(k)
                continue
            r.result.tokens = final
            r.result.steps = (r.answer_steps + r.block_steps)[: len(final)]
            r.result.finish_reason = reason
            event.finished[r.index] = reason
        if len(keep) < len(active):
            active = [active[k] for k in keep]
            if active:
                cache.select(keep)
        event.seconds = time.perf_counter() - t0
        yield event


def _advance(r: _Row, eos: set[int], block_size: int) -> str | None:
    """After commits: truncate at a mid-block EOS, close a complete block, open the next."""
    cut = _first_eos(r.block, eos)
    if cut is not None:
        del r.block[cut + 1 :], r.block_steps[cut + 1 :]
    if MASKED in r.block:
        return None
    return r.start_block(block_size, eos_hit=cut is not None)


def _first_eos(tokens: list[int], eos: set[int]) -> int | None:
    for i, t in enumerate(tokens):
        if t in eos:
            return i
    return None


def _sample_rows(
    logits: torch.Tensor, owners: list, sampling: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy is one batched call; sampling draws per row from the row's own generator."""
    if sampling.greedy:
        return sample(logits, sampling)
    tokens = torch.empty(len(owners), dtype=torch.long)
    conf = torch.empty(len(owners))
    start = 0
    while start < len(owners):
        r = owners[start][0]
        end = start
        while end < len(owners) and owners[end][0] is r:
            end += 1
        tokens[start:end], conf[start:end] = sample(logits[start:end], sampling, r.gen)
        start = end
    return tokens, conf
