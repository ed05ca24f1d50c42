"""`clover bench`: harnesses on tiny random models, the code sandbox, answer scoring, suite."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest
import torch

from clover import LLM
from clover.bench.common import DecoderConfig, parse_configs
from clover.bench.quality import (
    extract_number,
    repetition_rate,
    run_quality,
    score_answer,
)
from clover.bench.sandbox import extract_code, run_python_checks
from clover.bench.speed import (
    CloverEngine,
    LlamaCppEngine,
    TransformersEngine,
    add_ratios,
    llamacpp_check,
    run_speed,
)
from clover.cli import main
from clover.data.suite import KINDS, load_suite
from clover.errors import CloverError


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), dtype="float32", progress=False)


# --- suite and scoring ---------------------------------------------------------------------------


def test_suite_file_has_150_items_in_four_kinds():
    items = load_suite()
    assert len(items) >= 150
    counts = {k: sum(i["kind"] == k for i in items) for k in KINDS}
    assert all(n >= 20 for n in counts.values()), counts
    assert len({i["id"] for i in items}) == len(items)
    for it in items:
        if it["kind"] == "code":
            assert it["entry"] in it["prompt"] and "assert" in it["tests"]
        elif it["kind"] == "math":
            assert isinstance(it["answer"], int | float)
        elif it["kind"] == "fact":
            assert it.get("accept") or it.get("regex")
            if it.get("regex"):
                re.compile(it["regex"])
    short = load_suite(limit=8)  # kinds in turn
    assert [i["kind"] for i in short] == list(KINDS) * 2
    code = load_suite(kinds=("code",))  # one kind: its items in file order
    assert code == [i for i in items if i["kind"] == "code"]
    assert [i["kind"] for i in load_suite(limit=3, kinds=("math", "fact"))] == [
        "math", "fact", "math"]  # fmt: skip
    with pytest.raises(CloverError, match="unknown suite kinds"):
        load_suite(kinds=("poetry",))


def test_extract_number():
    assert extract_number("12") == 12
    assert extract_number("The answer is 12.") == 12
    assert extract_number("7 + 5 = 12") == 12
    assert extract_number("There are 1,000 grams in a kilogram.") == 1000
    assert extract_number("It is -3 degrees") == -3
    assert extract_number("3.50 dollars") == 3.5
    assert extract_number("5 apples and 3 more: the answer is 8 apples") == 8
    assert extract_number("no digits here") is None


def test_repetition_rate():
    assert repetition_rate("") == 0.0
    assert repetition_rate("one two three four five six") == 0.0
    loop = "the cat sat down " * 5  # 20 words, 17 four-grams, 4 distinct
    assert repetition_rate(loop) == pytest.approx(1 - 4 / 17)


def test_score_math_and_fact():
    math_item = {"kind": "math", "answer": 24}
    assert score_answer(math_item, "4 boxes x 6 = 24 eggs")[0] is True
    assert score_answer(math_item, "25")[0] is False
    fact = {"kind": "fact", "accept": ["paris"]}
    assert score_answer(fact, "The capital is Paris.")[0] is True
    assert score_answer({"kind": "fact", "regex": r"\b(8|eight)\b"}, "Eight legs")[0] is True
    assert score_answer({"kind": "open"}, "anything")[0] is None


# --- the code sandbox ----------------------------------------------------------------------------


def test_sandbox_pass_fail_timeout_memory():
    code = "def largest(xs):\n    return max(xs)\n"
    assert run_python_checks(code, "assert largest([1, 5, 3]) == 5").reason == "passed"
    failed = run_python_checks(code, "assert largest([1, 5, 3]) == 1")
    assert not failed.passed and failed.reason == "failed"
    slow = run_python_checks("while True:\n    pass\n", "", timeout=1.0)
    assert not slow.passed and slow.reason == "timeout"
    big = run_python_checks("x = bytearray(512 * 1024 * 1024)\n", "", memory_mb=128)
    assert not big.passed and big.reason == "memory"
    assert run_python_checks("", "assert True").reason == "no code"
    assert run_python_checks("def f(:\n", "").reason == "error"


def test_extract_code():
    answer = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert extract_code(answer).strip() == "def add(a, b):\n    return a + b"
    assert extract_code("Sure.\ndef f():\n    return 1").startswith("def f()")
    assert extract_code("no code at all") == ""
    item = {"kind": "code", "entry": "add", "tests": "assert add(2, 3) == 5"}
    assert score_answer(item, answer) == (True, "passed")


def test_configs_parse_and_round_trip():
    text = (
        "ar,low_confidence:32:0.95,self_spec:4,low_confidence:8,self_spec:3:lookup,self_spec:4:mask"
    )
    configs = parse_configs(text)
    assert [c.name for c in configs] == [
        "ar",
        "low_confidence:32:0.95",
        "self_spec:4",
        "low_confidence:8:0.95",
        "self_spec:3:lookup",
    ]  # self_spec:4:mask is self_spec:4, dropped as a duplicate
    assert all(DecoderConfig.parse(c.name) == c for c in configs)
    assert configs[4].policy().draft == "lookup" and configs[4].settings(8).draft == "lookup"
    fixed = parse_configs("self_spec:16:lookup+store:fixed,self_spec:4:mask:fixed")
    assert [c.name for c in fixed] == ["self_spec:16:lookup+store:fixed", "self_spec:4:mask:fixed"]
    assert all(DecoderConfig.parse(c.name) == c for c in fixed)
    assert fixed[0].policy().adaptive is False and fixed[0].settings(8).policy().adaptive is False
    assert configs[4].policy().adaptive is True
    # `default`: the model's own decoding, once it is known (before: `ar` holds its place)
    from types import SimpleNamespace

    coder = SimpleNamespace(default_decoder="self_spec", block_size=4, draft="drafter+lookup")
    mine = DecoderConfig.model_default(coder)
    assert mine.name == "self_spec:4:drafter+lookup"
    assert [c.name for c in parse_configs("ar,default", mine)] == ["ar", mine.name]
    assert [c.name for c in parse_configs("ar,default")] == ["ar"]
    smol = SimpleNamespace(default_decoder="ar", block_size=32, draft="mask")
    assert DecoderConfig.model_default(smol) == DecoderConfig()
    lc = DecoderConfig.model_default(SimpleNamespace(default_decoder="low_confidence",
                                                     block_size=8))  # fmt: skip
    assert lc.name == "low_confidence:8:0.95"
    for bad in ("beam:4", "low_confidence", "self_spec:x", "ar:4", "self_spec:4:ngram",
                "low_confidence:4:lookup", "self_spec:4:lookup:slide"):  # fmt: skip
        with pytest.raises(CloverError):
            DecoderConfig.parse(bad)


# --- harnesses on a tiny model -------------------------------------------------------------------

ITEMS = [
    {"id": "c1", "kind": "code", "prompt": "Write add(a, b).", "entry": "add",
     "tests": "assert add(1, 2) == 3"},
    {"id": "m1", "kind": "math", "prompt": "What is 2 + 2?", "answer": 4},
    {"id": "f1", "kind": "fact", "prompt": "Capital of France?", "accept": ["paris"]},
    {"id": "o1", "kind": "open", "prompt": "Say something."},
    {"id": "o2", "kind": "open", "prompt": "Say something else, at length."},
]  # fmt: skip


def test_run_quality_on_tiny_model(llm):
    configs = parse_configs("low_confidence:4:0.9,self_spec:2,self_spec:3:mask+lookup")
    out = run_quality(llm, configs, ITEMS, max_tokens=6, batch_size=2, reference=llm)
    assert out["settings"]["configs"] == [
        "ar", "low_confidence:4:0.9", "self_spec:2", "self_spec:3:mask+lookup"
    ]  # fmt: skip
    ar = out["summary"]["ar"]
    assert ar["agreement_with_ar"] == 1.0 and ar["tpf"] <= 1.0 and ar["drafts"] == {}
    # self_spec is AR-exact in float32, batched or not, whatever its drafts
    for name in ("self_spec:2", "self_spec:3:mask+lookup"):
        assert out["summary"][name]["agreement_with_ar"] == 1.0
    mask = out["summary"]["self_spec:2"]["drafts"]["mask"]
    assert mask["drafted"] > 0 and 0 <= mask["kept"] <= mask["drafted"]
    for s in out["summary"].values():
        assert set(s["accuracy"]) == {"code", "math", "fact", "all_checked"}
        assert s["fluency_nll"]["open"] > 0 and 0 <= s["repetition"]["all"] <= 1
        assert s["output_tokens"] > 0 and s["tokens_per_s"] > 0
    item = out["items"][3]
    assert item["id"] == "o1" and set(item["outputs"]) == set(out["summary"])
    trace = out["traces"]["low_confidence:4:0.9"]
    assert trace["item"] == "o1" and len(trace["pieces"]) == len(trace["steps"])


def test_run_speed_on_tiny_model(llm):
    engines = [CloverEngine(llm, c) for c in parse_configs("ar,low_confidence:4:0.9")]
    prompts = [llm.encode("hello there"), llm.encode("the quick brown fox jumps")]
    rows = run_speed(engines, prompts, tokens=6, reps=2, batches=[1, 2])
    add_ratios(rows)
    ar = rows["clover ar float32"]["batch"]
    assert ar["1"]["tokens_per_s"]["n"] == 4 and ar["2"]["tokens_per_s"]["n"] == 2
    assert ar["1"]["tpf"] <= 1.0 and ar["1"]["vs_our_ar"] == 1.0
    lc = rows["clover low_confidence:4:0.9 float32"]["batch"]["2"]
    assert lc["nfe_per_row"] >= 2 and lc["ttft_s"]["median"] > 0


def test_transformers_engine_left_pads_a_batch():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    engine = TransformersEngine.__new__(TransformersEngine)  # skip the GGUF loading
    engine.model, engine.pad_id = LlamaForCausalLM(cfg).eval(), 0
    r = engine.run([[5, 6, 7], [8]], 4)
    assert r.rows == 2 and [len(t) for t in r.token_ids] == [4, 4]
    alone = engine.run([[8]], 4)
    assert alone.token_ids[0] == r.token_ids[1]  # padding does not change the short row
    assert 0 < r.ttft <= r.seconds


def test_llamacpp_engine_glue(monkeypatch):
    calls = {}

    class FakeLlama:
        def __init__(self, **kw):
            calls["init"] = kw

        def reset(self):
            calls["reset"] = True

        def generate(self, tokens, **kw):
            calls["generate"] = (list(tokens), kw)
            yield from range(100, 200)

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    e = LlamaCppEngine("model.gguf", "Q4_1", threads=2)
    r = e.run([[1, 2, 3]], 5)
    assert r.token_ids == [[100, 101, 102, 103, 104]] and r.nfe_per_row == 5
    assert calls["reset"] and calls["generate"][1]["temp"] == 0.0
    assert calls["init"]["n_threads"] == 2 and e.name == "llama.cpp Q4_1"
    with pytest.raises(CloverError, match="one sequence"):
        e.run([[1], [2]], 5)


def test_llamacpp_check_turns_a_crashing_build_into_a_note():
    ok = "import sys; print('AVX2 = 1 |', sys.argv[1], sys.argv[2])"
    assert llamacpp_check("m.gguf", 2, program=ok) == (None, "AVX2 = 1 | m.gguf 2")
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    why, info = llamacpp_check("m.gguf", 2, program=crash)
    assert why.startswith("llama.cpp skipped") and "signal 11" in why and "AMX" in why
    assert info == ""
    fails = "import sys; sys.exit('no such file: ' + sys.argv[1])"
    why, _ = llamacpp_check("m.gguf", 2, program=fails)
    assert "exit 1" in why and "no such file: m.gguf" in why and "AMX" not in why
    why, _ = llamacpp_check("m.gguf", 2, timeout=1, program="import time; time.sleep(30)")
    assert "over 1 s" in why


def test_gpu_script_runs_on_cpu_at_tiny_shape():
    from clover.bench.gpu import time_passes

    report = time_passes("clover-tiny", "cpu", lengths=[16], batches=[1, 2], block=4, reps=1)
    assert [(r["length"], r["batch"]) for r in report["results"]] == [(16, 1), (16, 2)]
    r = report["results"][1]
    assert r["block_pass_ms"]["median"] > 0 and r["commit_pass_ms"]["median"] > 0
    assert set(r["block_tokens_per_s_bound"]) == {"tpf_1", "tpf_2", "tpf_2.55", "tpf_4"}
    with pytest.raises(CloverError, match="GPU"):
        time_passes("clover-35b-a3b", "cpu")


# --- the CLI -------------------------------------------------------------------------------------


def test_cli_quality_speed_plot(tiny_checkpoint, tmp_path, capsys):
    q = tmp_path / "q.json"
    rc = main(["bench", "quality", "-m", str(tiny_checkpoint), "--limit", "4", "--max-tokens",
               "4", "--configs", "ar,low_confidence:4:0.9,default", "--reference", "none",
               "--dtype", "float32", "--out", str(q)])  # fmt: skip
    assert rc == 0
    report = json.loads(q.read_text())
    assert report["command"] and report["machine"]["cores"] and len(report["items"]) == 4
    # `default`: the tiny checkpoint's own decoding (its config: low_confidence, block 32)
    assert list(report["summary"]) == ["ar", "low_confidence:4:0.9", "low_confidence:32:0.95"]
    assert (tmp_path / "q-frontier.png").stat().st_size > 0
    assert (tmp_path / "q-trace.png").stat().st_size > 0
    s = tmp_path / "s.json"
    rc = main(["bench", "speed", "-m", str(tiny_checkpoint), "--configs", "ar,self_spec:2",
               "--dtypes", "float32", "--tokens", "4", "--reps", "1", "--prompts", "2",
               "--batch", "1,2", "--out", str(s)])  # fmt: skip
    assert rc == 0
    report = json.loads(s.read_text())
    assert "peers skipped" in report["notes"][0]  # an HF directory: no GGUF for the peers
    assert report["settings"]["device"] == "cpu"
    row = report["rows"]["clover self_spec:2 float32"]
    assert row["batch"]["2"]["output_tokens_per_row"] == 4
    rss = report["peak_rss_mb"]
    assert rss["clover float32"] > 0 and row["peak_rss_mb"] == rss["clover float32"]
    assert s.with_suffix(".png").stat().st_size > 0
    s.with_suffix(".png").unlink()
    assert main(["bench", "plot", str(s), str(q)]) == 0
    assert s.with_suffix(".png").is_file()
    assert "clover ar float32" in capsys.readouterr().out


def test_cli_speed_and_quality_with_an_adapter_and_a_drafter(tiny_checkpoint, tmp_path, capsys):
    """The draft adapter and the drafter side by side in one run, the RSS probe included."""
    from clover.models.adapter import AdapterConfig, attach_adapter, save_adapter
    from clover.models.drafter import new_drafter, save_drafter

    model = LLM(str(tiny_checkpoint), dtype="float32", progress=False).model
    drafter = new_drafter(model, "tiny", feature_layers=[0], num_hidden_layers=1, block_size=4)
    save_drafter(drafter, tmp_path / "d.safetensors", dtype=torch.float32)
    attach_adapter(model, AdapterConfig(rank=4))
    save_adapter(model, tmp_path / "a.safetensors", dtype=torch.float32)
    s = tmp_path / "s.json"
    rc = main(["bench", "speed", "-m", str(tiny_checkpoint), "--configs",
               "ar,self_spec:2,self_spec:4:drafter", "--dtypes", "float32", "--tokens", "6",
               "--reps", "1", "--prompts", "1", "--batch", "1", "--no-plot", "--out", str(s),
               "--adapter", str(tmp_path / "a.safetensors"),
               "--drafter", str(tmp_path / "d.safetensors")])  # fmt: skip
    assert rc == 0
    report = json.loads(s.read_text())
    assert report["settings"]["adapter"] == str(tmp_path / "a.safetensors")
    assert report["settings"]["drafter"] == str(tmp_path / "d.safetensors")
    assert report["settings"]["drafter_loaded"] == str(tmp_path / "d.safetensors")
    assert report["settings"]["draft_model_wide"] is None  # a drafter file, not a model
    assert report["rows"]["clover self_spec:4:drafter float32"]["peak_rss_mb"] > 0
    # the pass costs its draft lengths followed, as timed for the drafter's row
    costs = report["rows"]["clover self_spec:4:drafter float32"]["pass_costs_ms"]["drafter"]
    assert costs["verify"]["1"] > 0 and costs["draft"] and costs["verify_by_rows"]["2"]
    assert "pass_costs_ms" not in report["rows"]["clover ar float32"]
    q = tmp_path / "q.json"
    rc = main(["bench", "quality", "-m", str(tiny_checkpoint), "--limit", "2", "--max-tokens",
               "4", "--configs", "ar,self_spec:2", "--reference", "none", "--dtype", "float32",
               "--adapter", str(tmp_path / "a.safetensors"), "--no-plot",
               "--out", str(q)])  # fmt: skip
    assert rc == 0
    summary = json.loads(q.read_text())["summary"]
    assert summary["ar"]["verify_passes"] is None
    passes = summary["self_spec:2"]["verify_passes"]  # what each pass kept, as speed reports it
    assert sum(passes["kept_per_pass_histogram"].values()) == passes["passes_with_a_draft"] > 0
    assert 1 <= passes["mean_tokens_per_verify_pass"] <= 3
    by_kind = summary["self_spec:2"]["verify_passes_by_kind"]  # the suite's kinds, apart
    assert sum(p["passes_with_a_draft"] for p in by_kind.values() if p) == passes[
        "passes_with_a_draft"]  # fmt: skip
    assert summary["ar"]["verify_passes_by_kind"] == dict.fromkeys(by_kind)
    rc = main(["bench", "speed", "-m", str(tiny_checkpoint), "--adapter",
               str(tmp_path / "none.safetensors"), "--no-rss"])  # fmt: skip
    assert rc == 1 and "none.safetensors not found" in capsys.readouterr().err


def test_cli_speed_on_a_missing_gpu_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["bench", "speed", "-m", "clover-tiny", "--device", "cuda", "--no-rss"]) == 1
    assert "no CUDA device is visible" in capsys.readouterr().err


def test_bench_passes_breakdown_on_a_tiny_quantized_model():
    """The harness of `clover bench passes`: every pass kind, its ratio to the AR step, the
    fused layers' components and their bounds (tiny llama, int4, our kernels if built)."""
    import torch

    from clover import kernels
    from clover.bench.passes import format_passes, measure_machine, run_passes
    from clover.quant import quantize_model
    from tests.test_kernels import tiny_llama

    model = quantize_model(tiny_llama())
    report = run_passes(model, [2], 3, [1, 2], [8], reps=2, log=lambda _: None)
    rates = report["machine_rates"]
    assert set(rates) == {"bandwidth_gb_s", "bf16_gflop_s", "fp32_gflop_s"}
    assert all(v > 0 for v in rates.values())
    rows = report["passes"]
    assert [r["pass"] for r in rows] == ["ar", "verify 2", "block 3"] * 2
    assert all(r["x_ar_step"] == 1.0 for r in rows if r["pass"] == "ar")
    for r in rows:
        comp = r["components_ms"]
        assert "head" in comp and "rest" in comp and set(r["bounds_ms"]) >= {"weights", "head"}
        if kernels.load() is not None:  # the fused layers ran and their stages were timed
            assert comp["weights"] > 0 and comp["attention"] > 0 and "weights" in r["x_bound"]
            stages = r["stages_ms"]
            assert {"qkv", "gate_up", "silu*up", "attention"} <= set(stages)
            assert comp["weights"] == pytest.approx(
                sum(stages[k] for k in ("qkv", "o", "gate_up", "down")), abs=0.01
            )
    report["machine"] = {"torch_threads": torch.get_num_threads()}
    assert "block 3" in format_passes(report)
    assert measure_machine(0.01)["bandwidth_gb_s"] > 0


