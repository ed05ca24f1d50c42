"""`clover bench quality`: the project's own prompt suite, scored per decoder setting.

The suite (`benchmarks/suites/quality.jsonl`, one JSON object per line) has four kinds:
- `code`: write a small Python function; passes if the item's asserts run clean in a limited
  child process (`sandbox.py`). Fields: `entry`, `tests`.
- `math`: arithmetic and unit conversions with one exact answer; the number is taken from the
  answer text (`extract_number`). Field: `answer`.
- `fact`: short facts and instructions; correct if the answer contains one of `accept`
  (case-insensitive) or matches `regex`.
- `open`: open-ended; no right answer. Scored, like every answer, by fluency (the reference
  AR model's mean per-token NLL of the answer text, teacher-forced after the same chat prompt;
  lower is better) and repetition (fraction of repeated word 4-grams; lower is better).

Per decoder setting: accuracy per kind, agreement with AR greedy (token-identical answers; `ar`
is always run, first, as the reference), fluency, repetition, NFE, TPF and tokens/s. Settings
are interleaved batch by batch so background load hits them alike. `run_quality` is the
library entry point; the CLI adds model loading, the results file and the plots.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable

import torch

from clover.bench.common import DecoderConfig, verify_passes
from clover.bench.sandbox import extract_code, run_python_checks
from clover.data.suite import KINDS
from clover.decoding.policies import Source, draft_sources
from clover.engine import LLM
from clover.errors import CloverError

CHECKED = ("code", "math", "fact")

# --- the suite ---------------------------------------------------------------------------------


# --- scoring one answer --------------------------------------------------------------------------

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_MARKER = re.compile(
    r"(?:\banswer(?: is)?|\bresult(?: is)?|\bequals|=|\bis)\s*:?\s*\$?(" + _NUMBER + ")"
)


def extract_number(text: str) -> float | None:
    """The number an answer gives: the one after the last "answer is" / "=" / "is" marker, else
    the first number in the text. Thousands separators are dropped."""
    text = text.replace("\u2212", "-")
    marked = _MARKER.findall(text.lower())
    found = marked[-1] if marked else next(iter(re.findall(_NUMBER, text)), None)
    if found is None:
        return None
    try:
        return float(found.replace(",", "").rstrip("."))
    except ValueError:
        return None


def repetition_rate(text: str, n: int = 4) -> float:
    """Fraction of the word n-grams of `text` that already occurred earlier in it."""
    words = re.findall(r"\w+", text.lower())
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def score_answer(
    item: dict, text: str, *, code_timeout: float = 5.0, code_memory_mb: int = 256
) -> tuple[bool | None, str]:
    """-> (correct, detail); correct is None for open items."""
    kind = item["kind"]
    if kind == "code":
        r = run_python_checks(
            extract_code(text), item["tests"], timeout=code_timeout, memory_mb=code_memory_mb
        )
        return r.passed, r.reason
    if kind == "math":
        got = extract_number(text)
        want = float(item["answer"])
        ok = got is not None and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
        return ok, f"got {got:g}" if got is not None else "no number"
    if kind == "fact":
        low = text.lower()
        if any(a.lower() in low for a in item.get("accept", [])):
            return True, "accepted"
        if item.get("regex") and re.search(item["regex"], text, re.IGNORECASE | re.MULTILINE):
            return True, "regex"
        return False, "no match"
    return None, ""


def answer_nll(reference: LLM | None, prompt: str, answer: str) -> float | None:
    """Mean per-token NLL (nats) of `answer` after the chat prompt, under `reference` (an LLM
    decoding causally, teacher-forced). The answer is re-encoded with the reference's own
    tokenizer, so any model can score any other's text. None for an empty answer."""
    prompt_ids = reference.chat_prompt([{"role": "user", "content": prompt}])
    answer_ids = reference.tokenizer.encode(answer)
    if not answer_ids:
        return None
    ids = (prompt_ids + answer_ids)[: reference.model.context_length]
    n = len(ids) - len(prompt_ids)
    if n <= 0:
        return None
    with torch.inference_mode():
        hidden = reference.model(torch.tensor([ids]), None, "causal")
        # the output at position i predicts token i + 1
        logits = reference.model.logits(hidden[0, len(prompt_ids) - 1 : len(ids) - 1])
        target = torch.tensor(ids[len(prompt_ids) :])
        return float(torch.nn.functional.cross_entropy(logits.float(), target))


