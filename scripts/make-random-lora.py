#!/usr/bin/env python3
"""Random LoRA adapters in PEFT's format for a Llama-graph model, for benchmarks.

No hub has adapters for the packaged models, so the benchmarks make their own: random A and B
(so each adapter costs what a trained one would: the same shapes, ranks and targets) for every
linear layer of every decoder layer ("all-linear"). Read the sizes from an HF config.json (the
HF copy fetch-models.sh makes of SmolLM2).

usage: make-random-lora.py CONFIG_JSON OUT_DIR [--count N] [--rank R] [--alpha A] [--seed S]

Writes OUT_DIR/lora-0 ... lora-(N-1), each adapter_config.json + adapter_model.safetensors
(float16 by default). Needs numpy and safetensors.
"""
import argparse
import json
import os

import numpy as np
from safetensors.numpy import save_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float16",
                    help="as PEFT saves an adapter trained in that precision")
    a = ap.parse_args()
    c = json.load(open(a.config))
    hid, f = c["hidden_size"], c["intermediate_size"]
    h = c["num_attention_heads"]
    hkv = c.get("num_key_value_heads", h)
    d = c.get("head_dim") or hid // h
    shapes = {  # module: (in, out)
        "self_attn.q_proj": (hid, h * d),
        "self_attn.k_proj": (hid, hkv * d),
        "self_attn.v_proj": (hid, hkv * d),
        "self_attn.o_proj": (h * d, hid),
        "mlp.gate_proj": (hid, f),
        "mlp.up_proj": (hid, f),
        "mlp.down_proj": (f, hid),
    }
    r = a.rank
    for i in range(a.count):
        rng = np.random.default_rng(a.seed + i)
        tensors = {}
        for layer in range(c["num_hidden_layers"]):
            for m, (k, n) in shapes.items():
                name = f"base_model.model.model.layers.{layer}.{m}"
                # NOTE: small values, so that each adapter shifts the output without drowning it
                tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((r, k)) / np.sqrt(k)).astype(a.dtype)
                tensors[f"{name}.lora_B.weight"] = (rng.standard_normal((n, r)) * 0.01).astype(a.dtype)
        out = os.path.join(a.out, f"lora-{i}")
        os.makedirs(out, exist_ok=True)
        save_file(tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
        cfg = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": r,
            "lora_alpha": a.alpha,
            "target_modules": sorted({m.split(".")[-1] for m in shapes}),
            "bias": "none",
            "use_rslora": False,
            "modules_to_save": None,
        }
        json.dump(cfg, open(os.path.join(out, "adapter_config.json"), "w"), indent=2)
    print(f"{a.count} adapters of rank {r} in {a.out}")


if __name__ == "__main__":
    main()
