#!/usr/bin/env python3
"""Pagoda's CPU backend beside llama.cpp, same machine, same threads, one run (issue 41): decode
of 1 sequence, prefill of 512 tokens and aggregate decode at 4, 16 and 64 sequences, for
SmolLM2-135M in f32, f16, Q8_0, Q4_1 (as shipped), Q6_K and IQ4_XS (made by llama.cpp's own
quantizer from the F32 copy, scripts/llama-quantize.py), Qwen2.5-Coder-0.5B Q4_K_M and
Gemma 3 270M Q4_K_M (as shipped). Every engine runs the files as stored (Pagoda's `--dtype
auto`); K/V in f16 for all but the f32 file, in both. Rounds alternate the engines (A B A B).
The read bandwidth (benches/bandwidth.rs, same threads) gives each batch-1 decode's share of
the roofline: weight bytes x tokens/s / bandwidth.

    cargo bench --bench decode --no-run && cargo bench --bench bandwidth --no-run
    python3 scripts/bench-cpu-table.py [--rounds 2] [--tokens 64] [--out FILE.json]

Needs llama-cpp-python in $LLAMA_VENV (default $PAGODA_CACHE/venv-llama, docs/benchmarks.md)
and the models of scripts/fetch-models.sh. Prints a markdown table; writes the raw runs.
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("PAGODA_CACHE", os.path.expanduser("~/.cache/pagoda"))
VENV = os.environ.get("LLAMA_VENV", os.path.join(CACHE, "venv-llama"))
M, B = os.path.join(CACHE, "models"), os.path.join(CACHE, "bench")
SMOL_F32 = os.path.join(M, "SmolLM2-135M-Instruct.F32.gguf")
# name -> (file, how it is made from the F32 copy, or None when fetched)
FILES = {
    "SmolLM2 f32": (SMOL_F32, None),
    "SmolLM2 f16": (os.path.join(B, "SmolLM2-135M-Instruct.F16.gguf"), "F16"),
    "SmolLM2 Q8_0": (os.path.join(B, "SmolLM2-135M-Instruct.Q8_0.gguf"), "Q8_0"),
    "SmolLM2 Q4_1": (os.path.join(M, "SmolLM2-135M-Instruct.Q4_1.gguf"), None),
    "SmolLM2 Q6_K": (os.path.join(B, "SmolLM2-135M-Instruct.Q6_K.gguf"), "Q6_K"),
    "SmolLM2 IQ4_XS": (os.path.join(B, "SmolLM2-135M-Instruct.IQ4_XS.gguf"), "IQ4_XS"),
    "Qwen2.5-Coder-0.5B Q4_K_M": (os.path.join(M, "Qwen2.5-Coder-0.5B-Instruct.gguf"), None),
    "Gemma 3 270M Q4_K_M": (os.path.join(M, "gemma-3-270m-Q4_K_M.gguf"), None),
}
BATCHES = [1, 4, 16, 64]


def out(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return p.stdout


def parse(text):
    """prefill and per-batch tokens/s from either engine's output."""
    r = {"prefill": float(re.search(r"prefill 512 tokens: ([\d.]+)", text).group(1))}
    for n, tps in re.findall(r"batch\s+(\d+): \d+ tokens in [\d.]+ s = ([\d.]+) tokens/s", text):
        r[f"batch {n}"] = float(tps)
    return r


def binary(name):
    found = sorted(glob.glob(os.path.join(ROOT, f"target/release/deps/{name}-*")), key=os.path.getmtime)
    found = [f for f in found if os.access(f, os.X_OK) and not f.endswith(".d")]
    if not found:
        sys.exit(f"build it first: cargo bench --bench {name} --no-run")
    return found[-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", help="rows whose name contains this")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/results/cpu-vs-llama.json"))
    a = ap.parse_args()
    py = os.path.join(VENV, "bin/python")
    if not os.path.exists(SMOL_F32):
        out([os.path.join(CACHE, "venv/bin/python"), os.path.join(ROOT, "scripts/gguf-to-f32.py"),
             os.path.join(M, "SmolLM2-135M-Instruct.Q4_1.gguf"), SMOL_F32])
    os.makedirs(B, exist_ok=True)
    for path, ty in FILES.values():
        if ty and not os.path.exists(path):
            out([py, os.path.join(ROOT, "scripts/llama-quantize.py"), SMOL_F32, path, ty])
    names = [n for n in FILES if not a.only or a.only in n]
    env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads), OMP_NUM_THREADS=str(a.threads))
    decode, bandwidth = binary("decode"), binary("bandwidth")
    bw = [json.loads(out([bandwidth], env).strip().splitlines()[-1])["median_gbs"]]
    runs = {n: {"pagoda": [], "llama.cpp": [], "weights_mib": None} for n in names}
    args = [str(b) for b in BATCHES] + ["--tokens", str(a.tokens)]
    for rnd in range(a.rounds):
        for n in names:
            path = FILES[n][0]
            text = out([decode, *args], dict(env, PAGODA_BENCH_MODEL=path))
            summary = json.loads(text.strip().splitlines()[-1])
            runs[n]["weights_mib"] = summary["weights_mib"]
            runs[n]["pagoda"].append(parse(text))
            kv = "f32" if n.endswith("f32") else "f16"
            text = out([py, os.path.join(ROOT, "scripts/bench-llama-cpp.py"), path, *args,
                        "--threads", str(a.threads), "--kv", kv], env)
            runs[n]["llama.cpp"].append(parse(text))
            print(f"round {rnd + 1}: {n}: pagoda {runs[n]['pagoda'][-1]}, "
                  f"llama.cpp {runs[n]['llama.cpp'][-1]}", file=sys.stderr)
    bw.append(json.loads(out([bandwidth], env).strip().splitlines()[-1])["median_gbs"])
    gbs = sum(bw) / len(bw)
    print(f"read bandwidth, {a.threads} threads: {bw[0]:.1f} GB/s before, {bw[1]:.1f} after\n")
    print("| model | row | " + " | ".join(f"pagoda {r + 1}" for r in range(a.rounds)) + " | "
          + " | ".join(f"llama.cpp {r + 1}" for r in range(a.rounds)) + " | ratio per round |"
          + " roofline share (pagoda) |")
    print("|---|---|" + "---|" * (2 * a.rounds + 2))
    for n in names:
        for row in ["batch 1", "prefill", "batch 4", "batch 16", "batch 64"]:
            ours = [r[row] for r in runs[n]["pagoda"]]
            theirs = [r[row] for r in runs[n]["llama.cpp"]]
            ratio = " / ".join(f"{o / t:.2f}x" for o, t in zip(ours, theirs))
            share = ""
            if row == "batch 1":
                b = runs[n]["weights_mib"] * (1 << 20)
                share = " / ".join(f"{100 * b * o / (gbs * 1e9):.0f}%" for o in ours)
            label = "decode 1" if row == "batch 1" else ("prefill 512" if row == "prefill" else row)
            print(f"| {n} | {label} | " + " | ".join(f"{v:.1f}" for v in ours + theirs)
                  + f" | {ratio} | {share} |")
    with open(a.out, "w") as f:
        json.dump({"threads": a.threads, "tokens": a.tokens, "bandwidth_gbs": bw, "runs": runs}, f, indent=1)


main()
