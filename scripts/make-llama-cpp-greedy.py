#!/usr/bin/env python3
"""llama.cpp's greedy tokens for the public golden prompts on the quantized GGUF files as
shipped, with its top-2 log-probabilities at every step: the reference tests/quantized.rs
compares Pagoda's `--dtype auto` (weights kept quantized) against.

    python3 scripts/make-llama-cpp-greedy.py --llama-server ~/.cache/pagoda/llama.cpp/bin/llama-server

Starts llama-server once per model (CPU, 2 threads), sends each golden entry's prompt token
ids to /completion with temperature 0 and n_probs 2, and writes
tests/data/golden/llama_cpp_quant.json. Only the standard library is needed.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("PAGODA_CACHE", os.path.expanduser("~/.cache/pagoda"))
# golden model id -> the quantized file as shipped (scripts/fetch-models.sh)
MODELS = {
    "smollm2-135m-instruct-f32": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b-instruct-f32": "Qwen2.5-Coder-0.5B-Instruct.gguf",
}


def post(port, path, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def wait_ready(port, proc):
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    sys.exit("llama-server did not become ready")


def top2(step):
    """The two most likely (id, logprob) of one step, from either response format."""
    tops = step.get("top_logprobs") or step.get("probs") or []
    out = []
    for t in tops[:2]:
        lp = t.get("logprob")
        if lp is None and t.get("prob") is not None:
            import math

            lp = math.log(max(t["prob"], 1e-30))
        out.append([t.get("id"), lp])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--port", type=int, default=8099)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--out", default=os.path.join(ROOT, "tests/data/golden/llama_cpp_quant.json")
    )
    a = ap.parse_args()
    golden = json.load(open(os.path.join(ROOT, "tests/data/golden/golden_public.json")))
    version = subprocess.run(
        [a.llama_server, "--version"], capture_output=True, text=True
    )
    result = {
        "generator": "scripts/make-llama-cpp-greedy.py",
        "llama_cpp_version": (version.stdout + version.stderr).strip().splitlines()[-2:],
        "models": {},
    }
    for model_id, fname in MODELS.items():
        path = os.path.join(CACHE, "models", fname)
        proc = subprocess.Popen(
            [a.llama_server, "-m", path, "--port", str(a.port), "-t", str(a.threads),
             "-c", "2048", "--host", "127.0.0.1", "-np", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_ready(a.port, proc)
            entries = []
            for e in golden["entries"]:
                if e["model"] != model_id:
                    continue
                r = post(a.port, "/completion", {
                    "prompt": e["prompt_ids"],
                    "n_predict": e["n_generated"],
                    "temperature": 0,
                    "n_probs": 2,
                    "cache_prompt": False,
                    "return_tokens": True,
                    "ignore_eos": False,
                })
                steps = r.get("completion_probabilities", [])
                entries.append({
                    "name": e["name"],
                    "file": fname,
                    "generated_ids": r.get("tokens", []),
                    "top2": [top2(s) for s in steps],
                    "content": r.get("content", ""),
                })
                print(model_id, e["name"], r.get("tokens", [])[:12], file=sys.stderr)
            result["models"][model_id] = entries
        finally:
            proc.terminate()
            proc.wait()
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
