"""Clover as a model backend of EleutherAI's lm-evaluation-harness (`pip install clover[lm-eval]`).

    clover-lm-eval --model clover \
        --model_args model=smollm2-135m,decoder=low_confidence,block_size=32,threshold=0.95 \
        --tasks arc_easy --batch_size 8

How the harness finds the model: importing this package registers `CloverLM` under the name
"clover" with lm_eval's `register_model`. lm_eval 0.4.13 (the version this is tested with) has
no plugin discovery for models: its `lm_eval` command only knows the built-in backends, does not
read entry points, and `--include_path` loads task YAML only. So Clover ships `clover-lm-eval`
(also `python -m clover.integrations.lm_eval`), which registers "clover" and then hands argv,
unchanged, to lm_eval's own CLI entry: every lm_eval flag and subcommand works as documented.
From Python, `import clover.integrations.lm_eval` before `lm_eval.simple_evaluate(model="clover",
...)` does the same.

Generation runs Clover's decoders (`decoder`, `block_size`, `threshold` model_args); scores
(`loglikelihood`, `loglikelihood_rolling`) come from the causal mode of the same weights (see
`scoring.py` for why).
"""

try:
    import lm_eval  # noqa: F401
except ImportError as e:  # say which extra to install instead of a bare "No module named"
    raise ImportError(
        "clover.integrations.lm_eval needs lm-eval: pip install 'clover[lm-eval]'"
    ) from e

from clover.integrations.lm_eval.model import CloverLM  # noqa: E402  (registers "clover")

__all__ = ["CloverLM"]
