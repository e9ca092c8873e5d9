// Runs the CUDA sources in kernels/ on the CPU: the execution model of a GPU emulated in plain
// C++, so that every kernel can be checked against the CPU reference on a machine without a GPU
// (the `emu` backend, src/backend/gpu/emu.rs). Placed before common.cuh, as hip_compat.h is for
// HIP; the file is compiled by the system's C++ compiler into a shared library.
//
// The model, and what it catches:
//   - a block's threads are fibers on one OS thread, switched only at barriers: __syncthreads
//     waits for every live thread of the block, __syncwarp and the shuffles for every live lane
//     of the warp. A barrier that not all of them reach (divergence) is reported as an error,
//     never a hang. Between barriers a thread runs alone, so a kernel that reads what another
//     thread writes without a barrier between them sees the (deterministic) wrong value. The
//     threads between two barriers run in index order, in reverse, or shuffled per block and
//     round (PG_EMU_ORDER 0, 1, 2 with PG_EMU_SEED; the host's PAGODA_EMU_ORDER), so that a race
//     hidden by one order shows under another;
//   - a launch asks for at most 48 KiB of dynamic shared memory: the host never opts in to
//     more (as a GPU refuses without cuFuncSetAttribute);
//   - blocks run one after another on each of a few OS threads (PAGODA_EMU_THREADS);
//   - __shared__ arrays are per block; dynamic shared memory is filled with NaNs before each
//     block, so that reading what no thread wrote shows up in the results;
//   - device memory is host memory, and inline PTX has no meaning here: kernels keep their
//     vendor instructions behind the small functions of common.cuh, which this file replaces.
// Speed, on 2 cores: the op table in about 7 s, SmolLM2-135M in f32 at about 0.3 tokens/s;
// enough for correctness, never a measure of speed.
#pragma once
#define PG_EMU 1

#include <cmath>
#include <csetjmp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
// NOTE: per OS thread, and each OS thread runs one block at a time: per block.
#define __shared__ static thread_local
#define PG_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(pg_emu::dynamic_shared())

