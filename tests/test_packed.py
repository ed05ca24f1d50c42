"""A GGUF's own levels packed for the kernels (clover.checkpoints.packed): every ggml type
against the gguf package's dequantizer, tensor by tensor; the embedding read from the file;
the packed file's reuse, checks and repacking; bad files."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from gguf.quants import dequantize

from clover import kernels
from clover.checkpoints import cache, ggml, loader, packed
from clover.checkpoints.gguf import GGUFFile, read_gguf
from clover.checkpoints.loader import load
from clover.errors import CloverError
from clover.kernels.qgemm import QWeight
from clover.quant import Int4Linear, Int4Part, Int8Linear, quantize_int4
from tests.gguf_files import QT, TINY, dequantized, write_gguf

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="Clover's kernels did not build")

ALL_TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))


def linear_weight(model, name: str) -> QWeight:
    """The packed matrix holding HF linear `name`, and that linear's rows in it."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner).get_submodule(attr)
    if isinstance(module, Int4Part):
        return module.fused.weight, slice(module.start, module.stop)
    return module.weight, slice(None)


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_every_type_reaches_the_kernels_with_the_file_s_own_values(tmp_path, kind):
    """Each linear, and an untied head, of type `kind`: the packed matrix's dequantized values
    equal the gguf package's dequantization of the file's blocks, to the bit."""
    path = tmp_path / "m.gguf"
    write_gguf(path, {n: kind for n in ("attn_q", "attn_k", "attn_v", "attn_output",
                                               "ffn_gate", "ffn_up", "ffn_down")},
                      head=kind)  # fmt: skip
    model = load(str(path), dtype="int4", progress=False).model
    gf = GGUFFile(path)
    for gname, t in gf.tensors.items():
        if t.type != kind or gname == "token_embd.weight":
            continue
        ref = dequantize(gf.raw(gname), QT[kind]).reshape(t.shape)
        hf = "lm_head" if gname == "output.weight" else None
        if hf is None:
            i, short = gname.split(".")[1:3]
            hf = f"model.layers.{i}.{dict(zip(_G, _H))[short]}"
        w, rows = (model.quantized_head.weight, slice(None)) if hf == "lm_head" else \
            linear_weight(model, hf)  # fmt: skip
        bits = {"Q5_0": 5, "Q6_K": 6}.get(kind, 4 if kind in ggml.INT4_TYPES else 8)
        assert w.bits == bits, hf
        assert torch.equal(w.dequantized()[rows], torch.from_numpy(ref)), hf


_G = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
_H = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]  # fmt: skip


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_the_embedding_is_read_from_the_file_a_row_at_a_time(tmp_path, kind):
    """Rows looked up are the file's rows dequantized, in bfloat16 (as the float route's
    table); the tied head is the embedding's own levels, packed."""
    path = tmp_path / "m.gguf"
    held = write_gguf(path, {"attn_q": "Q4_K"}, embedding=kind)
    model = load(str(path), dtype="int4", progress=False).model
    embed = model.model.embed_tokens
    assert isinstance(embed, packed.GGUFEmbedding) and embed.dtype == torch.bfloat16
    table = torch.from_numpy(dequantized(held["model.embed_tokens.weight"]))
    ids = torch.tensor([[5, 0, 63, 5], [1, 2, 3, 4]])
    assert torch.equal(embed(ids), table.to(torch.bfloat16)[ids])
    with pytest.raises(IndexError):
        embed(torch.tensor([64]))
    # past KEEP rows the kept ones are let go, and a lookup that mixes kept rows and new
    # ones still gets every row (a batch of 16 sampling rows once lost its kept ones)
    embed.KEEP = 6
    embed.kept.clear()
    for ids in ([[1, 2, 3, 4]], [[1, 7, 8, 9]], [[10, 11, 1, 2]], [[2, 3, 12, 13]]):
        ids = torch.tensor(ids)
        assert torch.equal(embed(ids), table.to(torch.bfloat16)[ids])
        assert len(embed.kept) <= 6
    if kind != "F32":  # a quantized table: the head takes its levels as they are
        assert torch.equal(model.quantized_head.weight.dequantized(), table)


