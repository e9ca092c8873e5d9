// Choosing the next token on the device, so that a step brings back token ids, not logits:
// greedy (argmax) and random sampling with temperature, top-k, top-p and min-p, after the
// sparse edits of logit_bias, banned tokens and the repetition, presence and frequency penalties.
// One block per row; blockDim.x is a multiple of PG_WARP_SIZE, at most SAMPLE_THREADS.
//
// NOTE: reproducible per (seed, step) whatever the launch shape. Probabilities relative to the
// most likely token, exp((x - max) / T) in [0, 1], become integers w = floor(p · 2^40), so
// every sum below is exact and its order does not matter (a row of 2^17 tokens sums below
// 2^58). Tokens with p < 2^-40 get w = 0 and cannot be drawn (at most 2^-23 of the mass for
// a 128k vocabulary). The draw u in [0, 1) comes from the host (ChaCha8 of the request's seed
// and step, the u the host sampler would use) as 53 bits.
//
// The order of the host sampler (src/sampling/sampler.rs): top-k on the logits (ties: lowest
// ids), then top-p over what is left (the smallest most-likely-first prefix, ties by lowest id,
// whose mass reaches top_p of it), then min-p (p >= min_p), then the draw. The draw walks the
// tokens left in id order (the host walks them most likely first): the same distribution, a
// different token for a given u.
//
// The thresholds are found by radix select, 8 bits a pass, on the logit's order-preserving key:
// a histogram of counts (top-k) or of masses (top-p) per digit, the digit that holds the k-th
// token or the mass's boundary, and the next pass within that digit.
#include "common.cuh"

#define SAMPLE_THREADS 512

