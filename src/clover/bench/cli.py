"""`clover bench speed | quality | plot | gpu`: argument parsing, model loading, results files.

The harnesses (`speed.run_speed`, `quality.run_quality`, `gpu.time_passes`) take loaded models
and return dicts; this file loads what the flags name, adds the machine/settings/date/command
record, writes `benchmarks/results/bench-<kind>-<model>[-quick].json` and draws the plots.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from clover.bench.common import (
    DecoderConfig,
    command_line,
    machine,
    model_label,
    now,
    parse_configs,
    write_results,
)
from clover.bench.gpu import format_gpu, time_passes
from clover.bench.llama_server import LlamaServerEngine, is_server_peer, server_flags
from clover.bench.load import format_load, run_load
from clover.bench.passes import format_passes, run_passes
from clover.bench.quality import run_quality
from clover.bench.speed import (
    DEFAULT_CONFIGS,
    LLAMACPP_MISSING,
    CloverEngine,
    LlamaCppEngine,
    TransformersEngine,
    add_ratios,
    gguf_precision,
    llamacpp_available,
    llamacpp_check,
    probe_rss,
    run_speed,
)
from clover.checkpoints import BASE_MODEL, DEFAULT_MODEL
from clover.checkpoints.registry import resolve
from clover.data.bench_prompts import OPEN_CODE_PROMPTS, SPEED_PROMPTS
from clover.data.suite import KINDS, load_suite
from clover.decoding.policies import Source, draft_sources
from clover.engine import LLM
from clover.errors import CloverError

RESULTS = Path("benchmarks") / "results"


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _out_path(a: argparse.Namespace, kind: str) -> Path:
    if a.out:
        return Path(a.out)
    return RESULTS / f"bench-{kind}-{model_label(a.model)}{'-quick' if a.quick else ''}.json"


def _busy_note(record: dict) -> list[str]:
    """A note when other work loads the machine: every row then runs slower and noisier."""
    load, cores = record.get("load_average_1m", 0), record.get("cores") or 1
    if load > 0.5 * cores:
        return [
            f"the machine was busy: 1-minute load average {load} on {cores} cores at the start; "
            "figures are slower and noisier than on an idle machine"
        ]
    return []


def _plot(fn_name: str, *args: object) -> list[str]:
    try:
        from clover.bench import plots
    except ImportError:
        _log("plots skipped: matplotlib is not installed (`pip install 'clover[bench]'`)")
        return []
    return [str(p) for p in getattr(plots, fn_name)(*args)]


# --- speed ---------------------------------------------------------------------------------------


def _our_rss_key(dtype: str, compiled: bool) -> str:
    """The peak-RSS probe of one loaded copy of our model (a precision, maybe compiled)."""
    return f"clover {dtype}{' compiled' if compiled else ''}"


def _store_record(llm: LLM) -> dict | None:
    store = llm.runtime.store
    return None if store is None else store.describe()


PROMPT_SETS = {"speed": SPEED_PROMPTS, "code": OPEN_CODE_PROMPTS}


def cmd_speed(a: argparse.Namespace) -> int:

    machine_record = machine()  # before our own load: the load average says what else runs
    if a.quick:
        a.tokens, a.reps, a.prompts = a.tokens or 32, a.reps or 1, a.prompts or 1
        a.dtypes = a.dtypes or "auto"
    texts = PROMPT_SETS[a.prompt_set]
    tokens, reps, n_prompts = a.tokens or 128, a.reps or 3, a.prompts or len(texts)
    configs = parse_configs(a.configs or DEFAULT_CONFIGS)  # checked before any load
    batches = sorted({int(b) for b in a.batch.split(",")})
    peers = {p.strip() for p in a.peers.split(",") if p.strip()}
    servers = sorted(p for p in peers if is_server_peer(p))
    unknown = peers - set(servers) - {"transformers", "llama.cpp"}
    if unknown:
        raise CloverError(
            f"unknown peers {sorted(unknown)}: transformers, llama.cpp, "
            "llama-server[:ngram-mod|:ngram-simple|:draft=MODEL|:dflash=FILE]"
        )
    # checked before any load too: a bad kind or a missing draft file fails now
    server_specs = [server_flags(p, lambda m: resolve(m, progress=False).path) for p in servers]
    notes: list[str] = []
    llms: dict[str, object] = {}
    for dt in (a.dtypes or "auto,float32").split(","):
        llm = LLM(a.model, dtype=dt.strip(), progress=False, device=a.device,
                  adapter=a.adapter, drafter=a.drafter, store=a.store)  # fmt: skip
        llms.setdefault(llm.dtype, llm)  # `auto` may resolve to float32 itself
    # `default`: the model's own decoding (the same at every precision)
    default = DecoderConfig.model_default(next(iter(llms.values())).config)
    configs = parse_configs(a.configs or DEFAULT_CONFIGS, default)
    compiled = []
    if a.compile:  # a second, compiled copy per precision: rows side by side with eager
        for dt in list(llms):
            _log(f"compiling the causal passes at {dt} (slow the first time)")
            compiled.append(LLM(a.model, dtype=dt, progress=False, compile=True, device=a.device,
                                adapter=a.adapter, drafter=a.drafter, store=a.store))  # fmt: skip
    # the speed prompts repeat (reps, batches): a store that learned from one run's answers
    # would draft the next run's from them; it stays at its seed
    for llm in list(llms.values()) + compiled:
        if any(Source.STORE in draft_sources(c.draft) for c in configs):
            llm.runtime.ngram_store()  # made now: its first rows' answers must not feed it
        store = llm.runtime.store
        if store is not None:
            store.learning = False
    first = next(iter(llms.values()))
    device = first.device
    if device.type != "cpu":  # peers and RSS probes measure CPU processes: not side by side
        if peers:
            notes.append(f"peers skipped: they run on the CPU here, our rows on {device}")
        peers, a.no_rss = set(), True
    prompts = [first.chat_prompt([{"role": "user", "content": p}]) for p in texts[:n_prompts]]
    ours = list(llms.values()) + compiled
    engines: list[object] = [CloverEngine(llm, c) for llm in ours for c in configs]
    gguf = first.resolved.path if first.resolved and first.resolved.kind == "gguf" else None
    if peers and gguf is None:
        notes.append("peers skipped: they load a GGUF file and this model is not one")
    pad_id = first.tokenizer.pad_token_id
    pad_id = first.eos_token_ids[0] if pad_id is None else pad_id
    if gguf is not None and "transformers" in peers:
        engines.append(TransformersEngine(gguf, pad_id))
    gguf_type = gguf_precision(gguf) if gguf is not None else None
    if gguf is not None and "llama.cpp" in peers:
        if llamacpp_available():
            why, system = llamacpp_check(gguf, torch.get_num_threads())
            if why is None:
                engines.append(LlamaCppEngine(gguf, gguf_type, torch.get_num_threads()))
                notes.append(f"llama.cpp build: {system}")
            else:
                notes.append(why)
                _log(why)
        else:
            notes.append(LLAMACPP_MISSING)
            _log(LLAMACPP_MISSING)
    peer_runs = {}
    if gguf is not None and server_specs:
        for label, flags in server_specs:
            _log(f"starting llama-server {label}")
            e = LlamaServerEngine(gguf, gguf_type, torch.get_num_threads(), label, flags)
            engines.append(e)
            peer_runs[e.name] = e.describe()
    if any(b > 1 for b in batches) and any(e.engine == "llama.cpp" for e in engines):
        notes.append("llama.cpp rows run batch 1 only")
    _log(f"{len(engines)} rows x {len(prompts)} prompts x {reps} reps, batches {batches}")
    rss: dict[str, float | None] = {}
    try:
        rows = run_speed(engines, prompts, tokens=tokens, reps=reps, batches=batches, log=_log)
    finally:
        for e in engines:
            if isinstance(e, LlamaServerEngine):
                rss[e.name] = e.peak_rss_mb()  # the server's own high-water mark
                e.close()
    add_ratios(rows)
    if not a.no_rss:
        base = dict(model=a.model, prompts=prompts, tokens=tokens, batch=max(batches),
                    adapter=a.adapter, drafter=a.drafter)  # fmt: skip
        base.update(threads=torch.get_num_threads(), gguf=str(gguf), pad_id=pad_id)
        specs = {"baseline (python + torch + transformers, no model)": dict(engine="none")}
        for llm in ours:
            specs[_our_rss_key(llm.dtype, llm.compiled)] = dict(
                engine="clover",
                dtype=llm.dtype,
                compile=llm.compiled,
                configs=[c.name for c in configs],
            )
        for e in engines:
            if e.engine != "clover" and not isinstance(e, LlamaServerEngine):
                specs[e.name] = dict(engine=e.engine, precision=e.precision)
        for name, spec in specs.items():
            _log(f"peak RSS probe: {name}")
            rss[name] = probe_rss({**base, **spec})
        for name, row in rows.items():
            ours_row = row["engine"] == "clover"
            key = _our_rss_key(row["precision"], row.get("compiled", False)) if ours_row else name
            row["peak_rss_mb"] = rss.get(key)
    for name in peer_runs:  # read from the server itself, probes or not
        rows[name]["peak_rss_mb"] = rss.get(name)
    report = {
        "benchmark": "clover bench speed",
        "quick": bool(a.quick),
        "date": now(),
        "command": command_line(),
        "machine": machine_record,
        "model": a.model,
        "settings": {
            "configs": [c.name for c in configs],
            "adapter": first.adapter,
            "drafter": a.drafter,
            # the drafter the model ran with (its registry default unless --drafter) and, for
            # a draft model, its wider tensors' precision
            "drafter_loaded": first.drafter,
            "draft_model_wide": first.draft_wide,
            "store": _store_record(first),
            "precisions": {
                "clover": list(llms),
                "compiled": [llm.dtype for llm in compiled],
                "transformers": "float32 (the GGUF dequantized by transformers)",
                "llama.cpp": f"{gguf_type} (the GGUF as it is)" if gguf_type else None,
            },
            "device": str(device)
            + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
            "tokens_per_row": tokens,
            "reps": reps,
            "prompt_set": a.prompt_set,
            "prompts": texts[:n_prompts],
            "llama_server": peer_runs,
            "prompt_tokens": [len(p) for p in prompts],
            "batches": batches,
            "greedy": True,
            "eos": "ignored on every engine: exactly tokens_per_row output tokens per row",
            "tokens_per_s": "output tokens only / wall time of the call (prefill included)",
            "peak_rss": "ru_maxrss of a fresh child process per engine and precision that "
            "loads it alone and runs all its configs once at the largest batch",
        },
        "notes": notes + _busy_note(machine_record),
        "peak_rss_mb": rss,
        "rows": rows,
    }
    out = write_results(report, _out_path(a, "speed"))
    _log(f"wrote {out}")
    print(format_speed(report))
    if not a.no_plot:
        for p in _plot("plot_speed", report, out.with_suffix(".png")):
            _log(f"wrote {p}")
    return 0


def format_speed(report: dict) -> str:
    head = f"{'row':<40} {'batch':>5} {'tok/s (min-max)':>22} {'TPF':>6} {'TTFT s':>7}"
    lines = [head + f" {'RSS MB':>7}"]
    for name, row in report["rows"].items():
        for b, s in row["batch"].items():
            if not s:
                continue
            t = s["tokens_per_s"]
            rng = f"{t['median']} ({t['min']}-{t['max']})"
            rss = row.get("peak_rss_mb")
            lines.append(
                f"{name:<40} {b:>5} {rng:>22} {s['tpf']:>6} {s['ttft_s']['median']:>7} "
                f"{rss if rss is not None else '-':>7}"
            )
    return "\n".join(lines + [f"note: {n}" for n in report["notes"]])


# --- quality -------------------------------------------------------------------------------------


def cmd_quality(a: argparse.Namespace) -> int:

    machine_record = machine()  # before our own load: the load average says what else runs
    if a.quick:
        a.limit = a.limit or 8
    text = a.configs or "ar,low_confidence:32:0.95,self_spec:4,self_spec:4:lookup,default"
    parse_configs(text)  # checked before the load
    items = load_suite(a.suite, limit=a.limit, kinds=tuple(a.kinds.split(",")))
    llm = LLM(a.model, dtype=a.dtype, progress=False, adapter=a.adapter, drafter=a.drafter,
              store=a.store)  # fmt: skip
    configs = parse_configs(text, DecoderConfig.model_default(llm.config))
    if a.store_frozen and llm.runtime.store is not None:
        llm.runtime.store.learning = False
    reference = None
    if a.reference != "none":
        same = a.reference == a.model and a.reference_dtype == llm.dtype
        reference = llm if same else LLM(a.reference, dtype=a.reference_dtype, progress=False)
    _log(f"{len(items)} items x {len(configs)} settings on {llm.name} ({llm.dtype})")
    result = run_quality(
        llm,
        configs,
        items,
        max_tokens=a.max_tokens,
        batch_size=a.batch_size,
        reference=reference,
        code_timeout=a.code_timeout,
        code_memory_mb=a.code_memory_mb,
        log=_log,
    )
    report = {
        "benchmark": "clover bench quality",
        "quick": bool(a.quick),
        "date": now(),
        "command": command_line(),
        "machine": machine_record,
        "notes": _busy_note(machine_record),
        "model": a.model,
        "dtype": llm.dtype,
        "suite": str(a.suite or "benchmarks/suites/quality.jsonl"),
        **result,
    }
    out = write_results(report, _out_path(a, "quality"))
    _log(f"wrote {out}")
    print(format_quality(report))
    if not a.no_plot:
        for p in _plot("plot_quality", report, out.with_suffix("")):
            _log(f"wrote {p}")
    return 0


def format_quality(report: dict) -> str:
    head = f"{'setting':<26} {'code':>5} {'math':>5} {'fact':>5} {'all':>5} {'=ar':>5} "
    lines = [head + f"{'NLL':>6} {'rep':>6} {'TPF':>6} {'tok/s':>7}"]
    for name, s in report["summary"].items():
        acc = s["accuracy"]

        def f(v: object, width: int = 5) -> str:
            return f"{v:>{width}.2f}" if isinstance(v, float) else f"{'-':>{width}}"

        lines.append(
            f"{name:<26} {f(acc.get('code'))} {f(acc.get('math'))} {f(acc.get('fact'))} "
            f"{f(acc.get('all_checked'))} {f(s['agreement_with_ar'])} "
            f"{f(s['fluency_nll']['open'], 6)} {f(s['repetition']['open'], 6)} "
            f"{f(s['tpf'], 6)} {f(s['tokens_per_s'], 7)}"
        )
    return "\n".join(lines)


# --- plot / gpu ----------------------------------------------------------------------------------


def cmd_plot(a: argparse.Namespace) -> int:

    written: list[str] = []
    for path in a.results:
        report = json.loads(Path(path).read_text())
        kind = report.get("benchmark", "")
        if kind.endswith("speed"):
            written += _plot("plot_speed", report, Path(path).with_suffix(".png"))
        elif kind.endswith("quality"):
            written += _plot("plot_quality", report, Path(path).with_suffix(""))
        else:
            raise CloverError(f"{path}: not a `clover bench` speed or quality results file")
    for p in written:
        print(p)
    return 0


def cmd_load(a: argparse.Namespace) -> int:

    models = [m.strip() for m in a.models.split(",") if m.strip()]
    record = machine()
    report = {"benchmark": "clover bench load", "date": now(), "command": command_line(),
              "machine": record, "notes": _busy_note(record)}  # fmt: skip
    report.update(run_load(models, a.tokens, a.reps, a.threads, log=_log))
    out = Path(a.out) if a.out else RESULTS / "bench-load.json"
    write_results(report, out)
    _log(f"wrote {out}")
    print(format_load(report))
    return 0


def cmd_passes(a: argparse.Namespace) -> int:

    if a.threads:
        torch.set_num_threads(a.threads)
    llm = LLM(a.model, dtype=a.dtype, progress=False)
    ints = lambda text: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731
    record = machine()
    report = {"benchmark": "clover bench passes", "date": now(), "command": command_line(),
              "machine": record, "model": a.model, "dtype": llm.dtype, "reps": a.reps,
              "notes": _busy_note(record)}  # fmt: skip
    report.update(run_passes(llm.model, ints(a.widths), a.block, ints(a.batch), ints(a.cache),
                             a.reps, log=_log))  # fmt: skip
    out = Path(a.out) if a.out else RESULTS / f"bench-passes-{model_label(a.model)}.json"
    write_results(report, out)
    _log(f"wrote {out}")
    print(format_passes(report))
    return 0


def cmd_gpu(a: argparse.Namespace) -> int:

    report = time_passes(
        preset=a.preset,
        device=a.device,
        lengths=[int(x) for x in a.lengths.split(",")] if a.lengths else None,
        batches=[int(x) for x in a.batch.split(",")],
        block=a.block,
        reps=a.reps,
        tpf=a.tpf,
        log=_log,
    )
    report.update(benchmark="clover bench gpu", date=now(), command=command_line())
    report["machine"] = machine()
    out = Path(a.out) if a.out else RESULTS / f"bench-gpu-{a.preset}-{report['device']}.json"
    write_results(report, out)
    _log(f"wrote {out}")
    print(format_gpu(report))
    return 0


# --- parser --------------------------------------------------------------------------------------


def add_bench_parser(sub: argparse._SubParsersAction) -> None:

    bench = sub.add_parser("bench", help="speed and quality benchmarks (results + plots)")
    kinds = bench.add_subparsers(dest="bench", required=True)

    s = kinds.add_parser("speed", help="tokens/s, NFE, TPF, TTFT, RSS: ours vs peers")
    s.add_argument("--model", "-m", default=DEFAULT_MODEL, help="name, GGUF file or HF directory")
    s.add_argument("--configs", "--decoders", help="comma list; `default` is the model's own "
                   "decoding (default: ar, low_confidence 8/16/32 x 0.9/0.95, self_spec 4/8, "
                   "self_spec:4:lookup, default)")  # fmt: skip
    s.add_argument("--dtypes", help="our precisions, comma list (default auto,float32)")
    s.add_argument("--peers", default="transformers,llama.cpp",
                   help="'' for none; llama-server[:ngram-mod|:ngram-simple|:draft=MODEL|"
                   ":dflash=FILE.gguf] runs llama.cpp's server, with its speculation")  # fmt: skip
    s.add_argument("--prompt-set", choices=sorted(PROMPT_SETS), default="speed",
                   help="speed: four open-ended answers; code: ten coding requests that "
                   "do not quote their answer")  # fmt: skip
    s.add_argument("--tokens", type=int, help="output tokens per row (128; quick 32)")
    s.add_argument("--reps", type=int, help="repetitions (3; quick 1)")
    s.add_argument("--prompts", type=int, help="how many of the built-in prompts (4; quick 1)")
    s.add_argument("--batch", default="1,8", help="batch sizes, comma list (1,8)")
    s.add_argument("--out", help="results JSON (default benchmarks/results/bench-speed-*.json)")
    s.add_argument("--quick", action="store_true", help="a smoke run: short, our default dtype")
    s.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    s.add_argument(
        "--device",
        default="cpu",
        help="where our rows run: cpu (default), cuda, "
        "cuda:N or auto; off the CPU, peers and RSS probes are skipped",
    )
    s.add_argument("--compile", action="store_true",
                   help="also rows with torch.compile'd causal passes, per precision")  # fmt: skip
    s.add_argument("--adapter", help="a draft adapter file to attach (clover train adapt)")
    s.add_argument("--drafter", help="a drafter file for self_spec:B:drafter configs, or a "
                   "smaller model of the same tokenizer that drafts as a whole (a name, GGUF "
                   "file or HF directory); none: not even the model's own")  # fmt: skip
    s.add_argument("--store", action="append", metavar="PATH",
                   help="seed for self_spec:B:lookup+store: a `clover data distill` set of "
                   "this model or a text file (repeatable); the store does not learn here "
                   "(the prompts repeat)")  # fmt: skip
    s.add_argument("--no-plot", action="store_true")
    s.set_defaults(func=cmd_speed)

    q = kinds.add_parser("quality", help="the project's suite: accuracy, agreement, fluency")
    q.add_argument("--model", "-m", default=DEFAULT_MODEL, help="name, GGUF file or HF directory")
    q.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8",
                   "int4"])  # fmt: skip
    q.add_argument("--configs", "--decoders",
                   help="comma list; `default` is the model's own decoding (default ar,"
                   "low_confidence:32:0.95,self_spec:4,self_spec:4:lookup,default)")  # fmt: skip
    q.add_argument("--suite", help="JSONL suite (default benchmarks/suites/quality.jsonl)")
    q.add_argument("--adapter", help="a draft adapter file to attach (clover train adapt)")
    q.add_argument("--drafter", help="a drafter file for self_spec:B:drafter configs, or a "
                   "smaller model of the same tokenizer that drafts as a whole (a name, GGUF "
                   "file or HF directory); none: not even the model's own")  # fmt: skip
    q.add_argument("--store", action="append", metavar="PATH",
                   help="seed for self_spec:B:lookup+store: a `clover data distill` set of "
                   "this model or a text file (repeatable)")  # fmt: skip
    q.add_argument("--store-frozen", action="store_true",
                   help="the store keeps its seed only (default: each setting's store also "
                   "learns from its own earlier answers, as a server's would)")  # fmt: skip
    q.add_argument("--limit", type=int, help="first N items, kinds in turn (quick: 8)")
    every = ",".join(KINDS)
    q.add_argument("--kinds", default=every, help=f"the suite's kinds to run (default {every})")
    q.add_argument("--max-tokens", type=int, default=128)
    q.add_argument("--batch-size", type=int, default=8, help="items decoded together (8)")
    q.add_argument("--reference", default=BASE_MODEL,
                   help="AR model that scores fluency ('none': skip)")  # fmt: skip
    q.add_argument("--reference-dtype", default="float32")
    q.add_argument("--code-timeout", type=float, default=5.0, help="seconds per code check")
    q.add_argument("--code-memory-mb", type=int, default=256, help="address space per check")
    q.add_argument("--out", help="results JSON (default benchmarks/results/bench-quality-*.json)")
    q.add_argument("--quick", action="store_true", help="a smoke run (--limit 8)")
    q.add_argument("--no-plot", action="store_true")
    q.set_defaults(func=cmd_quality)

    ld = kinds.add_parser(
        "load",
        help="start time, peak RSS and disk: ours vs llama.cpp on "
        "the same GGUF (first-ever and warm starts)",
    )
    ld.add_argument(
        "--models",
        "-m",
        default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b",
        help="comma list of GGUF models (names or paths)",
    )
    ld.add_argument("--tokens", type=int, default=256, help="answer length for the RSS figure")
    ld.add_argument("--reps", type=int, default=3, help="warm starts per engine")
    ld.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ld.add_argument("--out", help="results JSON (default benchmarks/results/bench-load.json)")
    ld.set_defaults(func=cmd_load)
    p = kinds.add_parser("plot", help="PNGs from bench results files")
    p.add_argument("results", nargs="+", help="bench-speed-*.json / bench-quality-*.json")
    p.set_defaults(func=cmd_plot)

    ps = kinds.add_parser("passes", help="forward pass cost by width, by component, vs bounds")
    ps.add_argument("--model", "-m", default=DEFAULT_MODEL, help="name, GGUF file or HF directory")
    ps.add_argument("--dtype", default="int4", help="precision (int4)")
    ps.add_argument("--widths", default="4,8,16", help="verify pass widths (4,8,16)")
    ps.add_argument("--block", type=int, default=33, help="block pass positions (33)")
    ps.add_argument("--batch", default="1,8", help="rows per pass (1,8)")
    ps.add_argument("--cache", default="200,2000", help="cached tokens per row (200,2000)")
    ps.add_argument("--reps", type=int, default=10, help="timed passes each (10)")
    ps.add_argument("--threads", type=int, help="torch threads (default: PyTorch's)")
    ps.add_argument("--out", help="results JSON (default benchmarks/results/bench-passes-*.json)")
    ps.set_defaults(func=cmd_passes)

    g = kinds.add_parser("gpu", help="time one block pass and one commit pass at a model shape")
    g.add_argument("--preset", default="clover-35b-a3b", help="clover-35b-a3b or clover-tiny")
    g.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cpu")
    g.add_argument("--lengths", help="prompt lengths (default 1024,8192,32768; tiny 64,256)")
    g.add_argument("--batch", default="1,8")
    g.add_argument("--block", type=int, default=32, help="block positions (32)")
    g.add_argument("--reps", type=int, default=5)
    g.add_argument("--tpf", type=float, action="append", help="TPF for the tokens/s bound")
    g.add_argument("--out", help="results JSON")
    g.set_defaults(func=cmd_gpu)
