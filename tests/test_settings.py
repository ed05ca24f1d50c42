"""The decoding and sampling settings are declared once (`clover.decoding.settings`); these
tests walk that declaration, so a setting added there is checked everywhere without a change
here: each of the four HTTP APIs honours it identically or refuses a bad value with a 400 that
names it, the OpenAPI schemas list it, and the command line offers it."""

from __future__ import annotations

import pytest

from clover.cli import _settings, build_parser
from clover.decoding.settings import GenerationSettings, kind, specs
from clover.errors import CloverError
from clover.serving import anthropic, openai_responses, schemas
from clover.serving.errors import APIError
from clover.serving.protocol import Limits, parse_chat, parse_completion

LIMITS = Limits(("m",), 2048, 50, GenerationSettings())
USER = [{"role": "user", "content": "hi"}]


def chat(body):
    return parse_chat({"messages": USER, **body}, LIMITS).settings


def completions(body):
    return parse_completion({"prompt": "hi", **body}, LIMITS).settings


def messages(body):
    body = {"max_tokens": 16, "messages": USER, **body}
    return parse_chat(anthropic.to_chat_body(body), LIMITS, anthropic.NAMES).settings


def responses(body):
    body = openai_responses.to_chat_body({"input": "hi", **body})
    return parse_chat(body, LIMITS, openai_responses.NAMES).settings


# each API's parser and how it spells the settings it renames
APIS = {
    "chat": (chat, {}),
    "completions": (completions, {}),
    "messages": (messages, anthropic.RENAMED),
    "responses": (responses, openai_responses.RENAMED),
}
HTTP = [f for f, _ in specs("http")]


def other_value(f, spec):
    """A valid value of the setting that is not its default."""
    if spec.choices:
        return spec.choices[-1]
    return {bool: not f.default, int: 3, float: 0.5, tuple: ["END"], str: "x"}[kind(f)]


def bad_value(f, spec):
    return 5 if kind(f) in (str, tuple) and not spec.choices else "nope"


def test_the_http_settings_are_the_ones_a_request_may_set():
    names = {f.name for f in HTTP}
    assert {"decoder", "block_size", "threshold", "draft", "slide", "tree", "max_tokens",
            "temperature", "top_p", "top_k", "seed", "stop"} <= names  # fmt: skip
    assert "adaptive" not in names  # a bench option (`:fixed`)


@pytest.mark.parametrize("f", HTTP, ids=lambda f: f.name)
def test_every_api_honours_every_setting_the_same(f):
    spec = f.metadata["spec"]
    value = other_value(f, spec)
    want = tuple(value) if isinstance(value, list) else value
    for api, (parse, renamed) in APIS.items():
        got = parse({renamed.get(f.name, f.name): value})
        assert getattr(got, f.name) == want, api
        assert getattr(got, f.name) != getattr(LIMITS.defaults, f.name), api
        for other in HTTP:  # and nothing else moved
            if other.name not in (f.name, "max_tokens"):
                assert getattr(got, other.name) == getattr(LIMITS.defaults, other.name), api


@pytest.mark.parametrize("f", HTTP, ids=lambda f: f.name)
def test_every_api_refuses_a_bad_value_naming_the_setting(f):
    spec = f.metadata["spec"]
    for api, (parse, renamed) in APIS.items():
        name = renamed.get(f.name, f.name)
        with pytest.raises(APIError) as e:
            parse({name: bad_value(f, spec)})
        assert e.value.status == 400, api
        assert e.value.param == name, api


def out_of_range(spec):
    """Values just outside the setting's bounds (top_k's -1 means off: -2 is out)."""
    step = 2 if isinstance(spec.low, int) else 0.5
    values = [] if spec.low is None or spec.low < -(2**62) else [spec.low - step]
    values += [spec.low] if spec.open_low else []
    return values + ([] if spec.high is None or spec.high > 2**62 else [spec.high + step])


@pytest.mark.parametrize("f", HTTP, ids=lambda f: f.name)
def test_every_api_refuses_a_value_out_of_range(f):
    spec = f.metadata["spec"]
    if not out_of_range(spec):
        pytest.skip("unbounded")
    for value in out_of_range(spec):
        for api, (parse, renamed) in APIS.items():
            name = renamed.get(f.name, f.name)
            with pytest.raises(APIError) as e:
                parse({name: value})
            assert (e.value.status, e.value.param) == (400, name), (api, value)


def test_the_schemas_list_every_setting():
    for schema, renamed in ((schemas.CHAT, {}), (schemas.COMPLETIONS, {}),
                            (schemas.MESSAGES, anthropic.RENAMED)):  # fmt: skip
        props = schema["properties"]
        assert all(renamed.get(f.name, f.name) in props for f in HTTP)
    props = schemas.RESPONSES["properties"]
    assert all(
        openai_responses.RENAMED.get(f.name, f.name) in props for f in HTTP if f.name != "stop"
    )


def test_the_command_line_offers_every_setting():
    parser = build_parser()
    a = parser.parse_args(["generate", "-p", "x", "--tree", "3", "--slide", "--stop", "END",
                           "--draft", "lookup", "--top-k", "5", "--seed", "9"])  # fmt: skip
    s = _settings(a)
    assert (s.tree, s.slide, s.stop, s.draft, s.top_k, s.seed) == (
        3,
        True,
        ("END",),
        "lookup",
        5,
        9,
    )
    assert {f.name for f, _ in specs("cli")} == {f.name for f in HTTP}
    served = _settings(
        parser.parse_args(["serve", "--decoder", "ar", "--max-tokens", "9"]), "serve"
    )
    assert (served.decoder, served.max_tokens) == ("ar", 9)
    for f, _ in specs("serve"):
        assert getattr(parser.parse_args(["serve"]), f.name) == f.default


def test_settings_refuse_values_outside_their_spec():
    for bad, message in [({"threshold": 1.5}, "threshold must be in"), ({"top_p": 0.0}, "top_p"),
                         ({"draft": "ngram"}, "draft must be one of"), ({"tree": -1}, "tree"),
                         ({"slide": 1}, "slide must be bool"), ({"stop": "END"}, "stop must be"),
                         ({"block_size": 2.5}, "block_size must be")]:  # fmt: skip
        with pytest.raises(CloverError, match=message):
            GenerationSettings(**bad)
