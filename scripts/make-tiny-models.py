#!/usr/bin/env python3
"""Make tiny random-weight test models with HF transformers, and their golden greedy outputs.

Writes tests/data/tiny/<name>/ (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json) for mistral, qwen3, gemma3, phi3, phi3-longrope, gpt2,
falcon, falcon-new, falcon-untied, granite, gpt-neox, stablelm, starcoder2, cohere,
gpt-bigcode, gptj, olmo2, bloom, mpt, falcon-rw, mixtral, qwen2-moe, qwen3-moe, olmoe, and
tests/data/tiny/goldens.json. See tests/data/tiny/README.md.

usage: make-tiny-models.py [--out tests/data/tiny] [--only NAME ...]

Needs torch, transformers (5.x), tokenizers, safetensors, numpy; runs offline on CPU.
The output is deterministic: running it twice gives byte-identical files.
"""
import argparse
import json
import os
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
import tokenizers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(1)

N_GEN = 48
MIN_MARGIN = 0.01  # required minimum top1-top2 logit gap over every golden position
MAX_BYTES = 700_000  # per model dir
VOCAB_SIZE = 320
EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Fixed English text the tokenizer is trained on (written for this script).
CORPUS = """\
The river ran slowly past the old mill, and the town woke up to the sound of water on stone.
In the morning the baker opened the door and the smell of warm bread filled the street.
Children walked to school with their books, and the teacher wrote the day's lesson on the board.
The old engineer walked along the river every evening, counting the boats and listening to the water.
She thought about the machines she had built, the bridges that still stood, and the roads that
carried people from one town to the next. Every machine is a small promise: it will turn, it will
lift, it will carry the weight that people cannot carry alone.
What is the weather like today? The sky is grey, the wind is cold, and it will rain in the evening.
A good question is better than a quick answer. The student asked why the moon changes its shape,
and the teacher drew the sun, the earth and the moon on the board, one circle after another.
The market opened at nine. Farmers brought apples, cheese, honey and eggs, and the people of the
town came with baskets and talked about the weather, the harvest and the news from the city.
At night the lights of the houses were reflected in the river, and the mill stood dark and quiet.
The library kept old maps of the valley. On one of them the river had a different course, and the
mill was drawn on the other bank. Nobody could say when the water had moved.
Numbers are useful: one, two, three, four, five, six, seven, eight, nine, ten. A train left the
station at 10:45 and arrived in the city two hours later, carrying 120 people and 3 tons of mail.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
The computer counted the words in the book and printed the list of the most common ones.
"""

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

PROMPTS = [
    ("short", "The river"),
    ("medium", "In the morning the baker opened the door and"),
    ("long", "The old engineer walked along the river every evening, counting the boats and listening "
             "to the water. She thought about the"),
    ("chat", "<|im_start|>user\nWhat is the weather like today?<|im_end|>\n<|im_start|>assistant\n"),
]


