#!/usr/bin/env python3
"""Pagoda's CPU backend against llama.cpp, same machine, same threads, same run (issue 12).

    cargo bench --bench decode --no-run     # builds target/release/deps/decode-*
    python3 scripts/bench-quant-vs-llama.py --llama-bin ~/.cache/pagoda/llama.cpp/bin

Rows: decode of one sequence and prefill of 512 tokens for SmolLM2-135M in f32, f16, Q8_0 and
Q4_1 (the file as shipped) and Qwen2.5-Coder-0.5B Q4_K_M (as shipped); aggregate decode at
4, 16 and 64 sequences for SmolLM2 Q4_1 and f16. Each engine runs its files as stored
(Pagoda's default `--dtype auto`). Rounds alternate the engines (A B A B ...) and each row
takes the median over rounds; peak RSS of every run is recorded. Pagoda: benches/decode.rs
(512-token prefill timed to its first token, then 64 greedy tokens per sequence).
llama.cpp: llama-bench (pp512, tg64) and llama-batched-bench (-npp 32 -ntg 64). llama.cpp
keeps K/V in f16 (its default); so does Pagoda for the f16 and quantized files (its
`--kv-cache-dtype auto`), and in f32 for the f32 file.

Prints a markdown table and writes the raw results to docs/results/quant-vs-llama.json.
"""

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("PAGODA_CACHE", os.path.expanduser("~/.cache/pagoda"))
M = os.path.join(CACHE, "models")
FILES = {
    "SmolLM2 f32": "SmolLM2-135M-Instruct.F32.gguf",
    "SmolLM2 f16": "SmolLM2-135M-Instruct.F16.gguf",
    "SmolLM2 Q8_0": "SmolLM2-135M-Instruct.Q8_0.gguf",
    "SmolLM2 Q4_1": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "Qwen2.5-Coder-0.5B Q4_K_M": "Qwen2.5-Coder-0.5B-Instruct.gguf",
}
BATCHED = ["SmolLM2 Q4_1", "SmolLM2 f16"]
BATCHES = [4, 16, 64]


def run(cmd, env=None):
    """stdout and peak RSS (MiB) of a command, through /usr/bin/time."""
    full = ["/usr/bin/time", "-f", "RSS_KB %M"] + cmd
    p = subprocess.run(full, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    rss = int(re.findall(r"RSS_KB (\d+)", p.stderr)[-1]) / 1024
    return p.stdout, rss


def pagoda(bench, path, batches, threads):
    env = dict(os.environ, PAGODA_BENCH_MODEL=path, RAYON_NUM_THREADS=str(threads))
    out, rss = run([bench] + [str(b) for b in batches] + ["--tokens", "64"], env)
    js = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
    r = {"rss_mib": rss, "rss_after_mib": js.get("rss_mib", -1), "weights_mib": js.get("weights_mib", -1)}
    for x in js["results"]:
        if "prefill_tokens_per_s" in x:
            r["pp512"] = x["prefill_tokens_per_s"]
        else:
            r[f"tg{x['batch']}"] = x["tokens_per_s"]
    return r


def llama_bench(binp, path, threads):
    out, rss = run([os.path.join(binp, "llama-bench"), "-m", path, "-t", str(threads),
                    "-p", "512", "-n", "64", "-r", "1", "-o", "json"])
    r = {"rss_mib": rss}
    for x in json.loads(out):
        if x["n_prompt"] == 512:
            r["pp512"] = x["avg_ts"]
        elif x["n_gen"] == 64:
            r["tg1"] = x["avg_ts"]
    return r


def llama_batched(binp, path, threads):
    npl = ",".join(str(b) for b in BATCHES)
    out, rss = run([os.path.join(binp, "llama-batched-bench"), "-m", path, "-t", str(threads),
                    "-c", str(max(BATCHES) * 96 + 256), "-npp", "32", "-ntg", "64",
                    "-npl", npl])
    r = {"rss_mib": rss}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and cells[0] == "32" and cells[2].isdigit():
            r[f"tg{int(cells[2])}"] = float(cells[7])  # S_TG t/s
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", default=os.path.join(CACHE, "llama.cpp/bin"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/results/quant-vs-llama.json"))
    a = ap.parse_args()
    benches = sorted(glob.glob(os.path.join(ROOT, "target/release/deps/decode-*")),
                     key=os.path.getmtime)
    benches = [b for b in benches if os.access(b, os.X_OK) and not b.endswith(".d")]
    if not benches:
        sys.exit("build it first: cargo bench --bench decode --no-run")
    bench = benches[-1]
    runs = {"pagoda": {}, "llama.cpp": {}}
    for rnd in range(a.rounds):
        for name, f in FILES.items():
            path = os.path.join(M, f)
            batches = [1] + (BATCHES if name in BATCHED else [])
            for engine in (["pagoda", "llama.cpp"] if rnd % 2 == 0 else ["llama.cpp", "pagoda"]):
                if engine == "pagoda":
                    r = pagoda(bench, path, batches, a.threads)
                else:
                    r = llama_bench(a.llama_bin, path, a.threads)
                    if name in BATCHED:
                        b = llama_batched(a.llama_bin, path, a.threads)
                        r.update({k: v for k, v in b.items() if k != "rss_mib"})
                        r["rss_mib_batched"] = b["rss_mib"]
                runs[engine].setdefault(name, []).append(r)
                print(f"round {rnd} {engine:9} {name}: {r}", file=sys.stderr)
                time.sleep(2)
    med = {e: {n: {k: statistics.median(x[k] for x in rs if k in x)
                   for k in rs[0]} for n, rs in m.items()} for e, m in runs.items()}
    rows = []
    for name in FILES:
        for key, label in [("tg1", "decode, 1 sequence"), ("pp512", "prefill, 512 tokens")] + \
                [(f"tg{b}", f"aggregate decode, {b} sequences") for b in BATCHES]:
            p = med["pagoda"][name].get(key)
            l = med["llama.cpp"][name].get(key)
            if p is None or l is None:
                continue
            rows.append(f"| {label} | {name} | {p:.1f} | {l:.1f} | **{p / l:.2f}x** |")
    print("| row | model and weights | Pagoda tok/s | llama.cpp tok/s | Pagoda / llama.cpp |")
    print("|---|---|---:|---:|---:|")
    print("\n".join(rows))
    print()
    print("| model and weights | Pagoda weights (MiB) | Pagoda RSS after the runs (MiB) | "
          "Pagoda peak RSS (MiB) | llama.cpp peak RSS (MiB), llama-bench |")
    print("|---|---:|---:|---:|---:|")
    for name in FILES:
        p = med["pagoda"][name]
        print(f"| {name} | {p['weights_mib']:.0f} | {p['rss_after_mib']:.0f} | "
              f"{p['rss_mib']:.0f} | {med['llama.cpp'][name]['rss_mib']:.0f} |")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"runs": runs, "median": med, "threads": a.threads}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
