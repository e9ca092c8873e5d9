#!/usr/bin/env python3
"""Writes a synthetic GGUF with Qwen3-30B-A3B's shape and random weights, for benchmarking the
mixture-of-experts path against llama.cpp on the same file (issue 37).

Shape per layer as Qwen3-30B-A3B (`qwen3moe`): hidden 2048, 32 query heads and 4 KV heads of 128,
per-head Q/K RMSNorm, 128 experts of 768 with the top 8 renormalised, a vocabulary of 151,936;
only the number of layers is cut (48 in the real model, `--layers`, 12 by default: about 4.4 GB
in Q4_K), so that it fits this machine's 24 GiB twice over (both engines map it). Per token and
layer, decode reads as much as the real model's.

Linear weights are Q4_K blocks of random bytes with fixed small scales (valid values, not a
trained model: the point is the bytes and flops); the router and the norms are f32, as
llama.cpp's converter writes them. The tokenizer is a SentencePiece (`llama`) vocabulary of byte
tokens and placeholders, which both engines read.

usage: make-moe-gguf.py OUT.gguf [--layers N] [--seed S]
needs: pip install gguf numpy
"""
import argparse

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType, TokenType

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, TOP_K, EXPERT_FFN, DENSE_FFN = 128, 8, 768, 6144
VOCAB = 151936
QK_K, Q4_K_BYTES = 256, 144  # values and bytes per Q4_K block


def q4_k(rng, rows, k, lead=()):
    """Random Q4_K blocks for `lead + (rows, k)` values, as uint8 `lead + (rows, k/256*144)`."""
    n_blocks = int(np.prod(lead, dtype=np.int64)) * rows * (k // QK_K)
    b = rng.integers(0, 256, size=(n_blocks, Q4_K_BYTES), dtype=np.uint8)
    # d and dmin (f16): small and fixed, so that every value is finite and outputs stay O(1)
    d = np.array([0.02 / np.sqrt(k)], dtype=np.float16).view(np.uint8)
    b[:, 0:2] = d
    b[:, 2:4] = d
    return b.reshape(*lead, rows, (k // QK_K) * Q4_K_BYTES)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)

    w = GGUFWriter(a.out, "qwen3moe")
    w.add_name("synthetic Qwen3-30B-A3B shape (random weights)")
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(DENSE_FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(TOP_K)
    w.add_expert_feed_forward_length(EXPERT_FFN)

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    tokens += [f"\u2581t{i}" for i in range(VOCAB - len(tokens))]
    types += [TokenType.NORMAL] * (VOCAB - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(VOCAB)])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    qt = GGMLQuantizationType.Q4_K
    w.add_tensor("token_embd.weight", q4_k(rng, VOCAB, HIDDEN), raw_dtype=qt)
    for l in range(a.layers):
        p = f"blk.{l}."
        ones = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        w.add_tensor(p + "attn_norm.weight", ones(HIDDEN))
        w.add_tensor(p + "attn_q.weight", q4_k(rng, HEADS * HEAD_DIM, HIDDEN), raw_dtype=qt)
        w.add_tensor(p + "attn_k.weight", q4_k(rng, KV_HEADS * HEAD_DIM, HIDDEN), raw_dtype=qt)
        w.add_tensor(p + "attn_v.weight", q4_k(rng, KV_HEADS * HEAD_DIM, HIDDEN), raw_dtype=qt)
        w.add_tensor(p + "attn_q_norm.weight", ones(HEAD_DIM))
        w.add_tensor(p + "attn_k_norm.weight", ones(HEAD_DIM))
        w.add_tensor(p + "attn_output.weight", q4_k(rng, HIDDEN, HEADS * HEAD_DIM), raw_dtype=qt)
        w.add_tensor(p + "ffn_norm.weight", ones(HIDDEN))
        router = rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32)
        w.add_tensor(p + "ffn_gate_inp.weight", router)
        for part, (rows, k) in [("gate", (EXPERT_FFN, HIDDEN)), ("up", (EXPERT_FFN, HIDDEN)),
                                ("down", (HIDDEN, EXPERT_FFN))]:
            w.add_tensor(p + f"ffn_{part}_exps.weight", q4_k(rng, rows, k, (EXPERTS,)), raw_dtype=qt)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.add_tensor("output.weight", q4_k(rng, VOCAB, HIDDEN), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    print("wrote", a.out)


if __name__ == "__main__":
    main()
