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


def save_plain(spec, out_dir, torch_dtype, dtype_name, tokenizer, rope_scaling=None):
    """The fallback when transformers cannot build or save the model: the same tensor names
    and shapes, drawn with torch and written with safetensors."""
    import torch
    from safetensors.torch import save_file

    h, f, L = spec["hidden_size"], spec["intermediate_size"], spec["num_hidden_layers"]
    H, Hkv, d, v = spec["num_attention_heads"], spec["num_key_value_heads"], spec["head_dim"], spec["vocab_size"]
    std = spec["initializer_range"]
    r = lambda *shape: (torch.randn(*shape, device="cuda") * std).to(torch_dtype)
    one = lambda n: torch.ones(n, device="cuda", dtype=torch_dtype)
    t = {"model.embed_tokens.weight": r(v, h), "model.norm.weight": one(h)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({
            p + "self_attn.q_proj.weight": r(H * d, h), p + "self_attn.k_proj.weight": r(Hkv * d, h),
            p + "self_attn.v_proj.weight": r(Hkv * d, h), p + "self_attn.o_proj.weight": r(h, H * d),
            p + "mlp.gate_proj.weight": r(f, h), p + "mlp.up_proj.weight": r(f, h),
            p + "mlp.down_proj.weight": r(h, f), p + "input_layernorm.weight": one(h),
            p + "post_attention_layernorm.weight": one(h),
        })
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: x.contiguous().cpu() for k, x in t.items()}, os.path.join(out_dir, "model.safetensors"))
    json.dump(pagoda_config(spec, dtype_name, rope_scaling), open(os.path.join(out_dir, "config.json"), "w"), indent=1)
    extend_tokenizer(tokenizer, spec["vocab_size"], os.path.join(out_dir, "tokenizer.json"))


def make_models(work, tokenizer):
    import torch

    torch.manual_seed(1234)
    t0 = time.time()
    for name, spec, dt, dt_name, scaling in [
        ("tiny", TINY, torch.float32, "float32", None),
        ("llama-1b", LLAMA_1B, torch.bfloat16, "bfloat16", LLAMA3_ROPE_SCALING),
    ]:
        out_dir = os.path.join(work, name)
        try:
            save(build_model(spec, dt, "cuda"), spec, out_dir, dt_name, tokenizer, scaling)
            log(f"{name}: made with transformers' save_pretrained")
        except Exception as e:
            log(f"{name}: transformers failed ({e!r}); writing the safetensors directly")
            traceback.print_exc()
            save_plain(spec, out_dir, dt, dt_name, tokenizer, scaling)
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


# A mismatch counts only where transformers' top-2 log-probability gap exceeds this: below it
# the two engines' last-bit differences may order a true near-tie either way.
NEAR_TIE = 1e-3


def teacher_forced(model, rows):
    """For each request: transformers' argmax, its top-2 gap, and the log-probability of
    Pagoda's token at every generated position, with Pagoda's tokens as the context."""
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
        top2 = lp[pos].topk(2, dim=-1).values
        res.append(
            {
                "argmax": lp[pos].argmax(-1).tolist(),
                "gap": (top2[:, 0] - top2[:, 1]).tolist(),
                "logprob": lp[pos, tgt].tolist(),
            }
        )
    return res


def agreement(rows, ref):
    """Top-1 agreement with the reference, excusing near-ties; the first real divergence."""
    same = total = ties = 0
    max_dlp = 0.0
    first = None
    for ri, (r, f) in enumerate(zip(rows, ref)):
        for i, t in enumerate(r["token_ids"]):
            total += 1
            if f["argmax"][i] == t:
                same += 1
            elif f["gap"][i] <= NEAR_TIE:
                ties += 1
            elif first is None:
                first = {"request": ri, "position": i, "pagoda": t, "transformers": f["argmax"][i], "gap": f["gap"][i]}
            if r.get("logprobs") and i < len(r["logprobs"]):
                max_dlp = max(max_dlp, abs(r["logprobs"][i]["logprob"] - f["logprob"][i]))
    return {
        "agree": (same + ties) / max(total, 1),
        "tokens": total,
        "near_ties": ties,
        "first_divergence": first,
        "max_dlogprob": max_dlp,
    }


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
    # the NCCL path (workers, tensor parallel 1) against the single device
    try:
        a = read_jsonl(os.path.join(out, "tiny-cuda-f32.jsonl"))
        n = read_jsonl(os.path.join(out, "tiny-cuda-f32-nccl.jsonl"))
        toks = lambda rows: [x["token_ids"] for x in rows]
        result["nccl-vs-one-device-identical"] = bool(n) and toks(a) == toks(n)
    except Exception as e:
        result["nccl-vs-one-device-identical"] = repr(e)[:200]
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
        ("cuda-fp8", "bf16w-f32"),
    ]:
        path = os.path.join(out, f"tiny-{name.replace('-vs-hf-bf16', '')}.jsonl")
        try:
            rows = read_jsonl(path)
            if not rows:
                raise RuntimeError(f"no output in {path}")
            ref = teacher_forced(refs[ref_name], rows)
            result[name] = dict(agreement(rows, ref), reference=ref_name)
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