def train_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  special_tokens=[EOT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    return tok


def tokenizer_config():
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": None,
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


# name -> (model_type, config kwargs, first seed, extra)
# "emb_std": std of embedding / lm_head matrices, "w_std": std of every other matrix.
def specs(ids):
    eot, im_end = ids[EOT], ids[IM_END]
    common = dict(bos_token_id=eot, eos_token_id=eot, pad_token_id=None)
    longrope_rng = torch.Generator().manual_seed(1234)
    short_f = [round(1.0 + 3.0 * x, 4) for x in torch.rand(8, generator=longrope_rng).tolist()]
    long_f = [round(1.0 + 3.0 * x, 4) for x in torch.rand(8, generator=longrope_rng).tolist()]
    return {
        "mistral": ("mistral", dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=12, max_position_embeddings=256,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, **common), 100, {"init": dict(emb_std=0.6, head_std=1.2)}),
        "qwen3": ("qwen3", dict(
            hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rope_theta=1000000.0,
            rms_norm_eps=1e-6, attention_bias=False, use_sliding_window=False, tie_word_embeddings=True,
            **common), 200, {"init": dict(emb_std=0.6, norm_offset={"model.norm.": 1.0}),
                           "generation_config": dict(
                bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot, do_sample=True,
                temperature=0.6, top_p=0.95, top_k=20)}),
        "gemma3": ("gemma3_text", dict(
            hidden_size=48, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention", "sliding_attention", "full_attention"],
            sliding_window_pattern=3, rope_theta=1000000.0, rope_local_base_freq=10000.0, max_position_embeddings=256,
            rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0,
            attn_logit_softcapping=None, tie_word_embeddings=True, **common), 300,
            {"init": dict(emb_std=0.15, norm_offset={"post_": 3.0, "model.norm.": 7.0})}),
        "phi3": ("phi3", dict(
            hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, sliding_window=12, max_position_embeddings=256,
            original_max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False, **common), 400, {"init": dict(emb_std=0.6, head_std=1.2)}),
        "phi3-longrope": ("phi3", dict(
            hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, sliding_window=None, max_position_embeddings=1024,
            original_max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5,
            rope_scaling={"type": "longrope", "short_factor": short_f, "long_factor": long_f},
            tie_word_embeddings=False, **common), 500, {"init": dict(emb_std=0.6, head_std=1.2)}),
        "gpt2": ("gpt2", dict(
            n_embd=64, n_layer=3, n_head=4, n_inner=128, n_positions=256, activation_function="gelu_new",
            layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            tie_word_embeddings=True, **common), 600,
            {"init": dict(emb_std=0.6, norm_offset={"ln_f.": 1.0})}),
        "falcon": ("falcon", dict(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, new_decoder_architecture=False,
            multi_query=True, parallel_attn=True, bias=False, alibi=False, ffn_hidden_size=128,
            max_position_embeddings=256, rope_theta=10000.0, layer_norm_epsilon=1e-5,
            tie_word_embeddings=True, **common), 700,
            {"init": dict(emb_std=0.6, w_std=0.4, norm_offset={"ln_f.": 1.0})}),
        "falcon-new": ("falcon", dict(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_kv_heads=2,
            new_decoder_architecture=True, parallel_attn=True, bias=True, alibi=False, ffn_hidden_size=128,
            max_position_embeddings=256, rope_theta=10000.0, layer_norm_epsilon=1e-5,
            tie_word_embeddings=True, **common), 800,
            {"init": dict(emb_std=0.6, w_std=0.4, norm_offset={"ln_f.": 1.0})}),
        # Llama with Granite's four multipliers (each unlike 1 and the default scale)
        "granite": ("granite", dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
            embedding_multiplier=4.0, residual_multiplier=0.8, attention_multiplier=0.15,
            logits_scaling=2.0, tie_word_embeddings=False, **common), 1000,
            {"init": dict(emb_std=0.15, head_std=2.4)}),
        # Pythia's layout: fused per-head QKV, parallel residual with two norms, half the head
        # rotated
        "gpt-neox": ("gpt_neox", dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5},
            layer_norm_eps=1e-5, hidden_act="gelu", use_parallel_residual=True, attention_bias=True,
            tie_word_embeddings=False, **common), 1100,
            {"init": dict(emb_std=0.6, head_std=1.2, w_std=0.4, norm_offset={"final_layer_norm.": 1.0})}),
        # StableLM 2's layout: a quarter of the head rotated, Q/K/V biases, sequential residual,
        # a LayerNorm of each Q and K head (12B's qk_layernorm)
        "stablelm": ("stablelm", dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            layer_norm_eps=1e-5, use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=False,
            tie_word_embeddings=False, **common), 1200,
            {"init": dict(emb_std=0.6, head_std=1.2, norm_offset={"model.norm.": 1.0})}),
        # StarCoder2: biases everywhere, LayerNorm, a GELU MLP, a sliding window
        "starcoder2": ("starcoder2", dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, sliding_window=12, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, norm_epsilon=1e-5,
            use_bias=True, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, **common), 1300,
            {"init": dict(emb_std=0.6, w_std=0.4, norm_offset={"model.norm.": 1.0})}),
        # Command-R: one LayerNorm without bias feeding attention and MLP in parallel,
        # interleaved RoPE, scaled logits, a LayerNorm of each Q and K head (Command R+'s
        # use_qk_norm)
        "cohere": ("cohere", dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, layer_norm_eps=1e-5,
            logit_scale=0.25, use_qk_norm=True, tie_word_embeddings=True, **common), 1400,
            {"init": dict(emb_std=0.6, w_std=0.4, norm_offset={"model.norm.": 1.0})}),
        # StarCoder's layout: GPT-2 with one KV head and Linear weights
        "gpt-bigcode": ("gpt_bigcode", dict(
            n_embd=64, n_layer=3, n_head=4, n_inner=128, n_positions=256, multi_query=True,
            activation_function="gelu_pytorch_tanh", layer_norm_epsilon=1e-5, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, **common), 1500,
            {"init": dict(emb_std=0.6, w_std=0.4, norm_offset={"ln_f.": 1.0})}),
        # GPT-J: attention and MLP in parallel off one LayerNorm, interleaved RoPE over part of
        # each head, an output head with a bias
        "gptj": ("gptj", dict(
            n_embd=64, n_layer=3, n_head=4, n_inner=128, n_positions=256, rotary_dim=8,
            activation_function="gelu_new", layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=False, **common), 1600,
            {"init": dict(emb_std=0.6, head_std=1.2, w_std=0.4, norm_offset={"ln_f.": 1.0})}),
        # OLMo 2: norms after attention and MLP (none before), RMSNorm of all of Q and of K
        "olmo2": ("olmo2", dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
            attention_bias=False, tie_word_embeddings=False, **common), 1700,
            {"init": dict(emb_std=0.6, head_std=1.2, norm_offset={"model.norm.": 1.0})}),
        # BLOOM: ALiBi over 6 heads (not a power of two), a LayerNorm on the embeddings, fused
        # per-head QKV, biases everywhere
        "bloom": ("bloom", dict(
            hidden_size=48, n_layer=3, n_head=6, layer_norm_epsilon=1e-5,
            apply_residual_connection_post_layernorm=False, hidden_dropout=0.0, attention_dropout=0.0,
            tie_word_embeddings=True, **common), 1800,
            {"init": dict(emb_std=0.6, w_std=1.0, norm_offset={"ln_f.": 1.0})}),
        # MPT: ALiBi, LayerNorm without bias, no biases, fused [q | k | v], Q, K and V clamped
        # to ±6 (a few percent of the values, at these weights)
        "mpt": ("mpt", dict(
            d_model=64, n_heads=4, n_layers=3, max_seq_len=256, no_bias=True,
            attn_config={"alibi": True, "alibi_bias_max": 8, "clip_qkv": 6.0, "qk_ln": False,
                         "softmax_scale": None},
            layer_norm_epsilon=1e-5, tie_word_embeddings=True, **common), 1900,
            {"init": dict(emb_std=0.6, w_std=0.4, norm_offset={"norm_f.": 1.0})}),
        # Falcon-40B's layout with its own output head
        "falcon-untied": ("falcon", dict(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_kv_heads=2,
            new_decoder_architecture=True, parallel_attn=True, bias=False, alibi=False, ffn_hidden_size=128,
            max_position_embeddings=256, rope_theta=10000.0, layer_norm_epsilon=1e-5,
            tie_word_embeddings=False, **common), 900,
            {"init": dict(emb_std=0.6, head_std=1.2, w_std=0.4, norm_offset={"ln_f.": 1.0})}),
        # Falcon-RW: ALiBi added before the attention scale, per-head fused QKV (multi-head),
        # sequential residual, biases. NOTE: transformers' eager path adds the bias twice (once
        # in the mask it builds, once in the attention), its SDPA path once, as the original
        # code did: the goldens come from SDPA. It rounds slope * position to bf16, which is
        # exact for these 4 heads (slopes are powers of two) below position 256.
        "falcon-rw": ("falcon", dict(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, new_decoder_architecture=False,
            multi_query=False, parallel_attn=False, bias=True, alibi=True, ffn_hidden_size=128,
            max_position_embeddings=256, layer_norm_epsilon=1e-5, tie_word_embeddings=True, **common), 2000,
            {"init": dict(emb_std=0.6, w_std=0.4, norm_offset={"ln_f.": 1.0}), "attn": "sdpa"}),
        # Mixtral: 4 experts, the top 2 renormalised
        "mixtral": ("mixtral", dict(
            hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
            max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=True, **common), 2100,
            {"init": dict(emb_std=0.6, norm_offset={"model.norm.": 1.0})}),
        # Qwen2-MoE: QKV biases, 4 experts with the top 2 not renormalised, a shared expert
        # behind a sigmoid gate. NOTE: every layer sparse, as in every released checkpoint:
        # llama.cpp's qwen2moe has no dense layers (mlp_only_layers), so no GGUF copy could
        # hold one.
        "qwen2-moe": ("qwen2_moe", dict(
            hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
            mlp_only_layers=[], decoder_sparse_step=1, max_position_embeddings=256,
            rope_theta=10000.0, rms_norm_eps=1e-6, use_sliding_window=False,
            tie_word_embeddings=True, **common), 2200,
            {"init": dict(emb_std=0.6, norm_offset={"model.norm.": 1.0})}),
        # Qwen3-MoE: per-head Q/K norms, 4 experts, the top 2 renormalised
        "qwen3-moe": ("qwen3_moe", dict(
            hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            max_position_embeddings=256, rope_theta=1000000.0, rms_norm_eps=1e-6,
            use_sliding_window=False, tie_word_embeddings=True, **common), 2300,
            {"init": dict(emb_std=0.6, w_std=0.4, norm_offset={"model.norm.": 1.0})}),
        # OLMoE: RMSNorm of all of Q and of K, 6 experts, the top 3 not renormalised
        "olmoe": ("olmoe", dict(
            hidden_size=64, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
            max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=True, **common), 2400,
            {"init": dict(emb_std=0.6, w_std=0.4, norm_offset={"model.norm.": 1.0})}),
    }


