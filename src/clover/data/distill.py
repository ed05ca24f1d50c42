"""`clover data distill`: the base model answers the project's prompt set; we keep its answers
and its top-k next-token distribution at every answer position.

Why top-k log-probs: distilling distributions (KL to the teacher) carries far more signal per
token than hard tokens, and compute is what a CPU adaptation lacks. The teacher decodes AR,
greedy, continuously batched (a finished answer's row takes the next prompt); each answer
position's distribution is kept from the AR step that wrote it: the numbers a verify pass
sees, without a second teacher-forced pass over prompt + answer (`teacher_topk_batch`), which
would add a large share of the time. An answer that ended on EOS keeps the EOS as its last target,
so the student learns to stop.

Output: `<out>/distill.jsonl`, one JSON object per prompt: id, kind, split (train / heldout,
a function of the id), messages, prompt_ids, answer_ids, finish_reason, topk_ids and
topk_logprobs ([answer_len][k]); `<out>/meta.json` records the settings. Rerunning skips
prompts already written (a crash loses at most the answers in flight; a torn last line is
ignored and redone).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from clover.checkpoints import resolve_device
from clover.data.prompts import PROMPT_SET_VERSION, prompt_set
from clover.data.self_prompts import VERSION as SELF_VERSION
from clover.data.self_prompts import self_prompt_set
from clover.decoding.loop import BatchDecoder
from clover.engine import LLM, GenerationSettings
from clover.errors import CloverError
from clover.files import truncate_torn_tail


def done_ids(path: Path) -> set[str]:
    """Ids already distilled; a torn (half-written) last line does not count."""
    ids: set[str] = set()
    if not path.exists():
        return ids
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                ids.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return ids


def teacher_topk_batch(
    model: torch.nn.Module, prompts: list[list[int]], answers: list[list[int]], k: int
) -> list[tuple]:
    """Top-k log-probs at each answer position of each prompt + answer, from one right-padded
    causal pass (padding comes after each row's tokens, so causal attention never reads it)
    -> [(ids, logprobs)] per row.
    Logits are made row by row: [answer_len, vocab], never [batch, length, vocab]."""
    seqs = [p + a for p, a in zip(prompts, answers)]
    width = max(len(s) for s in seqs)
    device = next(model.parameters()).device
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=device)
    valid = torch.tensor([len(s) for s in seqs], device=device)
    mask_id = model.config.mask_token_id
    out = []
    with torch.inference_mode():
        hidden = model(ids, n_valid=valid)
        for row, (p, a) in enumerate(zip(prompts, answers)):
            logits = model.logits(hidden[row, len(p) - 1 : len(p) + len(a) - 1]).float()
            if mask_id is not None:  # never a target, as in decoding
                logits[:, mask_id] = float("-inf")
            values, top = logits.log_softmax(-1).topk(k, dim=-1)
            out.append((top.tolist(), [[round(v, 4) for v in r] for r in values.tolist()]))
    return out


def distill(
    model: str,
    out_dir: Path,
    n_prompts: int,
    *,
    max_tokens: int = 192,
    batch_size: int = 8,
    top_k: int = 8,
    seed: int = 0,
    dtype: str = "auto",
    device: str = "cpu",
    max_minutes: float | None = None,
    skip: list[Path] | tuple = (),
    self_prompts: bool = False,
    progress: bool = True,
) -> dict:
    """Distil `n_prompts` prompts (resumable); returns counts. `device` "cuda" runs the teacher
    on a GPU (dtype auto -> float32 there: the GGUF's levels, unrounded); `max_minutes` stops
    once that much time has passed, after the answers in flight (a rerun continues). `skip`:
    other distilled directories (of this teacher) to train beside this one: prompts they
    already answered are not answered again (a new prompt-set version repeats many of them).
    `self_prompts`: the teacher writes the prompts itself (`self_prompts.py`, kept in the
    output directory) instead of the templates; `max_minutes` covers both stages."""

    if n_prompts < 1 or batch_size < 1 or top_k < 1 or max_tokens < 1:
        raise CloverError("prompts, batch size, top-k and max tokens must be >= 1")
    if max_minutes is not None and max_minutes <= 0:
        raise CloverError("max_minutes must be > 0")
    dev = resolve_device(device)
    if dev.type != "cpu" and dtype == "auto":
        dtype = "float32"  # the teacher's distributions: the GGUF's levels, unrounded
    out_dir = Path(out_dir)
    elsewhere: set[str] = set()
    for other in map(Path, skip):
        if not (other / "distill.jsonl").is_file():
            raise CloverError(f"--skip {other}: no distill.jsonl there (nothing was changed)")
        if other.resolve() == out_dir.resolve():
            raise CloverError(f"--skip {other} is the output directory itself")
        elsewhere |= done_ids(other / "distill.jsonl")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "distill.jsonl"
    truncate_torn_tail(path)
    done = done_ids(path)
    llm = LLM(model, dtype=dtype, progress=progress, device=str(dev))
    for other in skip:  # another teacher's answers are no reason to leave a prompt out
        teacher = (read_meta(Path(other)) or {}).get("teacher")
        if teacher != llm.name:
            raise CloverError(f"--skip {other} holds answers of {teacher!r}, not of {llm.name!r}")
    t0 = time.perf_counter()
    meta = {
        "teacher": llm.name,
        "dtype": llm.dtype,
        "prompts": n_prompts,
        "seed": seed,
        "max_tokens": max_tokens,
        "top_k": top_k,
        "decoder": "ar (greedy)",
        "device": str(dev),
        "prompt_set": f"self-{SELF_VERSION}" if self_prompts else PROMPT_SET_VERSION,
        "answered_elsewhere": sorted(str(d) for d in skip),  # --skip: not part of the check
    }
    _check_meta(out_dir, meta, done)
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    if self_prompts:
        with _on(dev):
            made = self_prompt_set(llm, n_prompts, out_dir, seed=seed, batch_size=batch_size,
                                   max_minutes=max_minutes, progress=progress)  # fmt: skip
        if max_minutes is not None:
            max_minutes = max(max_minutes - (time.perf_counter() - t0) / 60, 1e-9)
    else:
        made = prompt_set(n_prompts, seed)
    prompts = [p for p in made if p["id"] not in elsewhere]
    todo = [p for p in prompts if p["id"] not in done]
    eos = llm.tokenizer.eos_token_id
    s = llm.default_settings(GenerationSettings(decoder="ar", max_tokens=max_tokens))
    bar = None
    if progress:
        bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="distill",
                   unit="prompt")  # fmt: skip
    t0, tokens, written, too_long, no_tools = time.perf_counter(), 0, 0, 0, 0
    context = llm.model.context_length
    with open(path, "a", encoding="utf-8") as f, _on(dev):
        batch = BatchDecoder(llm.runtime, cached=False)
        running: dict[int, tuple] = {}  # row index -> (prompt, its ids, its row, top-k by index)
        seen: list[tuple[int, torch.Tensor, list]] = []  # this step's rows' logits

        def keep(index: int, logits: torch.Tensor, commits: list) -> None:
            if len(commits) != len(logits):  # an AR row commits one token per logits row
                raise CloverError("distillation needs a decoder that commits one token a pass")
            seen.append((index, logits, commits))

        def keep_step() -> None:
            """The step's top-k for every row at once (one op and one copy, not per row: a
            GPU paid a host sync for each)."""
            if not seen:
                return
            values, top = torch.cat([g for _, g, _ in seen]).float().log_softmax(-1).topk(top_k)
            values, top, i = values.tolist(), top.tolist(), 0
            for index, _, commits in seen:
                for at, _ in commits:
                    running[index][3][at] = (top[i], [round(v, 4) for v in values[i]])
                    i += 1
            seen.clear()

        batch.on_logits = keep
        policy, eos_ids = s.policy(), llm.eos_token_ids
        queue, added = iter(todo), 0
        try:
            while True:
                # continuous batching: finished answers' rows take the next prompts at once
                # (the prompts joining share one prefill pass), so no row idles to the
                # longest answer
                room = batch_size - len(batch.active)
                with batch.joining():
                    while room > 0 and (
                        max_minutes is None or time.perf_counter() - t0 <= 60 * max_minutes
                    ):
                        p = next(queue, None)
                        if p is None:
                            break
                        prompt = _render(llm, p)
                        if prompt is None or len(prompt) >= context:
                            # left out: a teacher whose chat template has no tool turns, or
                            # a short-context one, distils the rest
                            no_tools += prompt is None
                            too_long += prompt is not None
                            if bar is not None:
                                bar.update(1)
                            continue
                        row = batch.add(prompt, policy, max_new_tokens=s.max_tokens,
                                        eos_token_ids=eos_ids, index=added)  # fmt: skip
                        running[added], added, room = (p, prompt, row, {}), added + 1, room - 1
                if not batch.active:
                    break
                event = batch.step()
                keep_step()
                for index in event.finished:
                    p, prompt, row, tops = running.pop(index)
                    answer = list(row.result.tokens)
                    if row.result.finish_reason == "stop" and eos is not None:
                        answer.append(eos)  # the EOS stays the answer's last target
                    answer = answer[: len(tops)]
                    if not answer:
                        continue
                    at = range(len(answer))
                    record = {**p, "prompt_ids": prompt, "answer_ids": answer,
                              "finish_reason": row.result.finish_reason,
                              "topk_ids": [tops[i][0] for i in at],
                              "topk_logprobs": [tops[i][1] for i in at]}  # fmt: skip
                    f.write(json.dumps(record) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                    tokens += len(answer)
                    written += 1
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.1f}")
        finally:
            batch.close()
    if bar is not None:
        bar.close()
    return {"written": written, "skipped": len(prompts) - len(todo),
            "answered_elsewhere": n_prompts - len(prompts), "too_long": too_long,
            "no_tool_template": no_tools, "left": len(todo) - written - too_long - no_tools,
            "answer_tokens": tokens,
            "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


def _render(llm: LLM, p: dict) -> list[int] | None:
    """A prompt record's ids through the teacher's chat template, with the tools it offers;
    None where the template cannot render its tool turns (a call with no text, a tool's
    result)."""
    if not p.get("tools"):
        return llm.chat_prompt(p["messages"])
    try:
        return llm.chat_prompt(p["messages"], tools=p["tools"])
    except CloverError:
        return None


def _on(dev: torch.device) -> contextlib.AbstractContextManager:
    """On a GPU every tensor the engine makes must land there: factories default to `dev` (on
    the CPU that mode only costs: it intercepts every torch call, ~20 per row and step)."""
    return torch.device(dev) if dev.type != "cpu" else contextlib.nullcontext()


def read_meta(out_dir: Path) -> dict | None:
    """A distilled directory's meta.json, or None; a meta.json without a prompt-set version
    is version 1."""
    path = Path(out_dir) / "meta.json"
    if not path.is_file():
        return None
    meta = json.loads(path.read_text())
    meta.setdefault("prompt_set", 1)
    return meta


def _check_meta(out_dir: Path, meta: dict, done: set[str]) -> None:
    """A rerun extends a directory only with answers made the same way: another teacher,
    precision, seed, top-k, answer length or prompt-set version would mix two datasets."""
    old = read_meta(out_dir) if done else None
    if old is None:
        return
    keys = ("teacher", "dtype", "seed", "max_tokens", "top_k", "prompt_set")
    diff = [f"{k} {old.get(k)!r} -> {meta[k]!r}" for k in keys if old.get(k) != meta[k]]
    if diff:
        raise CloverError(
            f"{out_dir} holds {len(done)} answers made differently ({', '.join(diff)}); "
            "distil into a new --out directory (nothing was changed here)"
        )


def load_examples(path: Path, split: str | None = None) -> list[dict]:
    """The distilled records of a split (or all), skipping a torn last line."""
    path = Path(path)
    if path.is_dir():
        path = path / "distill.jsonl"
    if not path.exists():
        raise CloverError(f"no distillation data at {path}: run `clover data distill` first")
    meta = read_meta(path.parent)
    old = meta is not None and isinstance(meta["prompt_set"], int) and meta["prompt_set"] < 2
    if old:  # set 2 on (and self-written prompts) is kept clear of the suite
        warnings.warn(
            f"{path.parent} was distilled from prompt set {meta['prompt_set']}, which holds "
            "quality-suite questions: acceptance measured on the suite after training on it "
            "reads high; distil again into a new directory for clean measurements",
            stacklevel=2,
        )
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if split is None or r.get("split") == split:
                out.append(r)
    return out
