#!/usr/bin/env bash
# The whole CUDA check on a GPU machine, in one run, most valuable steps first: kernels against
# the CPU backend; greedy tokens and log-probabilities against transformers on the same random
# weights, and through the tensor-parallel workers and NCCL where PyTorch's wheels bring it;
# decode of one sequence against the memory roofline, with the time of every kernel in
# a decode and a prefill step; throughput with 64 and 256 requests (fixed lengths and a
# ShareGPT-like mix) beside transformers' generate on the very same lengths, and the first
# sampled at temperature 1 (tokens drawn on the device) beside its greedy run. Prints a table
# last. A global deadline clamps every step, and whatever fails (or runs out of time) the
# summary and the tarball of logs are written (a trap on exit).
#
# The GPU machine has no Rust toolchain and no network: the binary is built here.
#
#   1. Here (no GPU needed), from the repository root:
#        cargo build --release --features cuda
#        mkdir -p .gpu && cp target/release/pagoda .gpu/pagoda && strip .gpu/pagoda
#        cp ~/.cache/pagoda/models/smollm2-135m-instruct-f32/tokenizer.json .gpu/tokenizer.json
#        X="$(git rev-parse --git-common-dir)/info/exclude"; grep -qx '/.gpu/' "$X" || echo /.gpu/ >> "$X"
#      (.gpu/ is about 10 MiB: the stripped binary and SmolLM2's tokenizer.json — from
#      scripts/fetch-models.sh — which gpu_check.py pads to each model's vocabulary.) The call
#      sends the checkout the session started in: build and copy there.
#   2. One call of the device tool, carrying .gpu:
#        run(command="BUDGET=520 bash scripts/gpu-check.sh", carry=[".gpu"], timeout_s=560)
#   3. The table is the end of the output; $OUT/summary.txt, $OUT/log.txt (every step's output)
#      and $OUT/results.tgz (check-backend tables, op profiles, JSON lines, compare.json, bench
#      JSON) come back. Record the numbers in docs/benchmarks.md with this command.
#
# Environment knobs: BUDGET (seconds for the whole run, default 520), SKIP_BENCH=1 (correctness
# only), BATCHES="64 256", PROMPT_LEN=512, GEN_LEN=256, DECODE_LEN=256; for a dry run without a
# GPU: BACKEND=emu (the kernels on the CPU; `cpu` works too), SKIP_MODELS=1 (models already in
# $WORK), BENCH_MODEL=$WORK/tiny, MAX_MODEL_LEN, SKIP_HF=1 (no torch here).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check-out}
WORK=${WORK:-/tmp/pagoda-gpu}
RES="$WORK/res"
BIN=${PAGODA_BIN:-.gpu/pagoda}
BACKEND=${BACKEND:-cuda}
TOK=${TOKENIZER:-.gpu/tokenizer.json}
BATCHES=${BATCHES:-"64 256"}
PROMPT_LEN=${PROMPT_LEN:-512}
GEN_LEN=${GEN_LEN:-256}
DECODE_LEN=${DECODE_LEN:-256}
export BATCHES PROMPT_LEN GEN_LEN PYTHONUNBUFFERED=1
export PAGODA_KERNEL_CACHE="$WORK/kernels"
mkdir -p "$OUT" "$RES"
LOG="$OUT/log.txt"
: >"$LOG"
PY="python3 scripts/gpu_check.py"

# cuBLAS and NVRTC: the toolkit's, or the pip wheels beside PyTorch (nvidia/cu13/lib, ...).
NV_LIBS=$(python3 - <<'EOF'
import glob, os, site
dirs = []
for sp in site.getsitepackages():
    for d in sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib"))):
        if glob.glob(d + "/libcublas.so*") or glob.glob(d + "/libnvrtc.so*"):
            dirs.append(d)
print(":".join(dirs))
EOF
)
export LD_LIBRARY_PATH="${NV_LIBS}:/usr/local/cuda/lib64:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"