def test_pass_bounds_take_the_better_matmul_peak():
    """A CPU without bfloat16 arithmetic multiplies bf16 at ~1 GFLOP/s through PyTorch: the
    weights' compute bound must come from the float32 rate there, not from seconds of bf16."""
    from clover.bench.passes import bounds, weight_bytes
    from clover.quant import quantize_model
    from tests.test_kernels import tiny_llama

    model = quantize_model(tiny_llama())
    body_b, body_n, _, _ = weight_bytes(model)
    slow_bf16 = {"bandwidth_gb_s": 1e9, "bf16_gflop_s": 1.0, "fp32_gflop_s": 100.0}
    b = bounds(model, 16, 16, 32, slow_bf16)
    assert b["weights"] == pytest.approx(2 * body_n * 16 / 100.0 / 1e6)
    fast_bf16 = dict(slow_bf16, bf16_gflop_s=400.0)
    assert bounds(model, 16, 16, 32, fast_bf16)["weights"] == pytest.approx(b["weights"] / 4)
    memory = dict(slow_bf16, bandwidth_gb_s=1e-3)  # memory-bound: bytes / bandwidth
    assert bounds(model, 1, 1, 8, memory)["weights"] == pytest.approx(body_b / 1e-3 / 1e6)


def test_quality_keeps_each_settings_store_to_its_own_answers(llm):
    """`ar` answers every item first; a lookup+store setting must not draft from `ar`'s
    answer to the same item (nor from another store setting's): with one item its store has
    learned nothing of its own yet, so it drafts nothing from the store."""
    configs = parse_configs("self_spec:4:lookup+store:fixed,self_spec:8:lookup+store:fixed")
    out = run_quality(llm, configs, ITEMS[3:4], max_tokens=12, batch_size=1)
    for name in ("self_spec:4:lookup+store:fixed", "self_spec:8:lookup+store:fixed"):
        assert "store" not in out["summary"][name]["drafts"]
        assert out["summary"][name]["agreement_with_ar"] == 1.0
    store = llm.runtime.store
    assert store.learned == [] and store.tokens == 0  # the run leaves the store as it found it
    assert out["settings"]["store"] == {"seed_tokens": 0, "seed_sequences": 0, "learning": True}
    # two items: the second may draft from the first answer of the same setting
    out = run_quality(llm, configs, [ITEMS[3], ITEMS[3]], max_tokens=12, batch_size=1)
    drafts = out["summary"]["self_spec:4:lookup+store:fixed"]["drafts"]["store"]
    assert drafts["drafted"] > 0 and drafts["kept"] == drafts["drafted"]


