"""Token ids <-> text at the edges of the engine; the engine itself only ever sees ids.

We wrap the Rust `tokenizers` library directly instead of `transformers.AutoTokenizer`: it loads
in milliseconds, and a `tokenizer.json` plus `tokenizer_config.json` hold everything serving
needs (special tokens, chat template). The one job that needs transformers, turning a GGUF's
embedded vocabulary into those two files, lives in `clover.checkpoints.gguf_tokenizer`.

`clean_up_tokenization_spaces` is deliberately ignored (decode is the backend's decode): it is a
BERT-era option that chat models switch off, and honouring it would break streaming.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from clover.chat_template import render_chat_template, validate_messages
from clover.errors import CloverError

__all__ = ["StreamDecoder", "Tokenizer"]

# Markers that end an assistant turn in common chat formats (ChatML, Llama 3, Phi-3, Gemma, GPT-2
# style). A model may emit any of them instead of its configured eos, so generation stops on all.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CloverError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise CloverError(f"{path} must hold a JSON object")
    return data


def _token_content(value: object) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _load_chat_templates(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    """Named templates; "default" is the one used unless tools pick "tool_use"."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for item in raw:
            if isinstance(item, dict) and isinstance(item.get("template"), str):
                templates[str(item.get("name", "default"))] = item["template"]
    # Newer checkpoints keep templates in separate files, which take precedence (as in HF).
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    return templates