now_ms() { echo $(($(date +%s%N) / 1000000)); }
BUDGET=${BUDGET:-520}
RESERVE=20 # seconds kept for the summary and the tarball
T_END=$(($(date +%s) + BUDGET))
STEPS="$RES/steps.txt"
: >"$STEPS"
# step NAME TIMEOUT CMD...: runs CMD with a time limit (clamped to what the deadline leaves),
# output appended to the log; one line per step in steps.txt (rc 124: timed out or skipped).
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((T_END - RESERVE - $(date +%s)))
    if [ "$left" -lt 5 ]; then
        printf '%-26s skipped: the deadline is reached\n' "$name" | tee -a "$LOG" "$STEPS"
        return 124
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0
    t0=$(now_ms)
    echo "=== $name (limit ${limit} s): $*" >>"$LOG"
    timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    printf '%-26s rc=%-3s %6.1f s\n' "$name" "$rc" "$(echo "$(($(now_ms) - t0))" | awk '{print $1/1000}')" | tee -a "$LOG" "$STEPS"
    return $rc
}
finish() {
    tar czf "$OUT/results.tgz" -C "$WORK" res 2>>"$LOG"
    $PY summary "$RES" 2>&1 | tee "$OUT/summary.txt"
}
trap finish EXIT
trap 'exit 143' TERM INT

echo "== gpu-check $(date -u +%FT%TZ)" | tee -a "$LOG"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$LOG"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >>"$LOG"
chmod +x "$BIN" 2>/dev/null
if ! "$BIN" --version >>"$LOG" 2>&1; then
    echo "the binary $BIN does not run here:" | tee -a "$LOG"
    ldd "$BIN" 2>&1 | tee -a "$LOG"
    exit 1
fi

# 1. every op against the CPU backend: with cuBLAS, then with our own GEMM kernels only (the
#    HIP backend's path). On a failure: again with synchronous launches (the error then names
#    the kernel that faulted), and under compute-sanitizer where the machine has it.
cb_failed=0
step check-backend 240 sh -c "'$BIN' check-backend --backend $BACKEND > '$RES/check-backend.txt' 2>&1" || cb_failed=1
cat "$RES/check-backend.txt" >>"$LOG"
step check-backend-kernels 180 sh -c "PAGODA_GPU_GEMM=kernel '$BIN' check-backend --backend $BACKEND --seed 1 > '$RES/check-backend-kernels.txt' 2>&1" || cb_failed=1
cat "$RES/check-backend-kernels.txt" >>"$LOG"
if [ "$cb_failed" = 1 ]; then
    step check-backend-blocking 180 sh -c "CUDA_LAUNCH_BLOCKING=1 '$BIN' check-backend --backend $BACKEND > '$RES/check-backend-blocking.txt' 2>&1"
    cat "$RES/check-backend-blocking.txt" >>"$LOG"
    SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
    if [ -n "$SAN" ]; then
        step compute-sanitizer 180 sh -c "'$SAN' --tool memcheck --print-limit 20 '$BIN' check-backend --backend $BACKEND > '$RES/compute-sanitizer.txt' 2>&1"
        tail -60 "$RES/compute-sanitizer.txt" >>"$LOG"
    fi
fi

[ "${SKIP_MODELS:-0}" = 1 ] || step make-models 300 $PY make-models "$WORK" "$TOK"