def test_quality_times_the_pass_costs_before_any_setting(llm, monkeypatch, tmp_path):
    """A first cost measurement (~7 s on the coder 0.5B) must not land in the seconds of the
    first adaptive self_spec setting: run_quality measures the tables before it times."""
    from clover.decoding import timing as costs

    events = []
    real_measure, real_stream = costs.measure, llm.stream
    monkeypatch.setattr(costs, "costs_path", lambda key: tmp_path / f"{key}.json")  # none known
    monkeypatch.setattr(llm.runtime, "_costs", {})  # nor kept by the runtime: a first run
    measured = lambda *a, **k: events.append("measure") or real_measure(*a, **k)  # noqa: E731
    monkeypatch.setattr(costs, "measure", measured)
    monkeypatch.setattr(llm, "stream", lambda *a, **k: events.append("run") or real_stream(*a, **k))
    configs = parse_configs("self_spec:4:lookup")
    run_quality(llm, configs, ITEMS[3:4], max_tokens=8, batch_size=1)
    assert events[0] == "measure" and "measure" not in events[1:] and "run" in events


def test_a_results_command_carries_the_kernel_variables(monkeypatch):
    """A run under CLOVER_DOTS_X=15 (or another kernel switch) must say so in its recorded
    command, or rerunning the command computes something else."""
    from clover.bench.common import RESULT_ENV, command_line

    for k in RESULT_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr("sys.argv", ["/x/bin/clover", "bench", "quality", "--out", "a b.json"])
    assert command_line() == "clover bench quality --out 'a b.json'"
    monkeypatch.setenv("CLOVER_DOTS_X", "15")
    monkeypatch.setenv("CLOVER_API_KEY", "secret")  # not a result's: never recorded
    assert command_line() == "CLOVER_DOTS_X=15 clover bench quality --out 'a b.json'"
