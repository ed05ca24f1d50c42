"""The Python API: `clover.LLM(model).generate(...)` / `.chat(...)` / `.stream(...)`.

This is the edge where text meets token ids: it renders chat templates, turns the decoding
loop's events into text deltas, and applies stop strings. Loading (names, GGUF conversion,
HF directories, precision, device) is `clover.checkpoints.load`. It owns the model's prefix
cache across calls (`prefix_cache`), so a multi-turn `chat` prefills only what is new since
the last turn.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from clover.checkpoints import DEFAULT_MODEL, load
from clover.decoding.constraints import LogitsConstraint
from clover.decoding.loop import RowResult, generate
from clover.decoding.policies import Policy, SelfSpec, check_model_defaults, make_policy
from clover.decoding.prefix_cache import PrefixCache
from clover.decoding.runtime import Runtime
from clover.decoding.sampling import SamplingParams
from clover.decoding.settings import GenerationSettings
from clover.decoding.store import seed_store
from clover.errors import CloverError
from clover.models.base import DiffusionLM
from clover.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "LLM",
    "Completion",
    "GenerationSettings",
    "Request",
    "TextDelta",
    "TextStream",
]


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    nfe: int
    seconds: float
    steps: list[int] = field(default_factory=list)  # denoising step that committed each token
    drafts: dict = field(default_factory=dict)  # self_spec: source -> [drafted, kept] tokens
    accepted: list[int] = field(default_factory=list)  # self_spec: drafts kept per verify pass
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    prefill_seconds: float = 0.0  # to the pass that gave the first logits (`RowResult`)
    ttft: float = 0.0  # seconds from the call to this answer's first text (0: none came)
    settings: GenerationSettings | None = None  # what it was decoded with, defaults applied

    @property
    def output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tpf(self) -> float:
        return self.output_tokens / self.nfe if self.nfe else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens computed (not reused) per second of prefill."""
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else 0.0


@dataclass(frozen=True)
class Request:
    """One request's settings made concrete, once: the policy and sampling its rows decode
    with, the arguments each row joins a batch with, its text streams and its completions.
    `LLM.stream` and the server's scheduler both go through it."""

    settings: GenerationSettings  # the model's defaults applied
    policy: Policy
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]
    tokenizer: Tokenizer

    @classmethod
    def of(cls, llm: LLM, settings: GenerationSettings) -> Request:
        """Checks the settings against the model (a CloverError names what is wrong)."""
        s = llm.default_settings(settings)
        sampling = SamplingParams(s.temperature, s.top_k, s.top_p, s.seed)
        return cls(s, s.policy(), sampling, tuple(llm.eos_token_ids), llm.tokenizer)

    def text(self) -> TextStream:
        """A row's answer as text, cut at the request's stop strings."""
        return TextStream(self.tokenizer, self.settings.stop)

    def constraint(self) -> LogitsConstraint | None:
        """A fresh constraint for one row (constraints keep state), or None."""
        return self.settings.constraint() if self.settings.constraint is not None else None

    def completion(self, result: RowResult, text: TextStream, prompt_tokens: int,
                   seconds: float, ttft: float = 0.0) -> Completion:  # fmt: skip
        """A finished row's answer."""
        r = result
        return Completion(
            text=text.text,
            token_ids=r.tokens,
            prompt_tokens=prompt_tokens,
            finish_reason="stop" if text.stopped else r.finish_reason,
            nfe=r.nfe,
            seconds=seconds,
            steps=r.steps,
            drafts=r.drafts,
            accepted=r.accepted,
            cached_tokens=r.cached_tokens,
            prefill_seconds=r.prefill_seconds,
            ttft=ttft,
            settings=self.settings,
        )


@dataclass
class TextDelta:
    row: int
    text: str