def generate_timed(model, lens, g):
    """One `generate` over every request at once: prompts left-padded (as vLLM's comparison
    ran transformers), as many new tokens as the longest output; the useful tokens are each
    request's own output length."""
    import torch

    width = max(p for p, _ in lens)
    ids = torch.zeros((len(lens), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(lens):
        ids[i, width - p:] = torch.randint(1000, 100000, (p,), generator=g)
        mask[i, width - p:] = 1
    ids, mask = ids.cuda(), mask.cuda()
    new = max(o for _, o in lens)
    torch.cuda.synchronize()
    t0 = time.time()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                   do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    secs = time.time() - t0
    useful = sum(o for _, o in lens)
    return {"seconds": secs, "tokens": useful, "tok_per_s": useful / secs, "requests": len(lens)}


def hf_bench(work, out, batches, prompt_len, gen_len):
    import torch

    result = {"batches": {}, "sharegpt": {}, "prompt_len": prompt_len, "gen_len": gen_len}
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
                result["batches"][str(bsz)] = generate_timed(model, [(prompt_len, gen_len)] * bsz, g)
            except Exception as e:
                result["batches"][str(bsz)] = {"error": repr(e)[:300]}
            torch.cuda.empty_cache()
            # the ShareGPT-like mix: the very lengths `pagoda bench` drew
            try:
                lens = json.load(open(os.path.join(out, f"bench-sharegpt-{bsz}.json")))["request_lens"]
                result["sharegpt"][str(bsz)] = generate_timed(model, [tuple(x) for x in lens], g)
            except Exception as e:
                result["sharegpt"][str(bsz)] = {"error": repr(e)[:300]}
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


def op_profile_top(path, n=6):
    """The first rows of a PAGODA_PROFILE_OPS table: (total line, [(kernel, share)])."""
    try:
        lines = open(path).read().splitlines()
    except Exception:
        return None
    i = next((k for k, l in enumerate(lines) if l.startswith("op profile")), None)
    if i is None:
        return None
    rows = [l.split() for l in lines[i + 2:i + 2 + n] if l.strip()]
    return lines[i], [(r[0], r[-1]) for r in rows if len(r) >= 5]


def kernel_ms(path, prefix):
    """Total ms of the kernels named `prefix`... in a PAGODA_PROFILE_OPS table, or None."""
    try:
        lines = open(path).read().splitlines()
    except Exception:
        return None
    rows = [l.split() for l in lines]
    ms = [float(r[2]) for r in rows if len(r) == 5 and r[0].startswith(prefix)]
    return sum(ms) if ms else None


def summary(out):
    """Reads what the steps left in OUT and prints the table."""
    rows = []
    steps = os.path.join(out, "steps.txt")
    if os.path.exists(steps):
        bad = [l.split()[0] for l in open(steps) if "rc=0 " not in l]
        rows.append(("steps", f"{sum(1 for _ in open(steps))} run; not ok: {', '.join(bad) if bad else 'none'}"))
    for name, f in [("check-backend (cuBLAS)", "check-backend.txt"), ("check-backend (our GEMMs)", "check-backend-kernels.txt"),
                    ("check-backend (blocking)", "check-backend-blocking.txt")]:
        p = os.path.join(out, f)
        last = [l for l in open(p).read().splitlines() if "passed," in l] if os.path.exists(p) else []
        if last or "blocking" not in name:
            rows.append((name, last[-1] if last else "did not run"))
    cmp = load(os.path.join(out, "compare.json"), {})
    for k in ["cuda-f32", "cuda-f32-chunked", "cuda-f32-greedy", "cpu-f32", "cuda-bf16", "cuda-bf16-vs-hf-bf16",
              "cuda-fp8"]:
        v = cmp.get(k)
        if not isinstance(v, dict):
            rows.append((f"tokens {k}", "did not run"))
        elif "error" in v:
            rows.append((f"tokens {k}", "ERROR " + v["error"][:80]))
        else:
            # f32: every token but true near-ties; bf16: "nearly every position"; an fp8 cache
            # (3 mantissa bits, unscaled) is expected to drift more
            need = 1.0 if "f32" in k and "bf16" not in k else 0.75 if "fp8" in k else 0.9
            ok = "ok" if v["agree"] >= need else "FAIL"
            line = (f"{v['agree'] * 100:.1f}% of {v['tokens']} agree vs hf {v['reference']} "
                    f"({v.get('near_ties', 0)} near-ties), max |dlogprob| {v['max_dlogprob']:.2e}  {ok}")
            if v.get("first_divergence"):
                d = v["first_divergence"]
                line += f"; first divergence: request {d['request']} token {d['position']} (gap {d['gap']:.2e})"
            rows.append((f"tokens {k}", line))
    line = str(cmp.get("cuda-vs-cpu-f32-identical", "did not run"))
    if "cuda-vs-cpu-f32-max-dlogprob" in cmp:
        line += f" (max |dlogprob| {cmp['cuda-vs-cpu-f32-max-dlogprob']:.2e})"
    rows.append(("cuda f32 == cpu f32 tokens", line))
    if "error" in cmp:
        rows.append(("transformers reference", "ERROR " + cmp["error"][:100]))
    rows.append(("device argmax == host argmax", str(cmp.get("device-argmax-identical", "did not run"))))
    rows.append(("NCCL workers == one device", str(cmp.get("nccl-vs-one-device-identical", "did not run"))))
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
    for kind in ("prefill", "prefill-simt", "decode"):
        top = op_profile_top(os.path.join(out, f"ops-{kind}.txt"))
        if top:
            rows.append((f"ops {kind}", top[0].split(": ", 1)[-1] + ": " + ", ".join(f"{k} {v}" for k, v in top[1])))
    # the tensor-core prefill attention against the general SIMT kernel, on the same prompt
    mma = kernel_ms(os.path.join(out, "ops-prefill.txt"), "paged_attention_prefill_")
    simt = kernel_ms(os.path.join(out, "ops-prefill-simt.txt"), "paged_attention_bf16")
    if mma and simt:
        rows.append(("prefill attention", f"tensor cores {mma:.3f} ms, SIMT {simt:.3f} ms -> {simt / mma:.1f}x"))
    shape = f"{os.environ.get('PROMPT_LEN', 512)}+{os.environ.get('GEN_LEN', 256)}"
    for kind, hf_key, label, goal in [("throughput", "batches", shape, "> 1x"), ("sharegpt", "sharegpt", "sharegpt", ">= 10x")]:
        for bsz, v in sorted(bench.get(kind, {}).items(), key=lambda kv: int(kv[0])):
            h = hf.get(hf_key, {}).get(bsz, {})
            if "tok_per_s" in v:
                line = f"pagoda {v['tok_per_s']:.0f} tok/s"
                if "tok_per_s" in h:
                    line += f", transformers {h['tok_per_s']:.0f} tok/s -> {v['tok_per_s'] / h['tok_per_s']:.1f}x (goal {goal})"
                elif h:
                    line += f", transformers: {h.get('error', '?')[:60]}"
            else:
                line = "ERROR " + str(v.get("error"))[:100]
            rows.append((f"throughput {bsz} x {label}", line))
    # sampling on the device against the greedy run of the same requests
    for bsz, v in bench.get("sampled", {}).items():
        g = bench.get("throughput", {}).get(bsz, {})
        if "tok_per_s" in v and "tok_per_s" in g:
            line = (f"T=1 top-p 0.95 {v['tok_per_s']:.0f} tok/s, greedy {g['tok_per_s']:.0f} tok/s -> "
                    f"{v['tok_per_s'] / g['tok_per_s']:.2f}x; {v['random_samples_on_device']} of "
                    f"{v['tokens']} tokens drawn on the device")
        else:
            line = "ERROR " + str(v.get("error", g.get("error")))[:100]
        rows.append((f"sampled throughput {bsz}", line))
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
