"""`clover bench`: speed and quality numbers that anyone can reproduce with one command.

- `speed.py`   tokens/s, NFE, TPF, time to first token and peak RSS of our decoders and of
               the tools a user would pick instead (transformers `generate`, llama.cpp), on
               the same weights, interleaved repetitions, median and spread.
- `quality.py` the project's own prompt suite (`benchmarks/suites/`): accuracy per kind,
               agreement with AR greedy, fluency (reference-model NLL), repetition, TPF.
               `run_quality(llm, configs, items)` is the library entry point.
- `sandbox.py` runs generated code against asserts in a subprocess with time/memory limits.
- `plots.py`   PNGs from the results files; `gpu.py` times the big model's passes.

Every results file records the machine, the settings, the date and the command line.
"""

from clover.bench.common import DecoderConfig, parse_configs

__all__ = ["DecoderConfig", "parse_configs"]
