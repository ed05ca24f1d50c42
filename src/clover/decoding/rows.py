"""Per-sequence decoding state: what a row feeds the next forward and what it does with it.

The loop (`loop.py`) batches rows, runs the forward, computes the logits every row asked for
in one call, and hands each row its slice. Two kinds of row cover every decoder:

- `BlockRow` (ar, low_confidence): a block of masked positions, denoised step by step; the
  policy picks which confident positions to commit. A finished block is committed causally in
  the next pass, fused with the first denoising step of the following block. With a sliding
  window (`LowConfidence(slide=True)`) the committed leading run leaves the block at once
  (committed causally in the next pass) and fresh masks join the end: the first masked
  position is always the one the prefix's causal output predicts.
- `SpecRow` (self_spec, `spec_row.py`): lossless self-speculation, drafts verified causally.

Token shift is assumed where noted: the output at position i predicts position i + 1.

A row may carry a `LogitsConstraint` (`constraints.py`). A constrained `BlockRow` commits its
block left to right (a run per step); a constrained `SpecRow` constrains every token it keeps
(the AR samples at verification), while its drafts stay unconstrained guesses that the
verification accepts only where they match. When the constraint reports `finished` the row
drops it and decodes as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from clover.decoding.constraints import LogitsConstraint, pick
from clover.decoding.policies import Policy
from clover.decoding.sampling import SamplingParams, sample

MASKED = -1


@dataclass
class RowResult:
    tokens: list[int] = field(default_factory=list)  # the answer, without the EOS
    steps: list[int] = field(default_factory=list)  # step that committed each token
    nfe: int = 0
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache across requests
    # from joining the batch to the end of the pass that gave the row its first logits
    # (prefill of the uncached prompt, then that pass)
    prefill_seconds: float = 0.0
    # self_spec: per draft source ("mask", "lookup"), [tokens drafted, tokens kept]
    drafts: dict[str, list[int]] = field(default_factory=dict)
    accepted: list[int] = field(default_factory=list)  # drafted tokens kept, per verify pass

    @property
    def tpf(self) -> float:
        return len(self.tokens) / self.nfe if self.nfe else 0.0


def first_eos(tokens: list[int], eos: set[int]) -> int | None:
    eos = eos if isinstance(eos, (set, frozenset)) else set(eos)
    if eos.isdisjoint(tokens):  # the common case, at C speed (rows ask every step)
        return None
    for i, t in enumerate(tokens):
        if t in eos:
            return i
    return None


class Row:
    """What every row has: the prompt/answer bookkeeping and the result it fills."""

    def __init__(
        self, index: int, prompt: list[int], max_new: int, policy: Policy, gen: torch.Generator
    ) -> None:
        self.index = index
        self.prompt = list(prompt)
        self.pending = list(prompt)  # certain tokens to commit causally at the next pass
        self.committed: list[int] = []  # ids the cache row holds (the loop keeps it exact)
        self.marks: tuple[int, ...] = ()  # prompt positions for prefix-cache snapshots
        self.pin = None  # the prefix-cache block this row pins (the deepest of its chain)
        self.prompt_saved = False  # its prompt is in the prefix cache
        self.partition = None  # the prefix-cache partition it reads and feeds
        self.t_added = 0.0
        self.answer: list[int] = []  # final answer tokens (may end with EOS)
        self.answer_steps: list[int] = []
        self.emitted = 0  # final tokens already reported
        self.max_new = max_new
        self.policy = policy
        self.gen = gen
        self.steps = 0
        self.prefix_hidden: torch.Tensor | None = None  # output at the last committed token
        self.constraint: LogitsConstraint | None = None
        self.result = RowResult()

    def constrained(self, logits: torch.Tensor, at: int, sampling: SamplingParams) -> int:
        """logits [V] for answer index `at` -> the best token the constraint allows; the
        constraint advances past it."""
        token, _ = pick(logits, self.constraint, self.max_new - at, sampling, self.gen)
        self.constraint.advance(token)
        if self.constraint.finished:
            self.constraint = None
        return token

    def plan(self, mask_id: int, look: bool = True) -> tuple[list[int], int]:
        """-> (input tokens for the next pass, how many of them are committed causally).
        look=False: the pass has no room for a context-lookup draft (`SpecRow`'s)."""
        raise NotImplementedError

    def wanted(self, hidden: torch.Tensor | None, n_commit: int) -> list[torch.Tensor]:
        """hidden [T, D] of this row's last pass -> the hidden vectors to project to logits."""
        raise NotImplementedError

    def optional_tokens(self) -> int:
        """Input tokens at the end of the planned pass that the row could do without."""
        return 0

    def update(self, logits: torch.Tensor, sampling: SamplingParams, eos: set[int]) -> tuple:
        """logits [N, V] for `wanted` -> (commits [(answer index, token)], tokens to roll back)."""
        raise NotImplementedError

    def final_tokens(self) -> list[int]:
        return list(self.answer)

    def finish_reason(self, eos: set[int]) -> str | None:
        if first_eos(self.answer, eos) is not None:
            return "stop"
        if len(self.answer) >= self.max_new:
            return "length"
        return None


class BlockRow(Row):
    """ar and low_confidence: a masked block denoised step by step."""

    def __init__(self, *args: object, shifted: bool = True) -> None:
        super().__init__(*args)
        self.shifted = shifted
        self.block: list[int] = []
        self.block_steps: list[int] = []
        self.open_block()

    def open_block(self) -> None:
        n = min(self.policy.block_size, self.max_new - len(self.answer))
        self.block, self.block_steps = [MASKED] * max(n, 0), [0] * max(n, 0)

    def masked(self) -> list[int]:
        return [i for i, t in enumerate(self.block) if t == MASKED]

    def plan(self, mask_id: int, look: bool = True) -> tuple[list[int], int]:
        masked = self.masked()
        # with token shift, position 0 is predicted from the prefix: no block input needed
        need_block = any(p > 0 for p in masked) if self.shifted else bool(masked)
        blk = [mask_id if t == MASKED else t for t in self.block] if need_block else []
        return self.pending + blk, len(self.pending)

    def wanted(self, hidden: torch.Tensor | None, n_commit: int) -> list[torch.Tensor]:
        if n_commit and self.shifted:
            self.prefix_hidden = hidden[n_commit - 1]
        self.pending = []
        out = []
        for p in self.masked():
            if self.shifted:
                out.append(self.prefix_hidden if p == 0 else hidden[n_commit + p - 1])
            else:
                out.append(hidden[n_commit + p])
        return out

    def update(
        self,
        logits: torch.Tensor,
        sampling: SamplingParams,
        eos: set[int],
        sampled: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple:
        """`sampled`: (tokens, confidence) of greedy `sample` over these logits, computed by
        the caller for the whole batch at once (on the host); else sampled here."""
        if not len(logits):
            return [], 0
        self.steps += 1
        masked = self.masked()
        commits = []
        if self.constraint is not None:
            commits = self._commit_run(logits, masked, sampling, eos)
        else:
            tokens, conf = sampled if sampled is not None else sample(logits, sampling, self.gen)
            if conf is None:  # the loop's greedy draw for policies that read no confidence
                if self.policy.uses_confidence:
                    raise ValueError(f"{self.policy.name} selects by confidence; none given")
                chosen = torch.ones(len(tokens), dtype=torch.bool)
            else:
                chosen = self.policy.select(conf)
            for j in torch.nonzero(chosen).flatten().tolist():
                p, tok = masked[j], int(tokens[j])
                self.block[p], self.block_steps[p] = tok, self.steps
                commits.append((len(self.answer) + p, tok))
        cut = first_eos(self.block, eos)
        if cut is not None:  # nothing after an EOS matters: stop denoising it
            del self.block[cut + 1 :], self.block_steps[cut + 1 :]
        if MASKED not in self.block:  # block complete: it becomes the prefix
            self.answer += self.block
            self.answer_steps += self.block_steps
            self.pending = list(self.block)
            self.block, self.block_steps = [], []
            if cut is None:
                self.open_block()
        elif self.policy.slide:
            self._slide(more=cut is None)
        return commits, 0

    def _slide(self, more: bool) -> None:
        """Sliding window: the committed leading run becomes prefix (committed causally in the
        next pass) and as many fresh masks join the window's end as the budget allows (none
        after an EOS in the window)."""
        run = self.block.index(MASKED)
        if not run:
            return
        self.answer += self.block[:run]
        self.answer_steps += self.block_steps[:run]
        self.pending = self.block[:run]
        del self.block[:run], self.block_steps[:run]
        fresh = min(run, self.max_new - len(self.answer) - len(self.block)) if more else 0
        self.block += [MASKED] * max(fresh, 0)
        self.block_steps += [0] * max(fresh, 0)

    def _commit_run(
        self, logits: torch.Tensor, masked: list[int], sampling: SamplingParams, eos: set[int]
    ) -> list[tuple[int, int]]:
        """Constrained: commit the leftmost masked position, then the next ones while the
        policy is confident in their allowed token. Positions before masked[0] are all
        committed (a constrained row never leaves a gap), so each token is judged against
        everything before it."""
        commits = []
        for j, p in enumerate(masked):
            if self.constraint is None or (j and p != masked[j - 1] + 1):
                break  # the constraint finished: the rest of the block decodes as usual
            at = len(self.answer) + p
            token, conf = pick(logits[j], self.constraint, self.max_new - at, sampling, self.gen)
            if j and not self.policy.confident(conf):
                break
            self.constraint.advance(token)
            if self.constraint.finished:
                self.constraint = None
            self.block[p], self.block_steps[p] = token, self.steps
            commits.append((at, token))
            if token in eos:
                break
        return commits

    def final_tokens(self) -> list[int]:
        run = 0
        while run < len(self.block) and self.block[run] != MASKED:
            run += 1
        return self.answer + self.block[:run]

    def finish_reason(self, eos: set[int]) -> str | None:
        # an empty block means the answer hit an EOS or the token budget (see open_block)
        return None if self.block else (super().finish_reason(eos) or "length")