def test_projections_of_one_format_are_packed_together(tmp_path):
    """q/k/v of one format become one matrix (each part's own levels); v in Q6_K (groups
    of 16) beside Q4_K q and k keeps the three apart; gate/up in Q8_0 pack as 8-bit."""
    path = tmp_path / "m.gguf"
    held = write_gguf(path, {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
                             "ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q5_0"})  # fmt: skip
    model = load(str(path), dtype="int4", progress=False).model
    layer = model.model.layers[0]
    assert not hasattr(layer.self_attn, "fused_q_proj")
    assert isinstance(layer.self_attn.q_proj, Int4Linear)
    assert (
        isinstance(layer.self_attn.v_proj, Int8Linear) and layer.self_attn.v_proj.weight.group == 16
    )
    assert isinstance(layer.mlp.fused_gate_proj, Int8Linear)
    assert isinstance(layer.mlp.up_proj, Int4Part)
    for name in ("mlp.gate_proj", "mlp.up_proj", "self_attn.v_proj"):
        w, rows = linear_weight(layer, name)
        want = torch.from_numpy(dequantized(held[f"model.layers.0.{name}.weight"]))
        assert torch.equal(w.dequantized()[rows], want), name
    # q/k/v biases (qwen2) are the file's float32 values
    bias = layer.self_attn.q_proj.bias
    assert torch.equal(bias, torch.from_numpy(held["model.layers.0.self_attn.q_proj.bias"]))
    path2 = tmp_path / "all4.gguf"
    write_gguf(path2, {n: "Q4_K" for n in _G})
    layer = load(str(path2), dtype="int4", progress=False).model.model.layers[0]
    assert isinstance(layer.self_attn.fused_q_proj, Int4Linear)
    assert isinstance(layer.self_attn.k_proj, Int4Part)


