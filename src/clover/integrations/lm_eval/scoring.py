"""Log-likelihood of token sequences from the causal mode of a Clover model.

Decision: scores come from `mode="causal"`, the path that commits a prefix, of the same weights
that decode blocks. For a token-shifted block-diffusion model (`config.shifted`) the hidden state
at position i predicts token i + 1 exactly as in an AR model, so a sum of next-token log-probs is
a proper likelihood and matches what `--model hf` reports for the same weights. Diffusion-style
likelihood bounds (ELBOs over masking rates) are deliberately not used: they are bounds, not
likelihoods, they need many sampled forwards per request, and their numbers are not comparable
with other harness backends.

Nothing here depends on lm_eval: inputs are token ids, so the math is tested on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from clover.errors import CloverError
from clover.models.base import DiffusionLM

Pair = tuple[list[int], list[int]]  # (context ids, continuation ids)


def check_scorable(model: DiffusionLM) -> None:
    """Causal scoring reads position i's output as the prediction of token i + 1."""
    if not getattr(model.config, "shifted", False):
        raise CloverError(
            "log-likelihood needs a token-shifted model (config.shifted = true); this model "
            "predicts masked positions in place, so it has no causal next-token distribution"
        )


def score_pairs(
    model: DiffusionLM,
    pairs: Sequence[Pair],
    max_length: int,
    batch_size: int = 1,
    on_batch: Callable[[int], object] | None = None,
) -> list[tuple[float, bool]]:
    """Per pair: (sum of log p(continuation | context), whether greedy decoding picks it).

    The model reads at most `max_length` tokens: context + continuation minus the last token
    (which is only predicted), cut from the left. Pairs of similar length are batched together,
    right-padded, so a row's tokens never see the padding that follows them. `on_batch(n)` is
    called after each batch of n pairs (progress bars).
    """
    check_scorable(model)
    if max_length < 1:
        raise CloverError(f"max_length must be >= 1, got {max_length}")
    inputs: list[list[int]] = []
    for context, continuation in pairs:
        if not context:
            raise CloverError("cannot score without context: give at least a prefix token")
        if len(continuation) > max_length:
            raise CloverError(
                f"continuation of {len(continuation)} tokens does not fit the scoring window "
                f"of {max_length} tokens"
            )
        inputs.append((context + continuation)[-(max_length + 1) : -1])

    results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
    # Longest first: batches hold similar lengths (less padding), and a too-long batch fails
    # at once rather than at the end.
    order = sorted(range(len(pairs)), key=lambda i: -len(inputs[i]))
    for start in range(0, len(order), max(1, batch_size)):
        chunk = order[start : start + batch_size]
        rows = [i for i in chunk if pairs[i][1]]  # empty continuations: log 1 = 0, greedy
        if rows:
            scored = _score_batch(model, [inputs[i] for i in rows], [pairs[i][1] for i in rows])
            for i, result in zip(rows, scored):
                results[i] = result
        if on_batch is not None:
            on_batch(len(chunk))
    return results


@torch.inference_mode()
def _score_batch(
    model: DiffusionLM, inputs: list[list[int]], targets: list[list[int]]
) -> list[tuple[float, bool]]:
    lengths = [len(x) for x in inputs]
    ids = torch.zeros(len(inputs), max(lengths), dtype=torch.long)  # id 0 pads; never attended
    for row, x in enumerate(inputs):
        ids[row, : len(x)] = torch.tensor(x)
    hidden = model(ids, mode="causal", n_valid=torch.tensor(lengths))
    out = []
    for row, (n, target) in enumerate(zip(lengths, targets)):
        k = len(target)
        # output at position j predicts token j + 1: the last k outputs predict the continuation
        logprobs = torch.log_softmax(model.logits(hidden[row, n - k : n]).float(), dim=-1)
        want = torch.tensor(target)
        total = logprobs.gather(-1, want[:, None]).sum().item()
        greedy = bool((logprobs.argmax(-1) == want).all())
        out.append((total, greedy))
    return out


def rolling_windows(tokens: list[int], prefix_token: int, max_length: int) -> list[Pair]:
    """Split a document into (context, continuation) pairs that score every token once.

    The document is conditioned on `prefix_token`. Windows predict `max_length` tokens each; the
    first reads the prefix token, later ones read the tokens before their span, and the last
    (shorter) span still gets a full window of context from the left.
    """
    if max_length < 1:
        raise CloverError(f"max_length must be >= 1, got {max_length}")
    sequence = [prefix_token, *tokens]
    pairs = []
    for start in range(1, len(sequence), max_length):
        end = min(start + max_length, len(sequence))
        # targets sequence[start:end] need outputs at start-1 .. end-2: read at most max_length
        # tokens ending at end-2
        first = max(0, end - 1 - max_length)
        pairs.append((sequence[first:start], sequence[start:end]))
    return pairs
