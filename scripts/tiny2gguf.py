#!/usr/bin/env python3
"""Writes the tiny test models of tests/data/tiny/ as f32 GGUF files, the way llama.cpp's
converter lays them out, so that the engine's GGUF path is tested for every family llama.cpp
defines. Tensor names come from the `gguf` package's own HF-to-GGUF map (TensorNameMap), not from
the engine; what llama.cpp's converter does besides renaming is done here explicitly:

- llama (Mistral): Q and K rows permuted for llama.cpp's interleaved RoPE, the window stored as
  `llama.attention.sliding_window`;
- granite: Q and K permuted as Llama's, the four multipliers as `granite.*` keys;
- gemma3: RMSNorm weights stored as 1 + w; the layer pattern, local RoPE base, attention scale
  and final soft-cap under the gguf package's keys (llama.cpp fixes some of them per model size);
- phi3: longrope factors as `rope_factors_short/long.weight` tensors, the original context and
  the attention factor as keys;
- gpt2: Conv1D weights transposed to [out, in];
- falcon (new decoder architecture, tied or with its own head): the grouped QKV rows reordered
  to [q | k | v];
- gpt-neox: the per-head fused QKV rows (weight and bias) reordered to [q | k | v]; the rotated
  dimensions and the parallel residual as keys (stablelm too);
- stablelm: the per-head Q/K LayerNorms (`q_layernorm.norms.N`) stacked into one `[H, D]` tensor
  each, as llama.cpp's StableLMModel does;
- cohere (command-r): `logit_scale` as a key;
- bloom: the per-head fused QKV reordered as gpt-neox's, the embeddings copied to `output.weight`
  (as llama.cpp's converter does); a context length of 256 (its converter writes `seq_length`,
  which the tiny config lacks); mpt: `max_alibi_bias` and `clamp_kqv` as keys;
- gpt-bigcode (starcoder): one KV head with multi_query; gptj: the rotated dimensions as a key
  (llama.cpp's converter has no GPT-J class; the names and keys are the gguf package's);
- mixtral (`llama` with experts), qwen2moe, qwen3moe, olmoe: each layer's experts stacked into
  `[experts, out, in]` tensors before naming (`ffn_{gate,up,down}_exps`), the expert counts and
  sizes as keys; Mixtral's Q and K permuted as Llama's;
- starcoder2: llama.cpp's converter writes no window; the window is written here as
  `starcoder2.attention.sliding_window` (the key llama.cpp reads for every family), so that the
  tiny model's long prompt means the same thing.

Falcon-RW (ALiBi) has no GGUF form: llama.cpp's converter and loader have no such Falcon.

It also writes the tiny PEFT adapters of tests/data/tiny/lora (those without rsLoRA, which
llama.cpp's adapter format cannot say) as GGUF LoRA adapters, the way llama.cpp's
convert_lora_to_gguf.py lays them out: `general.type = adapter`, `adapter.type = lora`,
`adapter.lora.alpha`, the base's architecture, and for each adapted weight of GGUF name W the
tensors `W.lora_a` ([r, in]) and `W.lora_b` ([out, r]) in f32, where llama's Q/K B rows are
permuted as the base weight's rows are.

usage: tiny2gguf.py TINY_DIR OUT_DIR     (writes OUT_DIR/<model>.gguf for each model it knows,
                                          and OUT_DIR/lora-<adapter>.gguf)
"""
import json
import os
import sys

import numpy as np
from gguf import GGUFType, GGUFWriter, Keys, MODEL_ARCH, TokenType, get_tensor_name_map
from safetensors.numpy import load_file