class LLM:
    """A loaded model + tokenizer. `LLM("clover-smol-135m")`, a GGUF path or an HF directory."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        dtype: str = "auto",
        progress: bool = True,
        adapter: str | Path | None = None,
        compile: bool = False,
        device: str = "cpu",
        drafter: str | Path | None = None,
        wide: str = "int8",
        store: list[str | Path] | None = None,
        draft_wide: str = "int4",
    ) -> None:
        """wide (int4 from a GGUF): tensors the file stores wider than 4 bits (Q5_0, Q6_K,
        Q8_0) keep their 8-bit levels ("int8": exact) or are rounded to 4 bits ("int4": fewer
        bytes per pass, faster, not exact); draft_wide: the same for a draft model (its
        precision changes no answer: "int4" unless asked). drafter: a drafter file (`clover
        train drafter`) for self_spec draft="drafter", or a smaller model of the same
        tokenizer (a name, GGUF file or HF directory; "qwen2.5-coder-0.5b" for
        "qwen2.5-coder-1.5b") drafting as a whole;
        adapter: a draft adapter file (`clover train adapt` writes one) to attach; a
        registry name that ships one (clover-smol-135m) attaches its own. compile:
        `torch.compile` the passes without block tokens (`DiffusionLM.compile_causal`) and
        warm them up here at batch 1 (`warm_up`). device: cpu, cuda, cuda:N or auto
        (`resolve_device`): weights load on the CPU, then move; on a GPU, dtype auto is
        bfloat16 (int4 and int8 are CPU kernels). store: `clover data distill` sets of this
        model or text files to seed its n-gram store with (`seed_store`), which
        self_spec draft="lookup+store" drafts from."""
        t0 = time.perf_counter()
        loaded = load(model, dtype=dtype, progress=progress, adapter=adapter, device=device,
                      drafter=drafter, wide=wide, draft_wide=draft_wide)  # fmt: skip
        self.tokenizer = loaded.tokenizer
        # the model with its drafter, n-gram store, acceptance, pass costs and prefix cache
        self._runtime = Runtime(loaded.model, loaded.drafter_model)
        self.config = self.model.config
        check_model_defaults(self.config)  # a registry entry's decoding, checked before use
        if loaded.drafter_model is not None:
            # its LM-head rows now (their x bits set by the load), not in the first answer
            self._runtime.drafter_runner()
        self.name, self.dtype, self.device = loaded.name, loaded.dtype, loaded.device
        self.resolved, self.directory = loaded.resolved, loaded.directory
        self.adapter, self.drafter = loaded.adapter, loaded.drafter
        # a draft model's wider tensors: kept ("int8") or rounded ("int4"); None without one
        d = loaded.drafter_model
        self.draft_wide = d.draft_wide if isinstance(d, DiffusionLM) else None
        self.compiled = compile
        if store:
            self.seed_store(store)
        if compile:
            self.model.compile_causal()
            self.warm_up(rows=1)
        self.load_seconds = time.perf_counter() - t0

    def seed_store(self, paths: list[str | Path]) -> int:
        """Add `clover data distill` sets of this model (directories) and text files to the
        model's n-gram store (decoding/store.py); -> the n-grams it now holds."""
        return len(seed_store(self.runtime.ngram_store(), paths, self.name, self.tokenizer))

    def warm_up(self, rows: int = 1) -> None:
        """With `compile`: run the decoding loop as a first request of `rows` rows would, so
        the graphs it needs are made before it comes: `ar` on a chat prompt (prefill, AR
        steps), then `self_spec` with lookup drafts on a prompt that repeats itself, so that
        context matches are drafted and verified (a multi-token pass over a cache, the graph
        that a first answer with a match would otherwise wait for). Batch 1 and batch >= 2
        are separate graphs; a server decoding several rows warms both."""
        chat = self.chat_prompt([{"role": "user", "content": "Say hello, hello, hello."}])
        counting = self.encode("1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5,")
        for prompt, policy in (
            (chat, make_policy("ar")),
            # fixed-length drafts: adaptive ones follow this machine's measured pass costs and,
            # timed on a busy machine, may draft nothing (then the verify graph is not made)
            (counting, SelfSpec(4, draft="lookup", adaptive=False)),
        ):
            prompts = [prompt[: len(prompt) - i] for i in range(rows)]
            for _ in generate(self.model, prompts, policy, max_new_tokens=12):
                pass

    # --- prefix cache across calls ------------------------------------------------------------

    _prefix_cache_set = False

    @property
    def model(self) -> DiffusionLM:
        return self._runtime.model

    @model.setter
    def model(self, model: DiffusionLM) -> None:
        """Decode with another model (a test's stand-in): a fresh runtime, the same drafter
        and prefix cache."""
        old = self._runtime
        self._runtime = Runtime(model, old.drafter, old.prefix_cache)

    @property
    def runtime(self) -> Runtime:
        """What decoding this model needs beside its weights (`decoding/runtime.py`), its
        prefix cache made by now; every decoder of this model shares it."""
        if not self._prefix_cache_set:
            self.set_prefix_cache(None)
        return self._runtime

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """Committed prefixes kept across calls; made on first use at this model's default
        size (`PrefixCache.for_model`); None when turned off (`set_prefix_cache(0)`)."""
        return self.runtime.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, cache: PrefixCache | None) -> None:
        """Use this cache (None: none), e.g. to put back one set aside."""
        self._runtime.prefix_cache, self._prefix_cache_set = cache, True

    def set_prefix_cache(self, mb: float | None) -> None:
        """A new prefix cache of `mb` MiB (None: the model's default, 0: none); what the old
        one held is dropped."""
        cache = None if mb == 0 else PrefixCache.for_model(self.model, mb)
        self._runtime.prefix_cache, self._prefix_cache_set = cache, True

    def chat_marks(
        self, messages: list[dict], prompt: list[int], **template_kwargs: object
    ) -> tuple[int, ...]:
        """Prompt positions worth a prefix-cache snapshot: where the conversation before its
        last user turn ends, when its rendering is a token prefix of `prompt` (a template may
        render earlier turns differently once more follow). Only models with recurrent
        layers need them (K/V can resume at any block), so others get () at no cost."""
        cache = self.prefix_cache
        if cache is None or not cache.recurrent:
            return ()
        last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=0)
        if last == 0:
            return ()
        try:
            text = self.tokenizer.apply_chat_template(
                messages[:last], add_generation_prompt=False, **template_kwargs
            )
        except CloverError:  # e.g. a template that insists on ending with a user turn
            return ()
        ids = self.tokenizer.encode(text)
        return (len(ids),) if 0 < len(ids) < len(prompt) and prompt[: len(ids)] == ids else ()

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(set(self.config.eos_token_ids) | set(self.tokenizer.eos_token_ids))

    def default_settings(self, settings: GenerationSettings) -> GenerationSettings:
        return replace(
            settings,
            decoder=settings.decoder or self.config.default_decoder,
            block_size=settings.block_size or self.config.block_size,
            draft=settings.draft or self.config.draft,
        )

    # --- prompts -------------------------------------------------------------------------------

    def chat_prompt(self, messages: list[dict], **template_kwargs: object) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **template_kwargs
        )
        return self.tokenizer.encode(text)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise CloverError("empty prompt")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    # --- generation ----------------------------------------------------------------------------

    def stream(
        self,
        prompts: list[list[int]],
        settings: GenerationSettings,
        completions: list | None = None,
        marks: list[tuple[int, ...]] | None = None,
        cached: bool = True,
    ) -> Iterator[TextDelta]:
        """Text deltas per row as tokens become final; `completions` is filled at the end.
        `marks[row]`: prefix-cache snapshot positions of that prompt (`chat_marks`).
        cached=False: no prefix cache for this call (every prompt prefilled in full, nothing
        kept), for measurements that must not depend on what ran before: a warm prefill
        multiplies fewer rows, and 16-bit/int4 kernels round by shape, so a near-tie can
        flip (float32 answers are identical either way)."""
        request = Request.of(self, settings)
        texts = [request.text() for _ in prompts]
        results: list[RowResult] = []
        t0 = time.perf_counter()
        loop = generate(
            self.runtime,
            prompts,
            request.policy,
            max_new_tokens=request.settings.max_tokens,
            sampling=request.sampling,
            eos_token_ids=request.eos_token_ids,
            stop=lambda row, final: texts[row].on_final(final),
            results=results,
            constraint=lambda _row: request.constraint(),
            cached=cached,
            marks=marks,
        )
        first = [0.0] * len(prompts)
        try:
            for event in loop:
                for row, reason in event.finished.items():
                    texts[row].finish(cut=reason == "length")
                for row, ts in enumerate(texts):
                    text = ts.take()
                    if text:
                        first[row] = first[row] or time.perf_counter() - t0
                        yield TextDelta(row, text)
        finally:
            loop.close()  # stopped early: the rows leave the prefix cache's pins now
        seconds = time.perf_counter() - t0
        if completions is not None:
            completions[:] = [
                request.completion(r, texts[i], len(prompts[i]), seconds, first[i])
                for i, r in enumerate(results)
            ]

    def generate(
        self, prompts: str | list[str], settings: GenerationSettings | None = None, **kw: object
    ) -> list[Completion]:
        """Raw-text prompts (no chat template) -> one Completion each."""
        single = isinstance(prompts, str)
        items = [prompts] if single else list(prompts)
        if not items:
            raise CloverError("no prompts given")
        settings = _settings(settings, kw)
        out: list[Completion] = []
        for _ in self.stream([self.encode(p) for p in items], settings, out):
            pass
        return out

    def chat(
        self,
        messages: list[dict],
        settings: GenerationSettings | None = None,
        **kw: object,
    ) -> Completion:
        settings = _settings(settings, kw)
        prompt = self.chat_prompt(messages)
        out: list[Completion] = []
        for _ in self.stream([prompt], settings, out, [self.chat_marks(messages, prompt)]):
            pass
        return out[0]


