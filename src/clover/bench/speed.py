"""`clover bench speed`: our decoders and the tools a user would pick instead, side by side.

Rows: each decoder config on our engine at each requested precision (default: ours, `auto`,
and `float32`, the precision transformers runs the same GGUF at); transformers `generate` on
the same GGUF (dequantized to float32); llama.cpp through llama-cpp-python on the GGUF as it
is (Q4_1 for the default model), when that package is installed (`pip install clover[llamacpp]`).

Method (so the numbers reproduce and compare):
- every engine gets the same prompt token ids (the model's chat template) and makes exactly
  `tokens` output tokens per row, greedy, EOS ignored;
- output tokens/s = output tokens (never prompt tokens) / wall time of the whole call, prompt
  processing included; batch B counts B x tokens;
- time to first token: from the call to the moment a row's first output token is final
  (median over the rows of a batch); for transformers, the first logits-processor call, which
  comes right after the prefill forward; for llama.cpp, the first token the generator yields;
- NFE: forward passes per row (ours: counted by the decoding loop; peers: one per token);
  TPF = output tokens / NFE;
- repetitions are interleaved: every rep runs every row once per prompt, the row order
  rotating between reps, so slow drifts (thermal, other load) spread over all rows; median,
  min and max are reported;
- peak RSS: each engine and precision is loaded alone in a fresh child process that runs all
  of its configs at the largest batch once; its `ru_maxrss` is the figure (a bare process
  that imports the same libraries gives the baseline);
- a `self_spec` row records the pass costs its draft lengths followed (`pass_costs_ms`): they
  are timed once per machine and kernel build and kept, so two runs may decide with different
  tables.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from clover.bench.common import DecoderConfig, peak_rss_mb, spread, verify_passes
from clover.decoding.loop import generate
from clover.engine import LLM
from clover.errors import CloverError

DEFAULT_CONFIGS = (
    "ar,"
    "low_confidence:8:0.9,low_confidence:8:0.95,"
    "low_confidence:16:0.9,low_confidence:16:0.95,"
    "low_confidence:32:0.9,low_confidence:32:0.95,"
    "self_spec:4,self_spec:8,self_spec:4:lookup,default"
)
LLAMACPP_MISSING = (
    "llama.cpp skipped: llama-cpp-python is not installed (`pip install 'clover[llamacpp]'`; "
    "it compiles llama.cpp, which takes minutes)"
)


@dataclass
class RunStats:
    """One call: `rows` sequences of `tokens_per_row` output tokens each."""

    rows: int
    tokens_per_row: int
    seconds: float
    nfe_per_row: float
    ttft: float
    token_ids: list[list[int]] = field(default_factory=list)
    drafts: dict = field(default_factory=dict)  # self_spec: source -> [drafted, kept]
    accepted: list[int] = field(default_factory=list)  # drafted tokens kept, per verify pass

    @property
    def tokens_per_s(self) -> float:
        return self.rows * self.tokens_per_row / self.seconds


# --- engines -------------------------------------------------------------------------------------


class CloverEngine:
    engine = "clover"

    def __init__(self, llm: LLM, config: DecoderConfig) -> None:
        self.llm, self.config = llm, config
        self.precision = llm.dtype
        self.compiled = getattr(llm, "compiled", False)
        self.name = f"clover {config.name} {llm.dtype}{' compiled' if self.compiled else ''}"

    def run(self, prompts: list[list[int]], n: int) -> RunStats:

        results: list = []
        first: dict[int, float] = {}
        t0 = time.perf_counter()
        # no EOS ids: every row makes exactly n tokens
        loop = generate(self.llm.runtime, prompts, self.config.policy(), max_new_tokens=n,
                        results=results, cached=False)  # fmt: skip
        for event in loop:
            for row in event.final:
                first.setdefault(row, time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
        ttft = sorted(first.values())[len(first) // 2] if first else seconds
        nfe = sum(r.nfe for r in results) / len(results)
        ids = [r.tokens for r in results]
        drafts: dict = {}
        for r in results:
            for source, (d, k) in r.drafts.items():
                tally = drafts.setdefault(source, [0, 0])
                tally[0], tally[1] = tally[0] + d, tally[1] + k
        accepted = [a for r in results for a in r.accepted]
        return RunStats(len(prompts), n, seconds, nfe, ttft, ids, drafts, accepted)


class TransformersEngine:
    """HF transformers `generate` on the same GGUF file (transformers dequantizes it)."""

    engine = "transformers"

    def __init__(self, gguf: object, pad_id: int) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # transformers' model classes: only for its row
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        self.pad_id = pad_id
        self.precision = "float32"
        self.name = "transformers generate float32"

    def run(self, prompts: list[list[int]], n: int) -> RunStats:
        from transformers import LogitsProcessor, LogitsProcessorList  # only for transformers' row

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for k, p in enumerate(prompts):  # left padding, as decoder-only batching needs
            ids[k, width - len(p) :] = torch.tensor(p)
            mask[k, width - len(p) :] = 1
        marks: list[float] = []

        class FirstCall(LogitsProcessor):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                if not marks:
                    marks.append(time.perf_counter())
                return scores

        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=self.pad_id,
                logits_processor=LogitsProcessorList([FirstCall()]),
            )
        seconds = time.perf_counter() - t0
        new = out[:, width:].tolist()
        return RunStats(len(prompts), n, seconds, float(n), marks[0] - t0, new)


class LlamaCppEngine:
    """llama.cpp via llama-cpp-python on the GGUF file as it is; one sequence at a time (its
    high-level `Llama` has no batched generation)."""

    engine = "llama.cpp"

    def __init__(self, gguf: object, precision: str, threads: int, n_ctx: int = 2048) -> None:
        import llama_cpp  # optional (`.[llamacpp]`): only for its row

        self.model = llama_cpp.Llama(
            model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_batch=512, verbose=False
        )
        self.precision = precision
        self.name = f"llama.cpp {precision}"

    def run(self, prompts: list[list[int]], n: int) -> RunStats:
        if len(prompts) != 1:
            raise CloverError("llama-cpp-python's Llama generates one sequence at a time")
        self.model.reset()  # no prompt reuse between runs: prompt processing is timed too
        tokens: list[int] = []
        t0 = time.perf_counter()
        ttft = 0.0
        gen = self.model.generate(
            prompts[0], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
        )
        for tok in gen:  # a raw generator: it does not stop at EOS, so n tokens always come
            if not tokens:
                ttft = time.perf_counter() - t0
            tokens.append(int(tok))
            if len(tokens) == n:
                break
        seconds = time.perf_counter() - t0
        return RunStats(1, n, seconds, float(n), ttft, [tokens])


def llamacpp_available() -> bool:

    return importlib.util.find_spec("llama_cpp") is not None


_LLAMACPP_CHECK = """
import sys, llama_cpp
m = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), verbose=False)
gen = m.generate(m.tokenize(b"Hello"), top_k=1, temp=0.0)
next(gen); next(gen)
print(llama_cpp.llama_print_system_info().decode().strip())
"""


def llamacpp_check(
    gguf: object, threads: int, timeout: float = 300, program: str = _LLAMACPP_CHECK
) -> tuple[str | None, str]:
    """Load `gguf` in llama-cpp-python and make two tokens, in a child process: a llama.cpp
    build that crashes on this CPU (llama.cpp's AMX backend segfaults on some Sapphire
    Rapids-class machines with K-quants: llama.cpp issue 20824) would otherwise take the whole
    benchmark down with it. -> (None, llama.cpp's system info) when it works, else (why it
    does not, "")."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", program, str(gguf), str(threads)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"llama.cpp skipped: two tokens took over {timeout:.0f} s in a check", ""
    if proc.returncode == 0:
        return None, proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
    why = f"llama.cpp skipped: a two-token check of this GGUF died ({how})"
    if proc.returncode < 0:
        why += (
            "; if its log shows an AMX model buffer, this is llama.cpp's AMX backend (issue "
            "20824): rebuild llama-cpp-python without it, e.g. CMAKE_ARGS='-DGGML_NATIVE=OFF "
            "-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON' "
            "pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python"
        )
    else:
        why += f": {proc.stderr.strip()[-300:]}"
    return why, ""


