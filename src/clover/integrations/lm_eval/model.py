"""The `clover` model of lm-evaluation-harness: requests in, Clover decoders and scores out.

Decisions:
- Generation goes through `LLM.stream`, so the decoder, block size and threshold chosen in
  `--model_args` are exactly what `clover generate` runs; requests with the same generation
  settings are decoded `batch_size` at a time in one loop. Stop strings (`until`) are the
  engine's: the text is cut before the first one.
- Prompts are the raw context string, encoded like the engine does (BOS only when the checkpoint
  asks for it). With `--apply_chat_template` the harness renders the chat through
  `apply_chat_template` below and passes the rendered text as the context.
- Log-likelihoods come from the causal mode (see `scoring.py` for why). Context and continuation
  are encoded separately and concatenated, so every choice of a multiple-choice question is
  scored after the very same context ids.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

# lm_eval's get_model() loads its built-in backends only while the registry is empty; importing
# lm_eval.models first keeps `--model hf` & co. working next to `--model clover`.
import lm_eval.models  # noqa: F401
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from clover.decoding.policies import make_policy
from clover.engine import DEFAULT_MODEL, LLM, Completion, GenerationSettings
from clover.errors import CloverError
from clover.integrations.lm_eval.scoring import rolling_windows, score_pairs
from clover.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# gen_kwargs that the harness or tasks commonly send and Clover has no use for
IGNORED_GEN_KWARGS = {"num_beams", "repetition_penalty", "min_new_tokens", "use_cache"}


@register_model("clover")
class CloverLM(LM):
    """`lm_eval --model clover --model_args model=...,decoder=...,block_size=...,threshold=...`"""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        decoder: str | None = None,
        block_size: int | None = None,
        threshold: float = 0.95,
        dtype: str = "auto",
        max_tokens: int = 256,
        max_length: int | None = None,
        batch_size: int | str = 1,
        prefix_token_id: int | None = None,
        seed: int | None = None,
        **harness_kwargs: Any,
    ) -> None:
        super().__init__()
        # the harness always passes device / max_batch_size; Clover runs where torch runs it
        unknown = set(harness_kwargs) - {"device", "max_batch_size"}
        if unknown:
            raise CloverError(f"unknown clover model_args: {', '.join(sorted(unknown))}")
        self.llm = LLM(str(model), dtype=str(dtype))
        self.settings = self.llm.default_settings(
            GenerationSettings(
                decoder=decoder,
                block_size=_positive_int("block_size", block_size, allow_none=True),
                threshold=_number("threshold", threshold),
                max_tokens=_positive_int("max_tokens", max_tokens),
                seed=seed,
            )
        )
        s = self.settings
        if not 0.0 < s.threshold <= 1.0:
            raise CloverError(f"threshold must be in (0, 1], got {s.threshold}")
        make_policy(s.decoder, s.block_size, s.threshold)  # fail on a bad decoder before any work
        context = self.llm.model.context_length
        self.max_length = _positive_int("max_length", context if max_length is None else max_length)
        if self.max_length > context:
            raise CloverError(f"max_length {self.max_length} exceeds the model's context {context}")
        self.batch_size = _batch_size(batch_size)
        tok = self.llm.tokenizer
        if prefix_token_id is None:
            # as the harness's HF backend: BOS if the tokenizer has one, else EOS
            prefix_token_id = next(
                (i for i in (tok.bos_token_id, tok.eos_token_id) if i is not None),
                self.llm.eos_token_ids[0] if self.llm.eos_token_ids else None,
            )
        if prefix_token_id is None:
            raise CloverError("no BOS/EOS token to condition on: set prefix_token_id=...")
        self.prefix_token_id = int(prefix_token_id)
        self._warned: set[str] = set()  # gen_kwargs already reported as ignored

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> CloverLM:
        # The CLI always sends batch_size (default 1); an explicit model_args value wins.
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, Any] | None = None
    ) -> CloverLM:
        from lm_eval.utils import simple_parse_args_string  # optional (`.[lm-eval]`)

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # --- tokenization ----------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """Read by the harness only to log special tokens with the results."""
        return self.llm.tokenizer

    @property
    def eot_token_id(self) -> int | None:
        return self.llm.tokenizer.eos_token_id

    def _encode_context(self, text: str) -> list[int]:
        ids = self.llm.tokenizer.encode(text, add_special_tokens=True)
        return ids or [self.prefix_token_id]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # Word-boundary spaces belong to the continuation (" Paris", not "... is " + "Paris"),
        # as the harness expects of every backend.
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        cont = self.llm.tokenizer.encode(continuation)
        if context:
            return self._encode_context(context), cont
        if cont and cont[0] == self.prefix_token_id:
            return cont[:1], cont[1:]  # the text already starts with the prefix token
        return [self.prefix_token_id], cont

    # --- scoring -------------------------------------------------------------------------------

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*req.args) for req in requests]
        with tqdm(total=len(pairs), desc="clover loglikelihood", disable=disable_tqdm) as bar:
            results = score_pairs(
                self.llm.model, pairs, self.max_length, self.batch_size, on_batch=bar.update
            )
        for req, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        # the windows of all documents are scored together, so short documents share batches
        windows, owner = [], []
        for n, req in enumerate(requests):
            (text,) = req.args
            tokens = self.llm.tokenizer.encode(text)
            for window in rolling_windows(tokens, self.prefix_token_id, self.max_length):
                windows.append(window)
                owner.append(n)
        with tqdm(total=len(windows), desc="clover rolling windows", disable=disable_tqdm) as bar:
            scores = score_pairs(
                self.llm.model, windows, self.max_length, self.batch_size, on_batch=bar.update
            )
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, scores):
            totals[n] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generation ----------------------------------------------------------------------------

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        groups: dict[GenerationSettings, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[self._gen_settings(req.args[1])].append(i)
        out = [""] * len(requests)
        bar = tqdm(total=len(requests), desc="clover generate_until", disable=disable_tqdm)
        for settings, indices in groups.items():
            prompts = {i: self._prompt(requests[i].args[0], settings.max_tokens) for i in indices}
            # similar prompt lengths share a batch
            indices = sorted(indices, key=lambda i: -len(prompts[i]))
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start : start + self.batch_size]
                completions: list[Completion] = []
                batch_prompts = [prompts[i] for i in batch]  # cold: order-independent answers
                for _ in self.llm.stream(batch_prompts, settings, completions, cached=False):
                    pass
                for i, completion in zip(batch, completions):
                    out[i] = completion.text
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
                bar.update(len(batch))
        bar.close()
        return out

    def _prompt(self, context: str, max_tokens: int) -> list[int]:
        # keep the end of a long context: room for the generation, at least one prompt token
        keep = max(1, self.llm.model.context_length - max_tokens)
        return self._encode_context(context)[-keep:]

    def _gen_settings(self, gen_kwargs: dict) -> GenerationSettings:
        kw = dict(gen_kwargs or {})
        until = kw.pop("until", None) or ()
        stop = (until,) if isinstance(until, str) else tuple(until)
        max_tokens = _positive_int("max_gen_toks", kw.pop("max_gen_toks", self.settings.max_tokens))
        temperature = float(kw.pop("temperature", 0.0) or 0.0)
        do_sample = kw.pop("do_sample", None)
        # without a do_sample switch the temperature alone decides (0 = greedy)
        if do_sample is not None and not do_sample:
            temperature = 0.0  # the harness's greedy switch overrides any temperature
        elif do_sample and temperature == 0.0:
            temperature = 1.0  # sampling asked for without a temperature: sample as is
        top_p = float(kw.pop("top_p", 1.0) or 1.0)
        top_k = int(kw.pop("top_k", 0) or 0)
        seed = kw.pop("seed", self.settings.seed)
        for key in kw:
            if key not in IGNORED_GEN_KWARGS and key not in self._warned:
                self._warned.add(key)
                log.warning("clover ignores the generation setting %r", key)
        return GenerationSettings(
            decoder=self.settings.decoder,
            block_size=self.settings.block_size,
            threshold=self.settings.threshold,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=tuple(s for s in stop if s),
        )

    # --- chat templates (--apply_chat_template) -------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return str(self.llm.name).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        if isinstance(chat_template, str) and chat_template != "default":
            raise CloverError(
                f"chat template {chat_template!r}: clover renders the checkpoint's default "
                "template; use --apply_chat_template without a name"
            )
        return self.llm.tokenizer.chat_template

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.llm.tokenizer.apply_chat_template(
            chat_history, add_generation_prompt=add_generation_prompt
        )


def _positive_int(name: str, value: object, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CloverError(f"{name} must be a positive integer, got {value!r}")
    return value


def _number(name: str, value: object) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise CloverError(f"{name} must be a number, got {value!r}") from None


def _batch_size(value: int | str) -> int:
    # "auto" asks the harness's HF backend to probe GPU memory; on CPU a fixed batch is as good
    if isinstance(value, str) and value.startswith("auto"):
        return 8
    return _positive_int("batch_size", value)