def test_a_draft_models_wider_tensors_are_rounded_to_4_bits(tmp_path):
    """A draft model's tensors stored wider than 4 bits are rounded to 4 bits unless asked
    (`draft_wide`; fewer bytes a draft pass, and its precision changes no answer), the
    model's own keep their levels; the two draft loads time their passes apart (their pass
    costs' key names the bytes they read), and the answers stay `ar`'s."""
    from clover.decoding import timing
    from clover.decoding.loop import generate
    from clover.decoding.policies import make_policy
    from clover.decoding.runtime import Runtime

    path = tmp_path / "m.gguf"
    write_gguf(path, {"attn_q": "Q5_0", "attn_k": "Q4_K", "attn_v": "Q6_K",
                      "attn_output": "Q8_0", "ffn_gate": "Q4_K", "ffn_up": "Q4_K",
                      "ffn_down": "Q6_K"}, config={"num_hidden_layers": 2})  # fmt: skip

    def bits(model) -> set[int]:
        return {m.weight.bits for m in model.model.layers.modules()
                if isinstance(getattr(m, "weight", None), QWeight)}  # fmt: skip

    rounded = load(str(path), dtype="int4", progress=False, drafter=str(path))
    assert bits(rounded.model) == {4, 5, 6, 8} and bits(rounded.drafter_model) == {4}
    kept = load(str(path), dtype="int4", progress=False, drafter=str(path), draft_wide="int8")
    assert bits(kept.drafter_model) == {4, 5, 6, 8}
    packs = sorted(p.name for p in (tmp_path / "cache").rglob("weights-*.pack"))
    assert packs == [f"weights-{w}-v{packed.PACK_VERSION}.pack" for w in ("int4", "int8")]
    int4 = next((tmp_path / "cache").rglob("weights-int4-*.pack"))  # packing again drops
    stale = int4.with_name(f"weights-int8-v{packed.PACK_VERSION - 1}.pack")  # other versions
    stale.write_bytes(b"old")
    int4.unlink()
    load(str(path), dtype="int4", progress=False, drafter=str(path))
    assert sorted(p.name for p in int4.parent.glob("*.pack")) == packs
    assert timing._packed_bytes(rounded.drafter_model) < timing._packed_bytes(kept.drafter_model)
    # a target loaded with its wider tensors rounded (`--gguf-wide int4`) times its passes
    # apart from one that keeps them; the same load keeps its key
    target4 = load(str(path), dtype="int4", progress=False, wide="int4").model
    labels = {timing.target_label(m) for m in (rounded.model, kept.model, target4)}
    assert len(labels) == 2 and timing.target_label(target4) != timing.target_label(kept.model)
    for loaded, head_bits in ((rounded, 4), (kept, 8)):  # its head's rows of its vocabulary
        loaded.drafter_model.draft_vocab = 16
        head = Runtime(loaded.model, loaded.drafter_model).drafter_runner().head
        assert head.weight.bits == head_bits and head.float_output
    with pytest.raises(CloverError, match="draft_wide"):
        load(str(path), dtype="int4", progress=False, drafter=str(path), draft_wide="int2")
    from clover.engine import LLM  # what `clover bench speed` records

    assert LLM(str(path), dtype="int4", progress=False, drafter=str(path)).draft_wide == "int4"
    assert LLM(str(path), dtype="int4", progress=False, drafter="none").draft_wide is None

    prompts = [[5, 6, 7, 5, 6], [9, 10, 11]]

    def answers(model, policy) -> list[list[int]]:
        results: list = []
        for _ in generate(model, prompts, policy, max_new_tokens=12, results=results):
            pass
        return [r.tokens for r in results]

    want = answers(rounded.model, make_policy("ar"))
    for loaded in (rounded, kept):
        runtime = Runtime(loaded.model, loaded.drafter_model)
        policy = make_policy("self_spec", block_size=4, draft="drafter", adaptive=False)
        assert answers(runtime, policy) == want


def test_llama_rows_and_float_tensors_match_the_float_route(tmp_path):
    """A llama GGUF (q/k rows in llama.cpp's order) with float and quantized matrices: the
    packed model's matrices are the float route's (read_gguf) values, q/k rows in HF's order;
    float matrices are quantized to 4 bits as an HF checkpoint's are; the logits agree."""
    path = tmp_path / "m.gguf"
    write_gguf(path, {"attn_q": "Q4_0", "attn_k": "Q8_0", "attn_v": "F16", "ffn_gate": "Q4_1",
                      "ffn_up": "Q4_1", "ffn_down": "Q6_K"}, arch="llama", head="F16")  # fmt: skip
    model = load(str(path), dtype="int4", progress=False).model
    _, state = read_gguf(path)
    layer = model.model.layers[0]
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj"):
        w, rows = linear_weight(layer, name)
        assert torch.equal(w.dequantized()[rows], state[f"model.layers.0.{name}.weight"]), name
    w, rows = linear_weight(layer, "self_attn.v_proj")  # F16: 4-bit, as quantize_model does
    ref = QWeight.from_levels(*quantize_int4(state["model.layers.0.self_attn.v_proj.weight"]
                                             .to(torch.bfloat16)))  # fmt: skip
    assert torch.equal(w.dequantized()[rows], ref.dequantized())
    assert model.quantized_head.weight.bits == 8  # a float head: int8 per row
    floats = load(str(path), dtype="float32", progress=False).model
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.inference_mode():
        a, b = model.logits(model(ids)), floats.logits(floats(ids))
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8
    assert torch.isfinite(a).all()


