"""Shared fixtures: tiny random llama models and a scripted mock model for the loop."""

from __future__ import annotations

import pytest
import torch

from clover.models import build_model, make_config
from clover.models.base import DiffusionLM
from clover.models.cache import KVCache

TINY = dict(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    mask_token_id=3,
    eos_token_id=1,
    bos_token_id=2,
)


def tiny_model(seed: int = 0, **overrides) -> DiffusionLM:
    torch.manual_seed(seed)
    model = build_model(make_config({**TINY, **overrides})).eval()
    # random init gives near-uniform logits; sharpen them so greedy choices are not ties
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8)
    return model


@pytest.fixture
def model() -> DiffusionLM:
    return tiny_model()


class ScriptedModel(DiffusionLM):
    """Predicts answer position i as script[i] with confidence conf[i], whatever the input.

    Hidden state = one-hot of the absolute position; logits put `conf` mass on the scripted
    token of the position that the output predicts (i + 1 under token shift).
    """

    def __init__(self, prompt_len: int, script: list[int], conf: list[float], vocab: int = 32):
        super().__init__()
        self.config = make_config({**TINY, "vocab_size": vocab, "max_position_embeddings": 128})
        self.prompt_len, self.script, self.conf, self.vocab = prompt_len, script, conf, vocab
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def make_layer_caches(self, batch_size):
        return [KVCache(batch_size, 1, 2, torch.float32)]

    def backbone(self, input_ids, layout, caches):
        return torch.nn.functional.one_hot(layout.positions, 128).float()

    def logits(self, hidden):
        pos = hidden.argmax(-1) + 1  # token shift: output at i predicts i + 1
        out = torch.full((*pos.shape, self.vocab), -1e4)
        for idx in range(pos.numel()):
            i = int(pos.flatten()[idx]) - self.prompt_len
            tok = self.script[i] if 0 <= i < len(self.script) else 0
            c = self.conf[i] if 0 <= i < len(self.conf) else 0.99
            rest = (1 - c) / (self.vocab - 1)
            row = torch.full((self.vocab,), rest).log()
            row[tok] = torch.tensor(c).log()
            out.view(-1, self.vocab)[idx] = row
        return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """An HF-format directory: a tiny random llama + a byte-level BPE tokenizer + ChatML."""
    import json

    from clover.checkpoints.hf_dir import save_checkpoint
    from tests.test_tokenizer import CHATML, _byte_level_backend

    directory = tmp_path_factory.mktemp("ckpt") / "tiny"
    backend = _byte_level_backend()
    eos = backend.token_to_id("<|im_end|>")
    model = tiny_model(vocab_size=320, eos_token_id=eos, mask_token_id=0)
    tok_dir = tmp_path_factory.mktemp("tokfiles")
    backend.save(str(tok_dir / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": CHATML}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return save_checkpoint(model, directory, sorted(tok_dir.iterdir()))