def gguf_precision(path: object) -> str:
    """The GGUF's weight type as llama.cpp names it (Q4_1, F16, ...)."""
    from gguf import GGUFReader  # gguf's reader: slow to import, only here

    reader = GGUFReader(str(path))
    field_ = reader.fields.get("general.file_type")
    if field_ is None:
        return "gguf"
    from gguf import LlamaFileType  # gguf's reader: slow to import, only here

    value = int(field_.parts[field_.data[0]][0])
    return LlamaFileType(value).name.removeprefix("MOSTLY_")


# --- the harness ---------------------------------------------------------------------------------


def run_speed(
    engines: list[object],
    prompts: list[list[int]],
    *,
    tokens: int,
    reps: int,
    batches: list[int],
    log: object = None,
) -> dict:
    """Time every engine row; -> {row name: {"batch": {B: stats}}} (see the module doc)."""
    for e in engines:  # warm-up: first calls allocate and pick kernels
        # a compiled engine compiles a graph per batch shape (batch 1 is special): warm all
        for b in batches if getattr(e, "compiled", False) else [1]:
            e.run([prompts[i % len(prompts)] for i in range(b)], min(8, tokens))
    times: dict[tuple[str, int], list[RunStats]] = {}
    for batch in batches:
        groups = (
            [[p] for p in prompts]
            if batch == 1
            else [[prompts[i % len(prompts)] for i in range(batch)]]
        )
        rows = [e for e in engines if batch == 1 or e.engine != "llama.cpp"]
        for rep in range(reps):
            order = rows[rep % len(rows) :] + rows[: rep % len(rows)]
            for group in groups:
                for e in order:
                    times.setdefault((e.name, batch), []).append(e.run(group, tokens))
            if log:
                log(f"batch {batch}: rep {rep + 1}/{reps} done")
    out: dict[str, dict] = {}
    for e in engines:
        row = out.setdefault(
            e.name,
            {
                "engine": e.engine,
                "precision": e.precision,
                "decoder": getattr(getattr(e, "config", None), "name", "ar"),
                "batch": {},
            },
        )
        if getattr(e, "compiled", False):
            row["compiled"] = True  # torch.compile'd causal passes (`LLM(compile=True)`)
        if row["decoder"].startswith("self_spec"):  # the costs its draft lengths followed
            row["pass_costs_ms"] = pass_cost_tables(e.llm.runtime.measured_costs())
        for batch in batches:
            runs = times.get((e.name, batch))
            if not runs:
                row["batch"][str(batch)] = None
                continue
            nfe = sum(r.nfe_per_row for r in runs) / len(runs)
            row["batch"][str(batch)] = {
                "tokens_per_s": spread([r.tokens_per_s for r in runs]),
                "ttft_s": spread([r.ttft for r in runs], 3),
                "nfe_per_row": round(nfe, 2),
                "tpf": round(tokens / nfe, 3),
                "output_tokens_per_row": tokens,
            }
            accepted = [a for r in runs for a in r.accepted]
            drafts: dict = {}
            for r in runs:
                for source, (d, k) in r.drafts.items():
                    t = drafts.setdefault(source, [0, 0])
                    t[0], t[1] = t[0] + d, t[1] + k
            if accepted or drafts:  # what each verify pass kept (DFlash's acceptance length)
                # a peer reports totals only: its passes are its NFE
                passes = verify_passes(accepted) if accepted else {}
                row["batch"][str(batch)]["speculation"] = {
                    **passes,
                    "drafted_kept_by_source": drafts,
                    "kept_fraction": round(sum(k for _, k in drafts.values())
                                           / max(1, sum(d for d, _ in drafts.values())), 3),
                }  # fmt: skip
    _agreement(out, times, engines)
    return out