ARCH = {  # tiny model -> (GGUF architecture name, MODEL_ARCH)
    "mistral": ("llama", MODEL_ARCH.LLAMA),
    "qwen3": ("qwen3", MODEL_ARCH.QWEN3),
    "gemma3": ("gemma3", MODEL_ARCH.GEMMA3),
    "phi3": ("phi3", MODEL_ARCH.PHI3),
    "phi3-longrope": ("phi3", MODEL_ARCH.PHI3),
    "gpt2": ("gpt2", MODEL_ARCH.GPT2),
    "falcon": ("falcon", MODEL_ARCH.FALCON),
    "falcon-new": ("falcon", MODEL_ARCH.FALCON),
    "falcon-untied": ("falcon", MODEL_ARCH.FALCON),
    "granite": ("granite", MODEL_ARCH.GRANITE),
    "gpt-neox": ("gptneox", MODEL_ARCH.GPTNEOX),
    "stablelm": ("stablelm", MODEL_ARCH.STABLELM),
    "starcoder2": ("starcoder2", MODEL_ARCH.STARCODER2),
    "cohere": ("command-r", MODEL_ARCH.COMMAND_R),
    "gpt-bigcode": ("starcoder", MODEL_ARCH.STARCODER),
    "gptj": ("gptj", MODEL_ARCH.GPTJ),
    "olmo2": ("olmo2", MODEL_ARCH.OLMO2),
    "bloom": ("bloom", MODEL_ARCH.BLOOM),
    "mpt": ("mpt", MODEL_ARCH.MPT),
    "mixtral": ("llama", MODEL_ARCH.LLAMA),
    "qwen2-moe": ("qwen2moe", MODEL_ARCH.QWEN2MOE),
    "qwen3-moe": ("qwen3moe", MODEL_ARCH.QWEN3MOE),
    "olmoe": ("olmoe", MODEL_ARCH.OLMOE),
}
MOE = ("mixtral", "qwen2-moe", "qwen3-moe", "olmoe")
LAYER_NORM = ("gpt2", "falcon", "gpt-neox", "stablelm", "starcoder2", "cohere", "gpt-bigcode", "gptj",
              "bloom", "mpt")
NEW_FALCON = ("falcon-new", "falcon-untied")  # the new decoder architecture


