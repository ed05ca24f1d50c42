"""The Qwen2.5-Coder registry models on the real files (slow; skipped until `clover pull`)."""

import os

import pytest
import torch

from clover.checkpoints import registry
from clover.checkpoints.loader import tokenizer_dir
from clover.checkpoints.registry import KNOWN_MODELS, resolve


def pulled(name: str):
    entry = KNOWN_MODELS[name]
    if registry._locate(entry) is None:
        pytest.skip(f"{name} is not pulled (clover pull {name})")
    return resolve(name, pull_if_missing=False, progress=False)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "18C, sunny"},
    ],
]


@pytest.mark.slow
def test_qwen_chat_template_with_tools_matches_transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from clover.tokenizer import Tokenizer

    directory = tokenizer_dir(pulled("qwen2.5-coder-0.5b"), progress=False)
    ours, hf = Tokenizer.from_dir(directory), AutoTokenizer.from_pretrained(str(directory))
    for messages in CONVERSATIONS:
        for kw in ({}, {"tools": TOOLS}):
            text = ours.apply_chat_template(messages, add_generation_prompt=True, **kw)
            want = hf.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **kw
            )
            assert text == want
            assert ours.encode(text) == hf(want, add_special_tokens=False)["input_ids"]
    assert 151645 in ours.eos_token_ids  # <|im_end|> ends a turn
    # the prompt set's tool kinds (distilled through this template) render as transformers does
    from clover.data.prompts import prompt_set

    tool_prompts = [p for p in prompt_set(600) if "tools" in p][:12]
    assert {p["kind"] for p in tool_prompts} == {"tool_call", "tool_result"}
    for p in tool_prompts:
        text = ours.apply_chat_template(p["messages"], add_generation_prompt=True,
                                        tools=p["tools"])  # fmt: skip
        assert text == hf.apply_chat_template(p["messages"], add_generation_prompt=True,
                                              tokenize=False, tools=p["tools"])  # fmt: skip
        assert "<tools>" in text and ("<tool_response>" in text) == (p["kind"] == "tool_result")


@pytest.mark.slow
def test_coder_05b_logits_match_transformers_gguf_loader():
    """Float32, the same file dequantized by each side: same argmax, close logits."""
    pytest.importorskip("accelerate")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from clover.engine import LLM

    resolved = pulled("qwen2.5-coder-0.5b")
    llm = LLM("qwen2.5-coder-0.5b", dtype="float32", progress=False)
    ids = llm.chat_prompt([{"role": "user", "content": "Write a Python function add(a, b)."}])
    with torch.no_grad():
        ours = llm.model.logits(llm.model(torch.tensor([ids])))[0]
    del llm
    path = resolved.path
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=0)


@pytest.mark.slow
def test_the_coder_s_default_drafts_from_its_shipped_drafter_and_keeps_ar_s_answers():
    """The default model at its default precision (int4) attaches the drafter Clover ships,
    and its default decoding (self_spec, block 4, drafter+lookup) gives `ar`'s tokens: verify
    passes of at most 4 tokens give each position what a one-token step does. Fixed draft
    lengths, so that the drafter drafts every pass whatever this machine's costs say."""
    from pathlib import Path

    from clover.engine import LLM

    pulled("qwen2.5-coder-0.5b")
    llm = LLM("qwen2.5-coder-0.5b", progress=False)
    # cold prefills only: a warm prompt's new tokens pass in fewer rows, which int4 rounds
    # another way (README, "Prefix cache across requests"), whatever the decoder
    llm.set_prefix_cache(0)
    assert Path(llm.drafter).name == "qwen2.5-coder-0.5b.safetensors"
    assert (llm.config.default_decoder, llm.config.block_size, llm.config.draft) == (
        "self_spec", 4, "drafter+lookup")  # fmt: skip
    asks = ["Write a Python function that reverses a string.", "What is a linked list?"]
    for ask in asks:
        messages = [{"role": "user", "content": ask}]
        spec = llm.chat(messages, max_tokens=40, adaptive=False)
        ar = llm.chat(messages, max_tokens=40, decoder="ar")
        assert spec.token_ids == ar.token_ids
        assert spec.drafts.get("drafter", [0])[0] > 0 and spec.nfe < ar.nfe


@pytest.mark.slow
def test_info_names_the_coder_s_decoding_and_shipped_drafter(capsys):
    """`clover info` shows what `load` gives the entry: its decoding (it printed the GGUF's
    `ar`) and the drafter file it attaches, whose own header `clover info FILE` reads."""
    import json
    from pathlib import Path

    from clover.cli import main

    pulled("qwen2.5-coder-0.5b")
    assert main(["info", "qwen2.5-coder-0.5b", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["default_decoder"], info["block_size"], info["draft"]) == (
        "self_spec", 4, "drafter+lookup")  # fmt: skip
    assert info["adapter"] is None and Path(info["drafter"]).is_file()
    assert main(["info", info["drafter"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target"] == "qwen2.5-coder-0.5b"
