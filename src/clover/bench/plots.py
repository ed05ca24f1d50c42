"""PNGs from `clover bench` results files (matplotlib, `pip install 'clover[bench]'`).

- `plot_speed`: median output tokens/s per row (min-max whiskers), one panel per batch size.
- `plot_quality`: accuracy vs TPF across decoder settings (the frontier: settings no other
  beats on both), and the decode trace of one answer: which step committed each token.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402 (the backend is chosen first)

ENGINE_COLOURS = {"clover": "#2a7a3b", "transformers": "#c05a1a", "llama.cpp": "#3a5cc0"}


def _subtitle(report: dict) -> str:
    m = report.get("machine", {})
    quick = "QUICK smoke run, " if report.get("quick") else ""
    return f"{quick}{m.get('cpu', '?')}, {m.get('torch_threads', '?')} threads, {report['date']}"


def plot_speed(report: dict, out: str | Path) -> list[Path]:
    rows = report["rows"]
    batches = sorted({b for r in rows.values() for b, s in r["batch"].items() if s}, key=int)
    fig, axes = plt.subplots(
        1, len(batches), figsize=(6 * len(batches), 0.35 * len(rows) + 2), squeeze=False
    )
    for ax, b in zip(axes[0], batches):
        names = [n for n, r in rows.items() if r["batch"].get(b)]
        stats = [rows[n]["batch"][b]["tokens_per_s"] for n in names]
        med = [s["median"] for s in stats]
        err = [
            [m - s["min"] for m, s in zip(med, stats)],
            [s["max"] - m for m, s in zip(med, stats)],
        ]
        colours = [ENGINE_COLOURS.get(rows[n]["engine"], "grey") for n in names]
        ax.barh(names, med, xerr=err, color=colours, capsize=2)
        ax.invert_yaxis()
        ax.set_xlabel("output tokens/s (median, min-max)")
        ax.set_title(f"batch {b}")
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"clover bench speed: {report['model']}\n{_subtitle(report)}", fontsize=9)
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points no other point beats on both axes (higher TPF and higher accuracy)."""
    best = sorted(points, key=lambda p: (-p[0], -p[1]))
    out, top = [], float("-inf")
    for x, y in best:
        if y > top:
            out.append((x, y))
            top = y
    return sorted(out)


def plot_quality(report: dict, stem: str | Path) -> list[Path]:
    """-> [<stem>-frontier.png, <stem>-trace.png]"""
    stem = Path(stem)
    paths = []
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    points = []
    for name, s in report["summary"].items():
        acc, tpf = s["accuracy"].get("all_checked"), s["tpf"]
        if acc is None or tpf is None:
            continue
        points.append((tpf, acc))
        ax.scatter(tpf, acc, color="#2a7a3b" if name != "ar" else "#c05a1a")
        ax.annotate(name, (tpf, acc), fontsize=7, xytext=(4, 3), textcoords="offset points")
    if len(points) > 1:
        xs, ys = zip(*_frontier(points))
        ax.plot(xs, ys, "--", color="grey", alpha=0.6, label="frontier")
        ax.legend(fontsize=7)
    ax.set_xlabel("tokens per forward (TPF)")
    ax.set_ylabel("accuracy (code + math + fact items)")
    ax.set_title(f"clover bench quality: {report['model']} ({report.get('dtype')})\n"
                 f"{_subtitle(report)}", fontsize=8)  # fmt: skip
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "-frontier.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    trace = _pick_trace(report.get("traces", {}))
    if trace:
        paths.append(stem.with_name(stem.name + "-trace.png"))
        plot_trace(*trace, paths[-1], _subtitle(report))
    return paths


def _pick_trace(traces: dict) -> tuple[str, dict] | None:
    """The trace of the most parallel non-AR setting (its steps say the most)."""
    candidates = [(n, t) for n, t in traces.items() if n != "ar" and t["steps"]]
    candidates = candidates or [(n, t) for n, t in traces.items() if t["steps"]]
    return max(candidates, key=lambda nt: nt[1]["tpf"]) if candidates else None


def plot_trace(name: str, trace: dict, out: str | Path, subtitle: str = "") -> None:
    """Tokens of one answer in reading order, wrapped, each coloured by the step that
    committed it; the step number is printed under the token."""
    pieces, steps = trace["pieces"], trace["steps"]
    per_line = 12
    lines = (len(pieces) + per_line - 1) // per_line
    fig, ax = plt.subplots(figsize=(12, 0.55 * lines + 1.4))
    cmap = plt.get_cmap("viridis")
    top = max(steps) if steps else 1
    for i, (piece, step) in enumerate(zip(pieces, steps)):
        x, y = i % per_line, -(i // per_line)
        ax.add_patch(plt.Rectangle((x, y - 0.4), 0.96, 0.8, color=cmap(step / top), alpha=0.55))
        label = piece.replace("\n", "\\n").strip() or "␣"
        ax.text(x + 0.48, y + 0.08, label[:12], ha="center", va="center", fontsize=7)
        ax.text(x + 0.48, y - 0.26, str(step), ha="center", va="center", fontsize=5, color="#333")
    ax.set_xlim(0, per_line)
    ax.set_ylim(-lines + 0.5, 0.6)
    ax.axis("off")
    ax.set_title(
        f"decode trace, {name}, item {trace['item']}: colour and small number = the step that "
        f"committed the token (TPF {trace['tpf']})\n{subtitle}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