def _add_declared_tokens(backend: tokenizers.Tokenizer, declared: dict[str, Any]) -> None:
    """Add tokens from `added_tokens_decoder` that tokenizer.json lacks, at their declared ids.

    A token is only added when its declared id is the next free one; anything else would give it
    a different id than the model was trained with, so it is left out.
    """
    entries = []
    for key, value in declared.items():
        content = _token_content(value)
        if content is not None and str(key).isdigit():
            entries.append((int(key), content, bool(value.get("special", False))))
    for token_id, content, special in sorted(entries):
        if backend.token_to_id(content) is not None:
            continue
        if token_id != backend.get_vocab_size(with_added_tokens=True):
            continue
        token = tokenizers.AddedToken(content, normalized=not special, special=special)
        if special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template of its checkpoint."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: dict[str, Any] | None = None,
        chat_templates: dict[str, str] | None = None,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        config = config or {}
        self._backend = backend
        self._literal: tokenizers.Tokenizer | None = None
        declared = config.get("added_tokens_decoder")
        if isinstance(declared, dict):
            _add_declared_tokens(backend, declared)

        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        self.bos_token_id = self._optional_id(self.bos_token)
        self.eos_token_id = self._optional_id(self.eos_token)
        self.pad_token_id = self._optional_id(self.pad_token)
        self.unk_token_id = self._optional_id(self.unk_token)
        # Whether encode(add_special_tokens=True) must start with BOS even if the backend's
        # post-processor does not add it (GGUF and some Llama configs state it only here).
        self.add_bos_token = config.get("add_bos_token") is True

        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        special |= {
            i
            for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id)
            if i is not None
        }
        self.special_token_ids: frozenset[int] = frozenset(special)

        eos: list[int] = [] if self.eos_token_id is None else [self.eos_token_id]
        eos += [int(i) for i in extra_eos_ids]
        for text in END_OF_TURN_TOKENS:
            token_id = backend.token_to_id(text)
            if token_id is not None and token_id in self.special_token_ids:
                eos.append(token_id)
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos))

        self.chat_templates: dict[str, str] = dict(chat_templates or {})

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (+ optional tokenizer_config.json, chat_template.jinja and
        generation_config.json, whose eos ids also end generation) from a checkpoint folder."""
        directory = Path(path).expanduser()
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CloverError(
                f"no tokenizer.json in {directory}: a tokenizer folder needs tokenizer.json "
                "(and usually tokenizer_config.json)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception on bad JSON
            raise CloverError(f"cannot load {tokenizer_file}: {exc}") from None
        config = _read_json(directory / "tokenizer_config.json")
        generation_eos = _read_json(directory / "generation_config.json").get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        elif not isinstance(generation_eos, list):
            generation_eos = []
        return cls(
            backend,
            config,
            _load_chat_templates(directory, config),
            [i for i in generation_eos if isinstance(i, int)],
        )

    def _optional_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """The default template, or the only one when a list names none "default"."""
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if len(self.chat_templates) == 1:
            return next(iter(self.chat_templates.values()))
        return None

    def encode(
        self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = True
    ) -> list[int]:
        """Text -> ids. Special-token strings in `text` (e.g. `<|im_start|>`) map to their ids,
        unless `split_special_tokens` is False: then they are encoded as the text they spell
        (for untrusted text that must not become control tokens)."""
        if not isinstance(text, str):
            raise CloverError(f"can only encode a string, got {type(text).__name__}")
        backend = self._backend if split_special_tokens else self._literal_backend()
        ids = backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None:
            if not ids or ids[0] != bos:
                ids = [bos, *ids]
        return ids

    def _literal_backend(self) -> tokenizers.Tokenizer:
        # a copy, so the shared backend's setting never changes under another thread
        if self._literal is None:
            literal = tokenizers.Tokenizer.from_str(self._backend.to_str())
            literal.encode_special_tokens = True
            self._literal = literal
        return self._literal

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The text of every special token, longest first."""
        texts = {self._backend.id_to_token(i) for i in self.special_token_ids}
        return tuple(sorted((t for t in texts if t), key=lambda t: (-len(t), t)))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Ids -> text. Incomplete UTF-8 at the end decodes to U+FFFD (see StreamDecoder)."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def stream(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh incremental detokenizer for one generated sequence."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt string the model was trained on.

        Extra kwargs (`tools`, `documents`, `enable_thinking`, ...) reach the template as
        variables, as in transformers; `tools` also selects a "tool_use" template if present.
        Without any chat template the fallback is one `role: content` line per message plus
        `assistant:` when a generation prompt is wanted, which base models continue sensibly.
        Encode the result with `add_special_tokens=False`: the template writes BOS itself.
        """
        validate_messages(messages)
        template = self.chat_template
        if kwargs.get("tools") and "tool_use" in self.chat_templates:
            template = self.chat_templates["tool_use"]
        if template is None:
            lines = [f"{m['role']}: {m['content'] or ''}" for m in messages]
            if add_generation_prompt:
                lines.append("assistant:")
            return "\n".join(lines)

        context: dict[str, Any] = {"tools": None, "documents": None}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(self, name)
            if value is not None:
                context[name] = value
        context.update(kwargs)
        context["messages"] = messages
        context["add_generation_prompt"] = add_generation_prompt
        return render_chat_template(template, **context)


class StreamDecoder:
    """Turns generated ids into text as they arrive, emitting each character exactly once.

    Byte-level vocabularies split multi-byte characters across tokens, and decoding such a
    prefix ends in U+FFFD. So each push decodes only a small window (a few already-final
    tokens of context plus the pending ones), returns the part of the window's text beyond
    what was already returned, and holds back trailing U+FFFD until the bytes that complete
    the character arrive (or `flush`). The context tokens make decoders that treat the first
    token specially (e.g. SentencePiece dropping a leading space) agree with a full decode.
    Invariant: "".join(pushes) + flush() == tokenizer.decode(all_ids).
    """

    # Tokens of already-emitted context kept at the start of the window.
    _CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._window: list[int] = []  # context tokens + tokens not yet fully emitted
        self._emitted = 0  # characters of decode(self._window) already returned

    def _decode_window(self) -> str:
        return self._tokenizer.decode(self._window, skip_special_tokens=self._skip_special)

    def push(self, ids: Iterable[int]) -> str:
        """Add generated ids; returns the newly final text (possibly "")."""
        self._window.extend(int(i) for i in ids)
        text = self._decode_window()
        stable = text.rstrip("\ufffd")
        new = stable[self._emitted :]
        self._emitted = max(self._emitted, len(stable))
        if len(stable) == len(text):
            self._slide()
        return new

    def flush(self) -> str:
        """Return whatever is held back (an unfinished character decodes as U+FFFD)."""
        text = self._decode_window()
        new = text[self._emitted :]
        self._emitted = len(text)
        self._slide()
        return new

    def _slide(self) -> None:
        # Everything in the window is emitted: keep only the last few tokens as context so
        # the next push decodes O(new tokens), and re-measure the context's own text.
        if len(self._window) > self._CONTEXT:
            del self._window[: len(self._window) - self._CONTEXT]
            self._emitted = len(self._decode_window())