class TextStream:
    """One answer's token ids -> final text: streaming detokenization and stop strings.

    `on_final(tokens)` takes the answer's final tokens so far (the loop's stop check) and
    returns True once a stop string appeared; `finish()` flushes at the end; `take()` returns
    text that is now safe to show (never text that later changes or passes a stop string).
    """

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self.decoder = tokenizer.stream(skip_special_tokens=True)
        self.stops = stops
        self.seen = 0  # final tokens already decoded
        self.held = ""  # decoded text held back while it may start a stop string
        self.outbox = ""  # text ready to emit
        self.text = ""  # text emitted so far
        self.stopped = False

    def on_final(self, final: list[int]) -> bool:
        self.held += self.decoder.push(final[self.seen :])
        self.seen = len(final)
        emit, self.held, self.stopped = _split_stop(self.held, self.stops, final=False)
        self.outbox += emit
        return self.stopped

    def finish(self, cut: bool = False) -> None:
        """The answer ended; `cut`: by its token budget, possibly inside a multi-byte
        character, whose incomplete bytes (decoded as U+FFFD) are then dropped."""
        if not self.stopped:
            rest = self.decoder.flush()
            tail = self.held + (rest.rstrip("\ufffd") if cut else rest)
            self.outbox += _split_stop(tail, self.stops, final=True)[0]
            self.held = ""

    def take(self) -> str:
        out, self.outbox = self.outbox, ""
        self.text += out
        return out


def _settings(settings: GenerationSettings | None, kw: dict) -> GenerationSettings:
    if isinstance(kw.get("stop"), str):
        kw["stop"] = (kw["stop"],)
    elif kw.get("stop") is not None:
        kw["stop"] = tuple(kw["stop"])
    try:
        return replace(settings or GenerationSettings(), **kw)
    except TypeError as e:
        raise CloverError(f"unknown generation setting: {e}") from None


def _split_stop(text: str, stops: tuple[str, ...], final: bool) -> tuple[str, str, bool]:
    """-> (text safe to emit, text to hold back, whether a stop string was found)."""
    if not stops:
        return text, "", False
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return text[: min(hits)], "", True
    if final:
        return text, "", False
    # hold back a tail that could be the start of a stop string
    keep = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                keep = max(keep, n)
                break
    return text[: len(text) - keep], text[len(text) - keep :], False
