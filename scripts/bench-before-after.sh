#!/usr/bin/env bash
# A bench before and after a change, alternated (A B A B) on one machine: builds the bench at
# BASE (a commit) in a temporary worktree and at the working tree, then runs both.
#   decode (default): SmolLM2 and Qwen2.5-Coder at 1 and 16 sequences (fetch-models.sh first)
#   matmul: the CPU matmuls, ARGS passed on (rows of x), with PAGODA_MATMUL_TYPES/_SHAPES
#
# usage: scripts/bench-before-after.sh BASE [decode | matmul [ARGS ...]]
set -euo pipefail
base=${1:?usage: scripts/bench-before-after.sh BASE-COMMIT [decode | matmul [ARGS ...]]}
bench=${2:-decode}
shift $(($# < 2 ? $# : 2))
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${PAGODA_CACHE:-$HOME/.cache/pagoda}
tmp=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$tmp/base" 2>/dev/null || true' EXIT
bin() { # dir, target dir -> path of the bench executable built there
  (cd "$1" && CARGO_TARGET_DIR="$2" cargo bench --bench "$bench" --no-run 2>&1) |
    sed -n "s/.*Executable benches\/$bench.rs (\(.*\))/\1/p"
}
git -C "$here" worktree add -q "$tmp/base" "$base"
# NOTE: cargo keys a build by package, not by path, and judges it fresh by the mtimes of the
# sources it was built from: in one target directory, the working tree's build found the base's
# fresh and built nothing (until 2026-12-07 this script compared the base with itself). So the
# base gets a target directory of its own, and the working tree's sources are touched.
cp "$(bin "$tmp/base" "$here/target/before-after-base")" "$tmp/$bench-before"
touch "$here/src/lib.rs" "$here/benches/$bench.rs"
cp "$(bin "$here" "$here/target")" "$tmp/$bench-after"
cmp -s "$tmp/$bench-before" "$tmp/$bench-after" && { echo "before and after are one binary" >&2; exit 1; }
qwen=$cache/models/Qwen2.5-Coder-0.5B-Instruct.gguf
for round in 1 2 3; do
  for which in before after; do
    if [ "$bench" = matmul ]; then
      echo "== round $round, $which"
      "$tmp/matmul-$which" "$@" 2>/dev/null | grep -v '^{'
      continue
    fi
    echo "== round $round, $which, SmolLM2"
    "$tmp/decode-$which" 1 16 --tokens 64 2>/dev/null | grep -v '^{'
    echo "== round $round, $which, Qwen2.5-Coder-0.5B"
    PAGODA_BENCH_MODEL=$qwen "$tmp/decode-$which" 1 16 --tokens 32 2>/dev/null | grep -v '^{'
  done
done