// Larger logits give larger keys; NaN gives 0 (below -inf), -0 and +0 the same key.
__device__ __forceinline__ u32 logit_key(float x) {
    if (x != x) return 0u;
    const u32 b = x == 0.0f ? 0u : __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Index of the largest value of the row (ties: the lowest index; NaN and -inf never win; 0 when
// nothing beats -inf), in every thread.
__device__ __forceinline__ u32 row_argmax(const float* row, u32 cols) {
    __shared__ float sv[SAMPLE_THREADS];
    __shared__ u32 si[SAMPLE_THREADS];
    float bv = PG_NEG_INF;
    u32 bi = 0xffffffffu;
    for (u32 i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = row[i];
        if (v > bv) {  // strictly greater: this thread visits indices in increasing order
            bv = v;
            bi = i;
        }
    }
    __syncthreads();  // sv and si may still be read by an earlier call
    sv[threadIdx.x] = bv;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float ov = sv[threadIdx.x + s];
            const u32 oi = si[threadIdx.x + s];
            if (ov > sv[threadIdx.x] || (ov == sv[threadIdx.x] && oi < si[threadIdx.x])) {
                sv[threadIdx.x] = ov;
                si[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    return si[0] == 0xffffffffu ? 0u : si[0];
}

// out[r] = the argmax of row r (see row_argmax), for greedy steps.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) argmax_f32(const float* logits, u32* out, u32 cols) {
    const u32 best = row_argmax(logits + (u64)blockIdx.x * cols, cols);
    if (threadIdx.x == 0) out[blockIdx.x] = best;
}

// Sum over the block (u64: exact; double: in a fixed order), in every thread.
template <class T>
__device__ __forceinline__ T block_total(T v) {
    __shared__ T part[SAMPLE_THREADS / 32];
    const u32 lane = threadIdx.x % PG_WARP_SIZE, warp = threadIdx.x / PG_WARP_SIZE;
#pragma unroll
    for (int m = PG_WARP_SIZE / 2; m > 0; m >>= 1) v += PG_SHFL_XOR(v, m);
    __syncthreads();  // part may still be read by an earlier call
    if (lane == 0) part[warp] = v;
    __syncthreads();
    T s = 0;
    for (u32 w = 0; w < blockDim.x / PG_WARP_SIZE; ++w) s += part[w];
    return s;
}

// The largest value of the row, NaN skipped (-inf for nothing else), in every thread.
__device__ __forceinline__ float row_max(const float* row, u32 cols) {
    __shared__ float part[SAMPLE_THREADS / 32];
    float mx = PG_NEG_INF;
    for (u32 i = threadIdx.x; i < cols; i += blockDim.x) mx = fmaxf(mx, row[i]);  // fmaxf skips NaN
    mx = warp_max(mx);
    __syncthreads();  // part may still be read by an earlier call
    if (threadIdx.x % PG_WARP_SIZE == 0) part[threadIdx.x / PG_WARP_SIZE] = mx;
    __syncthreads();
    for (u32 w = 0; w < blockDim.x / PG_WARP_SIZE; ++w) mx = fmaxf(mx, part[w]);
    return mx;
}

// The first index i (in id order) where f(0) + ... + f(i) > target, in every thread; `cols`
// when the total does not exceed it. Each thread sums a contiguous segment, one scan over the
// block finds the segment, and its thread walks it.
template <class F>
__device__ __forceinline__ u32 find_cumulative(u32 cols, u64 target, F f) {
    __shared__ u64 scan[SAMPLE_THREADS];
    __shared__ u32 found;
    const u32 t = threadIdx.x, seg = (cols + blockDim.x - 1) / blockDim.x;
    const u32 lo = min(t * seg, cols), hi = min(lo + seg, cols);
    u64 mine = 0;
    for (u32 i = lo; i < hi; ++i) mine += f(i);
    __syncthreads();  // scan and found may still be read by an earlier call
    scan[t] = mine;
    if (t == 0) found = cols;
    __syncthreads();
    // Inclusive scan (Hillis-Steele): each step reads, waits, then writes.
    for (u32 off = 1; off < blockDim.x; off <<= 1) {
        const u64 add = t >= off ? scan[t - off] : 0;
        __syncthreads();
        scan[t] += add;
        __syncthreads();
    }
    const u64 before = scan[t] - mine;
    if (before <= target && target < scan[t]) {  // one thread at most
        u64 c = before;
        for (u32 i = lo; i < hi; ++i) {
            c += f(i);
            if (c > target) {
                found = i;
                break;
            }
        }
    }
    __syncthreads();
    return found;
}

// Radix select: the largest key K with  Σ f(i) over key(i) >= K  reaching `need` (1 <= need <=
// Σ f), in every thread; *rest is what of `need` the keys equal to K must bring (>= 1).
template <class F, class K>
__device__ __forceinline__ u32 radix_select(u32 cols, u64 need, F f, K key, u64* rest) {
    __shared__ u64 hist[256];
    __shared__ u32 sel_prefix;
    __shared__ u64 sel_need;
    u32 prefix = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        __syncthreads();  // the previous pass's hist and selection were read
        for (u32 b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        // keys that agree with the prefix on the digits chosen so far
        const u32 high = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
        for (u32 i = threadIdx.x; i < cols; i += blockDim.x) {
            const u64 w = f(i);
            const u32 k = key(i);
            if (w != 0 && (k & high) == prefix) atomicAdd(&hist[(k >> shift) & 255u], w);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 above = 0;
            u32 b = 255;
            for (; b > 0 && above + hist[b] < need; --b) above += hist[b];
            sel_prefix = prefix | (b << shift);
            sel_need = need - above;
        }
        __syncthreads();
        prefix = sel_prefix;
        need = sel_need;
    }
    *rest = need;
    return prefix;
}

// The host sampler's edits of the logits before it chooses (src/sampling/sampler.rs), in its
// order and with its roundings (no contraction into FMAs), one thread per (row, token), each
// pair at most once: logit_bias added; a banned token (min_tokens' stop tokens, a bad word's
// last token) set to -inf; the repetition penalty on a token of the prompt or the output
// (divided when positive, multiplied otherwise); the presence and frequency penalties on a
// token the output holds `count` times. edits [n, 8] words: row, token, bias (f32 bits), flags
// (1: banned, 2: in the prompt or output), count, repetition, presence, frequency (f32 bits).
extern "C" __global__ void logit_edits_f32(float* logits, const u32* edits, u32 n, u32 cols) {
    const u32 e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const u32* w = edits + 8 * (u64)e;
    float* x = logits + (u64)w[0] * cols + w[1];
    float l = __fadd_rn(*x, __uint_as_float(w[2]));
    if (w[3] & 1u) l = PG_NEG_INF;
    const float rp = __uint_as_float(w[5]);
    if ((w[3] & 2u) && rp != 1.0f) l = l > 0.0f ? __fdiv_rn(l, rp) : __fmul_rn(l, rp);
    if (w[4] != 0) {
        const float pen = __fadd_rn(__uint_as_float(w[6]), __fmul_rn(__uint_as_float(w[7]), (float)w[4]));
        l = __fsub_rn(l, pen);
    }
    *x = l;
}

// out[r] = the token drawn from row r of logits [rows, cols]. params [rows, 6] (u32 words):
// temperature (f32 bits; <= 0: greedy), top_k (0: all), top_p (f32), min_p (f32), and the draw
// as 53 bits (low word, high word). Greedy, top_k = 1 and a row without a finite maximum take
// the argmax, as the host does.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_f32(const float* logits, const u32* params, u32* out, u32 cols) {
    const float* row = logits + (u64)blockIdx.x * cols;
    const u32* p = params + 6 * (u64)blockIdx.x;
    const float temperature = __uint_as_float(p[0]), top_p = __uint_as_float(p[2]), min_p = __uint_as_float(p[3]);
    const u32 top_k = p[1];
    const u64 u53 = (u64)p[4] | ((u64)p[5] << 32);

    const float mx = row_max(row, cols);
    if (!(temperature > 0.0f) || top_k == 1 || !(mx > PG_NEG_INF && mx < -PG_NEG_INF)) {
        const u32 best = row_argmax(row, cols);
        if (threadIdx.x == 0) out[blockIdx.x] = best;
        return;
    }
    const float inv_t = 1.0f / temperature;
    // p relative to the most likely token, and its integer weight
    auto prob = [&](float x) { return x != x ? 0.0f : expf((x - mx) * inv_t); };
    auto weight = [&](float q) { return (u64)(q * 0x1p40f); };
    auto key = [&](u32 i) { return logit_key(row[i]); };

    // top-k: the k-th largest key, and of the tokens with that key the lowest ids that fill k
    const bool use_k = top_k > 0 && top_k < cols;
    u32 k_key = 0, k_last = cols;
    if (use_k) {
        u64 ties = 0;
        k_key = radix_select(cols, top_k, [&](u32) { return (u64)1; }, key, &ties);
        k_last = find_cumulative(cols, ties - 1, [&](u32 i) { return (u64)(key(i) == k_key); });
    }
    auto in_k = [&](u32 i, u32 k) { return !use_k || k > k_key || (k == k_key && i <= k_last); };

    // top-p over what top-k left: the largest key whose most-likely-first prefix reaches the
    // target mass, and of its ties the lowest ids that do (ties have one weight)
    const bool use_p = top_p < 1.0f;
    u32 p_key = 0, p_last = cols;
    if (use_p) {
        auto wk = [&](u32 i) {
            const u32 k = key(i);
            return in_k(i, k) ? weight(prob(row[i])) : (u64)0;
        };
        u64 z = 0;
        for (u32 i = threadIdx.x; i < cols; i += blockDim.x) z += wk(i);
        z = block_total(z);
        u64 need = (u64)ceil((double)top_p * (double)z);
        need = need < 1 ? 1 : (need > z ? z : need);
        u64 rest = 0;
        p_key = radix_select(cols, need, wk, key, &rest);
        // NOTE: the ties' mass in id order, not their count: one weight each, so the tie
        // where it reaches `rest` is the last one taken, and no division is needed
        p_last = find_cumulative(cols, rest - 1, [&](u32 i) { return key(i) == p_key ? wk(i) : (u64)0; });
    }

    // what is left after min-p, drawn in id order
    auto w_final = [&](u32 i) {
        const u32 k = key(i);
        if (!in_k(i, k) || (use_p && !(k > p_key || (k == p_key && i <= p_last)))) return (u64)0;
        const float q = prob(row[i]);
        return q >= min_p ? weight(q) : (u64)0;
    };
    u64 total = 0;
    for (u32 i = threadIdx.x; i < cols; i += blockDim.x) total += w_final(i);
    total = block_total(total);
    u32 tok = cols;
    if (total > 0) tok = find_cumulative(cols, __umul64hi(u53 << 11, total), w_final);
    if (tok >= cols) tok = row_argmax(row, cols);  // nothing left to draw (as the host)
    if (threadIdx.x == 0) out[blockIdx.x] = tok;
}

// Raw log-probabilities (of the logits as they came, before any edit or temperature), as the
// host computes them (src/sampling/sampler.rs, raw_logprobs): NaN counts as -inf and +inf as
// the largest finite value; log Σ exp(x - max) summed in double; a row without a finite
// maximum is uniform. One block per scored row. params [rows, 4] words: the row in `logits`,
// its entry in `tokens`, the token to score (0xffffffff: tokens[entry], the one chosen) and k
// (<= LOGPROBS_MAX). out [rows, LOGPROBS_WORDS] words: the token, its log-probability (f32
// bits), its rank (1 + the count of logits above its own), then the k most likely tokens
// (ties: lowest id first) as (id, log-probability) pairs.
#define LOGPROBS_MAX 20
#define LOGPROBS_WORDS (3 + 2 * LOGPROBS_MAX)

__device__ __forceinline__ float clean_logit(float x) { return x != x ? PG_NEG_INF : fminf(x, 3.402823466e38f); }

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    logprobs_f32(const float* logits, const u32* params, const u32* tokens, u32* out, u32 cols) {
    __shared__ u32 top_id[LOGPROBS_MAX], top_key[LOGPROBS_MAX], top_n;
    const u32* p = params + 4 * (u64)blockIdx.x;
    const float* row = logits + (u64)p[0] * cols;
    const u32 tok = p[2] != 0xffffffffu ? p[2] : tokens[p[1]];
    const u32 k = min(min(p[3], (u32)LOGPROBS_MAX), cols);
    u32* o = out + LOGPROBS_WORDS * (u64)blockIdx.x;

    const float x = tok < cols ? row[tok] : PG_NEG_INF;
    const float mx = fminf(row_max(row, cols), 3.402823466e38f);
    double sum = 0.0;
    u32 above = 0;
    for (u32 i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = row[i];
        sum += (double)expf(__fsub_rn(clean_logit(v), mx));
        above += v > x;
    }
    sum = block_total(sum);
    above = (u32)block_total((u64)above);
    const bool flat = !(mx > PG_NEG_INF);
    const float lse = flat ? 0.0f : (float)log(sum);
    auto logprob = [&](float v) {
        return flat ? -logf((float)cols) : __fsub_rn(__fsub_rn(clean_logit(v), mx), lse);
    };

    if (k > 0) {
        // the k-th largest key (NaN as -inf), and of its ties the lowest ids that fill k
        auto key = [&](u32 i) { return logit_key(row[i] != row[i] ? PG_NEG_INF : row[i]); };
        u64 ties = 0;
        const u32 k_key = radix_select(cols, k, [&](u32) { return (u64)1; }, key, &ties);
        const u32 k_last = find_cumulative(cols, ties - 1, [&](u32 i) { return (u64)(key(i) == k_key); });
        if (threadIdx.x == 0) top_n = 0;
        __syncthreads();
        for (u32 i = threadIdx.x; i < cols; i += blockDim.x) {
            const u32 c = key(i);
            if (c > k_key || (c == k_key && i <= k_last)) {
                const u32 at = atomicAdd(&top_n, 1u);  // exactly k pass
                if (at < LOGPROBS_MAX) {
                    top_id[at] = i;
                    top_key[at] = c;
                }
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            // insertion sort of k <= 20: larger key first, then lower id
            for (u32 a = 1; a < k; ++a) {
                const u32 ia = top_id[a], ka = top_key[a];
                u32 b = a;
                for (; b > 0 && (top_key[b - 1] < ka || (top_key[b - 1] == ka && top_id[b - 1] > ia)); --b) {
                    top_id[b] = top_id[b - 1];
                    top_key[b] = top_key[b - 1];
                }
                top_id[b] = ia;
                top_key[b] = ka;
            }
            for (u32 j = 0; j < k; ++j) {
                o[3 + 2 * j] = top_id[j];
                o[4 + 2 * j] = __float_as_uint(logprob(row[top_id[j]]));
            }
        }
    }
    if (threadIdx.x == 0) {
        o[0] = tok;
        o[1] = __float_as_uint(tok < cols ? logprob(x) : PG_NEG_INF);
        o[2] = 1 + above;
    }
}
