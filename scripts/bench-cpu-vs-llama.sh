#!/usr/bin/env bash
# Pagoda's CPU backend beside llama.cpp on the same machine, in one run, same threads (2), same
# precision (f32 weights, f32 KV cache): SmolLM2-135M-Instruct dequantized to F32 for llama.cpp
# (scripts/gguf-to-f32.py), and Pagoda loading the Q4_1 GGUF with --dtype f32 (the same f32
# values). Runs A, B, A, B and prints every run, so drift shows.
#
# usage: scripts/bench-cpu-vs-llama.sh [--tokens N] [BATCH ...]
# needs: a venv with llama-cpp-python at $LLAMA_VENV (default /work/venv-llama), see docs/benchmarks.md
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${PAGODA_CACHE:-$HOME/.cache/pagoda}
venv=${LLAMA_VENV:-/work/venv-llama}
f32=$cache/models/SmolLM2-135M-Instruct.F32.gguf
[ -f "$f32" ] || "$cache/venv/bin/python" scripts/gguf-to-f32.py "$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf" "$f32"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(1 16 64)
cargo build --release --bench decode >/dev/null 2>&1 || cargo bench --bench decode --no-run
export RAYON_NUM_THREADS=2 OMP_NUM_THREADS=2
for round in 1 2; do
  echo "=== round $round: pagoda"
  cargo bench -q --bench decode -- "${args[@]}" 2>/dev/null | grep -E "^(prefill|batch)"
  echo "=== round $round: llama.cpp"
  "$venv/bin/python" scripts/bench-llama-cpp.py "$f32" "${args[@]}" --threads 2 2>/dev/null | grep -E "^(prefill|batch|llama.cpp)"
done
