#!/usr/bin/env bash
# The mixture-of-experts path on the CPU beside llama.cpp, same file, same threads (2), in one
# run (issue 37): a synthetic GGUF with Qwen3-30B-A3B's shape (scripts/make-moe-gguf.py, 12 of
# its 48 layers, Q4_K, random weights), K/V in f16 in both. Prefill of 512 tokens, then greedy
# decode of N sequences together. Runs A, B, A, B and prints every run, so drift shows.
#
# usage: scripts/bench-moe-vs-llama.sh [--tokens N] [BATCH ...]      (default: --tokens 32 1 16)
# needs: a venv with llama-cpp-python at $LLAMA_VENV (default $PAGODA_CACHE/venv-llama), built
#        as docs/benchmarks.md says; the gguf package in $PAGODA_CACHE/venv (fetch-models.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${PAGODA_CACHE:-$HOME/.cache/pagoda}
venv=${LLAMA_VENV:-$cache/venv-llama}
model=$cache/bench/qwen3moe-shape-12l-q4k.gguf
mkdir -p "$cache/bench"
[ -f "$model" ] || "$cache/venv/bin/python" scripts/make-moe-gguf.py "$model" --layers 12
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--tokens 32 1 16)
cargo build --release --bench decode >/dev/null 2>&1 || cargo bench --bench decode --no-run
export RAYON_NUM_THREADS=2 OMP_NUM_THREADS=2 PAGODA_BENCH_MODEL=$model
for round in 1 2; do
  echo "=== round $round: pagoda"
  cargo bench -q --bench decode -- "${args[@]}" 2>/dev/null | grep -E "^(prefill|batch|\{)"
  echo "=== round $round: llama.cpp"
  "$venv/bin/python" scripts/bench-llama-cpp.py "$model" "${args[@]}" --threads 2 --kv f16 2>/dev/null |
    grep -E "^(prefill|batch|llama.cpp)"
done
