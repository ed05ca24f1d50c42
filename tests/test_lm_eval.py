"""The lm-evaluation-harness bridge: scores against hand computations, generation through the
decoders, and whole harness runs of the small tasks in tests/data/lm_eval_task (offline)."""

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

# Never reach the network: the harness and `datasets` read these when first imported.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[dev]')")

from lm_eval.api.instance import Instance  # noqa: E402

from clover.engine import LLM  # noqa: E402
from clover.errors import CloverError  # noqa: E402
from clover.integrations.lm_eval import CloverLM  # noqa: E402
from clover.integrations.lm_eval.scoring import score_pairs  # noqa: E402

TASK_DIR = Path(__file__).parent / "data" / "lm_eval_task"
TASKS = ["clover_tiny_gen", "clover_tiny_mc", "clover_tiny_ppl"]


def request(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


def make_lm(checkpoint, **kw):
    return CloverLM(model=str(checkpoint), dtype="float32", **kw)


@pytest.fixture(scope="module")
def lm(tiny_checkpoint):
    return make_lm(tiny_checkpoint, batch_size=3)


@pytest.fixture
def offline_cwd(tmp_path, monkeypatch):
    """Run from the task folder (its data_files are relative) with a private datasets cache."""
    import datasets

    monkeypatch.chdir(TASK_DIR)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")


def logprobs(model, ids):
    """[T, V] log-probs of the next token after each position, from one uncached causal pass."""
    with torch.inference_mode():
        hidden = model(torch.tensor([ids]), mode="causal")
        return torch.log_softmax(model.logits(hidden)[0].float(), dim=-1)


def hand_score(model, context, continuation):
    lp = logprobs(model, context + continuation)
    picks = [lp[len(context) - 1 + j, t] for j, t in enumerate(continuation)]
    greedy = all(int(lp[len(context) - 1 + j].argmax()) == t for j, t in enumerate(continuation))
    return float(sum(picks)), greedy


# --- loglikelihood -----------------------------------------------------------------------------


def test_loglikelihood_equals_hand_computation(lm):
    tok, model = lm.llm.tokenizer, lm.llm.model
    pairs = [
        ("The quick brown fox", " jumps over"),
        ("hello", " world"),
        ("the lazy dog sleeps all day long and", " then wakes up"),
        ("a", "b"),
    ]
    got = lm.loglikelihood([request("loglikelihood", c, x) for c, x in pairs])  # batches of 3
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        want = hand_score(model, tok.encode(context), tok.encode(continuation))
        assert logprob == pytest.approx(want[0], abs=1e-4)
        assert greedy == want[1]


def test_trailing_space_moves_to_continuation_and_empty_context_uses_prefix(lm):
    tok, model = lm.llm.tokenizer, lm.llm.model
    (moved, _), (plain, _) = lm.loglikelihood(
        [request("loglikelihood", "hello ", "world"), request("loglikelihood", "hello", " world")]
    )
    assert moved == pytest.approx(plain, abs=1e-5)
    ((empty, _),) = lm.loglikelihood([request("loglikelihood", "", "hello world")])
    want, _ = hand_score(model, [lm.prefix_token_id], tok.encode("hello world"))
    assert empty == pytest.approx(want, abs=1e-4)


def test_is_greedy_true_for_the_argmax_continuation(lm):
    model, context = lm.llm.model, lm.llm.tokenizer.encode("the quick brown")
    ids = list(context)
    for _ in range(4):  # greedy AR continuation, by hand
        ids.append(int(logprobs(model, ids)[-1].argmax()))
    greedy_cont = ids[len(context) :]
    other = [*greedy_cont[:-1], (greedy_cont[-1] + 1) % 320]
    results = score_pairs(model, [(context, greedy_cont), (context, other)], 256, batch_size=2)
    assert [flag for _, flag in results] == [True, False]
    assert results[0][0] == pytest.approx(hand_score(model, context, greedy_cont)[0], abs=1e-4)


def test_long_context_is_cut_from_the_left(tiny_checkpoint):
    lm = make_lm(tiny_checkpoint, max_length=8)
    tok, model = lm.llm.tokenizer, lm.llm.model
    context, continuation = "the quick brown fox jumps over", " the lazy dog"
    c, x = tok.encode(context), tok.encode(continuation)
    assert len(c) + len(x) > 9
    ((got, _),) = lm.loglikelihood([request("loglikelihood", context, continuation)])
    kept = (c + x)[-9:]  # 8 tokens read, the last one only predicted
    want, _ = hand_score(model, kept[: len(kept) - len(x)], x)
    assert got == pytest.approx(want, abs=1e-4)
    with pytest.raises(CloverError, match="scoring window"):
        lm.loglikelihood([request("loglikelihood", "a", " the quick brown fox jumps over")])


def test_loglikelihood_rolling_sums_windows_by_hand(tiny_checkpoint):
    lm = make_lm(tiny_checkpoint, max_length=16, batch_size=2)
    tok, model = lm.llm.tokenizer, lm.llm.model
    text = "the quick brown fox jumps over the lazy dog; hello world, héllo wörld! " * 2
    t = tok.encode(text)
    assert 33 <= len(t) <= 47, len(t)  # three windows of 16 predictions, the last one partial
    p = lm.prefix_token_id
    windows = [  # (what the model reads, the tokens its last outputs predict)
        ([p, *t[:15]], t[:16]),
        (t[15:31], t[16:32]),
        (t[-17:-1], t[32:]),  # the partial tail still reads a full window
    ]
    want = 0.0
    for read, targets in windows:
        lp = logprobs(model, read)
        first = len(read) - len(targets)
        want += float(sum(lp[first + j, target] for j, target in enumerate(targets)))
    (got,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    assert got == pytest.approx(want, abs=1e-3)
    # documents scored together (windows of both share batches) score as when scored alone
    (short,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", "hello")])
    both = lm.loglikelihood_rolling(
        [request("loglikelihood_rolling", text), request("loglikelihood_rolling", "hello")]
    )
    assert both == pytest.approx([got, short], abs=1e-4)
    # one window covering everything is the plain sum over the whole text
    (whole,) = make_lm(tiny_checkpoint).loglikelihood_rolling(
        [request("loglikelihood_rolling", text)]
    )
    assert whole == pytest.approx(hand_score(model, [p], t)[0], abs=1e-3)


# --- generate_until ----------------------------------------------------------------------------


@pytest.mark.parametrize("decoder", ["ar", "low_confidence"])
def test_generate_until_runs_the_decoder(tiny_checkpoint, decoder):
    lm = make_lm(tiny_checkpoint, decoder=decoder, block_size=4, threshold=0.9, batch_size=2)
    llm = LLM(str(tiny_checkpoint), dtype="float32", progress=False)
    prompts = ["hello", "the quick brown fox", "héllo wörld"]
    gen = {"until": [], "max_gen_toks": 10, "do_sample": False}
    got = lm.generate_until([request("generate_until", p, gen) for p in prompts])
    for prompt, text in zip(prompts, got):
        (want,) = llm.generate(prompt, decoder=decoder, block_size=4, threshold=0.9, max_tokens=10)
        assert text == want.text


def test_generate_until_cuts_before_the_first_stop_string(lm):
    gen = {"until": [], "max_gen_toks": 16}
    (full,) = lm.generate_until([request("generate_until", "hello", gen)])
    if len(full) < 5:
        pytest.skip("random model answered too little to cut")
    stops = [full[3:5], full[1:3]]  # the earlier one wins, whatever the list order
    (cut,) = lm.generate_until([request("generate_until", "hello", {**gen, "until": stops})])
    assert cut == full[: full.find(full[1:3])]
    (one,) = lm.generate_until([request("generate_until", "hello", {**gen, "until": full[3:5]})])
    assert one == full[: full.find(full[3:5])]


def test_chat_template_renders_the_checkpoint_template(lm):
    assert lm.chat_template(True) == lm.llm.tokenizer.chat_template
    text = lm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n") and "hi" in text
    assert lm.tokenizer_name


def test_registered_next_to_the_built_in_backends():
    from lm_eval.api.registry import get_model

    assert get_model("clover") is CloverLM
    assert get_model("dummy").__name__ == "DummyLM"  # built-ins still resolve


def test_bad_model_args(tiny_checkpoint):
    with pytest.raises(CloverError, match="decoder must be one of"):
        make_lm(tiny_checkpoint, decoder="beam")
    with pytest.raises(CloverError, match="unknown clover model_args"):
        make_lm(tiny_checkpoint, pretrained="gpt2")
    with pytest.raises(CloverError, match="block_size"):
        make_lm(tiny_checkpoint, block_size=0)
    with pytest.raises(CloverError, match="max_length"):
        make_lm(tiny_checkpoint, max_length=10_000)


# --- whole harness runs ------------------------------------------------------------------------


def model_args(checkpoint):
    return f"model={checkpoint},decoder=low_confidence,block_size=4,threshold=0.9,dtype=float32"


def test_simple_evaluate_runs_the_repo_tasks(tiny_checkpoint, offline_cwd):
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(TASK_DIR), include_defaults=False)
    out = lm_eval.simple_evaluate(
        model="clover",  # resolved through lm_eval's registry, as the CLI does
        model_args=model_args(tiny_checkpoint),
        tasks=TASKS,
        task_manager=tasks,
        batch_size=2,
    )
    results = out["results"]
    assert 0.0 <= results["clover_tiny_gen"]["exact_match,none"] <= 1.0
    assert 0.0 <= results["clover_tiny_mc"]["acc,none"] <= 1.0
    assert results["clover_tiny_ppl"]["word_perplexity,none"] > 1.0
    assert out["tokenizer_eos_token"][0] == "<|im_end|>"  # logged from our tokenizer


def test_simple_evaluate_with_chat_template(tiny_checkpoint, offline_cwd):
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="clover",
        model_args=model_args(tiny_checkpoint),
        tasks=["clover_tiny_gen"],
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        apply_chat_template=True,
        system_instruction="Answer in one word.",
        limit=2,
    )
    (sample, _) = out["samples"]["clover_tiny_gen"]
    ((prompt, _),) = sample["arguments"]  # (context, gen_kwargs) as sent to generate_until
    assert prompt.startswith("<|im_start|>system\nAnswer in one word.<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\n")


def test_clover_lm_eval_cli_hands_argv_to_lm_eval(
    tiny_checkpoint, offline_cwd, monkeypatch, capsys
):
    import lm_eval.tasks

    from clover.integrations.lm_eval.cli import main

    # Only to save ~15 s: skip indexing lm_eval's thousands of built-in task files.
    monkeypatch.setattr(
        lm_eval.tasks, "TaskManager", partial(lm_eval.tasks.TaskManager, include_defaults=False)
    )
    monkeypatch.setattr(sys, "argv", ["clover-lm-eval"])
    args = ["--model", "clover", "--model_args", model_args(tiny_checkpoint)]
    args += ["--tasks", "clover_tiny_mc", "--include_path", ".", "--limit", "3"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "clover_tiny_mc" in table and "acc" in table


@pytest.mark.slow
def test_clover_lm_eval_console_script(tiny_checkpoint, tmp_path):
    """The exact command of the README, in a fresh process (indexes every lm_eval task: slow)."""
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    command = [
        sys.executable,
        "-m",
        "clover.integrations.lm_eval",
        "--model",
        "clover",
        "--model_args",
        model_args(tiny_checkpoint) + ",max_tokens=8",
        "--tasks",
        ",".join(TASKS),
        "--include_path",
        ".",
        "--batch_size",
        "2",
    ]
    done = subprocess.run(command, cwd=TASK_DIR, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert all(task in done.stdout for task in TASKS)
