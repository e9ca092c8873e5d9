#!/usr/bin/env bash
# Speculative decoding (n-gram prompt lookup) against plain decoding at batch 1, on three
# workloads: rewrite a passage of code (the output copies the prompt), summarize a text (some
# overlap), open chat (little). Each model and workload runs without and with
# --speculative-config, alternated, for ROUNDS rounds; `generate` prints the time (prefill
# included) and, with speculation, the acceptance. Greedy outputs are the same both ways.
#
# With BATCHES="4 16 64", each row is instead one `generate` of that many requests at once,
# cycling through the three workloads (aggregate tokens/s: where speculation stops paying).
#
# usage: scripts/bench-spec.sh [MODEL...]   (default: SmolLM2 Q4_1 and f32, Qwen2.5-Coder Q4_K_M)
# env: PAGODA (binary, default target/release/pagoda), ROUNDS (2), MAX_TOKENS (128), SPEC (the
#      JSON), BATCHES (none: batch 1 per workload), SAMPLING (extra generate flags, e.g.
#      "--temperature 0.7 --seed 1": sampled requests speculate too)
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${PAGODA_CACHE:-$HOME/.cache/pagoda}
bin=${PAGODA:-target/release/pagoda}
rounds=${ROUNDS:-2}
max_tokens=${MAX_TOKENS:-128}
spec=${SPEC:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'}
if [ $# -gt 0 ]; then models=("$@"); else
  models=("$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf" "$cache/models/smollm2-135m-instruct-f32"
          "$cache/models/Qwen2.5-Coder-0.5B-Instruct.gguf")
fi

read -r -d '' code <<'PY' || true
def total(items, tax_rate, discount=None):
    subtotal = 0
    for item in items:
        price = item["price"] * item["quantity"]
        if item.get("taxable", True):
            price = price * (1 + tax_rate)
        subtotal += price
    if discount is not None:
        subtotal = subtotal - discount
    return round(subtotal, 2)
PY
read -r -d '' text <<'TXT' || true
The lighthouse on the northern cape was built in 1872 after three ships were lost on the reef in a single winter. Its first keeper, a retired sailor named Thomas Hale, lit the lamp every evening for thirty-one years and kept a log of every ship that passed. The light was automated in 1968, and the keeper's house became a small museum. Today visitors can climb the one hundred and twelve steps to the lamp room, read pages from Hale's log, and on a clear day see the reef where the ships went down.
TXT
declare -A prompts=(
  [rewrite]="Rewrite this Python function with the name total changed to order_total, and change nothing else:

$code"
  [summarize]="Summarize this text in two sentences:

$text"
  [chat]="What are some good habits for staying healthy?"
)

run() { # generate's stderr (time, acceptance) for the prompts in "$@"
  # shellcheck disable=SC2086
  "$bin" generate --model "$m" --chat-template --max-tokens "$max_tokens" ${SAMPLING:-} "$@" 2>&1 >/dev/null
}
row() { # label round prompts...
  local label=$1 r=$2; shift 2
  local out a b acc
  a=$(run "$@" | sed -n 's/.*generated in .* s: \([0-9.]*\) tokens\/s/\1/p')
  out=$(run --speculative-config "$spec" "$@")
  b=$(sed -n 's/.*generated in .* s: \([0-9.]*\) tokens\/s/\1/p' <<<"$out")
  acc=$(sed -n 's/^speculation: \([0-9]* of [0-9]*\) draft tokens accepted (\([0-9.]*%\)).*/\1 (\2)/p' <<<"$out")
  echo "| $(basename "$m") | $label | $r | $a | $b | $(python3 -c "print(f'{$b / $a:.2f}')") | ${acc:-none} |"
}

echo "| model | workload | round | plain tok/s | ngram tok/s | ratio | accepted |"
echo "|---|---|---|---|---|---|---|"
for m in "${models[@]}"; do
  if [ -n "${BATCHES:-}" ]; then
    for n in $BATCHES; do
      batch=()
      for i in $(seq 0 $((n - 1))); do
        w=(rewrite summarize chat); batch+=("${prompts[${w[$((i % 3))]}]}")
      done
      for r in $(seq "$rounds"); do row "mixed, $n at once" "$r" "${batch[@]}"; done
    done
    continue
  fi
  for w in rewrite summarize chat; do
    for r in $(seq "$rounds"); do row "$w" "$r" "${prompts[$w]}"; done
  done
done
