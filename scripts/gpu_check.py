#!/usr/bin/env python3
"""The Python half of scripts/gpu-check.sh (run on the GPU machine; see that script's header).

Subcommands:
  make-models WORK TOKENIZER   random-weight Llama models saved with save_pretrained (safetensors):
                               WORK/tiny (f32, for correctness) and WORK/llama-1b (bf16,
                               Llama-3.2-1B's shape, for speed), each with a tokenizer.json
  compare WORK OUT             Pagoda's greedy tokens and log-probabilities (OUT/tiny-*.jsonl)
                               against transformers on the same weights -> OUT/compare.json
  hf-bench WORK OUT            transformers' generate throughput and the device copy bandwidth
                               -> OUT/hf-bench.json
  summary OUT                  the short table printed last

Written for unknown torch/transformers versions: the models are built from our own config
dict, the reference runs plain forward passes (no generate, no tokenizer) except in hf-bench,
and every step reports its own failure instead of stopping the script.
"""

import json
import os
import sys
import time
import traceback

TINY = dict(
    vocab_size=49152,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.05,
)

# Llama-3.2-1B's shape (its config.json), random weights.
LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    bos_token_id=128000,
    eos_token_id=128001,
    initializer_range=0.02,
)
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def build_model(spec, torch_dtype, device):
    """A LlamaForCausalLM from our own dict (version-proof: only long-stable arguments)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in spec.items() if k != "rope_theta"})
    # transformers 5 keeps RoPE settings in rope_parameters, 4.x in rope_theta.
    if hasattr(cfg, "rope_parameters"):
        rp = cfg.rope_parameters
        rp = dict(rp) if isinstance(rp, dict) else {"rope_type": "default"}
        rp["rope_theta"] = spec["rope_theta"]
        cfg.rope_parameters = rp
    cfg.rope_theta = spec["rope_theta"]
    try:
        cfg._attn_implementation = "sdpa"
    except Exception:
        pass
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(torch_dtype).eval()


def pagoda_config(spec, dtype_name, rope_scaling=None):
    """config.json as Pagoda reads it (written by us, whatever save_pretrained wrote)."""
    c = dict(spec)
    c.pop("initializer_range", None)
    c.update(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_act="silu",
        torch_dtype=dtype_name,
        rope_scaling=rope_scaling,
        attention_bias=False,
    )
    return c


def extend_tokenizer(src, vocab_size, dst):
    """SmolLM2's byte-level BPE tokenizer with unreachable entries appended up to vocab_size, so
    that every id a random model can produce decodes."""
    tok = json.load(open(src))
    vocab = tok["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in tok.get("added_tokens", [])}
    for i in range(vocab_size):
        if i not in used:
            vocab[f"<|unused_{i}|>"] = i
    json.dump(tok, open(dst, "w"))


def save(model, spec, out_dir, dtype_name, tokenizer, rope_scaling=None):
    import torch

    os.makedirs(out_dir, exist_ok=True)
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    except TypeError:  # transformers versions where safetensors is the only format
        model.save_pretrained(out_dir)
    if not any(f.endswith(".safetensors") for f in os.listdir(out_dir)):
        raise RuntimeError(f"save_pretrained wrote no safetensors in {out_dir}")
    # NOTE: our config.json replaces the one save_pretrained wrote, so that Pagoda reads the
    # same RoPE and norm settings whatever the transformers version.
    json.dump(pagoda_config(spec, dtype_name, rope_scaling), open(os.path.join(out_dir, "config.json"), "w"), indent=1)
    for f in ("generation_config.json",):
        p = os.path.join(out_dir, f)
        if os.path.exists(p):
            os.remove(p)
    extend_tokenizer(tokenizer, spec["vocab_size"], os.path.join(out_dir, "tokenizer.json"))
    json.dump(
        {"bos_token": None, "eos_token": None, "add_bos_token": False},
        open(os.path.join(out_dir, "tokenizer_config.json"), "w"),
    )
    del model
    torch.cuda.empty_cache()


def make_models(work, tokenizer):
    import torch

    torch.manual_seed(1234)
    t0 = time.time()
    tiny = build_model(TINY, torch.float32, "cuda")
    save(tiny, TINY, os.path.join(work, "tiny"), "float32", tokenizer)
    big = build_model(LLAMA_1B, torch.bfloat16, "cuda")
    save(big, LLAMA_1B, os.path.join(work, "llama-1b"), "bfloat16", tokenizer, LLAMA3_ROPE_SCALING)
    log(f"models made in {time.time() - t0:.1f} s")


def load_reference(model_dir, spec, torch_dtype, round_to=None):
    """The saved weights in a model built from `spec`; `round_to` rounds them first (bf16
    weights computed in f32)."""
    import torch
    from safetensors.torch import load_file

    model = build_model(spec, torch.float32, "cuda")
    sd = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(model_dir, f), device="cuda"))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"weights do not match: missing {missing}, unexpected {unexpected}")
    if spec.get("tie_word_embeddings"):
        try:
            model.tie_weights()
        except Exception:
            pass
        emb = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        if head.data_ptr() != emb.data_ptr():
            with torch.no_grad():
                head.copy_(emb)
    if round_to is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(round_to).to(torch.float32))
    return model.to(torch_dtype).eval()


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip().startswith("{")]


def teacher_forced(model, rows):
    """For each request: transformers' argmax and the log-probability of Pagoda's token at every
    generated position, with Pagoda's tokens as the context."""
    import torch

    res = []
    for r in rows:
        prompt, out = r["prompt_token_ids"], r["token_ids"]
        ids = torch.tensor([prompt + out], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        n = len(prompt)
        pos = torch.arange(n - 1, n - 1 + len(out), device="cuda")
        tgt = torch.tensor(out, device="cuda")
        res.append(
            {
                "argmax": lp[pos].argmax(-1).tolist(),
                "logprob": lp[pos, tgt].tolist(),
            }
        )
    return res


def agreement(rows, ref):
    same = total = 0
    max_dlp = 0.0
    for r, f in zip(rows, ref):
        for i, t in enumerate(r["token_ids"]):
            total += 1
            same += int(f["argmax"][i] == t)
            if r.get("logprobs") and i < len(r["logprobs"]):
                max_dlp = max(max_dlp, abs(r["logprobs"][i]["logprob"] - f["logprob"][i]))
    return same / max(total, 1), total, max_dlp


def compare(work, out):
    result = {}
    # Pagoda's runs against each other first (no torch needed): f32 tokens identical on CUDA
    # and CPU, and with or without the device argmax.
    try:
        a = read_jsonl(os.path.join(out, "tiny-cuda-f32.jsonl"))
        b = read_jsonl(os.path.join(out, "tiny-cpu-f32.jsonl"))
        c = read_jsonl(os.path.join(out, "tiny-cuda-f32-greedy.jsonl"))
        toks = lambda rows: [x["token_ids"] for x in rows]
        result["cuda-vs-cpu-f32-identical"] = bool(a) and toks(a) == toks(b)
        result["device-argmax-identical"] = bool(a) and toks(a) == toks(c)
        dlp = 0.0
        for x, y in zip(a, b):
            for p, q in zip(x.get("logprobs", []), y.get("logprobs", [])):
                if p["token_id"] == q["token_id"]:
                    dlp = max(dlp, abs(p["logprob"] - q["logprob"]))
        result["cuda-vs-cpu-f32-max-dlogprob"] = dlp
    except Exception as e:
        result["cuda-vs-cpu-f32-identical"] = repr(e)
    try:
        compare_with_transformers(work, out, result)
    except Exception as e:
        result["error"] = repr(e)[:300]
        traceback.print_exc()
    json.dump(result, open(os.path.join(out, "compare.json"), "w"), indent=1)
    log(json.dumps(result, indent=1))


def compare_with_transformers(work, out, result):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tiny_dir = os.path.join(work, "tiny")
    refs = {
        "f32": load_reference(tiny_dir, TINY, torch.float32),
        "bf16w-f32": load_reference(tiny_dir, TINY, torch.float32, round_to=torch.bfloat16),
        "bf16": load_reference(tiny_dir, TINY, torch.bfloat16),
    }
    for name, ref_name in [
        ("cuda-f32", "f32"),
        ("cuda-f32-chunked", "f32"),
        ("cuda-f32-greedy", "f32"),
        ("cpu-f32", "f32"),
        ("cuda-bf16", "bf16w-f32"),
        ("cuda-bf16-vs-hf-bf16", "bf16"),
    ]:
        path = os.path.join(out, f"tiny-{name.replace('-vs-hf-bf16', '')}.jsonl")
        try:
            rows = read_jsonl(path)
            if not rows:
                raise RuntimeError(f"no output in {path}")
            ref = teacher_forced(refs[ref_name], rows)
            agree, n, dlp = agreement(rows, ref)
            result[name] = {"agree": agree, "tokens": n, "max_dlogprob": dlp, "reference": ref_name}
        except Exception as e:
            result[name] = {"error": repr(e)[:300]}


def copy_bandwidth():
    import torch

    n = 1 << 30  # 1 GiB each way, several times the L2
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return 2 * n / times[len(times) // 2]


def hf_bench(work, out, batches, prompt_len, gen_len):
    import torch

    result = {"batches": {}, "prompt_len": prompt_len, "gen_len": gen_len}
    try:
        result["copy_bandwidth"] = copy_bandwidth()
    except Exception as e:
        result["copy_bandwidth_error"] = repr(e)
    try:
        import transformers

        result["transformers"] = transformers.__version__
        result["torch"] = torch.__version__
        model = load_reference(os.path.join(work, "llama-1b"), LLAMA_1B, torch.bfloat16)
        g = torch.Generator().manual_seed(0)
        # warm-up
        ids = torch.randint(1000, 100000, (1, 16), generator=g).cuda()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
        for bsz in batches:
            try:
                ids = torch.randint(1000, 100000, (bsz, prompt_len), generator=g).cuda()
                torch.cuda.synchronize()
                t0 = time.time()
                o = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=gen_len,
                    min_new_tokens=gen_len,
                    do_sample=False,
                    pad_token_id=0,
                )
                torch.cuda.synchronize()
                secs = time.time() - t0
                new = (o.shape[1] - prompt_len) * bsz
                result["batches"][str(bsz)] = {"seconds": secs, "tokens": int(new), "tok_per_s": new / secs}
            except Exception as e:
                result["batches"][str(bsz)] = {"error": repr(e)[:300]}
            torch.cuda.empty_cache()
    except Exception as e:
        result["error"] = repr(e)[:500]
        traceback.print_exc()
    json.dump(result, open(os.path.join(out, "hf-bench.json"), "w"), indent=1)
    log(json.dumps(result, indent=1))


def load(path, default=None):
    try:
        return json.load(open(path))
    except Exception:
        return default


def summary(out):
    """Reads what the steps left in OUT and prints the table."""
    rows = []
    cb = open(os.path.join(out, "check-backend.txt")).read() if os.path.exists(os.path.join(out, "check-backend.txt")) else ""
    last = [l for l in cb.splitlines() if "passed," in l]
    rows.append(("check-backend (cuBLAS)", last[-1] if last else "did not run"))
    cbk = os.path.join(out, "check-backend-kernels.txt")
    last = [l for l in open(cbk).read().splitlines() if "passed," in l] if os.path.exists(cbk) else []
    rows.append(("check-backend (our GEMMs)", last[-1] if last else "did not run"))
    cmp = load(os.path.join(out, "compare.json"), {})
    for k in ["cuda-f32", "cuda-f32-chunked", "cuda-f32-greedy", "cpu-f32", "cuda-bf16", "cuda-bf16-vs-hf-bf16"]:
        v = cmp.get(k)
        if not isinstance(v, dict):
            rows.append((f"tokens {k}", "did not run"))
        elif "error" in v:
            rows.append((f"tokens {k}", "ERROR " + v["error"][:80]))
        else:
            # f32: every token; bf16: "nearly every position" (random weights have near-ties)
            need = 1.0 if "f32" in k and "bf16" not in k else 0.9
            ok = "ok" if v["agree"] >= need else "FAIL"
            rows.append((f"tokens {k}", f"{v['agree'] * 100:.1f}% of {v['tokens']} top-1 agree vs hf {v['reference']}, max |dlogprob| {v['max_dlogprob']:.2e}  {ok}"))
    line = str(cmp.get("cuda-vs-cpu-f32-identical", "did not run"))
    if "cuda-vs-cpu-f32-max-dlogprob" in cmp:
        line += f" (max |dlogprob| {cmp['cuda-vs-cpu-f32-max-dlogprob']:.2e})"
    rows.append(("cuda f32 == cpu f32 tokens", line))
    if "error" in cmp:
        rows.append(("transformers reference", "ERROR " + cmp["error"][:100]))
    rows.append(("device argmax == host argmax", str(cmp.get("device-argmax-identical", "did not run"))))
    bench = load(os.path.join(out, "pagoda-bench.json"), {})
    hf = load(os.path.join(out, "hf-bench.json"), {})
    bw = hf.get("copy_bandwidth")
    if bw:
        rows.append(("copy bandwidth (torch)", f"{bw / 1e12:.2f} TB/s"))
    d = bench.get("decode")
    if d and "step_ms" in d:
        line = f"{d['step_ms']:.3f} ms/step ({1000 / d['step_ms']:.0f} tok/s)"
        if bw:
            roof_ms = d["bytes_per_step"] / bw * 1e3
            line += f"; roofline {roof_ms:.3f} ms -> {roof_ms / d['step_ms'] * 100:.0f}% of roofline (goal 70%)"
        rows.append(("decode bs=1 bf16 1B", line))
    elif d:
        rows.append(("decode bs=1 bf16 1B", "ERROR " + str(d.get("error"))[:100]))
    for bsz, v in sorted(bench.get("throughput", {}).items(), key=lambda kv: int(kv[0])):
        h = hf.get("batches", {}).get(bsz, {})
        if "tok_per_s" in v:
            line = f"pagoda {v['tok_per_s']:.0f} tok/s"
            if "tok_per_s" in h:
                line += f", transformers {h['tok_per_s']:.0f} tok/s -> {v['tok_per_s'] / h['tok_per_s']:.1f}x (goal >= 14-24x)"
            elif h:
                line += f", transformers: {h.get('error', '?')[:60]}"
        else:
            line = "ERROR " + str(v.get("error"))[:100]
        shape = f"{os.environ.get('PROMPT_LEN', 512)}+{os.environ.get('GEN_LEN', 256)}"
        rows.append((f"throughput {bsz} x {shape}", line))
    w = max(len(r[0]) for r in rows)
    print("\n==== gpu-check summary ====")
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


def main():
    cmd = sys.argv[1]
    if cmd == "make-models":
        make_models(sys.argv[2], sys.argv[3])
    elif cmd == "compare":
        compare(sys.argv[2], sys.argv[3])
    elif cmd == "hf-bench":
        batches = [int(b) for b in os.environ.get("BATCHES", "64 256").split()]
        hf_bench(sys.argv[2], sys.argv[3], batches, int(os.environ.get("PROMPT_LEN", 512)), int(os.environ.get("GEN_LEN", 256)))
    elif cmd == "summary":
        summary(sys.argv[2])
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
