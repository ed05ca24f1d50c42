"""The default model's frontier: tokens per forward and tokens/s against answer quality.

Runs `clover.bench.quality.run_quality` on one loaded model (the base GGUF + a draft adapter)
for `ar` (the base model decoded causally: with a draft adapter the causal path *is* the base),
`self_spec` at several block sizes (lossless: the base's AR answer, faster or not), drafting
from the masked block, from context n-gram lookup or both, and
`low_confidence` for block {4, 8, 16, 32} x threshold {0.7, 0.8, 0.9, 0.95}, and its sliding
window (`:slide`) for windows {2, 4, 8} x the same thresholds. Items: checkable
suite items (code / math / fact, `benchmarks/suites/quality.jsonl`) plus held-out prompts of the
distillation set (never trained on) as open items. Settings are interleaved batch by batch.

    python benchmarks/frontier.py --model clover-smol-135m --per-kind 12 --heldout 12

Writes benchmarks/results/frontier-<label>.json and .png (quality vs TPF, quality vs tokens/s).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from clover.bench.common import machine, now, parse_configs, write_results
from clover.bench.quality import CHECKED, load_suite, run_quality
from clover.engine import LLM

THRESHOLDS = (0.7, 0.8, 0.9, 0.95)
LOW_CONF = [f"low_confidence:{b}:{t}" for b in (4, 8, 16, 32) for t in THRESHOLDS]
SLIDE = [f"low_confidence:{b}:{t}:slide" for b in (2, 4, 8) for t in THRESHOLDS]
SPEC = ["self_spec:2", "self_spec:3", "self_spec:4"]
SPEC += ["self_spec:4:lookup", "self_spec:3:mask+lookup"]
DEFAULT = ["ar"] + SPEC + LOW_CONF + SLIDE


def heldout_items(data: Path, n: int) -> list[dict]:
    from clover.data.distill import load_examples

    if n <= 0 or not data.exists():
        return []
    items = []
    for ex in load_examples(data, "heldout")[:n]:
        msgs = ex["messages"]
        if len(msgs) != 1:  # single-turn only: run_quality renders one user message
            continue
        items.append({"id": f"heldout-{ex['id']}", "kind": "open", "prompt": msgs[0]["content"]})
    return items


def pick(items: list[dict], per_kind: int) -> list[dict]:
    out = []
    for kind in CHECKED:
        out += [it for it in items if it["kind"] == kind][:per_kind]
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    batch = report["settings"]["batch_size"]
    axes_spec = [(axes[0], "tpf", "tokens per forward (TPF)"),
                 (axes[1], "tokens_per_s", f"output tokens/s (batch {batch})")]  # fmt: skip
    for ax, xkey, xlabel in axes_spec:
        for name, row in s.items():
            q = row["quality"]
            colour = ("#555" if name == "ar" else "#2a7a3b" if "self_spec" in name
                      else "#1f5fa8" if name.endswith(":slide") else "#c05a1a")  # fmt: skip
            ax.scatter(row[xkey], q, color=colour, s=28)
            ax.annotate(name.replace("low_confidence", "lc"), (row[xkey], q), fontsize=6,
                        xytext=(3, 2), textcoords="offset points")  # fmt: skip
        ax.axhline(0.9 * s["ar"]["quality"], color="#888", ls="--", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("quality (accuracy on checked items)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report['label']}: grey = ar, green = self_spec, orange = low_confidence, "
                 "blue = its sliding window; dashed = 90% of ar", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="clover-smol-135m")
    p.add_argument("--adapter", help="a draft adapter file (default: the model's own)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--configs", default=",".join(DEFAULT))
    p.add_argument("--per-kind", type=int, default=12, help="suite items per checked kind")
    p.add_argument("--heldout", type=int, default=12, help="held-out distillation prompts")
    p.add_argument("--data", default="runs/distill", help="distillation data (held-out split)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--label", default=None)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    llm = LLM(a.model, dtype=a.dtype, adapter=a.adapter)
    items = pick(load_suite(), a.per_kind) + heldout_items(Path(a.data), a.heldout)
    report = run_quality(
        llm, parse_configs(a.configs), items, max_tokens=a.max_tokens, batch_size=a.batch_size,
        log=lambda m: print(m, file=sys.stderr, flush=True),
    )  # fmt: skip
    ar = report["summary"]["ar"]
    for row in report["summary"].values():
        # one quality number: checked accuracy relative to ar's, and the repetition rate
        acc = row["accuracy"].get("all_checked") or 0.0
        row["quality"] = round(acc, 4)
        row["relative_quality"] = round(acc / ar["accuracy"]["all_checked"], 3) if (
            ar["accuracy"].get("all_checked")) else None  # fmt: skip
        row["speed_vs_ar"] = round(row["tokens_per_s"] / ar["tokens_per_s"], 3)
    label = a.label or f"{llm.name}-{llm.dtype}"
    report.update(label=label, model=a.model, adapter=llm.adapter, dtype=llm.dtype,
                  date=now(), machine=machine(), command=" ".join(sys.argv))  # fmt: skip
    out = Path(a.out)
    path = write_results(report, out / f"frontier-{label}.json")
    plot(report, out / f"frontier-{label}.png")
    rows = sorted(report["summary"].items(), key=lambda kv: -kv[1]["tpf"])
    print(f"{'setting':28} {'TPF':>5} {'tok/s':>6} {'xAR':>5} {'acc':>5} {'rel':>5} "
          f"{'agree':>5} {'rep4':>5}  drafts kept/drafted")  # fmt: skip
    for name, r in rows:
        drafts = " ".join(f"{k} {d['kept']}/{d['drafted']}" for k, d in r["drafts"].items())
        print(f"{name:28} {r['tpf']:5.2f} {r['tokens_per_s']:6.1f} {r['speed_vs_ar']:5.2f} "
              f"{r['quality']:5.2f} {r['relative_quality'] or 0:5.2f} "
              f"{r['agreement_with_ar']:5.2f} {r['repetition']['all'] or 0:5.3f}  "
              f"{drafts}")  # fmt: skip
    print(f"wrote {path}")
    print(json.dumps({"items": len(items)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