# 2. greedy tokens and log-probabilities on the tiny model (one batch of prompts of mixed
#    lengths; chunked prefill in one run; the device-argmax path when no logprobs are asked)
P="$WORK/prompts-tiny.txt"
{
    echo "Hello"
    echo "The capital of France is a city that"
    echo "Once upon a time, in a land far away, there lived a king who had three daughters and a very old dog named Rex."
    python3 -c "print(' '.join(['lorem ipsum dolor sit amet'] * 30))"
} >"$P"
TINY=(generate --model "$WORK/tiny" --json --max-tokens 24 --ignore-eos --file "$P")
step tiny-cuda-f32 120 sh -c "'$BIN' ${TINY[*]} --backend $BACKEND --dtype f32 --logprobs 5 > '$RES/tiny-cuda-f32.jsonl'"
step tiny-cuda-f32-chunked 120 sh -c "'$BIN' ${TINY[*]} --backend $BACKEND --dtype f32 --logprobs 5 --max-num-batched-tokens 16 > '$RES/tiny-cuda-f32-chunked.jsonl'"
step tiny-cuda-f32-greedy 120 sh -c "'$BIN' ${TINY[*]} --backend $BACKEND --dtype f32 > '$RES/tiny-cuda-f32-greedy.jsonl'"
step tiny-cpu-f32 120 sh -c "'$BIN' ${TINY[*]} --backend cpu --dtype f32 --logprobs 5 > '$RES/tiny-cpu-f32.jsonl'"
step tiny-cuda-bf16 120 sh -c "'$BIN' ${TINY[*]} --backend $BACKEND --dtype bf16 --logprobs 5 > '$RES/tiny-cuda-bf16.jsonl'"
# the same over an fp8 (E4M3) cache: decode, tensor-core prefill and the cache write in fp8
step tiny-cuda-fp8 120 sh -c "'$BIN' ${TINY[*]} --backend $BACKEND --dtype bf16 --kv-cache-dtype fp8 --logprobs 5 > '$RES/tiny-cuda-fp8.jsonl'"
# the NCCL path: one worker per device and NCCL between them, at tensor parallel 1 (this
# machine has one GPU), forced through the workers by PAGODA_PARALLEL_RUNNER; its tokens and
# log-probabilities must be the single device's. NCCL comes with PyTorch's wheels.
NCCL=$(python3 - <<'EOF'
import glob, os, site
for sp in site.getsitepackages():
    for f in sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib", "libnccl.so*"))):
        print(f)
        raise SystemExit
EOF
)
if [ -n "$NCCL" ] && [ "$BACKEND" = cuda ]; then
    step tiny-cuda-f32-nccl 120 sh -c "PAGODA_PARALLEL_RUNNER=1 PAGODA_NCCL_LIBRARY='$NCCL' '$BIN' ${TINY[*]} --backend $BACKEND --dtype f32 --logprobs 5 > '$RES/tiny-cuda-f32-nccl.jsonl' 2> '$RES/tiny-cuda-f32-nccl.err'"
else
    printf '%-26s skipped: no libnccl.so in the Python packages (or not cuda)\n' tiny-cuda-f32-nccl | tee -a "$LOG" "$STEPS"
fi
[ "${SKIP_HF:-0}" = 1 ] || step compare 240 $PY compare "$WORK" "$RES"

# 3. benchmark on the Llama-3.2-1B-shaped model, bf16, with `pagoda bench`
if [ "${SKIP_BENCH:-0}" != 1 ]; then
    M=(--model "${BENCH_MODEL:-$WORK/llama-1b}" --backend "$BACKEND" --dtype bf16 --max-model-len "${MAX_MODEL_LEN:-1024}")
    # decode of one sequence: time per output token after the first (128-token prompt)
    step bench-latency 240 "$BIN" bench latency "${M[@]}" --batch-size 1 --input-len 128 \
        --output-len "$DECODE_LEN" --num-iters 3 --output-json "$RES/bench-latency.json"
    # the time of every kernel in prefill (one prompt of PROMPT_LEN tokens) and in decode steps
    step ops-prefill 120 sh -c "PAGODA_PROFILE_OPS=1 '$BIN' bench latency ${M[*]} --batch-size 1 --input-len $PROMPT_LEN --output-len 1 --num-iters 1 --num-iters-warmup 1 > '$RES/ops-prefill.txt' 2>&1"
    # the same prefill with attention on the SIMT kernel: what the tensor-core kernel gains
    step ops-prefill-simt 120 sh -c "PAGODA_GPU_ATTENTION=general PAGODA_PROFILE_OPS=1 '$BIN' bench latency ${M[*]} --batch-size 1 --input-len $PROMPT_LEN --output-len 1 --num-iters 1 --num-iters-warmup 1 > '$RES/ops-prefill-simt.txt' 2>&1"
    step ops-decode 120 sh -c "PAGODA_PROFILE_OPS=1 '$BIN' bench latency ${M[*]} --batch-size 1 --input-len 16 --output-len 64 --num-iters 1 --num-iters-warmup 1 > '$RES/ops-decode.txt' 2>&1"
    # throughput: all requests at once, fixed lengths and a ShareGPT-like mix (medians half
    # the fixed lengths, long tails); the drawn lengths go to transformers too
    for b in $BATCHES; do
        step "bench-throughput-$b" 300 "$BIN" bench throughput "${M[@]}" --max-num-seqs "$b" \
            --workload fixed --num-prompts "$b" --input-len "$PROMPT_LEN" --output-len "$GEN_LEN" \
            --output-json "$RES/bench-throughput-$b.json"
        step "bench-sharegpt-$b" 300 "$BIN" bench throughput "${M[@]}" --max-num-seqs "$b" \
            --workload sharegpt --num-prompts "$b" --input-len "$((PROMPT_LEN / 2))" \
            --output-len "$((GEN_LEN / 2))" --max-input-len "$((PROMPT_LEN * 7 / 4))" \
            --max-output-len "$((GEN_LEN * 2))" --output-json "$RES/bench-sharegpt-$b.json"
    done
    # the first batch size again, sampled (temperature 1, top-p 0.95, as a chat client asks):
    # the tokens are drawn on the device, so it should run near the greedy figure
    B1=${BATCHES%% *}
    step "bench-sampled-$B1" 300 "$BIN" bench throughput "${M[@]}" --max-num-seqs "$B1" \
        --workload fixed --num-prompts "$B1" --input-len "$PROMPT_LEN" --output-len "$GEN_LEN" \
        --temperature 1 --top-p 0.95 --output-json "$RES/bench-sampled-$B1.json"
    python3 - "$RES" "$DECODE_LEN" <<'EOF' >>"$LOG" 2>&1