struct uint3 {
    unsigned x, y, z;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

namespace pg_emu {

enum class St : unsigned char { Run, BarBlock, BarWarp, Done };

struct Fiber {
    jmp_buf env;
    char* stack;
    St st;
    bool started;
};

struct Block {
    std::vector<Fiber> fibers;
    std::vector<unsigned long long> xchg;  // one slot per thread, for the shuffles
    std::vector<unsigned> site;            // per thread, the source line of its shuffle
    std::vector<unsigned> frags;           // six words per thread, for mma_16816
    std::vector<float4> dyn;               // dynamic shared memory, 16-byte aligned
    jmp_buf sched;
    unsigned cur = 0, n = 0;
    void (*body)(void*) = nullptr;
    void* arg = nullptr;
    std::string fault;  // the first fault of a thread that a GPU would stop at (see __ldg)
};

inline thread_local Block* cur_block = nullptr;
inline thread_local uint3 tidx, bidx, bdim, gdim;

constexpr size_t STACK_BYTES = 128 << 10;

inline void* dynamic_shared() { return cur_block->dyn.data(); }

#ifndef PG_EMU_ORDER
#define PG_EMU_ORDER 0
#endif
#ifndef PG_EMU_SEED
#define PG_EMU_SEED 0ULL
#endif

// The order in which round `round` of the current block runs its `n` threads.
static void round_order(std::vector<unsigned>& ord, unsigned n, unsigned long long round) {
    ord.resize(n);
    for (unsigned i = 0; i < n; ++i) ord[i] = PG_EMU_ORDER == 1 ? n - 1 - i : i;
    if (PG_EMU_ORDER != 2) return;
    // splitmix64 over (seed, block, round): the same shuffles on every run
    unsigned long long s = PG_EMU_SEED ^ (round * 0x9E3779B97F4A7C15ULL) ^
                           (((unsigned long long)bidx.z << 42) | ((unsigned long long)bidx.y << 21) | bidx.x);
    for (unsigned i = n; i > 1; --i) {
        s += 0x9E3779B97F4A7C15ULL;
        unsigned long long z = s;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        z ^= z >> 31;
        const unsigned j = (unsigned)(z % i);
        const unsigned t = ord[i - 1];
        ord[i - 1] = ord[j];
        ord[j] = t;
    }
}

[[noreturn]] static void fiber_entry() {
    Block* b = cur_block;
    b->body(b->arg);
    b = cur_block;
    b->fibers[b->cur].st = St::Done;
    _longjmp(b->sched, 1);
}

// Starts fiber `f` on its own stack; it comes back to the scheduler with _longjmp.
[[noreturn]] static void start_fiber(Fiber& f) {
    char* top = f.stack + STACK_BYTES;
    top = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(top) & ~uintptr_t(63));
#if defined(__x86_64__)
    asm volatile("mov %0, %%rsp\n\tcall *%1" : : "r"(top), "r"(&fiber_entry) : "memory");
#elif defined(__aarch64__)
    asm volatile("mov sp, %0\n\tblr %1" : : "r"(top), "r"(&fiber_entry) : "memory", "x30");
#else
#error "the kernel emulator switches stacks on x86-64 and aarch64 only"
#endif
    __builtin_unreachable();
}

static inline void wait_at(St st) {
    Block* b = cur_block;
    Fiber& f = b->fibers[b->cur];
    f.st = st;
    if (!_setjmp(f.env)) _longjmp(b->sched, 1);
}

static inline void set_thread(const Block& b, unsigned i) {
    tidx.x = i % bdim.x;
    tidx.y = (i / bdim.x) % bdim.y;
    tidx.z = i / (bdim.x * bdim.y);
    (void)b;
}

// Runs every thread of the current block to its end. False (with `err`) on a barrier that not
// every thread it waits for can reach.
static bool run_block(Block& b, std::string& err) {
    for (unsigned i = 0; i < b.n; ++i) {
        b.fibers[i].st = St::Run;
        b.fibers[i].started = false;
    }
    std::vector<unsigned> ord;
    for (unsigned long long round = 0;; ++round) {
        round_order(ord, b.n, round);
        for (unsigned i : ord) {
            Fiber& f = b.fibers[i];
            if (f.st != St::Run) continue;
            b.cur = i;
            set_thread(b, i);
            if (!_setjmp(b.sched)) {
                if (!f.started) {
                    f.started = true;
                    start_fiber(f);
                }
                _longjmp(f.env, 1);
            }
        }
        unsigned live = 0, at_block = 0;
        for (unsigned i = 0; i < b.n; ++i) {
            live += b.fibers[i].st != St::Done;
            at_block += b.fibers[i].st == St::BarBlock;
        }
        if (live == 0) return true;
        if (at_block == live) {
            for (auto& f : b.fibers)
                if (f.st == St::BarBlock) f.st = St::Run;
            continue;
        }
        bool released = false;
        for (unsigned w0 = 0; w0 < b.n; w0 += PG_WARP_SIZE) {
            const unsigned w1 = w0 + PG_WARP_SIZE < b.n ? w0 + PG_WARP_SIZE : b.n;
            unsigned lanes = 0, at_warp = 0;
            for (unsigned i = w0; i < w1; ++i) {
                lanes += b.fibers[i].st != St::Done;
                at_warp += b.fibers[i].st == St::BarWarp;
            }
            if (lanes > 0 && at_warp == lanes) {
                for (unsigned i = w0; i < w1; ++i)
                    if (b.fibers[i].st == St::BarWarp) b.fibers[i].st = St::Run;
                released = true;
            }
        }
        if (!released) {
            char msg[200];
            snprintf(msg, sizeof msg,
                     "barrier divergence in block (%u, %u, %u): %u of %u live threads wait at "
                     "__syncthreads, the others at a warp barrier",
                     bidx.x, bidx.y, bidx.z, at_block, live);
            err = msg;
            return false;
        }
    }
}

// Stacks are kept between launches (a launch with 1024 threads needs 1024 of them per worker).
static std::mutex stacks_mu;
static std::vector<std::vector<char*>> stack_sets;

static std::vector<char*> take_stacks(unsigned n) {
    std::vector<char*> s;
    {
        std::lock_guard<std::mutex> g(stacks_mu);
        if (!stack_sets.empty()) {
            s = std::move(stack_sets.back());
            stack_sets.pop_back();
        }
    }
    while (s.size() < n) s.push_back(static_cast<char*>(std::malloc(STACK_BYTES)));
    return s;
}

static void give_stacks(std::vector<char*> s) {
    std::lock_guard<std::mutex> g(stacks_mu);
    stack_sets.push_back(std::move(s));
}

static int run_grid(void (*body)(void*), void* arg, const unsigned* grid, const unsigned* block,
                    unsigned shared, char* err, unsigned errlen) {
    auto fail = [&](const std::string& m) {
        snprintf(err, errlen, "%s", m.c_str());
        return 1;
    };
    const unsigned n = block[0] * block[1] * block[2];
    if (n == 0 || n > 1024) return fail("a block of " + std::to_string(n) + " threads (1 to 1024)");
    if (block[2] > 64 || grid[1] > 65535 || grid[2] > 65535) return fail("grid or block dimension out of range");
    if (shared > 48 * 1024)
        return fail("more than 48 KiB of dynamic shared memory (" + std::to_string(shared) +
                    " bytes); a GPU refuses it unless the host opts in, which Pagoda never does");
    const unsigned long long total = (unsigned long long)grid[0] * grid[1] * grid[2];
    if (total == 0) return 0;
    unsigned workers = std::thread::hardware_concurrency();
    if (const char* e = std::getenv("PAGODA_EMU_THREADS")) workers = (unsigned)std::atoi(e);
    if (workers == 0) workers = 1;
    if (workers > total) workers = (unsigned)total;
    std::mutex mu;
    std::string first_err;
    auto work = [&](unsigned w) {
        Block b;
        b.n = n;
        b.body = body;
        b.arg = arg;
        b.fibers.resize(n);
        b.xchg.assign(n, 0);
        b.site.assign(n, 0);
        b.frags.assign(6 * (size_t)n, 0);
        b.dyn.resize((shared + 15) / 16 + 1);
        std::vector<char*> stacks = take_stacks(n);
        for (unsigned i = 0; i < n; ++i) b.fibers[i].stack = stacks[i];
        cur_block = &b;
        bdim = {block[0], block[1], block[2]};
        gdim = {grid[0], grid[1], grid[2]};
        std::string e;
        for (unsigned long long id = w; id < total; id += workers) {
            {
                std::lock_guard<std::mutex> g(mu);
                if (!first_err.empty()) break;
            }
            bidx.x = (unsigned)(id % grid[0]);
            bidx.y = (unsigned)((id / grid[0]) % grid[1]);
            bidx.z = (unsigned)(id / ((unsigned long long)grid[0] * grid[1]));
            const float nan = std::nanf("");
            for (auto& v : b.dyn) v = {nan, nan, nan, nan};
            if (!run_block(b, e) || !b.fault.empty()) {
                if (e.empty()) e = b.fault;
                std::lock_guard<std::mutex> g(mu);
                if (first_err.empty()) first_err = e;
                break;
            }
        }
        cur_block = nullptr;
        give_stacks(std::move(stacks));
    };
    if (workers == 1) {
        work(0);
    } else {
        std::vector<std::thread> ts;
        for (unsigned w = 0; w < workers; ++w) ts.emplace_back(work, w);
        for (auto& t : ts) t.join();
    }
    return first_err.empty() ? 0 : fail(first_err);
}

template <class... A, size_t... I>
static void invoke(void (*k)(A...), void** args, std::index_sequence<I...>) {
    k(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

// The host's side of a launch: `args[i]` points at the value of parameter i, as for
// cuLaunchKernel.
template <class... A>
static int launch(void (*k)(A...), void** args, const unsigned* grid, const unsigned* block, unsigned shared,
                  char* err, unsigned errlen) {
    struct Call {
        void (*k)(A...);
        void** args;
    } call{k, args};
    auto body = [](void* p) {
        Call* c = static_cast<Call*>(p);
        invoke(c->k, c->args, std::index_sequence_for<A...>{});
    };
    return run_grid(body, &call, grid, block, shared, err, errlen);
}

// A shuffle at source line `site` among the lanes of `mask` (every lane of a 64-wide warp): each
// lane leaves its value, waits for the warp, reads its source lane's. A lane of the mask that
// has exited or waits at another shuffle is a fault (on a GPU the exchange is undefined, and
// here the lanes would silently pair up).
// NOTE: each lane compares itself with the next lane of the mask only (cyclically): the lanes
// are not all at this shuffle exactly when some lane's next one is not where it is.
template <class T>
static inline T shfl(unsigned site, unsigned mask, T v, unsigned src_lane_of(unsigned lane, unsigned arg),
                     unsigned arg) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    Block* b = cur_block;
    const unsigned t = b->cur, lane = t % PG_WARP_SIZE, base = t - lane;
    std::memcpy(&b->xchg[t], &v, sizeof(T));
    b->site[t] = site;
    wait_at(St::BarWarp);
    for (unsigned d = 1; d < PG_WARP_SIZE; ++d) {
        const unsigned l = (lane + d) % PG_WARP_SIZE, o = base + l;
        if (o >= b->n || (PG_WARP_SIZE == 32 && !((mask >> l) & 1u))) continue;
        if ((b->fibers[o].st == St::Done || b->site[o] != site) && b->fault.empty()) {
            char m[200];
            snprintf(m, sizeof m,
                     "divergent shuffle in block (%u, %u, %u): thread %u at line %u, thread %u %s %u", bidx.x,
                     bidx.y, bidx.z, t, site, o, b->fibers[o].st == St::Done ? "exited, last shuffle at line" : "at line",
                     b->site[o]);
            b->fault = m;
        }
        break;
    }
    unsigned src = base + src_lane_of(lane, arg);
    if (src >= b->n || src_lane_of(lane, arg) >= PG_WARP_SIZE) src = t;
    T r;
    std::memcpy(&r, &b->xchg[src], sizeof(T));
    wait_at(St::BarWarp);  // nobody overwrites its slot before every lane has read
    return r;
}

// mma.sync.m16n8k16 (row, col) with f32 accumulators, for the warp of the calling thread: each
// lane hands in its A and B fragments (common.cuh has the layout), waits for the whole warp,
// computes its own four outputs from everyone's fragments, and waits again before anyone's
// fragments are overwritten. `half` widens one 16-bit value. Products are summed in f32 in k
// order (the hardware's order is unspecified; the tolerance of the tests covers either).
static inline void mma_16816(float* c, const unsigned* a, const unsigned* b, float (*half)(unsigned)) {
    Block* bk = cur_block;
    const unsigned t = bk->cur, lane = t % PG_WARP_SIZE, base = t - lane;
    if (PG_WARP_SIZE != 32 || base + 32 > bk->n) {
        std::fprintf(stderr, "pg_emu: mma_16816 needs a full warp of 32 lanes\n");
        std::abort();
    }
    unsigned* mine = &bk->frags[6 * (size_t)t];
    for (int i = 0; i < 4; ++i) mine[i] = a[i];
    mine[4] = b[0];
    mine[5] = b[1];
    wait_at(St::BarWarp);
    const unsigned* f = &bk->frags[6 * (size_t)base];
    auto elem = [&](unsigned l, unsigned word, unsigned k) {
        const unsigned w = f[6 * l + word];
        return half(k % 2 ? w >> 16 : w & 0xffffu);
    };
    float d[4];
    for (unsigned i = 0; i < 4; ++i) {
        const unsigned row = lane / 4 + 8 * (i / 2), col = 2 * (lane % 4) + i % 2;
        float s = c[i];
        for (unsigned k = 0; k < 16; ++k) {
            const float x = elem((row % 8) * 4 + (k % 8) / 2, (row / 8) + 2 * (k / 8), k);
            const float y = elem(col * 4 + (k % 8) / 2, 4 + k / 8, k);
            s += x * y;
        }
        d[i] = s;
    }
    wait_at(St::BarWarp);
    for (int i = 0; i < 4; ++i) c[i] = d[i];
}

}  // namespace pg_emu

#define threadIdx pg_emu::tidx
#define blockIdx pg_emu::bidx
#define blockDim pg_emu::bdim
#define gridDim pg_emu::gdim

static inline void __syncthreads() { pg_emu::wait_at(pg_emu::St::BarBlock); }
static inline void __syncwarp(unsigned = 0xffffffffu) { pg_emu::wait_at(pg_emu::St::BarWarp); }

// NOTE: macros, so that each shuffle knows the line it is written on.
#define __shfl_xor_sync(mask, v, m) pg_shfl_xor_sync(__LINE__, (mask), (v), (m))
#define __shfl_sync(mask, v, src) pg_shfl_sync(__LINE__, (mask), (v), (src))
#define __shfl_down_sync(mask, v, d) pg_shfl_down_sync(__LINE__, (mask), (v), (d))
template <class T>
static inline T pg_shfl_xor_sync(unsigned site, unsigned mask, T v, int m) {
    return pg_emu::shfl(site, mask, v, [](unsigned lane, unsigned a) { return lane ^ a; }, (unsigned)m);
}
template <class T>
static inline T pg_shfl_sync(unsigned site, unsigned mask, T v, int src) {
    return pg_emu::shfl(site, mask, v, [](unsigned, unsigned a) { return a % PG_WARP_SIZE; }, (unsigned)src);
}
template <class T>
static inline T pg_shfl_down_sync(unsigned site, unsigned mask, T v, unsigned d) {
    return pg_emu::shfl(site, mask, v, [](unsigned lane, unsigned a) { return lane + a; }, d);
}

template <class To, class From>
static inline To pg_bits(From f) {
    static_assert(sizeof(To) == sizeof(From), "same size");
    To t;
    std::memcpy(&t, &f, sizeof t);
    return t;
}
static inline float __int_as_float(int i) { return pg_bits<float>(i); }
static inline float __uint_as_float(unsigned i) { return pg_bits<float>(i); }
static inline unsigned __float_as_uint(float f) { return pg_bits<unsigned>(f); }
static inline int __float_as_int(float f) { return pg_bits<int>(f); }
// NOTE: a GPU stops a kernel that loads a vector from an address that is not a multiple of its
// size ("misaligned address"), where the host's loads succeed: the emulator records the first
// such load of a block as the launch's error.
template <class T>
static inline T __ldg(const T* p) {
    pg_emu::Block* b = pg_emu::cur_block;
    if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0 && b && b->fault.empty()) {
        char m[200];
        snprintf(m, sizeof m, "misaligned %zu-byte load at %p (a multiple of %zu is required) in block (%u, %u, %u), thread %u",
                 sizeof(T), (const void*)p, alignof(T), blockIdx.x, blockIdx.y, blockIdx.z, b->cur);
        b->fault = m;
    }
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// IEEE single operations, rounded to nearest.
// NOTE: under PG_EMU_CONTRACT (the host compiler contracting to FMA, as NVRTC does), operands
// and results pass through an empty asm, so that none of these is fused with a neighbouring
// product or sum: the GPU never contracts them either.
static inline float pg_rounded(float x) {
#ifdef PG_EMU_CONTRACT
#if defined(__x86_64__)
    __asm__("" : "+x"(x));
#else
    __asm__("" : "+w"(x));
#endif
#endif
    return x;
}
static inline float __fadd_rn(float a, float b) { return pg_rounded(pg_rounded(a) + pg_rounded(b)); }
static inline float __fsub_rn(float a, float b) { return pg_rounded(pg_rounded(a) - pg_rounded(b)); }
static inline float __fmul_rn(float a, float b) { return pg_rounded(pg_rounded(a) * pg_rounded(b)); }
static inline float __fdiv_rn(float a, float b) { return pg_rounded(pg_rounded(a) / pg_rounded(b)); }
static inline float __fdividef(float a, float b) { return a / b; }
template <class A, class B>
static inline std::common_type_t<A, B> min(A a, B b) {
    return a < b ? a : b;
}
template <class A, class B>
static inline std::common_type_t<A, B> max(A a, B b) {
    return a < b ? b : a;
}

// Atomics: blocks run on several OS threads, so these are real atomics.
static inline float atomicAdd(float* p, float v) {
    unsigned* u = reinterpret_cast<unsigned*>(p);
    unsigned old = __atomic_load_n(u, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(u, &old, __float_as_uint(__uint_as_float(old) + v), false, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
    }
    return __uint_as_float(old);
}
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}

// Half precision through the compiler's _Float16 (round to nearest even, as cvt.rn).
static inline float f16_bits_to_f32(unsigned bits) { return (float)pg_bits<_Float16>((unsigned short)bits); }
static inline unsigned short f32_to_f16_bits(float f) { return pg_bits<unsigned short>((_Float16)f); }

// The tensor-core instruction of common.cuh; the tag types are complete only there.
struct bf16_t;
struct f16_t;
static inline float pg_emu_bf16(unsigned bits) { return pg_bits<float>(bits << 16); }
static inline void mma_16816(float* c, const unsigned* a, const unsigned* b, const bf16_t*) {
    pg_emu::mma_16816(c, a, b, pg_emu_bf16);
}
static inline void mma_16816(float* c, const unsigned* a, const unsigned* b, const f16_t*) {
    pg_emu::mma_16816(c, a, b, f16_bits_to_f32);
}
