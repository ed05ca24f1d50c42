"""`CloverForCausalLM`: our model behind transformers' `PreTrainedModel` interface.

The wrapper builds our own model (`clover.models`) and adopts its backbone and LM head as its
own submodules, so its parameter names are exactly the checkpoint's (`model.layers.0...`,
`lm_head.weight`) and transformers' loader fills our modules directly; the decoding code then
runs on them unchanged. A plain forward is a causal pass returning HF-style `.logits`;
`diffusion_generate` runs our decoding loop (any decoder, block size, threshold).

transformers builds models on the meta device and then assigns the loaded tensors; RoPE
frequencies are not in checkpoints, so they are recomputed on first use. Importing this module
registers the class with `AutoModelForCausalLM`.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.generation.configuration_utils import GenerationConfig
from transformers.modeling_outputs import CausalLMOutput
from transformers.modeling_utils import PreTrainedModel
from transformers.models.auto.modeling_auto import AutoModelForCausalLM

from clover.checkpoints.hf_dir import model_from_state, read_hf_dir
from clover.decoding.loop import RowResult, generate
from clover.decoding.policies import make_policy
from clover.decoding.sampling import SamplingParams
from clover.errors import CloverError
from clover.hf.config import CloverConfig
from clover.models import architecture, build_model, make_config
from clover.models.base import DiffusionLM

__all__ = ["CloverConfig", "CloverForCausalLM"]

# from_pretrained arguments that say where files come from; reused for generation_config.json
HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


def _right_padded_lengths(mask: torch.Tensor) -> torch.Tensor:
    """attention_mask [B, T] of right-padded rows -> valid tokens per row."""
    lengths = mask.sum(-1)
    expected = torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]
    if not torch.equal(mask.bool(), expected):
        raise CloverError("attention_mask must be right-padded (ones first) for a forward pass")
    return lengths


class CloverForCausalLM(PreTrainedModel):
    config_class = CloverConfig
    main_input_name = "input_ids"
    _no_split_modules = ["DecoderLayer"]

    def __init__(self, config: CloverConfig) -> None:
        super().__init__(config)
        names = {f.name for f in fields(architecture(config.clover_architecture).Config)}
        clover = build_model(make_config(config.clover_dict(names - {"extra"})))
        # its modules become ours (same objects), so state-dict names match the checkpoint;
        # the model itself is kept outside the module tree to avoid a second set of names
        for name, child in clover.named_children():
            self.add_module(name, child)
        self.__dict__["_clover"] = clover
        self.decoding_config: GenerationConfig | None = None
        self.post_init()

    @property
    def clover_model(self) -> DiffusionLM:
        """Our model (sharing this wrapper's parameters), ready to run."""
        clover = self.__dict__["_clover"]
        if getattr(clover, "inv_freq", None) is not None and clover.inv_freq.is_meta:
            clover.reset_buffers()  # built on the meta device by from_pretrained
        return clover

    def _init_weights(self, module: torch.nn.Module) -> None:
        pass  # weights come from the checkpoint; our modules initialize themselves

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: object, *args: object, **kwargs: object
    ) -> CloverForCausalLM:
        hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
        local = Path(str(pretrained_model_name_or_path))
        config = CloverConfig.from_pretrained(str(pretrained_model_name_or_path), **hub)
        if local.is_dir() and hasattr(architecture(config.clover_architecture), "to_checkpoint"):
            # a family whose files use its published names (e.g. the hybrid's Qwen3.5 layout,
            # per-expert tensors), not our module names: our own reader maps them
            dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
            model = cls._from_published_layout(local, config, dtype)
        else:
            model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        try:
            model.decoding_config = GenerationConfig.from_pretrained(
                pretrained_model_name_or_path, **hub
            )
        except OSError:
            model.decoding_config = None  # no generation_config.json: config.json's defaults
        return model

    @classmethod
    def _from_published_layout(
        cls, directory: Path, config: CloverConfig, dtype: object
    ) -> CloverForCausalLM:

        native, state = read_hf_dir(directory)
        dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        clover = model_from_state(native, state, str(directory), dtype)
        with torch.device("meta"):
            model = cls(config)
        for name, child in clover.named_children():  # the loaded modules replace the empty ones
            model.add_module(name, child)
        model.__dict__["_clover"] = clover
        return model.eval()

    def save_pretrained(self, save_directory: object, *args: object, **kwargs: object) -> None:
        super().save_pretrained(save_directory, *args, **kwargs)
        if self.decoding_config is not None:  # transformers saves it only for `generate` models
            self.decoding_config.save_pretrained(save_directory)

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: object,
    ) -> CausalLMOutput:
        """A causal pass over the whole input: logits [B, T, V] (float32), and the next-token
        loss when `labels` are given (-100 ignored). Padding must be on the right. Other HF
        arguments (`use_cache`, `past_key_values`, ...) are accepted and ignored: no KV cache
        crosses calls."""
        model = self.clover_model
        n_valid = None if attention_mask is None else _right_padded_lengths(attention_mask)
        hidden = model(input_ids, mode="causal", n_valid=n_valid)
        logits = model.logits(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutput(loss=loss, logits=logits)

    def _default(self, name: str, given: object, fallback: object) -> object:
        """A setting: the caller's, else generation_config.json's, else `fallback`."""
        if given is not None:
            return given
        value = getattr(self.decoding_config, name, None) if self.decoding_config else None
        return fallback if value is None else value

    @torch.no_grad()
    def diffusion_generate(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | None = None,
        decoder: str | None = None,
        block_size: int | None = None,
        threshold: float | None = None,
        draft: str | None = None,
        slide: bool = False,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
    ) -> torch.LongTensor:
        """Decode with Clover's loop -> [B, T + longest answer]: each row is its input followed
        by its answer, right-padded with `pad_token_id` (as `generate` returns them).

        Unset settings come from generation_config.json, then config.json. Rows may be padded
        on either side; `attention_mask` says which tokens are the prompt.
        """
        model = self.clover_model
        c = model.config
        decoder = self._default("decoder", decoder, c.default_decoder)
        block_size = self._default("block_size", block_size, c.block_size)
        threshold = self._default("threshold", threshold, 0.95)
        draft = self._default("draft", draft, c.draft)
        max_new_tokens = self._default("max_new_tokens", max_new_tokens, 256)
        eos = self._default("eos_token_id", eos_token_id, c.eos_token_ids)
        eos = [eos] if isinstance(eos, int) else list(eos)
        pad_token_id = self._default("pad_token_id", pad_token_id, eos[0] if eos else 0)
        if input_ids.dim() != 2:
            raise CloverError(
                f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}"
            )
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        prompts = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)]
        results: list[RowResult] = []
        loop = generate(
            model,
            prompts,
            make_policy(decoder, block_size, threshold, draft=draft, slide=slide),
            max_new_tokens=max_new_tokens,
            sampling=SamplingParams(temperature, top_k, top_p, seed),
            eos_token_ids=eos,
            results=results,
        )
        for _ in loop:
            pass
        rows = [input_ids[i].tolist() + r.tokens for i, r in enumerate(results)]
        width = max(len(r) for r in rows)
        out = [r + [pad_token_id] * (width - len(r)) for r in rows]
        return torch.tensor(out, dtype=torch.long, device=input_ids.device)


AutoModelForCausalLM.register(CloverConfig, CloverForCausalLM, exist_ok=True)
