#!/usr/bin/env bash
# Multi-LoRA serving throughput (issue 40): `pagoda serve` on the packaged SmolLM2 (Q4_1) with 0
# (the base model alone), 1, 4 and 16 random rank-16 all-linear adapters, each run a 64-stream
# closed loop of `bench serve` whose requests name the adapters in turn (uniformly mixed), back
# to back, ROUNDS rounds. Prints output tok/s of each run and its ratio to the base model's in
# the same round; also each server's adapter load lines (time and memory).
#
# usage: scripts/bench-lora.sh
#   COUNTS  adapter counts (default "0 1 4 16"; 0 is the base model alone)
#   N       requests per run (default 256); STREAMS (default 64); ROUNDS (default 2)
#   MAX_LORAS  --max-loras (default: the adapter count, so that all stay on the device; fewer
#           moves the least recently used out to host memory as others are needed)
#   OUT     folder for the JSON results (default docs/results)
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${PAGODA_CACHE:-$HOME/.cache/pagoda}
out=${OUT:-docs/results}
model=$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
loras=$cache/lora-bench
py=${PYTHON:-$cache/venv-ref/bin/python}
[ -x "$py" ] || py=python3
[ -d "$loras/lora-15" ] || "$py" scripts/make-random-lora.py \
  "$cache/models/smollm2-135m-instruct-f32/config.json" "$loras" --count 16 --rank 16
cargo build --release -q
pagoda=target/release/pagoda
mkdir -p "$out"
port=8392
server=
stop() { [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null; server=; }
trap stop EXIT
wait_ready() {
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return
    sleep 1
  done
  echo "server on port $port did not become ready" >&2
  exit 1
}
streams=${STREAMS:-64}
for round in $(seq "${ROUNDS:-2}"); do
  base=
  for n in ${COUNTS:-0 1 4 16}; do
    flags=() names=()
    if [ "$n" -gt 0 ]; then
      flags=(--enable-lora --max-loras "${MAX_LORAS:-$n}" --lora-modules)
      for i in $(seq 0 $((n - 1))); do
        flags+=("lora-$i=$loras/lora-$i")
        names+=("lora-$i")
      done
    fi
    "$pagoda" serve --model "$model" --port $port "${flags[@]}" >/tmp/bench-lora-serve.log 2>&1 &
    server=$!
    wait_ready
    grep -h "LoRA adapter" /tmp/bench-lora-serve.log | tail -n 1 || true
    lora_flag=()
    [ "$n" -gt 0 ] && lora_flag=(--lora-modules "${names[@]}")
    json="$out/lora-$n-r$round.json"
    "$pagoda" bench serve --base-url "http://127.0.0.1:$port" --label "lora-$n" \
      --workload fixed --input-len 100 --output-len 128 --num-prompts "${N:-256}" \
      --max-concurrency "$streams" "${lora_flag[@]}" --output-json "$json" >/dev/null
    tps=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1]))['output_tokens_per_s'])" "$json")
    [ -n "$base" ] || base=$tps
    ratio=$("$py" -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.3f}')" "$tps" "$base")
    echo "round $round: $n adapters: $tps output tok/s, $ratio x the base model"
    stop
  done
done
