"""What decoding a model needs beside its weights, in one object.

`LLM` owns one `Runtime` per loaded model and hands it to every decoder of that model
(`BatchDecoder`, `generate`): the drafter (self_spec draft="drafter*": a trained drafter or
a smaller model of the same tokenizer), the n-gram store of
earlier text, the draft acceptance the model's rows have seen per source, this machine's pass
costs, and the prefix cache. Nothing of it hangs on the model module; a model decoded without
one (`generate(model, ...)`) gets a fresh one for that call.
"""

from __future__ import annotations

import torch

from clover.decoding.costs import Acceptance, PassCosts
from clover.decoding.draft_model import ModelDraftRunner, runner_for
from clover.decoding.drafting import DrafterRunner
from clover.decoding.prefix_cache import PrefixCache
from clover.decoding.store import NgramStore
from clover.decoding.timing import model_costs
from clover.models.base import DiffusionLM
from clover.models.drafter import Drafter


class Runtime:
    def __init__(
        self,
        model: DiffusionLM,
        drafter: Drafter | DiffusionLM | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.model, self.drafter, self.prefix_cache = model, drafter, prefix_cache
        # made on first use (a row drafting from it, a seed): from then on finished rows feed it
        self.store: NgramStore | None = None
        self._acceptance: dict[tuple[str, int], Acceptance] = {}
        self._costs: dict[bool, PassCosts] = {}
        self._vocab_head: tuple | None = None
        self._vocab_key: tuple | None = None  # a draft model's vocabulary that head is for

    def ngram_store(self) -> NgramStore:
        """The model's n-gram store (made on first use)."""
        if self.store is None:
            self.store = NgramStore()
        return self.store

    def pass_costs(self, drafter: bool = False) -> PassCosts:
        """This machine's pass costs for the model (with its drafter's passes when `drafter`),
        measured once per machine and kept (`timing.model_costs`)."""
        if drafter not in self._costs:
            self._costs[drafter] = model_costs(self.model, self.drafter if drafter else None)
        return self._costs[drafter]

    def shared_acceptance(self, source: str, positions: int) -> Acceptance:
        """The acceptance every row of the model reports to for one draft source: learns 4x
        slower than a row's and drifts back to the prior 10x slower (a draft model's prior is
        its own: `ModelDraftRunner.PRIOR`)."""
        key = (source, positions)
        if key not in self._acceptance:
            prior = {}
            if source == "drafter" and isinstance(self.drafter, DiffusionLM):
                prior = {"prior": ModelDraftRunner.PRIOR}
            self._acceptance[key] = Acceptance(positions, rate=0.05, drift=0.002, **prior)
        return self._acceptance[key]

    def measured_costs(self) -> dict[str, PassCosts]:
        """The pass costs measured so far (nothing is timed here): "model" and "drafter" (the
        model's with its drafter's passes), as `pass_costs` returned them."""
        return {("drafter" if d else "model"): c for d, c in self._costs.items()}

    def forget_acceptance(self) -> None:
        """Every shared estimate back to its prior (benchmarks that compare settings answer by
        answer start each one alike)."""
        self._acceptance.clear()

    def relax(self) -> None:
        """One step of drift for the shared estimates: once per decode step, so they come
        back toward the prior at the same pace at batch 1 and batch 8."""
        for shared in self._acceptance.values():
            shared.relax()

    def drafter_runner(self, cached: bool = True) -> DrafterRunner:
        """A runner of the drafter over a batch's rows; the LM head's rows of the drafter's
        vocabulary are made once per runtime (they read most of the head's tiles: made per
        batch they would cost every request that time). cached: a draft model keeps its own
        prefix cache beside the model's (`PrefixCache.for_draft`), when there is one."""
        if isinstance(self.drafter, DiffusionLM):  # its vocabulary may be set after the load
            # keyed by the ids tensor itself: a new vocabulary is a new tensor, and comparing
            # its 16k ids on every batch would cost a millisecond
            key = (self.drafter.draft_vocab, self.drafter.draft_ids)
            old = self._vocab_key
            if old is None or key[0] != old[0] or key[1] is not old[1]:
                self._vocab_head, self._vocab_key = ModelDraftRunner.vocab_head(self.drafter), key
        elif self._vocab_head is None:
            if isinstance(self.drafter, Drafter) and self.drafter.vocab is not None:
                with torch.inference_mode():
                    self._vocab_head = DrafterRunner.vocab_head(self.model, self.drafter)
        prefix = self.prefix_cache if cached else None
        return runner_for(self.model, self.drafter, self._vocab_head, prefix)


def runtime_of(model: DiffusionLM | Runtime, prefix_cache: PrefixCache | None = None) -> Runtime:
    """`model`'s own runtime when it is one, else a fresh one for a bare model."""
    if isinstance(model, Runtime):
        return model
    return Runtime(model, prefix_cache=prefix_cache)
