#!/usr/bin/env python3
"""Greedy goldens of Gemma 3 270M (the Q4_K_M GGUF, dequantized to f32) from HF transformers.

usage: make-gemma3-golden.py [--gguf GGUF] [--model-dir DIR] [--out JSON] [--new-tokens N]

  --gguf       default $PAGODA_CACHE/models/gemma-3-270m-Q4_K_M.gguf (scripts/fetch-models.sh gemma3)
  --model-dir  default $PAGODA_CACHE/models/gemma-3-270m-f32; made from the GGUF with
               scripts/gguf2hf.py --dtype f32 when it has no model.safetensors
  --out        default tests/data/golden/gemma3-270m.json
($PAGODA_CACHE defaults to ~/.cache/pagoda.)

Needs torch, transformers (5.x, with gemma3_text), tokenizers, safetensors, numpy, gguf==0.19.0.
Runs offline on CPU in float32 with eager attention; a few minutes on 2 cores (every step recomputes
the whole sequence). Deterministic.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
import tokenizers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("PAGODA_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagoda"))
MODEL_ID = "gemma-3-270m-q4_k_m-f32"

PROMPTS = [
    ("season", "text", "My favorite season of the year is"),
    ("story", "text", "Once upon a time, in a small village by the sea, there lived"),
    ("code", "code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("long", "text", "Photosynthesis is the process by which green plants, algae and some bacteria turn "
                     "light energy into chemical energy. During this process, carbon dioxide and water are "
                     "combined to make glucose and oxygen. In simple words, this matters for life on Earth "
                     "because"),
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


@torch.no_grad()
def greedy(model, prompt_ids, n):
    """Full recompute each step (no KV cache): argmax of the float32 logits of the last position
    (ties -> lowest id); EOS is not treated specially."""
    ids = list(prompt_ids)
    gen, margins, steps = [], [], []
    for i in range(n):
        logits = model(torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits[0, -1].float()
        top = torch.topk(logits, 5)
        vals, idx = top.values.tolist(), top.indices.tolist()
        nxt = int(torch.argmax(logits))
        assert nxt == idx[0]
        margins.append(vals[0] - vals[1])
        if i < 3:
            steps.append({"step": i, "top5": [[int(t), round(float(v), 5)] for t, v in zip(idx, vals)],
                          "max_abs_logit": round(float(logits.abs().max()), 5)})
        gen.append(nxt)
        ids.append(nxt)
    return gen, margins, steps


@torch.no_grad()
def cached_generate(model, prompt_ids, n):
    """HF generate with its KV cache, greedy, with EOS disabled so it runs exactly n steps."""
    saved_gc, saved_eos = model.generation_config, model.config.eos_token_id
    model.generation_config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=n,
                                               eos_token_id=None, pad_token_id=0)
    model.config.eos_token_id = None
    try:
        out = model.generate(torch.tensor([prompt_ids]),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), use_cache=True)
    finally:
        model.generation_config, model.config.eos_token_id = saved_gc, saved_eos
    return out[0, len(prompt_ids):].tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=os.path.join(CACHE, "models", "gemma-3-270m-Q4_K_M.gguf"))
    ap.add_argument("--model-dir", default=os.path.join(CACHE, "models", "gemma-3-270m-f32"))
    ap.add_argument("--out", default=os.path.join(HERE, "tests", "data", "golden", "gemma3-270m.json"))
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    st = os.path.join(a.model_dir, "model.safetensors")
    if not os.path.exists(st):
        if not os.path.exists(a.gguf):
            sys.exit(f"{a.gguf} not found: run scripts/fetch-models.sh gemma3")
        print(f"converting {a.gguf} -> {a.model_dir}", file=sys.stderr)
        subprocess.run([sys.executable, os.path.join(HERE, "scripts", "gguf2hf.py"), a.gguf, a.model_dir,
                        "--dtype", "f32"], check=True)

    tok_path = os.path.join(a.model_dir, "tokenizer.json")
    tok = Tokenizer.from_file(tok_path)
    tcfg = json.load(open(os.path.join(a.model_dir, "tokenizer_config.json")))
    raw_cfg = json.load(open(os.path.join(a.model_dir, "config.json")))
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    cfg = model.config
    bos = cfg.bos_token_id
    assert tcfg["add_bos_token"], "Gemma's tokenizer_config must say add_bos_token"

    entries, agree_all = [], True
    for name, kind, text in PROMPTS:
        enc = tok.encode(text, add_special_tokens=True)  # tokenizer.json's post-processor adds <bos>
        pids = enc.ids
        assert pids[0] == bos and bos not in pids[1:], pids[:4]
        assert pids[1:] == tok.encode(text, add_special_tokens=False).ids
        gen, margins, steps = greedy(model, pids, a.new_tokens)
        cached = cached_generate(model, pids, a.new_tokens)
        agree = cached == gen
        agree_all &= agree
        if not agree:
            print(f"{name}: cached generate differs: {cached} vs {gen}", file=sys.stderr)
        entries.append({
            "name": name, "model": MODEL_ID, "kind": kind, "prompt": text, "prompt_ids": pids,
            "generated_ids": gen, "generated_text": tok.decode(gen, skip_special_tokens=False),
            "first_steps": steps, "top2_margin": [round(m, 5) for m in margins],
            "cached_generate_agrees": agree,
        })
        print(f"{name}: {len(pids)} prompt tokens, min margin {min(margins):.4f}, cached agrees {agree}: "
              f"{tok.decode(gen)!r}", file=sys.stderr)

    main_cfg = {k: raw_cfg.get(k) for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
        "hidden_activation", "sliding_window", "sliding_window_pattern", "query_pre_attn_scalar",
        "rope_theta", "rope_local_base_freq", "final_logit_softcapping", "attn_logit_softcapping")}
    out = {
        "schema_version": 1,
        "set": "gemma3",
        "generator": "scripts/make-gemma3-golden.py",
        "command": "python3 scripts/make-gemma3-golden.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "numerics": "HF transformers Gemma3ForCausalLM, float32, eager attention, CPU; full recompute every "
                    "step (no KV cache), greedy argmax (ties -> lowest id); cross-checked against "
                    "model.generate with its KV cache (cached_generate_agrees)",
        "n_new_tokens": a.new_tokens,
        "stopping": "none: exactly n_new_tokens are generated, EOS (<eos>=1) and <end_of_turn>=106 are not "
                    "treated specially",
        "prompt_ids_from": "tokenizers.Tokenizer.from_file(<model-dir>/tokenizer.json).encode(prompt, "
                           "add_special_tokens=True): the tokenizer.json written by scripts/gguf2hf.py (Gemma's "
                           "SentencePiece vocabulary rebuilt as a BPE from the GGUF scores; ' ' -> U+2581, byte "
                           "fallback, no prefix space) whose post-processor prepends <bos> (id 2) because the GGUF "
                           "says add_bos_token; prompt_ids therefore START WITH BOS",
        "models": {MODEL_ID: {
            "arch": "gemma3",
            "source": "gemma-3-270m-Q4_K_M.gguf (sha256 %s), every tensor dequantized to f32 by "
                      "scripts/gguf2hf.py --dtype f32; norm weights stored as w (GGUF 1+w minus 1)" % (
                          sha256(a.gguf) if os.path.exists(a.gguf) else "?"),
            "config": main_cfg,
            "layer_types": list(cfg.layer_types),
            "rope_parameters": cfg.rope_parameters,
            "add_bos_token": True, "bos_token_id": bos, "eos_token_id": cfg.eos_token_id,
            "model_safetensors_sha256": sha256(st),
            "tokenizer_json_sha256": sha256(tok_path),
            "cached_generate_agrees": agree_all,
            "min_top2_margin": min(min(e["top2_margin"]) for e in entries),
        }},
        "entries": entries,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print("wrote", a.out, file=sys.stderr)


if __name__ == "__main__":
    main()
