"""The server's pure parts, without a socket: reasoning splitter, validation, key check,
metrics text."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from clover.decoding.sampling import SamplingParams, filtered_probs
from clover.engine import GenerationSettings
from clover.errors import CloverError
from clover.serving.errors import APIError
from clover.serving.metrics import Metrics
from clover.serving.protocol import Limits, fit, parse_chat, parse_completion, parse_json
from clover.serving.reasoning import ReasoningSplitter, prompt_opens_reasoning, split_reasoning
from clover.serving.security import digest, key_matches

CASES = [  # (answer, prompt opened <think>, reasoning, content)
    ("plain answer", False, "", "plain answer"),
    ("  spaced <b>bold</b>", False, "", "  spaced <b>bold</b>"),
    ("<thinking is a word", False, "", "<thinking is a word"),
    ("<think>\nhmm, 2+2</think>\n\nIt is 4.", False, "hmm, 2+2", "It is 4."),
    ("\n<think>a < b</think>b", False, "a < b", "b"),
    ("hmm, 2+2\n</think>\n\nIt is 4.", True, "hmm, 2+2", "It is 4."),
    ("still thinking </thi", True, "still thinking </thi", ""),
    ("\n\n", True, "", ""),
    ("<thi", False, "", "<thi"),
    ("x</think>", True, "x", ""),
]


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
def test_split_reasoning(text, opened, reasoning, content):
    assert split_reasoning(text, opened) == (reasoning, content)


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
def test_streamed_split_matches_whole_for_any_chunking(text, opened, reasoning, content):
    rng = random.Random(0)
    for trial in range(60):
        cuts = sorted(rng.sample(range(1, len(text)), min(trial % 6, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        splitter = ReasoningSplitter(opened)
        out = [splitter.push(p) for p in pieces] + [splitter.finish()]
        assert "".join(r for r, _ in out) == reasoning
        assert "".join(c for _, c in out) == content
        if "<think>" in text or opened:  # tag text never shows up as content
            assert all("</" not in c for _, c in out)


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


LIMITS = Limits(("m",), 100, 50, GenerationSettings(decoder="low_confidence", block_size=32))


def test_chat_defaults_and_overrides():
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, LIMITS)
    assert (req.n, req.stream, req.max_tokens, req.settings.decoder) == (
        1,
        False,
        None,
        "low_confidence",
    )
    assert fit(req, 90, LIMITS).max_tokens == 10  # the default, cut to what the context leaves
    parts = [{"type": "text", "text": "a"}]
    body = {
        "model": "m", "messages": [{"role": "developer", "content": parts}],
        "max_completion_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": -1, "seed": 2**40,
        "stop": "x", "block_size": 4, "threshold": 1, "decoder": "ar", "stream": True,
        "draft": "lookup",
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": True},
    }  # fmt: skip
    req = parse_chat(body, LIMITS)
    assert req.messages == [{"role": "system", "content": "a"}]
    s = req.settings
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stop) == (5, 0.5, 0.9, 0, ("x",))
    assert (s.block_size, s.threshold, s.decoder, req.include_usage) == (4, 1.0, "ar", True)
    assert s.draft == "lookup" and not s.slide
    hi = [{"role": "user", "content": "hi"}]
    assert parse_chat({"messages": hi, "slide": True}, LIMITS).settings.slide
    with pytest.raises(APIError, match="slide"):
        parse_chat({"messages": hi, "slide": "yes"}, LIMITS)
    assert s.tree == 0 and parse_chat({"messages": hi, "tree": 63}, LIMITS).settings.tree == 63
    with pytest.raises(APIError, match="tree"):
        parse_chat({"messages": hi, "tree": -1}, LIMITS)
    with pytest.raises(APIError, match="draft must be one of"):
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "draft": "ngram"}, LIMITS)
    assert 0 <= s.seed < 2**31 and req.template_kwargs == {"enable_thinking": True}


def test_completion_prompts():
    assert parse_completion({"prompt": [1, 2, 3]}, LIMITS).prompts == [[1, 2, 3]]
    assert parse_completion({"prompt": ["a", "b"], "n": 2}, LIMITS).prompts == ["a", "b"]
    for bad in ([], [[]], [1, "a"], [50], {"a": 1}, 3):
        with pytest.raises(APIError):
            parse_completion({"prompt": bad}, LIMITS)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 17}, "n"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logprobs": True}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content"),
        ({"max_tokens": 101}, "max_tokens"),
    ],
)  # fmt: skip
def test_invalid_fields_name_their_param(body, param):
    with pytest.raises(APIError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, LIMITS)
    assert e.value.status == 400 and e.value.param == param


def test_context_is_checked_against_prompt_and_max_tokens():
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}, LIMITS)
    assert fit(req, 80, LIMITS).max_tokens == 20
    for prompt_len in (81, 100):
        with pytest.raises(APIError) as e:
            fit(req, prompt_len, LIMITS)
        assert e.value.code == "context_length_exceeded"


def test_parse_json_refuses_non_objects():
    assert parse_json(b'{"a": 1}') == {"a": 1}
    for raw in (b"", b"[]", b'"x"', b"{", b'{"a": Infinity}', b"\xff"):
        with pytest.raises(APIError):
            parse_json(raw)


def test_a_tiny_temperature_samples_the_arg_max():
    """Fuzzing found it: a temperature that is 0 in float32 (1e-179) made NaN probabilities,
    and the failed step failed every answer in the batch."""
    logits = torch.tensor([[0.5, 2.0, -1.0], [3.0, 3.0, 0.0]])
    probs = filtered_probs(logits, SamplingParams(temperature=1e-179))
    assert torch.isfinite(probs).all() and probs[0].argmax() == 1
    assert torch.allclose(probs.sum(-1), torch.ones(2))


def test_key_matches():
    expected = digest("Secret-Key")
    assert key_matches("Bearer Secret-Key", expected)
    assert key_matches("bearer Secret-Key", expected)  # the scheme is case-insensitive
    for header in (None, "", "Bearer", "Bearer secret-key", "Secret-Key", "Basic Secret-Key"):
        assert not key_matches(header, expected)


def test_metrics_text():
    m = Metrics()
    m.request("/v1/completions", 200)
    m.first_token(0.2)
    m.finished(10, 30, 12, 1.5)
    m.finished(5, 20, 9, 0.5, [{"drafter": [12, 5], "lookup": [6, 4]}])
    m.finished(5, 20, 9, 0.5, [{"drafter": [3, 1]}])
    text = m.render(None, loaded=False)
    assert 'clover_draft_tokens_total{source="drafter",outcome="drafted"} 15' in text
    assert 'clover_draft_tokens_total{source="drafter",outcome="kept"} 6' in text
    assert 'clover_draft_tokens_total{source="lookup",outcome="kept"} 4' in text
    assert 'clover_requests_total{route="/v1/completions",code="200"} 1' in text
    assert "clover_generation_tokens_total 70" in text
    assert 'clover_request_latency_seconds_bucket{le="2.5"} 3' in text
    assert 'clover_tokens_per_forward_bucket{le="3"} 3' in text
    assert "clover_model_loaded 0" in text and "clover_queue_depth 0" in text


def test_nothing_from_a_request_is_unpickled():
    import clover.serving

    for source in Path(clover.serving.__file__).parent.glob("*.py"):
        code = source.read_text()
        unsafe = r"^\s*(import|from)\s+(pickle|dill|joblib)\b|pickle\.loads?\(|torch\.load\("
        assert not re.search(unsafe, code, re.M), source.name


def test_serve_options_check_the_draft_source():
    from clover.serving.options import ServeOptions

    def options(**defaults):
        return ServeOptions(model="smollm2-135m", defaults=GenerationSettings(**defaults))

    options(decoder="self_spec", draft="lookup").check()
    with pytest.raises(CloverError, match="draft must be one of"):
        options(draft="ngram")
    options(decoder="low_confidence", slide=True).check()
    with pytest.raises(CloverError, match="--slide is a low_confidence option"):
        options(slide=True).check()
    with pytest.raises(CloverError, match="needs --drafter FILE"):
        options(decoder="self_spec", draft="drafter+lookup").check()
    # the default model ships its drafter (clover/drafters/)
    coder = GenerationSettings(decoder="self_spec", draft="drafter")
    ServeOptions(model="qwen2.5-coder-0.5b", defaults=coder).check()
    with pytest.raises(CloverError, match="needs --drafter FILE"):  # its own one left out
        ServeOptions(model="qwen2.5-coder-0.5b", defaults=coder, drafter="none").check()
    ServeOptions(defaults=coder, drafter="d.safetensors").check()
    tree = GenerationSettings(decoder="self_spec", draft="drafter", tree=63)
    ServeOptions(defaults=tree, drafter="d.safetensors").check()
    with pytest.raises(CloverError, match="--tree grows trees from a drafter"):
        options(decoder="self_spec", draft="lookup", tree=63).check()
    with pytest.raises(CloverError, match="--gguf-wide must be int8 or int4"):
        ServeOptions(wide="int2").check()


def test_serve_loads_the_drafter_and_gguf_precision_it_was_given(monkeypatch):
    """`clover serve --drafter F --gguf-wide int4` reaches the model load (it was accepted on
    the command line and dropped before)."""
    import clover.serving.runtime as runtime
    from clover.cli import build_parser
    from clover.serving.options import ServeOptions

    seen = {}
    monkeypatch.setattr(runtime, "LLM", lambda model, **kw: seen.update(kw, model=model))
    a = build_parser().parse_args(["serve", "-m", "m.gguf", "--drafter", "d.safetensors",
                                   "--gguf-wide", "int4"])  # fmt: skip
    assert (a.drafter, a.gguf_wide) == ("d.safetensors", "int4")
    runtime.Runtime(ServeOptions(model="m.gguf", drafter=a.drafter, wide=a.gguf_wide)).loader()
    assert seen["drafter"] == "d.safetensors" and seen["wide"] == "int4"


def test_a_finished_call_reports_its_answers_draft_tokens_to_the_metrics():
    """Each answer's self_spec drafts (source -> [drafted, kept]) reach /metrics summed."""
    from clover.engine import Completion
    from clover.serving.responses import Call

    class Runtime:
        metrics = Metrics()

    answers = [Completion("a", [1, 2], 3, "stop", 2, seconds=1.0, drafts={"drafter": [4, 2]}),
               Completion("b", [3], 3, "stop", 1, seconds=1.0,
                          drafts={"drafter": [1, 1], "lookup": [2, 0]})]  # fmt: skip
    Call(Runtime(), True, "id", "m", None, None, [], 3).record(answers)
    assert dict(Runtime.metrics.drafts) == {"drafter": [5, 3], "lookup": [2, 0]}
    assert Runtime.metrics.completion_tokens == 3 and Runtime.metrics.nfe == 3
