#!/usr/bin/env bash
# Builds llama.cpp's tools (llama-bench, llama-cli, llama-completion, llama-server,
# llama-speculative-simple) once, from the sources the llama-cpp-python sdist carries
# (vendor/llama.cpp), for the side-by-side rows of `clover bench`. Prints the folder that holds the binaries; `clover bench` finds them
# there ($CLOVER_LLAMACPP_BIN overrides).
#
# Flags: a portable build (GGML_NATIVE=OFF) with AVX-512, VNNI and BF16 on and AMX off; a
# native build crashes on some of the CPUs this project runs on, and AMX is not in them.
#
# One source change, made here: llama.cpp's Qwen2 graph does not publish the input of each
# layer, which its DFlash and EAGLE-3 drafters read from the target (its Llama and Qwen3
# graphs do), so a DFlash drafter for a Qwen2.5 target stops on an assertion. One line in
# src/models/qwen2.cpp publishes it, as the Qwen3 graph does; the marker file says it is in.
# Usage: bash scripts/build_llamacpp.sh [llama-cpp-python version]
set -euo pipefail
VERSION="${1:-0.3.36}"
CACHE="${CLOVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/clover}"
ROOT="$CACHE/llama.cpp/$VERSION"
BIN="$ROOT/build/bin"
TOOLS=(llama-bench llama-cli llama-completion llama-server llama-speculative-simple)
PATCHED="$ROOT/qwen2-layer-inputs"
if [ -x "$BIN/llama-completion" ] && [ -x "$BIN/llama-server" ] && [ -f "$PATCHED" ]; then
  echo "$BIN"
  exit 0
fi
mkdir -p "$ROOT"
if [ ! -d "$ROOT/src" ]; then
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$tmp" >&2
  tar -xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$ROOT/src"
  rm -rf "$tmp"
fi
QWEN2="$ROOT/src/src/models/qwen2.cpp"
if ! grep -q "t_layer_inp" "$QWEN2"; then
  sed -i 's|^\( *\)for (int il = 0; il < n_layer; ++il) {$|&\n\1    res->t_layer_inp[il] = inpL;|' "$QWEN2"
  grep -q "res->t_layer_inp\[il\] = inpL;" "$QWEN2" || { echo "qwen2.cpp: patch failed" >&2; exit 1; }
fi
cmake -S "$ROOT/src" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON >&2
cmake --build "$ROOT/build" --config Release -j "$(nproc)" --target "${TOOLS[@]}" >&2
git -C "$ROOT/src" rev-parse --short HEAD > "$ROOT/commit" 2>/dev/null || true
touch "$PATCHED"
echo "$BIN"
