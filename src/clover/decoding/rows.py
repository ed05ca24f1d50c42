"""Per-sequence decoding state: what a row feeds the next forward and what it does with it.

The loop (`loop.py`) batches rows, runs the forward, computes the logits every row asked for
in one call, and hands each row its slice. Two kinds of row cover every decoder:

- `BlockRow` (ar, low_confidence): a block of masked positions, denoised step by step; the
  policy picks which confident positions to commit. A finished block is committed causally in
  the next pass, fused with the first denoising step of the following block. With a sliding
  window (`LowConfidence(slide=True)`) the committed leading run leaves the block at once
  (committed causally in the next pass) and fresh masks join the end: the first masked
  position is always the one the prefix's causal output predicts.
- `SpecRow` (self_spec): lossless self-speculation. Each pass feeds [certain tokens | draft
  (causal, to verify) | B masks (bidirectional, the next draft)]. The causal outputs give the
  AR token at every draft position: the longest matching draft prefix is accepted plus the AR
  token after it, the rejected tail is rolled back from the cache, and when the whole draft was
  accepted the masked block's outputs become the next draft. Every pass yields >= 1 token and
  the output is exactly AR decoding (greedy: identical tokens; sampling: the same
  distribution, since a draft token is accepted only when it equals the AR sample).
  Drafts come from the masked block (`draft="mask"`, needs a block-diffusion model or a draft
  adapter), from the context (`"lookup"`: the tokens that followed the last earlier occurrence
  of the current 3- or 2-token suffix in prompt + answer; any AR model, no masks in the pass)
  or from both (`"mask+lookup"`: a context match when there is one, else the block's draft).

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
from clover.decoding.drafting import graft
from clover.decoding.policies import Policy
from clover.decoding.sampling import SamplingParams, draw_drafts, filtered_probs, sample
from clover.decoding.sources import DraftSources
from clover.decoding.store import NgramIndex

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

    def plan(self, mask_id: int) -> tuple[list[int], int]:
        """-> (input tokens for the next pass, how many of them are committed causally)."""
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

    def plan(self, mask_id: int) -> tuple[list[int], int]:
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


class SpecRow(Row):
    """self_spec: draft a block, verify it causally next pass, keep what AR would write.

    With `policy.refine_steps` = r, a fresh draft first goes through r refinement passes:
    the draft is fed as a bidirectional block behind the last certain token, whose causal
    output gives the next AR token (so a refinement pass still yields one exact token) while
    the block outputs re-predict the rest of the draft with the whole draft in view.
    Context-lookup drafts (`policy.draft` with "lookup") are never refined.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.draft: list[int] = []
        self.draft_q: torch.Tensor | None = None  # [len(draft), V] what drafts were drawn from
        # a tree of drafts (`policy.tree`): each draft's parent among the drafts (-1: it
        # follows the last certain token); None: the drafts are a chain
        self.parents: list[int] | None = None
        # after a tree pass: the pass indices of the drafts kept (the loop moves their cache
        # entries and features into place)
        self.kept_branch: list[int] | None = None
        self.refine_left = 0
        self._from_context = False  # the planned pass's draft came from a context lookup
        self.sources = DraftSources(self.policy, self.pending)

    @property
    def uses_drafter(self) -> bool:
        return self.sources.uses_drafter

    @property
    def context(self) -> NgramIndex | None:
        return self.sources.context

    @property
    def refining(self) -> bool:
        return bool(self.draft) and self.refine_left > 0

    def plan(self, mask_id: int) -> tuple[list[int], int]:
        if self.refining:  # [certain | draft as a block]
            return self.pending + self.draft, len(self.pending)
        self._from_context = False
        found = self._lookup()
        if found and self.parents is not None and self.draft:
            # a tree of drafts takes the context match as one more branch (the drafter drew
            # the tree knowing a match would come: `drafter_length`)
            self.draft, self.parents = graft(self.draft, self.parents, found)
        elif found:  # a context match beats the block's or the drafter's guess
            self.draft, self.draft_q, self._from_context = found, None, True
            self.parents = None
        return self._verify_plan(mask_id)

    @property
    def grows_tree(self) -> bool:
        """Whether the drafter drafts this row trees (greedy, unconstrained rows of a tree
        policy; the others draft chains)."""
        return bool(self.policy.tree) and self.sampling.greedy and self.constraint is None

    def tree(self) -> list[int] | None:
        """The planned pass's parents (`layout.tree_parts`) when its drafts are a tree: the
        certain tokens a chain, each draft on its parent (-1: on the last certain token)."""
        if self.parents is None or self.refining:
            return None
        P = len(self.pending)
        return list(range(-1, P - 1)) + [P - 1 if p < 0 else P + p for p in self.parents]

    def _lookup(self) -> list[int]:
        """The context-lookup draft for the next pass ([] without lookup or a paying match).
        [] on a row's first pass: that pass then has `ar`'s width (the prompt), so its rows
        round as `ar`'s do. Drafts appended to the prompt would make a pass of another width,
        whose rows a matmul may sum in another order, and an int4 answer could then part from
        `ar`'s; with integer dots every later pass of up to 4 tokens (16 on AVX2) rounds as
        `ar`'s does (docs/kernels.md)."""
        if not self.sources.looks_up or not self.answer:
            return []
        return self.sources.lookup(self.max_new - len(self.answer) - 1, self.grows_tree)

    def drafter_length(self) -> int:
        """How many tokens the drafter should draft for the next pass (0: none, also when the
        next plan will take a context match instead: that drafter pass would be thrown away)."""
        room = self.max_new - len(self.answer) - 1
        if (
            not self.sources.uses_drafter
            or self.draft
            or room <= 0
            or first_eos(self.answer, self.eos) is not None
            # the next plan takes a context match over any drafter chain (a tree keeps both)
            or (self._lookup() and not self.grows_tree)
        ):
            return 0
        return self.sources.drafter_length(room)

    def take_drafts(
        self,
        logits: torch.Tensor,
        sampling: SamplingParams,
        drawn: tuple[list[int], torch.Tensor | None] | None = None,
        parents: list[int] | None = None,
    ) -> None:
        """The drafter's logits [k, V] for the next k positions -> this row's next draft
        (`drawn`: the draft and its q already drawn from them, by a chain drafter; with
        `parents`, a tree of drafts, `drawn`'s tokens its nodes)."""
        self.draft, self.draft_q = (
            drawn if drawn is not None else draw_drafts(logits, sampling, self.gen)
        )
        self.parents = parents

    def _verify_plan(self, mask_id: int) -> tuple[list[int], int]:
        """[certain | draft to verify | masked block (draft="mask*" only)]."""
        masks = [mask_id] * self.policy.block_size if self.sources.masks else []
        return self.pending + self.draft + masks, len(self.pending) + len(self.draft)

    def optional_tokens(self) -> int:
        """A context-lookup draft (remade every pass, so dropping part of it loses nothing but
        speed; a masked block, if any, moves up behind what is kept)."""
        return len(self.draft) if self._from_context else 0

    def shorten(self, n: int, mask_id: int) -> tuple[list[int], int]:
        """Keep only the first n tokens of the planned lookup draft; -> the new plan."""
        self.draft = self.draft[:n]
        self.draft_q = None if self.draft_q is None else self.draft_q[:n]
        self._from_context = bool(self.draft)
        return self._verify_plan(mask_id)

    def wanted(self, hidden: torch.Tensor | None, n_commit: int) -> list[torch.Tensor]:
        # pending is never empty (the prompt, then the last certain token), so the output at
        # its last token predicts draft[0]; the outputs at draft tokens predict the rest
        if self.refining:
            self._n_verify = 1
            return [hidden[n_commit - 1]] + list(hidden[n_commit : n_commit + len(self.draft) - 1])
        verify = hidden[len(self.pending) - 1 : n_commit]
        self._n_verify = len(verify)
        if not self.sources.masks:
            return list(verify)
        draft = hidden[n_commit : n_commit + self.policy.block_size - 1]  # next draft
        return list(verify) + list(draft)

    def update(
        self,
        logits: torch.Tensor,
        sampling: SamplingParams,
        eos: set[int],
        sampled: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple:
        """`sampled`: as `BlockRow.update`'s (greedy, unconstrained rows): the verify
        positions' AR tokens come from it."""
        self.steps += 1
        if self.refining:
            return self._refine(logits, sampling, eos)
        nv = self._n_verify
        verify, drafted = logits[:nv], logits[nv:]
        self.kept_branch = None
        ar = None  # the greedy tokens of the verify positions, drawn by the loop
        if sampled is not None and self.constraint is None:
            ar = sampled[0][:nv].tolist()
        if self.parents is not None:
            path, token = self._verify_tree(verify, sampling, ar)
            accepted = len(path)
            P = len(self.pending)
            self.kept_branch = [P + a for a in path]
            chain = [self.draft[a] for a in path]
        elif sampling.greedy or self.constraint is not None:
            accepted, token = self._verify_exact(verify, sampling, ar)
        else:
            accepted, token = self._verify_sampled(verify, sampling)
        if self.parents is None:
            chain = self.draft[:accepted]
        if self.draft:
            source = "drafter" if self.sources.uses_drafter else "mask"
            source = self.sources.last if self._from_context else source
            tally = self.result.drafts.setdefault(source, [0, 0])
            tally[0] += len(self.draft)
            tally[1] += accepted
            self.result.accepted.append(accepted)
            if (
                source in self.sources.acceptance
            ):  # a tree: as a chain as deep as its deepest branch
                deepest = len(self.draft) if self.parents is None else self._depth()
                self.sources.acceptance[source].update(deepest, accepted)
        for a in self.sources.acceptance.values():
            a.relax()
        self._from_context = False
        rollback = len(self.draft) - accepted
        new = chain + [token]
        start = self._append(new)
        room = self.max_new - len(self.answer) - 1  # the next pass always adds one AR token
        self.draft_q, self.parents = None, None
        if self.sources.masks and rollback == 0 and room > 0 and first_eos(new, eos) is None:
            self.draft, self.draft_q = draw_drafts(drafted[:room], sampling, self.gen)
            self.refine_left = self.policy.refine_steps
        else:
            self.draft = []
        return [(start + i, t) for i, t in enumerate(new)], rollback

    def _verify_exact(
        self, verify: torch.Tensor, sampling: SamplingParams, ar: list[int] | None = None
    ) -> tuple[int, int]:
        """Greedy or constrained: the AR token at each position, drafts kept while they equal
        it. -> (drafts accepted, the token after them). `ar`: the greedy tokens of these
        positions, already drawn by the caller."""
        for i in range(verify.shape[0]):  # sequential: a token is drawn only where AR draws
            tok = self._ar_token(verify, i, i, sampling, ar)
            if i < len(self.draft) and tok == self.draft[i]:
                continue
            return i, tok
        raise AssertionError("a verify pass has one position more than its draft")

    def _ar_token(self, verify: torch.Tensor, row: int, depth: int, sampling: SamplingParams,
                  ar: list[int] | None) -> int:  # fmt: skip
        """The AR token at verify row `row`, the answer's position len(answer) + depth: the
        loop's greedy draw, else the constrained or sampled one."""
        if ar is not None:
            return ar[row]
        if self.constraint is not None:
            return self.constrained(verify[row], len(self.answer) + depth, sampling)
        return int(sample(verify[row : row + 1], sampling, self.gen)[0][0])

    def _verify_tree(
        self, verify: torch.Tensor, sampling: SamplingParams, ar: list[int] | None = None
    ) -> tuple[list[int], int]:
        """`_verify_exact` over a tree: from the last certain token (verify row 0; draft i's
        output is row i + 1), the AR token at the current node, then on to the child that
        drafted it while there is one. -> (the drafts kept, in order; the token after them)."""
        children: dict[int, dict[int, int]] = {}
        for i, (p, t) in enumerate(zip(self.parents, self.draft)):
            children.setdefault(p, {}).setdefault(t, i)  # the first of equal siblings
        path, node = [], -1
        while True:
            tok = self._ar_token(verify, node + 1, len(path), sampling, ar)
            nxt = children.get(node, {}).get(tok)
            if nxt is None:
                return path, tok
            path.append(nxt)
            node = nxt

    def _depth(self) -> int:
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        return max(depth, default=0)

    def _verify_sampled(self, verify: torch.Tensor, sampling: SamplingParams) -> tuple[int, int]:
        """Speculative sampling: draft token d, drawn from q, is kept with probability
        min(1, p(d) / q(d)) under the target's p; the first one refused is replaced by a draw
        from the residual max(p - q, 0) (renormalised); after every draft, a draw from p. The
        tokens are distributed exactly as AR sampling's (tests/test_self_spec.py), and a draft
        drawn from a q close to p survives far more often than one that must equal p's sample.
        A draft without q (a context lookup, an arg-max) is a point mass: q(d) = 1."""
        probs = filtered_probs(verify.float(), sampling)  # [nv, V]
        for i, p in enumerate(probs):
            if i == len(self.draft):
                return i, int(torch.multinomial(p, 1, generator=self.gen))
            d = self.draft[i]
            q = None if self.draft_q is None else self.draft_q[i]
            qd = 1.0 if q is None else float(q[d])
            if float(torch.rand((), generator=self.gen)) * qd < float(p[d]):
                continue
            residual = p.clone()
            if q is None:
                residual[d] = 0.0
            else:
                residual = (p - q).clamp(min=0.0)
            if float(residual.sum()) <= 0:  # p <= q everywhere: only p itself is left
                residual = p
            return i, int(torch.multinomial(residual, 1, generator=self.gen))
        raise AssertionError("a verify pass has one position more than its draft")

    def _refine(self, logits: torch.Tensor, sampling: SamplingParams, eos: set[int]) -> tuple:
        if self.constraint is not None:
            token = self.constrained(logits[0], len(self.answer), sampling)
        else:
            token = int(sample(logits[:1], sampling, self.gen)[0][0])  # exact: a causal output
        start = self._append([token])
        # block outputs at draft[0..n-2] re-predict draft[1..n-1]; draft[0]'s slot is `token`
        refined = logits[1:].argmax(-1).tolist()
        room = self.max_new - len(self.answer) - 1
        self.draft = refined[:room] if token not in eos and room > 0 else []
        self.draft_q = None
        self.refine_left -= 1
        return [(start, token)], 0

    def _append(self, new: list[int]) -> int:
        start = len(self.answer)
        self.answer += new
        self.answer_steps += [self.steps] * len(new)
        self.pending = [new[-1]]
        if self.context is not None:
            self.context.extend(new)
        return start
