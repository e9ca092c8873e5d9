#!/usr/bin/env bash
# `pagoda serve` beside llama.cpp's C++ `llama-server` on the same all-F32 SmolLM2 file, same
# threads (2), back to back: N concurrent streams (a closed loop), 100-token prompts, 128 output
# tokens, 4N requests, for each N given (default 16 64), ROUNDS rounds alternating the servers.
# llama-server runs with N parallel slots, a context of N x 512 and continuous batching. Both keep
# the KV cache in f16 (llama-server's default; `--kv-cache-dtype f16` for Pagoda, whose default
# for f32 weights is an f32 cache).
#
# usage: scripts/bench-serve-vs-llama-server.sh [N ...]
#   LLAMA_BIN   folder with llama-server (default $PAGODA_CACHE/llama.cpp/bin; build it as
#               docs/benchmarks.md says)
#   PAGODA_ARGS extra flags for `pagoda serve` (e.g. "--max-num-batched-tokens 512")
#   KV_DTYPE    Pagoda's KV cache type (default f16, as llama-server's)
#   ROUNDS      rounds (default 2); OUT folder for the JSON results (default docs/results)
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${PAGODA_CACHE:-$HOME/.cache/pagoda}
llama=${LLAMA_BIN:-$cache/llama.cpp/bin}/llama-server
out=${OUT:-docs/results}
rounds=${ROUNDS:-2}
model=$cache/models/SmolLM2-135M-Instruct.F32.gguf
[ -x "$llama" ] || { echo "no llama-server at $llama (see docs/benchmarks.md)" >&2; exit 1; }
[ -f "$model" ] || "$cache/venv/bin/python" scripts/gguf-to-f32.py \
  "$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf" "$model"
cargo build --release -q
pagoda=target/release/pagoda
mkdir -p "$out"
streams=("$@")
[ ${#streams[@]} -gt 0 ] || streams=(16 64)
port=8391
server=
stop() { [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null; server=; }
trap stop EXIT
wait_ready() {
  for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return
    sleep 1
  done
  echo "server on port $port did not become ready" >&2
  exit 1
}
for round in $(seq "$rounds"); do
  for n in "${streams[@]}"; do
    for which in llama-server pagoda; do
      if [ "$which" = llama-server ]; then
        "$llama" -m "$model" -np "$n" -c $((n * 512)) -t 2 --cont-batching \
          --port $port >/tmp/bench-llama-server.log 2>&1 &
      else
        # shellcheck disable=SC2086
        RAYON_NUM_THREADS=2 "$pagoda" serve --model "$model" --port $port \
          --kv-cache-dtype "${KV_DTYPE:-f16}" ${PAGODA_ARGS:-} \
          >/tmp/bench-pagoda-serve.log 2>&1 &
      fi
      server=$!
      wait_ready
      echo "== round $round, $n streams, $which"
      "$pagoda" bench serve --base-url "http://127.0.0.1:$port" --label "$which" \
        --workload fixed --input-len 100 --output-len 128 --num-prompts $((4 * n)) \
        --max-concurrency "$n" --output-json "$out/serve-$which-$n-r$round.json" |
        grep -E "completed|tok/s|TTFT|TPOT"
      stop
    done
  done
done