W_STD, NORM_STD, BIAS_STD = 0.2, 0.2, 0.1


def randomize(model, model_type, seed, emb_std=0.6, head_std=None, norm_offset=None, w_std=W_STD):
    """Deterministically re-draw every parameter: embedding ~ N(0, emb_std), untied lm_head ~
    N(0, head_std), other matrices ~ N(0, w_std); norm weights ~ 1 + N(0, NORM_STD) (Gemma: N(0, NORM_STD),
    applied as 1 + w), plus norm_offset[k] for names containing k; every bias ~ N(0, BIAS_STD)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            n = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("bias"):
                p.copy_(BIAS_STD * n)
            elif p.dim() == 1 or name.endswith(("q_norm.weight", "k_norm.weight")):  # norm weight
                v = NORM_STD * n if model_type == "gemma3_text" else 1.0 + NORM_STD * n
                for k, off in (norm_offset or {}).items():
                    if k in name:
                        v += off
                p.copy_(v)
            elif "lm_head" in name:
                p.copy_((head_std or emb_std) * n)
            elif any(k in name for k in ("embed", "wte", "wpe", "word_embeddings")):
                p.copy_(emb_std * n)
            else:
                p.copy_(w_std * n)


def load(path, attn="eager", **overrides):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn,
                                                **overrides).eval()


@torch.no_grad()
def greedy(model, prompt_ids, n=N_GEN):
    """Full recompute each step: model(whole sequence).logits[-1], argmax (ties -> lowest id)."""
    ids = list(prompt_ids)
    gen, margins, steps = [], [], []
    for i in range(n):
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        top = torch.topk(logits, 5)
        vals, idx = top.values.tolist(), top.indices.tolist()
        nxt = int(torch.argmax(logits))
        assert nxt == idx[0]
        margins.append(vals[0] - vals[1])
        if i < 3:
            steps.append({"top5": [[int(t), round(float(v), 6)] for t, v in zip(idx, vals)]})
        gen.append(nxt)
        ids.append(nxt)
    return gen, margins, steps


@torch.no_grad()
def cached_generate(model, prompt_ids, n=N_GEN):
    """HF generate (KV cache) with greedy decoding and EOS disabled entirely (no min_new_tokens: that
    would mask the EOS logit instead of ignoring it), so it must equal the full-recompute loop."""
    saved_gc, saved_eos = model.generation_config, model.config.eos_token_id
    model.generation_config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=n,
                                               eos_token_id=None, pad_token_id=0)
    model.config.eos_token_id = None
    try:
        out = model.generate(torch.tensor([prompt_ids]),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), use_cache=True)
    finally:
        model.generation_config, model.config.eos_token_id = saved_gc, saved_eos
    gen = out[0, len(prompt_ids):].tolist()
    assert len(gen) == n, len(gen)
    return gen


def check_window_semantics(model, window, n):
    """Per layer, from the eager attention probabilities of head 0: the keys each query attends to."""
    x = torch.arange(3, 3 + n).unsqueeze(0)
    with torch.no_grad():
        att = model(x, use_cache=False, output_attentions=True).attentions
    seen = []
    for li, a in enumerate(att):
        if a is None:
            continue
        nz = (a[0, 0] > 0)
        rows = [[int(j) for j in torch.nonzero(nz[q]).flatten()] for q in range(n)]
        seen.append(rows)
    return seen


def max_run(gen):
    best = cur = 1
    for a, b in zip(gen, gen[1:]):
        cur = cur + 1 if a == b else 1
        best = max(best, cur)
    return best


def not_trivial(gen):
    """Greedy output must not collapse into repeating one token."""
    return len(set(gen)) >= 8 and len(set(gen[-16:])) >= 3 and max_run(gen) <= 10


def summary(cfg, name, seed):
    d = cfg.to_dict()
    mt = d["model_type"]
    if mt in ("bloom", "mpt"):
        s = dict(layers=d.get("n_layer") or d["n_layers"], hidden=d.get("hidden_size") or d["d_model"],
                 heads=d.get("n_head") or d["n_heads"], positions="ALiBi", window=None)
    elif mt in ("gpt2", "gpt_bigcode", "gptj"):
        s = dict(layers=d["n_layer"], hidden=d["n_embd"], heads=d["n_head"], kv_heads=d["n_head"],
                 head_dim=d["n_embd"] // d["n_head"], intermediate=d["n_inner"], window=None,
                 kv_heads_multi_query=1 if d.get("multi_query") else None, rotary_dim=d.get("rotary_dim"),
                 positions=("rotary" if mt == "gptj" else "learned (wpe)") + ", n_positions=%d" % d["n_positions"], act=d["activation_function"])
    elif mt == "falcon":
        kv = d["num_kv_heads"] if (d["new_decoder_architecture"] or not d["multi_query"]) else 1
        s = dict(layers=d["num_hidden_layers"], hidden=d["hidden_size"], heads=d["num_attention_heads"],
                 kv_heads=kv, head_dim=d["hidden_size"] // d["num_attention_heads"],
                 intermediate=d["ffn_hidden_size"], window=None, act=d["activation"],
                 new_decoder_architecture=d["new_decoder_architecture"], multi_query=d["multi_query"],
                 parallel_attn=d["parallel_attn"], bias=d["bias"], alibi=d["alibi"],
                 num_kv_heads_in_config=d["num_kv_heads"],
                 num_ln_in_parallel_attn=2 if d["new_decoder_architecture"] else 1,
                 rope_theta=d["rope_parameters"]["rope_theta"])
    else:
        hd = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        s = dict(layers=d["num_hidden_layers"], hidden=d["hidden_size"], heads=d["num_attention_heads"],
                 kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"], head_dim=hd, intermediate=d["intermediate_size"],
                 window=d.get("sliding_window"), rope_parameters=d.get("rope_parameters"))
        if mt == "gemma3_text":
            s.update(layer_types=d["layer_types"], query_pre_attn_scalar=d["query_pre_attn_scalar"],
                     final_logit_softcapping=d["final_logit_softcapping"],
                     attn_logit_softcapping=d["attn_logit_softcapping"], act=d["hidden_activation"])
        else:
            s["act"] = d["hidden_act"]
        if mt == "phi3":
            s["original_max_position_embeddings"] = d["original_max_position_embeddings"]
            s["max_position_embeddings"] = d["max_position_embeddings"]
        if mt == "qwen3":
            s["qk_norm"] = True
        for k in ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers"):
            if k in d:
                s[k] = d[k]
    s.update(model_type=mt, architecture=d["architectures"][0], tie_word_embeddings=d["tie_word_embeddings"],
             vocab_size=d["vocab_size"], seed=seed)
    return s


def build(name, mt, kw, seed0, extra, tok, out_dir, tmp_root, cases_prompts):
    """Try seeds from seed0 until the golden criteria hold; return (seed, cases, info)."""
    last_err = None
    for seed in range(seed0, seed0 + 100):  # seed0 + 99 < next model's seed0
        torch.manual_seed(seed)
        cfg = AutoConfig.for_model(mt, vocab_size=tok.get_vocab_size(), initializer_range=W_STD, **kw)
        attn = extra.get("attn", "eager")
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
        randomize(model, mt, seed, **extra.get("init", {}))
        d = os.path.join(tmp_root, name)
        shutil.rmtree(d, ignore_errors=True)
        model.save_pretrained(d, safe_serialization=True)
        if extra.get("generation_config"):
            GenerationConfig(**extra["generation_config"]).save_pretrained(d)
        model = load(d, attn)  # what is tested is what was written
        cases, ok, why = [], True, ""
        window = getattr(model.config, "sliding_window", None)
        wide = load(d, sliding_window=100000) if window else None
        window_effect = []
        for pname, text in cases_prompts:
            pids = tok.encode(text).ids
            gen, margins, steps = greedy(model, pids)
            if min(margins) < MIN_MARGIN:
                ok, why = False, f"{pname}: margin {min(margins):.4g}"
                break
            if not not_trivial(gen):
                ok, why = False, f"{pname}: trivial output {gen}"
                break
            if window and len(pids) > 2 * window:
                wgen, _, _ = greedy(wide, pids)
                window_effect.append({"prompt": pname, "generated_ids_differ_without_window": wgen != gen,
                                      "first_differing_step": next((i for i, (a, b) in enumerate(zip(gen, wgen))
                                                                    if a != b), None)})
            cases.append(dict(model=name, prompt_name=pname, prompt=text, prompt_ids=pids, generated_ids=gen,
                              generated_text=tok.decode(gen, skip_special_tokens=False), first_steps=steps,
                              top2_margin=[round(m, 6) for m in margins]))
        if ok and window and not any(w["generated_ids_differ_without_window"] for w in window_effect):
            ok, why = False, "sliding window does not change the long-prompt outputs"
        if not ok:
            last_err = why
            print(f"  {name}: seed {seed} rejected ({why})", file=sys.stderr)
            continue
        # cross-check the KV-cached generate path against the full recompute
        agree = []
        for c in cases:
            g = cached_generate(model, c["prompt_ids"])
            agree.append(g == c["generated_ids"])
            if g != c["generated_ids"]:
                print(f"  {name}: cached generate DIFFERS for {c['prompt_name']}: {g} vs {c['generated_ids']}",
                      file=sys.stderr)
        info = dict(summary(model.config, name, seed), min_top2_margin=round(min(min(c["top2_margin"]) for c in cases), 6),
                    cached_generate_agrees=all(agree))
        if window:
            info["window_effect"] = window_effect
            # which keys the query at position p attends to (nonzero eager attention probability),
            # per layer, as [first key, last key, count]
            n = 2 * window + 4
            p = n - 1
            sem = check_window_semantics(model, window, n)
            types = getattr(model.config, "layer_types", None) or ["sliding_attention"] * len(sem)
            info[f"keys_seen_by_query_at_position_{p}"] = {
                f"layer{i}_{types[i]}": [sem[i][p][0], sem[i][p][-1], len(sem[i][p])] for i in range(len(sem))}
        if mt == "phi3":
            rot = model.model.rotary_emb
            info["rope_attention_scaling"] = round(float(rot.attention_scaling), 7)
        dst = os.path.join(out_dir, name)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(d, dst)
        return seed, cases, info
    raise SystemExit(f"{name}: no seed in range met the criteria (last: {last_err})")


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--out", default=os.path.join(here, "tests", "data", "tiny"))
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tmp_root = os.path.join(a.out, ".tmp")
    shutil.rmtree(tmp_root, ignore_errors=True)
    os.makedirs(tmp_root)

    tok = train_tokenizer()
    vocab = tok.get_vocab()
    ids = {t: vocab[t] for t in (EOT, IM_START, IM_END)}
    tok_json = os.path.join(tmp_root, "tokenizer.json")
    tok.save(tok_json, pretty=True)
    tok = Tokenizer.from_file(tok_json)  # encode with exactly what is shipped
    tc = tokenizer_config()

    all_specs = specs(ids)
    names = a.only or list(all_specs)
    goldens_path = os.path.join(a.out, "goldens.json")
    old = json.load(open(goldens_path)) if (a.only and os.path.exists(goldens_path)) else None
    models_info, entries = {}, []
    if old:
        models_info = {k: v for k, v in old["models"].items() if k not in names}
        entries = [e for e in old["entries"] if e["model"] not in names]
    for name in names:
        mt, kw, seed0, extra = all_specs[name]
        print(f"{name}:", file=sys.stderr)
        seed, cases, info = build(name, mt, kw, seed0, extra, tok, a.out, tmp_root, PROMPTS)
        dst = os.path.join(a.out, name)
        shutil.copy(tok_json, os.path.join(dst, "tokenizer.json"))
        with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
            json.dump(tc, f, indent=2)
            f.write("\n")
        size = sum(os.path.getsize(os.path.join(dst, x)) for x in os.listdir(dst))
        assert size < MAX_BYTES, f"{name} is {size} bytes"
        info["dir_bytes"] = size
        models_info[name] = info
        entries.extend(cases)
        print(f"  {name}: seed {seed}, min margin {info['min_top2_margin']}, cached generate agrees: "
              f"{info['cached_generate_agrees']}, {size} bytes", file=sys.stderr)
    shutil.rmtree(tmp_root)
    order = list(all_specs)
    models_info = {k: models_info[k] for k in order if k in models_info}
    entries.sort(key=lambda e: (order.index(e["model"]), [p for p, _ in PROMPTS].index(e["prompt_name"])))
    out = {
        "about": "Greedy goldens of the tiny random-weight models in this folder; made by "
                 "scripts/make-tiny-models.py. Each entry: prompt_ids = tokenizer.json encoding of prompt "
                 "(no BOS added); generated_ids = exactly %d greedy tokens (argmax of float32 logits, full "
                 "recompute every step, eager attention, EOS not treated specially); first_steps[i].top5 = "
                 "[[id, logit], ...] at generated position i; top2_margin[i] = top1 - top2 logit at "
                 "generated position i." % N_GEN,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "tokenizer": {"vocab_size": tok.get_vocab_size(), "special_tokens": ids, "bos_token": EOT,
                      "eos_token": EOT, "add_bos_token": False},
        "models": models_info,
        "entries": entries,
    }
    with open(goldens_path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("wrote", goldens_path, file=sys.stderr)


if __name__ == "__main__":
    main()