def permute(w, n_head):
    # llama.cpp's LlamaModel.permute: HF rotate-half order -> GGML interleaved order
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def tokenizer(w, d):
    t = json.load(open(os.path.join(d, "tokenizer.json")))
    vocab = t["model"]["vocab"]
    tokens = [None] * len(vocab)
    for tok, i in vocab.items():
        tokens[i] = tok
    special = {a["id"] for a in t["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL if i in special else TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in t["model"]["merges"]])
    tc = json.load(open(os.path.join(d, "tokenizer_config.json")))
    w.add_bos_token_id(vocab[tc["bos_token"]])
    w.add_eos_token_id(vocab[tc["eos_token"]])
    w.add_add_bos_token(bool(tc.get("add_bos_token", False)))
    if tc.get("chat_template"):
        w.add_chat_template(tc["chat_template"])


def stack_norms(weights):
    """StableLM's per-head norms, `...{q,k}_layernorm.norms.{i}.weight`, as one `[heads, D]`
    tensor `...{q,k}_layernorm.weight` each (llama.cpp's StableLMModel._stack_qk_norm)."""
    out, parts = {}, {}
    for k, a in weights.items():
        if ".norms." in k:
            base, i = k.split(".norms.")
            parts.setdefault(base, {})[int(i.removesuffix(".weight"))] = a
        else:
            out[k] = a
    for base, p in parts.items():
        out[base + ".weight"] = np.stack([p[i] for i in range(len(p))])
    return out


def stack_experts(weights):
    """Each layer's per-expert projections, `...experts.{j}.{proj}.weight`, as one
    `[experts, out, in]` tensor `...experts.{proj}.weight` each, as llama.cpp's converter merges
    them (Mixtral's LlamaModel, Qwen2MoeModel, OlmoeModel) before naming them."""
    out, parts = {}, {}
    for k, a in weights.items():
        if ".experts." in k:
            base, rest = k.split(".experts.")
            j, proj = rest.split(".", 1)
            parts.setdefault(f"{base}.experts.{proj}", {})[int(j)] = a
        else:
            out[k] = a
    for k, p in parts.items():
        out[k] = np.stack([p[j] for j in range(len(p))])
    return out


def convert(name, d, out):
    arch_name, arch = ARCH[name]
    c = json.load(open(os.path.join(d, "config.json")))
    weights = load_file(os.path.join(d, "model.safetensors"))
    if name == "stablelm":
        weights = stack_norms(weights)
    if name in MOE:
        weights = stack_experts(weights)
    n_layer = c.get("num_hidden_layers") or c.get("n_layer") or c.get("n_layers")
    hid = c.get("hidden_size") or c.get("n_embd") or c.get("d_model")
    n_head = c.get("num_attention_heads") or c.get("n_head") or c.get("n_heads")
    head_dim = c.get("head_dim") or hid // n_head
    if name == "falcon":
        n_kv = 1 if c["multi_query"] and not c["new_decoder_architecture"] else n_head
    elif name in NEW_FALCON:
        n_kv = c["num_kv_heads"]
    elif name == "gpt-bigcode":
        n_kv = 1 if c["multi_query"] else n_head
    else:
        n_kv = c.get("num_key_value_heads", n_head)
    rope = c.get("rope_parameters") or {}
    w = GGUFWriter(out, arch_name)
    w.add_context_length(c.get("max_position_embeddings") or c.get("n_positions") or c.get("max_seq_len") or 256)
    w.add_embedding_length(hid)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(c.get("intermediate_size") or c.get("n_inner") or c.get("ffn_hidden_size")
                              or hid * c.get("expansion_ratio", 4))
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    if name in LAYER_NORM + NEW_FALCON:
        w.add_layer_norm_eps(c.get("layer_norm_epsilon") or c.get("layer_norm_eps") or c["norm_epsilon"])
    else:
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if name == "gemma3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_sliding_window(c["sliding_window"])
        # NOTE: llama.cpp fixes the local layers' pattern and base for gemma3; newer files
        # store them, as here, where they differ from its defaults
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        # the tiny model's query_pre_attn_scalar differs from head_dim, and it soft-caps
        w.add_attention_scale(c["query_pre_attn_scalar"] ** -0.5)
        if c.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(c["final_logit_softcapping"])
    elif "rope_theta" in rope:
        w.add_rope_freq_base(rope["rope_theta"])
    if name in ("gpt-neox", "stablelm"):
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
        w.add_parallel_residual(c["use_parallel_residual"])
    if name == "mpt":
        w.add_max_alibi_bias(c["attn_config"]["alibi_bias_max"])
        if c["attn_config"].get("clip_qkv"):
            w.add_clamp_kqv(c["attn_config"]["clip_qkv"])
    if name == "gptj":
        w.add_rope_dimension_count(c["rotary_dim"])
    if name == "cohere":
        w.add_logit_scale(c["logit_scale"])
    if name in ("mistral", "starcoder2") and c.get("sliding_window"):
        w.add_sliding_window(c["sliding_window"])
    if name == "granite":
        # llama.cpp's GraniteModel: the multipliers as keys (the logits are divided by its
        # logit_scale)
        w.add_embedding_scale(c["embedding_multiplier"])
        w.add_residual_scale(c["residual_multiplier"])
        w.add_attention_scale(c["attention_multiplier"])
        w.add_logit_scale(c["logits_scaling"])
    if name in ("qwen3", "qwen3-moe"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if name in MOE:
        # llama.cpp's converters: the counts, the experts' MLP size where it differs from
        # the dense one, the shared expert's
        w.add_expert_count(c.get("num_local_experts") or c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        if c.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        if c.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if name.startswith("phi3"):
        w.add_rope_dimension_count(head_dim)
        if c.get("sliding_window"):
            w.add_sliding_window(c["sliding_window"])
        if rope.get("rope_type") == "longrope":
            # llama.cpp's Phi3 converter: the factors as tensors, the rest as keys
            orig = rope["original_max_position_embeddings"]
            scale = c["max_position_embeddings"] / orig
            w.add_rope_scaling_attn_factors(
                (1 + np.log(scale) / np.log(orig)) ** 0.5 if scale > 1 else 1.0)
            w.add_rope_scaling_orig_ctx_len(orig)
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    tokenizer(w, d)

    names = get_tensor_name_map(arch, n_layer)
    tied = c.get("tie_word_embeddings", True)
    for hf, a in weights.items():
        a = a.astype(np.float32)
        if name == "gpt2" and hf.endswith((".attn.c_attn.weight", ".attn.c_proj.weight",
                                           ".mlp.c_fc.weight", ".mlp.c_proj.weight")):
            a = a.T
        if name in ("mistral", "granite", "mixtral") and hf.endswith("self_attn.q_proj.weight"):
            a = permute(a, n_head)
        if name in ("mistral", "granite", "mixtral") and hf.endswith("self_attn.k_proj.weight"):
            a = permute(a, n_kv)
        if name == "gemma3" and hf.endswith("norm.weight"):
            a = a + 1.0
        if name in NEW_FALCON and "query_key_value" in hf:
            rep = n_head // n_kv
            g = a.reshape(n_kv, rep + 2, head_dim, *a.shape[1:])
            a = np.concatenate([g[:, :rep].reshape(-1, *a.shape[1:]),
                                g[:, rep].reshape(-1, *a.shape[1:]),
                                g[:, rep + 1].reshape(-1, *a.shape[1:])])
        if name in ("gpt-neox", "bloom") and "query_key_value" in hf:
            g = a.reshape(n_head, 3, head_dim, *a.shape[1:])
            a = np.concatenate([g[:, i].reshape(-1, *a.shape[1:]) for i in range(3)])
        # llama.cpp's BloomModel maps the names without `transformer.`
        key = hf.removeprefix("transformer.") if name == "bloom" else hf
        new = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise SystemExit(f"{name}: no GGUF name for {hf}")
        w.add_tensor(new, np.ascontiguousarray(a))
        if name == "bloom" and new == "token_embd.weight":
            w.add_tensor("output.weight", np.ascontiguousarray(a))
    if not tied and "lm_head.weight" not in weights and "embed_out.weight" not in weights:
        raise SystemExit(f"{name}: untied without lm_head")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def convert_lora(adapter_dir, tiny, out):
    cfg = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    base = os.path.basename(cfg["base_model_name_or_path"])
    arch_name, arch = ARCH[base]
    c = json.load(open(os.path.join(tiny, base, "config.json")))
    n_head = c["num_attention_heads"]
    n_kv = c.get("num_key_value_heads", n_head)
    w = GGUFWriter(out, arch_name)
    w.add_type(GGUFType.ADAPTER)
    w.add_string(Keys.Adapter.TYPE, "lora")
    w.add_float32(Keys.Adapter.LORA_ALPHA, float(cfg["lora_alpha"]))
    names = get_tensor_name_map(arch, c["num_hidden_layers"])
    for hf, a in load_file(os.path.join(adapter_dir, "adapter_model.safetensors")).items():
        which = "a" if hf.endswith(".lora_A.weight") else "b"
        key = hf.removeprefix("base_model.model.").replace(f".lora_{which.upper()}.weight", ".weight")
        new = names.get_name(key, try_suffixes=(".weight",))
        if new is None:
            raise SystemExit(f"{adapter_dir}: no GGUF name for {hf}")
        # NOTE: the converter runs the base's own tensor changes on A·B, which for llama's
        # row permutation changes B's rows only
        if which == "b" and arch_name in ("llama", "granite") and key.endswith("self_attn.q_proj.weight"):
            a = permute(a, n_head)
        if which == "b" and arch_name in ("llama", "granite") and key.endswith("self_attn.k_proj.weight"):
            a = permute(a, n_kv)
        w.add_tensor(f"{new}.lora_{which}", np.ascontiguousarray(a.astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    tiny, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    for name in ARCH:
        convert(name, os.path.join(tiny, name), os.path.join(out_dir, f"{name}.gguf"))
        print("wrote", os.path.join(out_dir, f"{name}.gguf"))
    lora = os.path.join(tiny, "lora")
    for adapter in sorted(os.listdir(lora)):
        d = os.path.join(lora, adapter)
        cfg = os.path.join(d, "adapter_config.json")
        if not os.path.isfile(cfg) or json.load(open(cfg)).get("use_rslora"):
            continue
        out = os.path.join(out_dir, f"lora-{adapter}.gguf")
        convert_lora(d, tiny, out)
        print("wrote", out)


if __name__ == "__main__":
    main()
