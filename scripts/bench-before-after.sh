#!/usr/bin/env bash
# CPU decode before and after a change, alternated (A B A B) on one machine: builds
# `benches/decode.rs` at BASE (a commit) in a temporary worktree and at the working tree, then
# runs both on SmolLM2 and Qwen2.5-Coder (scripts/fetch-models.sh first).
#
# usage: scripts/bench-before-after.sh BASE
set -euo pipefail
base=${1:?usage: scripts/bench-before-after.sh BASE-COMMIT}
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${PAGODA_CACHE:-$HOME/.cache/pagoda}
tmp=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$tmp/base" 2>/dev/null || true' EXIT
bin() { # dir -> path of the decode bench executable built there
  (cd "$1" && CARGO_TARGET_DIR="$here/target" cargo bench --bench decode --no-run 2>&1) |
    sed -n 's/.*Executable benches\/decode.rs (\(.*\))/\1/p'
}
git -C "$here" worktree add -q "$tmp/base" "$base"
cp "$(bin "$tmp/base")" "$tmp/decode-before"
cp "$(bin "$here")" "$tmp/decode-after"
qwen=$cache/models/Qwen2.5-Coder-0.5B-Instruct.gguf
for round in 1 2; do
  for which in before after; do
    echo "== round $round, $which, SmolLM2"
    "$tmp/decode-$which" 1 16 --tokens 64 2>/dev/null | grep -v '^{'
    echo "== round $round, $which, Qwen2.5-Coder-0.5B"
    PAGODA_BENCH_MODEL=$qwen "$tmp/decode-$which" 1 16 --tokens 32 2>/dev/null | grep -v '^{'
  done
done
