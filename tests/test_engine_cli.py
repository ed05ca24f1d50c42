import json

import pytest

from clover import LLM
from clover.cli import main
from clover.engine import GenerationSettings, _split_stop
from clover.errors import CloverError


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), progress=False)


def test_generate_and_chat(llm):
    (c,) = llm.generate("hello world", max_tokens=12, decoder="ar")
    assert c.output_tokens <= 12 and c.nfe >= 1
    assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    chat = llm.chat([{"role": "user", "content": "hello"}], max_tokens=8, decoder="low_confidence")
    assert chat.output_tokens <= 8
    two = llm.generate(["hello", "the quick brown fox"], max_tokens=6, decoder="ar")
    assert [t.token_ids for t in two] == [
        llm.generate(p, max_tokens=6, decoder="ar")[0].token_ids
        for p in ["hello", "the quick brown fox"]
    ]


def test_streamed_text_equals_final_text(llm):
    out = []
    prompt = llm.encode("the lazy dog")
    settings = GenerationSettings(decoder="low_confidence", block_size=4, threshold=0.5)
    deltas = [d.text for d in llm.stream([prompt], settings, out)]
    assert "".join(deltas) == out[0].text


def test_stop_strings(llm):
    (full,) = llm.generate("hello", max_tokens=16, decoder="ar")
    if len(full.text) < 4:
        pytest.skip("random model answered too little to cut")
    stop = full.text[2:4]
    (cut,) = llm.generate("hello", max_tokens=16, decoder="ar", stop=[stop])
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.finish_reason == "stop"


def test_split_stop_holds_back_possible_prefixes():
    assert _split_stop("abc<", ("<stop>",), final=False) == ("abc", "<", False)
    assert _split_stop("abc<st", ("<stop>",), final=True) == ("abc<st", "", False)
    assert _split_stop("ab<stop>cd", ("<stop>",), final=False) == ("ab", "", True)


def test_bad_input(llm):
    with pytest.raises(CloverError, match="empty prompt"):
        llm.generate("")
    with pytest.raises(CloverError, match="context"):
        llm.generate("hello " * 300, max_tokens=100)
    (capped,) = llm.generate("hello " * 100, max_tokens=1000, decoder="ar")
    assert capped.prompt_tokens + capped.output_tokens <= 256
    with pytest.raises(CloverError, match="unknown generation setting"):
        llm.generate("hello", beams=3)
    with pytest.raises(CloverError, match="dtype"):
        LLM("whatever", dtype="int3")


