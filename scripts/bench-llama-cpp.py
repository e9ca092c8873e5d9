#!/usr/bin/env python3
"""llama.cpp's decode throughput through llama-cpp-python's low-level API, shaped like
`cargo bench --bench decode`: one prompt of 512 tokens timed to its first token (prefill), then
for each batch size N, N sequences with short prompts decoded together (one llama_batch with one
token per sequence per step, greedy), timed after every prompt has been computed.

usage: bench-llama-cpp.py MODEL.gguf [N ...] [--tokens T] [--threads K] [--kv f32|f16]
needs: pip install llama-cpp-python numpy
"""
import argparse
import ctypes
import time

import numpy as np
import llama_cpp as L


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("batches", nargs="*", type=int, default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv", choices=["f32", "f16"], default="f32",
                    help="K/V cache type (Pagoda: f32 for f32 weights, f16 for quantized ones)")
    a = ap.parse_intermixed_args()

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(a.model.encode(), mp)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    max_n = max(a.batches)

    def new_ctx(n_seq, n_ctx, n_batch=512):
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        # NOTE: all prompts go in one llama_batch, which must fit n_batch
        cp.n_batch = max(512, n_seq, n_batch)
        cp.n_ubatch = max(512, n_seq, n_batch)
        cp.n_seq_max = n_seq
        cp.n_threads = a.threads
        cp.n_threads_batch = a.threads
        # NOTE: K/V in the type Pagoda's pool has for the same file (llama.cpp defaults to f16)
        kv = L.GGML_TYPE_F32 if a.kv == "f32" else L.GGML_TYPE_F16
        cp.type_k = kv
        cp.type_v = kv
        return L.llama_init_from_model(model, cp)

    def tokenize(text):
        buf = (L.llama_token * 4096)()
        n = L.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 4096, False, True)
        return list(buf[:n])

    print(f"llama.cpp {getattr(L, '__version__', '?')}, {a.threads} threads, model {a.model}")
    results = []

    # prefill: 512 tokens, one sequence
    ctx = new_ctx(1, 1024)
    batch = L.llama_batch_init(512, 0, 1)
    ids = [1000 + (i * 7919) % 30000 for i in range(512)]
    batch.n_tokens = 512
    for i, t in enumerate(ids):
        batch.token[i] = t
        batch.pos[i] = i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = 1 if i == 511 else 0
    t0 = time.perf_counter()
    assert L.llama_decode(ctx, batch) == 0
    L.llama_get_logits_ith(ctx, 511)
    dt = time.perf_counter() - t0
    print(f"prefill 512 tokens: {512 / dt:.1f} tokens/s")
    results.append({"prefill_tokens_per_s": round(512 / dt, 2)})
    L.llama_batch_free(batch)
    L.llama_free(ctx)

    for n in a.batches:
        prompts = [tokenize(f"Request {i}: write a long story about a lighthouse keeper and the sea.") for i in range(n)]
        n_ctx = n * (max(len(p) for p in prompts) + a.tokens + 8)
        total = sum(len(p) for p in prompts)
        ctx = new_ctx(n, n_ctx, total)
        batch = L.llama_batch_init(max(total, n), 0, n)
        # prompts: all sequences in one batch
        k = 0
        last = []
        for s, p in enumerate(prompts):
            for j, t in enumerate(p):
                batch.token[k] = t
                batch.pos[k] = j
                batch.n_seq_id[k] = 1
                batch.seq_id[k][0] = s
                batch.logits[k] = 1 if j == len(p) - 1 else 0
                k += 1
            last.append(k - 1)
        batch.n_tokens = k
        assert L.llama_decode(ctx, batch) == 0
        pos = [len(p) for p in prompts]
        nxt = []
        for s in range(n):
            lg = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, last[s]), shape=(n_vocab,))
            nxt.append(int(lg.argmax()))
        # decode: one token per sequence per step
        t0 = time.perf_counter()
        generated = 0
        steps = a.tokens - 1
        for _ in range(steps):
            batch.n_tokens = n
            for s in range(n):
                batch.token[s] = nxt[s]
                batch.pos[s] = pos[s]
                batch.n_seq_id[s] = 1
                batch.seq_id[s][0] = s
                batch.logits[s] = 1
                pos[s] += 1
            assert L.llama_decode(ctx, batch) == 0
            for s in range(n):
                lg = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, s), shape=(n_vocab,))
                nxt[s] = int(lg.argmax())
            generated += n
        dt = time.perf_counter() - t0
        tps = generated / dt
        print(f"batch {n:>3}: {generated} tokens in {dt:.2f} s = {tps:.1f} tokens/s ({dt * 1e3 / steps:.1f} ms/step)")
        results.append({"batch": n, "tokens_per_s": round(tps, 2), "ms_per_step": round(dt * 1e3 / steps, 2)})
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    print({"results": results})


if __name__ == "__main__":
    main()