def test_packed_weights_are_reused_checked_and_packed_again(tmp_path, monkeypatch, capsys):
    path = tmp_path / "m.gguf"
    write_gguf(path, {"attn_q": "Q4_K", "ffn_down": "Q6_K"})
    first = load(str(path), dtype="int4", progress=False).model
    [entry] = cache.entries()
    [pack] = entry.path.glob("*.pack")
    assert entry.live and str(path.resolve()) in entry.files
    # a second start maps the same file: nothing packed again
    monkeypatch.setattr(loader, "pack_gguf", lambda *a, **k: pytest.fail("packed again"))
    again = load(str(path), dtype="int4", progress=False).model
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert torch.equal(first.logits(first(ids)), again.logits(again(ids)))
    monkeypatch.undo()
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    # cut short (a disk error, a copy that stopped): said in one line, packed again; (a new
    # file in its place: the models above still map the old one)
    data = pack.read_bytes()
    replace(pack, data[: len(data) // 2])
    third = load(str(path), dtype="int4", progress=False).model
    err = capsys.readouterr().err
    assert f"{pack}: not a whole packed file (cut short?); packing it again" in err
    assert pack.read_bytes() == data
    with torch.inference_mode():
        assert torch.equal(first.logits(first(ids)), third.logits(third(ids)))
    # another format version
    footer_at = len(data) - 16 - int.from_bytes(data[-16:-8], "little")
    footer = json.loads(data[footer_at:-16])
    raw = json.dumps(dict(footer, version=packed.PACK_VERSION + 1)).encode()
    replace(pack, data[:footer_at] + raw + len(raw).to_bytes(8, "little") + packed.TAIL)
    with pytest.raises(packed.PackError, match=f"by format version {packed.PACK_VERSION + 1}"):
        packed.PackFile(pack)
    load(str(path), dtype="int4", progress=False)
    assert "packing it again" in capsys.readouterr().err and pack.read_bytes() == data


def replace(path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc")
def test_packed_weights_are_read_into_private_memory(tmp_path):
    """The packed file is read into a private anonymous map: Python's anonymous maps are
    shared by default, and shared memory takes no transparent huge pages where the system
    leaves them off for shmem (the common default), which made the kernels' passes over the
    weights slower. /proc/self/maps says which: 'p' private, 's' shared."""
    import ctypes

    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(256)) * 64)
    reader = packed._Reader(path, 256 * 64)
    assert bytes(reader.data()[:256]) == bytes(range(256))
    at = ctypes.addressof(ctypes.c_char.from_buffer(reader.buf))
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= at < hi:
            assert perms[3] == "p", line
            break
    else:
        raise AssertionError("the reader's buffer is not in /proc/self/maps")


def test_a_failed_pack_leaves_nothing_a_later_start_trusts(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    write_gguf(path, {"attn_q": "Q4_K"})

    def dies(*a, **k):
        raise KeyboardInterrupt  # killed midway through the file

    monkeypatch.setattr(packed, "_put", dies)
    with pytest.raises(KeyboardInterrupt):
        load(str(path), dtype="int4", progress=False)
    [entry] = cache.entries()
    assert not list(entry.path.glob("*.pack")) and not list(entry.path.glob(".*"))
    monkeypatch.undo()
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    assert load(str(path), dtype="int4", progress=False).model is not None


def test_bad_gguf_files_say_what_is_wrong(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, {"attn_q": "Q4_K"})
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CloverError, match=r"cut.gguf: tensor .* runs past the end of the file"):
        GGUFFile(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:100])
    with pytest.raises(CloverError, match="head.gguf: truncated GGUF header"):
        GGUFFile(head)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + data[4:])
    with pytest.raises(CloverError, match="not a GGUF file"):
        GGUFFile(other)
    with pytest.raises(CloverError, match="not found"):
        GGUFFile(tmp_path / "missing.gguf")
    # an unsupported type: the type id of IQ2_XS written over attn_q's
    gf = GGUFFile(path)
    name = "blk.0.attn_q.weight"
    at = bytes(data).index(name.encode()) + len(name) + 4 + 8 * 2
    iq = bytearray(data)
    iq[at : at + 4] = (17).to_bytes(4, "little")
    bad = tmp_path / "iq.gguf"
    bad.write_bytes(iq)
    with pytest.raises(CloverError, match="blk.0.attn_q.weight has ggml type IQ2_XS"):
        GGUFFile(bad)
    assert gf.tensors[name].type == "Q4_K"


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, {"attn_q": "Q4_K"}, config={"intermediate_size": 256})
    cfg = json.loads(json.dumps(TINY))
    assert cfg["intermediate_size"] == 512
    gf = GGUFFile(path)
    gf.meta["qwen2.feed_forward_length"] = 512  # the header says one width, the tensors another
    with pytest.raises(CloverError, match=r"ffn_gate|gate_proj.*shape"):
        packed.pack_gguf(gf, tmp_path / "x.pack", progress=False)
    assert not (tmp_path / "x.pack").exists()