def pass_cost_tables(costs: dict) -> dict:
    """`Runtime.measured_costs()` as JSON: each table's ms by width (and by rows), to 0.1 ms.
    Draft lengths follow these tables, and a table is timed once per machine and kernel build:
    a results file says which one a run decided with."""

    def ms(table: dict) -> dict:
        return {str(w): round(v, 1) for w, v in sorted(table.items())}

    return {
        name: {
            "verify": ms(c.verify_ms),
            "draft": ms(c.draft_ms),
            "verify_by_rows": {str(r): ms(t) for r, t in sorted(c.rows_ms.items())},
            "draft_by_rows": {str(r): ms(t) for r, t in sorted(c.draft_rows_ms.items())},
        }
        for name, c in costs.items()
    }


def _agreement(out: dict, times: dict, engines: list[object]) -> None:
    """Whether our float32 `ar` made the same tokens as transformers (batch 1): a check that
    both engines run the same model, not a quality figure."""
    hf = [e for e in engines if e.engine == "transformers"]
    ours = [
        e
        for e in engines
        if e.engine == "clover" and e.precision == "float32" and e.config.decoder == "ar"
    ]
    if not hf or not ours or (hf[0].name, 1) not in times:
        return
    a, b = times[(ours[0].name, 1)], times[(hf[0].name, 1)]
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    out[ours[0].name]["same_tokens_as_transformers"] = f"{same}/{len(a)}"