import json, os, sys
res, decode_len = sys.argv[1], int(sys.argv[2])
out = {"decode": {}, "throughput": {}}
try:
    r = json.load(open(os.path.join(res, "bench-latency.json")))["results"][0]
    step_ms = r["tpot_ms"]["p50"]
    # bytes read per decode step: every weight once in bf16 (the tied embedding as lm_head),
    # norms in f32, and the KV cache of the average context (128 + decode_len / 2), bf16 as
    # --kv-cache-dtype auto makes it for bf16 weights
    h, f, L, hkv, d, v = 2048, 8192, 16, 8, 64, 128256
    weights = 2 * (v * h + L * (h * (32 + 2 * hkv) * d + 32 * d * h + 2 * f * h + f * h)) + 4 * (2 * L + 1) * h
    kv = 2 * 2 * L * hkv * d * (128 + decode_len / 2)
    out["decode"] = {"step_ms": step_ms, "bytes_per_step": weights + kv, "weight_bytes": weights,
                     "kv_bytes": kv, "tpot_ms": r["tpot_ms"], "ttft_ms": r["ttft_ms"]}
except Exception as e:
    out["decode"] = {"error": repr(e)}
batches = os.environ.get("BATCHES", "64 256").split()
for kind in ("throughput", "sharegpt", "sampled"):
    out.setdefault(kind, {})
    for b in batches if kind != "sampled" else batches[:1]:
        try:
            r = json.load(open(os.path.join(res, f"bench-{kind}-{b}.json")))["results"][0]
            out[kind][b] = {"tok_per_s": r["output_tokens_per_s"], "seconds": r["duration_s"],
                            "tokens": r["output_tokens"], "step_time_ms": r.get("step_time_ms"),
                            "random_samples_on_device": r.get("random_samples_on_device", 0)}
        except Exception as e:
            out[kind][b] = {"error": repr(e)}
json.dump(out, open(os.path.join(res, "pagoda-bench.json"), "w"), indent=1)
print(json.dumps(out, indent=1))
EOF
    [ "${SKIP_HF:-0}" = 1 ] || step hf-bench 300 $PY hf-bench "$WORK" "$RES"
fi

# 4. the compiler's resource report of every kernel for this GPU (registers, spills), when
#    nvcc is there: the starting point for tuning
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
    NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
    step ptxas 120 sh -c "for f in kernels/*.cu; do '$NVCC' -arch=sm_${ARCH:-90} -cubin -o /dev/null -Xptxas -v \$f; done > '$RES/ptxas.txt' 2>&1"
fi