def test_take_rows_equals_the_unpacked_rows():
    """A drafter's vocabulary head: rows gathered from the tiles as they lie equal the rows
    of the whole matrix, for int4, int5 and int8 levels, compact scales included."""
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([3, 77, 16, 0, 95, 17, 31, 64, 65, 66, 2, 90, 40, 41, 42, 43])
    for bits, group, low in ((4, 32, True), (8, 16, False), (8, 32, False), (8, 32, True)):
        lo, hi = (0, 16) if bits == 4 else (-128, 128)
        q = torch.randint(lo, hi, (96, 512), generator=g)
        # a float16 base per 256 values times small integers: compact scales (as k-quants)
        d = (torch.rand(96, 2, generator=g) + 0.1).half().float()
        d = d.repeat_interleave(512 // group // 2, 1)
        scale = d * torch.randint(1, 60, (96, 512 // group), generator=g)
        lows = -d * torch.randint(1, 60, (96, 512 // group), generator=g) if low else None
        w = QWeight.from_levels(q, scale, lows, bits=bits)
        assert w.mults is not None
        sub = w.take_rows(rows)
        assert torch.equal(sub.dequantized(), w.dequantized()[rows]), (bits, group)
        x = torch.randn(3, 512, generator=g)
        assert torch.equal(sub.matmul(x), w.matmul(x)[:, rows])
    q5 = torch.randint(-16, 16, (96, 64), generator=g)
    w5 = QWeight.from_levels(q5, torch.full((96, 2), 0.5), None, bits=8)
    assert w5.bits == 5
    assert torch.equal(w5.take_rows(rows).dequantized(), w5.dequantized()[rows])


@pytest.mark.slow
def test_a_7b_shaped_gguf_loads_within_its_size_plus_a_fixed_overhead(tmp_path):
    """Qwen2.5-7B's layer shapes (hidden 3584, ffn 18944, 28/4 heads; Q4_K layers and
    embedding, a Q6_K head) with two layers and a 32K vocabulary: the first start (packing
    included) peaks no higher than a later one, and a later one within what it holds (the
    packed file, the float32 k-quant scales made at load) plus a fixed overhead, measured in a
    child process each. docs/checkpoints.md scales it to a real 7B."""
    path = tmp_path / "7b.gguf"
    config = dict(vocab_size=32768, hidden_size=3584, intermediate_size=18944,
                  num_hidden_layers=2, num_attention_heads=28, num_key_value_heads=4)  # fmt: skip
    write_gguf(path, {n: "Q4_K" for n in _G}, embedding="Q4_K", head="Q6_K", config=config)
    size_mb = path.stat().st_size / 2**20
    # VmHWM (peak_rss_mb), not ru_maxrss: a child inherits its parent's ru_maxrss, and this
    # process held the random weights it wrote
    child = textwrap.dedent(f"""
        import torch
        from clover.bench.common import peak_rss_mb
        from clover.checkpoints.loader import load
        m = load({str(path)!r}, dtype="int4", progress=False).model
        with torch.inference_mode():
            m.logits(m(torch.tensor([[1, 2, 3, 4]])))
        print(peak_rss_mb())
    """)
    peaks = []
    for _ in range(2):  # the first start packs, the second reads the packed file back
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                             check=True)  # fmt: skip
        peaks.append(float(out.stdout.strip().splitlines()[-1]))
    base = subprocess.run([sys.executable, "-c", "import torch, clover.checkpoints.loader; "
                           "from clover.bench.common import peak_rss_mb; print(peak_rss_mb())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    [pack_path] = (tmp_path / "cache").glob("gguf/*/*.pack")
    pack = packed.PackFile(pack_path)
    held_mb = pack_path.stat().st_size / 2**20  # read into memory whole
    # the float32 scales made at load from the compact ones (4 bytes for each int8 multiple)
    mults = [n for name, (_, _, _, n) in pack.index.items() if name.endswith(".mults")]
    scales_mb = 4 * sum(mults) / 2**20
    overhead = max(peaks) - held_mb - scales_mb - float(base.stdout.strip())
    print(
        f"GGUF {size_mb:.0f} MB, pack {held_mb:.0f} MB, float32 scales {scales_mb:.0f} MB, "
        f"peaks {peaks} MB, beyond those and the import: {overhead:.0f} MB"
    )
    assert peaks[0] <= peaks[1] * 1.05  # the first start peaks no higher than later ones
    assert overhead < 150  # a fixed overhead: caches, a pass's activations, the allocator


@pytest.mark.slow
def test_bench_load_reports_first_and_warm_starts(tmp_path, monkeypatch):
    """`clover bench load`'s rows for a GGUF: a first-ever start in a cache of its own, warm
    starts after it, the disk the cache keeps beyond the GGUF; llama.cpp's row says why it is
    missing where its tools are not built."""
    from clover.bench import load as bench_load

    path = tmp_path / "m.gguf"
    write_gguf(
        path, {n: "Q4_K" for n in _G}, config={"max_position_embeddings": 512, "vocab_size": 320}
    )  # the tokenizer's
    monkeypatch.setenv("CLOVER_LLAMACPP_BIN", str(tmp_path / "nowhere"))
    report = bench_load.run_load([str(path)], tokens=4, reps=1, log=lambda m: None)
    row = report["models"][str(path)]
    ours = row["clover"]
    assert ours["load_s_first"] > 0 and ours["load_s_warm"] > 0
    assert ours["rss_answer_mb"] >= ours["rss_load_mb"] > 0
    assert 0 < ours["disk_beyond_gguf_bytes"] < 2 * row["gguf_bytes"]
    assert "skipped" in row["llama.cpp"] and "build_llamacpp.sh" in row["llama.cpp"]["skipped"]
    assert "llama.cpp  skipped" in bench_load.format_load(report)
    assert not list((tmp_path / "cache").glob("gguf/*"))  # the first-ever cache was its own


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packing_a_block_of_rows_at_a_time_gives_the_same_file(tmp_path, monkeypatch, arch):
    """Large matrices are packed a block of rows at a time (bounded memory); the tiles, scales
    and footer are the same as packing each matrix at once, grouped projections included;
    llama's q/k, whose rows the family reorders, are packed whole."""
    path = tmp_path / "m.gguf"
    write_gguf(path, {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q6_K",
                      "ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q5_0"},
               arch=arch, head="Q6_K")  # fmt: skip
    whole = packed.pack_gguf(GGUFFile(path), tmp_path / "whole.pack", progress=False)
    monkeypatch.setattr(packed, "BLOCK_VALUES", 16 * 256)  # 16-row blocks
    src = packed._Source(GGUFFile(path), GGUFFile(path).config())
    assert len(packed._blocks(src, "model.layers.0.mlp.gate_proj.weight")) == 512 // 16
    q_rows = packed._blocks(src, "model.layers.0.self_attn.q_proj.weight")
    assert len(q_rows) == (1 if arch == "llama" else 256 // 16)
    blocks = packed.pack_gguf(GGUFFile(path), tmp_path / "blocks.pack", progress=False)
    assert whole.read_bytes() == blocks.read_bytes()