def add_ratios(rows: dict) -> None:
    """Median tokens/s relative to transformers and to our `ar` at the same precision."""
    for batch in {b for r in rows.values() for b in r["batch"]}:

        def median(name: str, b: str = batch) -> float | None:
            stats = rows.get(name, {}).get("batch", {}).get(b)
            return stats["tokens_per_s"]["median"] if stats else None

        hf = next((median(n) for n, r in rows.items() if r["engine"] == "transformers"), None)
        for r in rows.values():
            stats = r["batch"].get(batch)
            if not stats:
                continue
            mine = stats["tokens_per_s"]["median"]
            if hf:
                stats["vs_transformers"] = round(mine / hf, 2)
            if r["engine"] == "clover":
                ar = median(f"clover ar {r['precision']}")  # eager: the reference
                if ar:
                    stats["vs_our_ar"] = round(mine / ar, 2)


# --- peak RSS, one engine per child process ------------------------------------------------------


def probe_rss(spec: dict, timeout: float = 900) -> float | None:
    """Run `spec` (engine, model, dtype, configs, prompts, tokens, batch) in a fresh process;
    -> its peak RSS in MB (None if it failed)."""
    proc = subprocess.run(
        [sys.executable, "-m", "clover.bench.speed", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        sys.stderr.write(f"RSS probe {spec['engine']} failed: {proc.stderr[-400:]}\n")
        return None
    return round(json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_mb"], 1)


def _probe_main(spec: dict) -> None:

    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    prompts, n, batch = spec["prompts"], spec["tokens"], spec["batch"]
    group = [prompts[i % len(prompts)] for i in range(batch)]
    import transformers  # noqa: F401 (the baseline imports what the benchmark process imports)

    if spec["engine"] == "clover":
        llm = LLM(spec["model"], dtype=spec["dtype"], progress=False,
                  compile=spec.get("compile", False), adapter=spec.get("adapter"),
                  drafter=spec.get("drafter"))  # fmt: skip
        for name in spec["configs"]:
            CloverEngine(llm, DecoderConfig.parse(name)).run(group, n)
    elif spec["engine"] == "transformers":
        TransformersEngine(Path(spec["gguf"]), spec["pad_id"]).run(group, n)
    elif spec["engine"] == "llama.cpp":
        e = LlamaCppEngine(spec["gguf"], spec["precision"], spec["threads"])
        e.run(group[:1], n)
    print(json.dumps({"peak_rss_mb": peak_rss_mb()}))


if __name__ == "__main__":
    _probe_main(json.loads(sys.argv[1]))