# --- the harness ---------------------------------------------------------------------------------


def run_quality(
    llm: LLM,
    configs: list[DecoderConfig],
    items: list[dict],
    *,
    max_tokens: int = 128,
    batch_size: int = 8,
    reference: object | None = None,
    code_timeout: float = 5.0,
    code_memory_mb: int = 256,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Answer every item with every config and score the answers.

    llm: a `clover.LLM`; configs: decoder settings (`ar` is added first if missing: it is the
    reference for agreement); items: suite entries (`load_suite`); reference: an LLM that
    scores fluency (None: no fluency). Returns {"settings", "summary", "items", "traces"}:
    summary per config name, per-item answers and scores, and one decode trace per config.
    """
    if not items:
        raise CloverError("no items to run")
    ar = DecoderConfig()
    configs = [ar] + [c for c in configs if c != ar]
    prompts = [llm.chat_prompt([{"role": "user", "content": it["prompt"]}]) for it in items]
    outputs: list[dict] = [{} for _ in items]
    totals = {
        c.name: {"tokens": 0, "nfe": 0, "seconds": 0.0, "drafts": {}, "accepted": []}
        for c in configs
    }
    traces: dict[str, dict] = {}
    trace_at = next((i for i, it in enumerate(items) if it["kind"] == "open"), 0)
    # the model's n-gram store (self_spec draft="lookup+store") learns from finished answers:
    # each config keeps what its own answers taught it, never another config's (same items)
    if any(Source.STORE in draft_sources(c.draft) for c in configs):
        llm.runtime.ngram_store()  # made now, not by the first such row: others' answers feed it
    store = llm.runtime.store
    for c in configs:  # this machine's pass costs, timed now if they are not known yet (a
        # first timing would otherwise land in the first self_spec setting's seconds)
        if c.decoder == "self_spec" and c.adaptive and c.draft != "mask":
            llm.runtime.pass_costs(drafter=Source.DRAFTER in draft_sources(c.draft))
    learned: dict[str, list] = {c.name: [] for c in configs}
    for start in range(0, len(items), batch_size):
        batch = list(range(start, min(start + batch_size, len(items))))
        for config in configs:  # interleaved: every config answers this batch in turn
            if store is not None:
                store.forget_learned()
                store.relearn(learned[config.name])
            completions: list = []
            t0 = time.perf_counter()
            # cold prefills: an answer must not depend on which items ran before
            batch_prompts = [prompts[i] for i in batch]
            settings = config.settings(max_tokens)
            for _ in llm.stream(batch_prompts, settings, completions, cached=False):
                pass
            seconds = time.perf_counter() - t0
            if store is not None:
                learned[config.name] = store.forget_learned()
            tot = totals[config.name]
            tot["seconds"] += seconds
            for i, c in zip(batch, completions):
                tot["tokens"] += c.output_tokens
                tot["nfe"] += c.nfe
                for source, (drafted, kept) in c.drafts.items():
                    tally = tot["drafts"].setdefault(source, [0, 0])
                    tally[0], tally[1] = tally[0] + drafted, tally[1] + kept
                tot["accepted"].extend(c.accepted)
                outputs[i][config.name] = {
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "output_tokens": c.output_tokens,
                    "nfe": c.nfe,
                    "finish_reason": c.finish_reason,
                    "accepted": list(c.accepted),
                }
                if i == trace_at:
                    traces[config.name] = {
                        "item": items[i]["id"],
                        "pieces": [llm.tokenizer.decode([t]) for t in c.token_ids],
                        "steps": list(c.steps),
                        "tpf": round(c.tpf, 3),
                    }
        if log:
            log(f"answered {batch[-1] + 1}/{len(items)} items x {len(configs)} settings")
    per_item = []
    for item, out in zip(items, outputs):
        ar_ids = out[ar.name]["token_ids"]
        for o in out.values():
            o["correct"], o["detail"] = score_answer(
                item, o["text"], code_timeout=code_timeout, code_memory_mb=code_memory_mb
            )
            o["repetition"] = round(repetition_rate(o["text"]), 4)
            nll = answer_nll(reference, item["prompt"], o["text"]) if reference else None
            o["nll"] = None if nll is None else round(nll, 4)
            ids = o.pop("token_ids")
            o["same_as_ar"] = ids == ar_ids
            o["common_prefix"] = _common_prefix(ids, ar_ids)
        per_item.append(
            {"id": item["id"], "kind": item["kind"], "prompt": item["prompt"], "outputs": out}
        )
    if log:
        log("scored every answer")
    summary = {c.name: _summarize(c.name, per_item, totals[c.name]) for c in configs}
    return {
        "settings": {
            "configs": [c.name for c in configs],
            "max_tokens": max_tokens,
            "batch_size": batch_size,
            "items": len(items),
            "items_per_kind": {k: sum(it["kind"] == k for it in items) for k in KINDS},
            "store": None if store is None else store.describe(),
            "code_limits": {"timeout_s": code_timeout, "memory_mb": code_memory_mb},
            "reference": getattr(reference, "name", None),
            "reference_dtype": getattr(reference, "dtype", None),
        },
        "summary": summary,
        "items": per_item,
        "traces": traces,
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 4) if values else None


def _summarize(name: str, per_item: list[dict], total: dict) -> dict:
    outs = [(it["kind"], it["outputs"][name]) for it in per_item]
    accuracy = {
        k: _mean([float(o["correct"]) for kind, o in outs if kind == k])
        for k in CHECKED
        if any(kind == k for kind, _ in outs)
    }
    checked = [float(o["correct"]) for kind, o in outs if kind in CHECKED]
    open_ = [o for kind, o in outs if kind == "open"]
    return {
        "accuracy": {**accuracy, "all_checked": _mean(checked)},
        "agreement_with_ar": _mean([float(o["same_as_ar"]) for _, o in outs]),
        "fluency_nll": {
            "open": _mean([o["nll"] for o in open_]),
            "all": _mean([o["nll"] for _, o in outs]),
        },
        "repetition": {
            "open": _mean([o["repetition"] for o in open_]),
            "all": _mean([o["repetition"] for _, o in outs]),
        },
        "output_tokens": total["tokens"],
        "nfe": total["nfe"],
        "tpf": round(total["tokens"] / total["nfe"], 3) if total["nfe"] else None,
        "tokens_per_s": round(total["tokens"] / total["seconds"], 2) if total["seconds"] else None,
        "seconds": round(total["seconds"], 2),
        # self_spec: tokens drafted per source, how many verification kept, and their share of
        # the output (the rest are the one AR token every pass yields)
        "drafts": {
            source: {
                "drafted": d,
                "kept": k,
                "kept_rate": round(k / d, 3) if d else None,
                "share_of_output": round(k / total["tokens"], 3) if total["tokens"] else None,
            }
            for source, (d, k) in sorted(total["drafts"].items())
        },
        "verify_passes": verify_passes(total["accepted"]),
        "verify_passes_by_kind": {
            k: verify_passes([a for kind, o in outs if kind == k for a in o["accepted"]])
            for k in KINDS
            if any(kind == k for kind, _ in outs)
        },
    }