def test_cli_generate_json(tiny_checkpoint, capsys):
    rc = main(
        [
            "generate",
            "-m",
            str(tiny_checkpoint),
            "-p",
            "hello",
            "--json",
            "--max-tokens",
            "5",
            "--dtype",
            "float32",
            "--decoder",
            "low_confidence",
            "--block-size",
            "4",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("text", "output_tokens", "nfe", "tpf", "tokens_per_s", "peak_rss_mb"):
        assert key in out
    assert out["decoder"] == "low_confidence" and out["block_size"] == 4


def test_cli_generate_self_spec_lookup_is_ar(tiny_checkpoint, capsys):
    args = ["generate", "-m", str(tiny_checkpoint), "-p", "a b a b a b a b", "--json",
            "--max-tokens", "12", "--dtype", "float32"]  # fmt: skip
    assert main(args + ["--decoder", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert main(args + ["--decoder", "self_spec", "--block-size", "4", "--draft", "lookup"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["text"] == ar["text"] and spec["draft"] == "lookup" and "drafts" not in ar
    assert set(spec["drafts"]) <= {"lookup"}  # source -> drafted and kept tokens
    assert all(0 <= d["kept"] <= d["drafted"] for d in spec["drafts"].values())
    # a sliding window that is never confident beyond its first position: the AR answer
    slide = ["--decoder", "low_confidence", "--block-size", "4", "--threshold", "1", "--slide"]
    assert main(args + slide) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == ar["text"] and out["slide"] is True
    assert main(args + ["--decoder", "self_spec", "--slide"]) == 1
    assert "slide is a low_confidence option" in capsys.readouterr().err


def test_cli_info_json(tiny_checkpoint, capsys):
    assert main(["info", str(tiny_checkpoint), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "llama"
    assert info["total_params"] == info["active_params"] > 0
    assert info["bf16_bytes"] == 2 * info["total_params"]
    from clover import kernels

    on = kernels.load() is not None  # the kernels' state, in one line: on, or off and why
    assert info["kernels"].startswith("on (" if on else "off: ")


def test_cli_says_in_one_line_that_the_kernels_are_off_and_why(tiny_checkpoint, capsys,
                                                               monkeypatch):  # fmt: skip
    from clover import kernels

    monkeypatch.setattr(kernels, "_state", {"module": None, "why": "no C++ compiler found"})
    assert main(["generate", "-m", str(tiny_checkpoint), "-p", "hi", "--max-tokens", "2",
                 "-v"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "[kernels off: no C++ compiler found (PyTorch's kernels instead, about 2.5x" in err
    assert main(["kernels"]) == 1
    assert "kernels off: no C++ compiler found" in capsys.readouterr().out


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["generate", "-m", str(tmp_path / "none"), "-p", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert main(["info", "no-such-model"]) == 1
    assert "smollm2-135m" in capsys.readouterr().err


def test_cli_chat_clear_and_interrupt(tiny_checkpoint, capsys, monkeypatch):
    from clover import cli

    lines = iter(["hello", "/clear", KeyboardInterrupt, "again", "/exit"])

    def read(prompt):
        item = next(lines)
        if item is KeyboardInterrupt:
            raise KeyboardInterrupt
        return item

    args = cli.build_parser().parse_args(
        ["chat", "-m", str(tiny_checkpoint), "--max-tokens", "4", "--dtype", "float32"]
    )
    assert cli.cmd_chat(args, read=read) == 0
    assert "(history cleared)" in capsys.readouterr().out


def test_compile_and_device_flags_reach_the_model(monkeypatch, capsys):
    """`--compile` (generate, chat, serve) asks LLM for the compiled causal passes (the
    compiled path itself is checked against eager in test_adapter); `--device` picks where
    the model runs (cpu unless asked)."""
    from clover.cli import build_parser, main

    seen = {}

    class Refuse:
        def __init__(self, *args, **kw):
            seen.update(kw)
            raise CloverError("not loading in this test")

    monkeypatch.setattr("clover.cli.LLM", Refuse)
    assert main(["generate", "--prompt", "hi", "--compile"]) == 1
    assert seen["compile"] is True
    assert "not loading" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi"]) == 1 and seen["compile"] is False
    assert seen["device"] == "cpu"
    assert main(["chat", "--device", "auto"]) == 1
    assert seen["device"] == "auto"
    assert build_parser().parse_args(["chat", "--compile"]).compile
    assert build_parser().parse_args(["serve", "--compile"]).compile
    assert build_parser().parse_args(["serve", "--device", "cuda:1"]).device == "cuda:1"


def test_device_rules(monkeypatch):
    """Where a model may run and at what precision: bad names and absent GPUs are clear
    errors before anything loads; off the CPU, auto means bfloat16 and the CPU-only int4 /
    int8 kernels are refused (the server checks this before it opens its socket)."""
    import torch

    from clover.checkpoints import device_dtype, resolve_device
    from clover.serving.options import ServeOptions

    with pytest.raises(CloverError, match="expected cpu, cuda"):
        resolve_device("gpu0")
    with pytest.raises(CloverError, match="expected cpu, cuda"):
        LLM("clover-tiny", device="tpu")
    assert resolve_device("cpu").type == "cpu" and device_dtype(torch.device("cpu"), "int4")
    cuda = torch.device("cuda")
    assert device_dtype(cuda, "auto") == "bfloat16" and device_dtype(cuda, "float32")
    with pytest.raises(CloverError, match="int4 is a CPU precision"):
        device_dtype(cuda, "int4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto").type == "cpu"
    with pytest.raises(CloverError, match="no CUDA device is visible"):
        LLM("clover-tiny", device="cuda")
    with pytest.raises(CloverError, match="no CUDA device"):
        ServeOptions(device="cuda").check()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # nothing touches it here
    assert resolve_device("auto") == cuda
    with pytest.raises(CloverError, match="int8 is a CPU precision"):
        ServeOptions(device="cuda", dtype="int8").check()
    ServeOptions(device="cuda", dtype="bfloat16").check()


def test_the_decoding_loop_runs_on_the_models_device():
    """BatchDecoder's add / step / cancel run with PyTorch's tensor factories defaulting to
    the model's device (so on a GPU every tensor the loop and the model make lands there);
    on the CPU they change nothing."""
    import torch

    from clover.decoding.batch import on_model_device

    class Probe:
        @on_model_device
        def where(self):
            return torch.empty(0).device

    probe = Probe()
    probe.device = torch.device("meta")  # a device no CPU tensor lives on
    assert probe.where().type == "meta"
    assert torch.empty(0).device.type == "cpu"  # only for the call
    probe.device = torch.device("cpu")
    assert probe.where().type == "cpu"


def test_cli_generate_lookup_store_is_ar_and_checks_its_seed(tiny_checkpoint, tmp_path, capsys):
    args = ["generate", "-m", str(tiny_checkpoint), "-p", "a b c d", "--json", "--max-tokens",
            "12", "--dtype", "float32"]  # fmt: skip
    assert main(args + ["--decoder", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)
    seed = tmp_path / "seed.txt"
    seed.write_text("a b c d e f g " * 20)
    spec_args = ["--decoder", "self_spec", "--block-size", "4", "--draft", "lookup+store"]
    assert main(args + spec_args + ["--store", str(seed)]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["text"] == ar["text"] and spec["draft"] == "lookup+store"
    assert main(args + spec_args + ["--store", str(tmp_path / "missing.txt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing.txt: no such file" in err
