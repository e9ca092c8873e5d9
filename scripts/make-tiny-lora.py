#!/usr/bin/env python3
"""Make tiny random LoRA adapters (PEFT's format) on the tiny test models, and their greedy goldens.

Writes under tests/data/tiny/lora/:
- mistral-attn/, mistral-all/, mistral-rslora/ (on tests/data/tiny/mistral), phi3-all/ (on
  tests/data/tiny/phi3), gemma3-all/ (on tests/data/tiny/gemma3) and olmo2-attn/ (on
  tests/data/tiny/olmo2): `PeftModel.save_pretrained` output, adapter_config.json and
  adapter_model.safetensors (float32), made with `LoraConfig(init_lora_weights=False)` under a fixed
  torch seed (A and B both random), then A and B multiplied by one factor per adapter so that the
  adapter changes the greedy output within the first tokens of every prompt;
- mistral-all-merged/: mistral-all merged into the base by peft's `merge_and_unload()`, saved as a
  plain HF model dir (float32) with the base's tokenizer and generation config;
- goldens.json: the prompts (token ids) and greedy continuations of the base models, of each adapter
  (a PeftModel, unmerged, loaded back from what was written) and of the merged copy.
See tests/data/tiny/lora/README.md.

usage: make-tiny-lora.py [--out tests/data/tiny/lora]

Needs the venv of tests/data/tiny/README.md plus peft (0.22.0); runs offline on CPU, one thread.
The output is deterministic: running it twice gives byte-identical files.
"""
import argparse
import json
import math
import os
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import peft  # noqa: E402
import safetensors  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(1)

N_GEN = 24
MIN_MARGIN = 0.01  # required minimum top1-top2 logit gap over every golden position
DIFFER_WITHIN = 8  # each adapter's ids must differ from the base's within this many tokens, every prompt
TARGET_REL = 0.3  # A and B are scaled so that |scaling * B @ A| / |W| = this, over the adapted modules
MAX_TOTAL = 1_500_000  # bytes, the whole lora/ folder

# (name, text): 5, 11 and 20 tokens with the tiny tokenizer (checked below), the same for every base.
# The long one, with its continuation, exceeds the sliding window (12) of mistral, phi3 and gemma3's
# sliding layers (olmo2 has no window).
PROMPTS = [
    ("short", "The old mill"),
    ("medium", "The teacher wrote the"),
    ("long", "At night the lights of the houses were in the"),
]
PROMPT_LENS = [5, 11, 20]

# base dir name under tests/data/tiny -> adapters: (name, LoraConfig kwargs, first seed)
ADAPTERS = {
    "mistral": [
        ("mistral-attn", dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), 1000),
        ("mistral-all", dict(r=16, lora_alpha=8, target_modules="all-linear"), 2000),
        ("mistral-rslora", dict(r=8, lora_alpha=32, use_rslora=True,
                                target_modules=["q_proj", "v_proj", "down_proj"]), 3000),
    ],
    "phi3": [
        ("phi3-all", dict(r=8, lora_alpha=16, target_modules="all-linear"), 4000),
    ],
    "gemma3": [
        ("gemma3-all", dict(r=8, lora_alpha=16, target_modules="all-linear"), 5000),
    ],
    "olmo2": [
        ("olmo2-attn", dict(r=16, lora_alpha=32, use_rslora=True,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]), 6000),
    ],
}
MERGED = ("mistral-all", "mistral-all-merged")  # adapter merged into its base
BASE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def greedy(model, prompt_ids, n=N_GEN):
    """Full recompute each step: model(whole sequence).logits[-1], argmax (ties -> lowest id)."""
    ids = list(prompt_ids)
    gen, margins, top5 = [], [], None
    for i in range(n):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        top = torch.topk(logits, 5)
        vals, idx = top.values.tolist(), top.indices.tolist()
        nxt = int(torch.argmax(logits))
        assert nxt == idx[0]
        margins.append(vals[0] - vals[1])
        if i == 0:
            top5 = [[int(t), round(float(v), 6)] for t, v in zip(idx, vals)]
        gen.append(nxt)
        ids.append(nxt)
    return gen, margins, top5


@torch.no_grad()
def cached_generate(model, hf_model, prompt_ids, n=N_GEN):
    """`generate` with the KV cache, greedy, EOS disabled; must equal the full-recompute loop."""
    saved_gc, saved_eos = hf_model.generation_config, hf_model.config.eos_token_id
    gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    hf_model.generation_config = gc
    hf_model.config.eos_token_id = None
    try:
        out = model.generate(input_ids=torch.tensor([prompt_ids]),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             generation_config=gc, use_cache=True)
    finally:
        hf_model.generation_config, hf_model.config.eos_token_id = saved_gc, saved_eos
    return out[0, len(prompt_ids):].tolist()


def run_prompts(model, prompts, hf_model=None):
    """Greedy outputs on every prompt: {generated_ids, top2_margin, first_top5, min_top2_margin}."""
    res = {"generated_ids": [], "top2_margin": [], "first_top5": []}
    for p in prompts:
        gen, margins, top5 = greedy(model, p)
        res["generated_ids"].append(gen)
        res["top2_margin"].append([round(m, 6) for m in margins])
        res["first_top5"].append(top5)
    res["min_top2_margin"] = min(min(m) for m in res["top2_margin"])
    if hf_model is not None:
        res["cached_generate_agrees"] = all(
            cached_generate(model, hf_model, p) == g for p, g in zip(prompts, res["generated_ids"]))
    return res


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def max_run(gen):
    best = run = 1
    for i in range(1, len(gen)):
        run = run + 1 if gen[i] == gen[i - 1] else 1
        best = max(best, run)
    return best


def lora_modules(pm):
    return [(n, m) for n, m in pm.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]


def rewrite_adapter_config(d, base_rel):
    """peft writes target_modules from a set (order varies with the hash seed) and the base path as
    given; sort the list and make the path the repository-relative one. Same formatting as peft."""
    path = os.path.join(d, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    if isinstance(cfg.get("target_modules"), list):
        cfg["target_modules"] = sorted(cfg["target_modules"])
    cfg["base_model_name_or_path"] = base_rel
    with open(path, "w") as f:
        f.write(json.dumps(cfg, indent=2, sort_keys=True))
    return cfg


def make_adapter(base_dir, base_rel, name, kw, seed, d):
    """A PeftModel with random A, B under `seed`, scaled to TARGET_REL; saved to d. Returns info."""
    base = load(base_dir)
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, lora_dropout=0.0, **kw)
    pm = peft.get_peft_model(base, cfg)
    mods = lora_modules(pm)
    scaling = mods[0][1].scaling["default"]
    want = kw["lora_alpha"] / (math.sqrt(kw["r"]) if kw.get("use_rslora") else kw["r"])
    assert all(abs(m.scaling["default"] - want) < 1e-12 for _, m in mods), (scaling, want)
    with torch.no_grad():
        num = sum(float((scaling * (m.lora_B["default"].weight @ m.lora_A["default"].weight)).pow(2).sum())
                  for _, m in mods)
        den = sum(float(m.get_base_layer().weight.pow(2).sum()) for _, m in mods)
        rel0 = math.sqrt(num / den)
        # delta = scaling * B @ A scales with factor**2 when A and B are both multiplied by factor
        factor = round(math.sqrt(TARGET_REL / rel0), 4)
        for _, m in mods:
            m.lora_A["default"].weight.mul_(factor)
            m.lora_B["default"].weight.mul_(factor)
    shutil.rmtree(d, ignore_errors=True)
    pm.save_pretrained(d)
    card = os.path.join(d, "README.md")  # peft's empty model-card template
    if os.path.exists(card):
        os.remove(card)
    rewrite_adapter_config(d, base_rel)
    return dict(scaling=scaling, ab_factor=factor, relative_delta_before_factor=round(rel0, 6),
                modules=[n.removeprefix("base_model.model.") for n, _ in mods])


def load_adapter(base_dir, d):
    base = load(base_dir)
    pm = peft.PeftModel.from_pretrained(base, d).eval()
    return pm, base


def adapter_tensors(d):
    """[[name, shape], ...] in the file's order (safetensors sorts the names)."""
    with safe_open(os.path.join(d, "adapter_model.safetensors"), "pt") as f:
        return [[k, list(f.get_slice(k).get_shape())] for k in f.keys()]


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(d, x)) for x in os.listdir(d))


def main():
    ap = argparse.ArgumentParser()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tiny = os.path.join(repo, "tests", "data", "tiny")
    ap.add_argument("--out", default=os.path.join(tiny, "lora"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tmp = os.path.join(a.out, ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    adapters_info, models = {}, {}
    for base_name, adapters in ADAPTERS.items():
        base_dir = os.path.join(tiny, base_name)
        base_rel = f"tests/data/tiny/{base_name}"
        tok = Tokenizer.from_file(os.path.join(base_dir, "tokenizer.json"))
        prompts = [tok.encode(text).ids for _, text in PROMPTS]
        assert [len(p) for p in prompts] == PROMPT_LENS, [len(p) for p in prompts]
        base = load(base_dir)
        base_out = run_prompts(base, prompts, base)
        assert base_out["min_top2_margin"] >= MIN_MARGIN, base_out["min_top2_margin"]
        print(f"{base_name}: base min margin {base_out['min_top2_margin']}", file=sys.stderr)
        outputs = {"base": base_out}
        for name, kw, seed0 in adapters:
            for seed in range(seed0, seed0 + 100):
                d = os.path.join(tmp, name)
                info = make_adapter(base_dir, base_rel, name, kw, seed, d)
                pm, hf = load_adapter(base_dir, d)  # what is tested is what was written
                out = run_prompts(pm, prompts)
                diffs = [first_diff(g, b) for g, b in zip(out["generated_ids"], base_out["generated_ids"])]
                why = None
                if out["min_top2_margin"] < MIN_MARGIN:
                    why = f"margin {out['min_top2_margin']}"
                elif any(x is None or x >= DIFFER_WITHIN for x in diffs):
                    why = f"first differing steps {diffs}"
                elif any(len(set(g)) < 6 or max_run(g) > 8 for g in out["generated_ids"]):
                    why = f"trivial output {out['generated_ids']}"
                if why:
                    print(f"  {name}: seed {seed} rejected ({why})", file=sys.stderr)
                    continue
                break
            else:
                raise SystemExit(f"{name}: no seed met the criteria")
            out = run_prompts(pm, prompts, hf)
            out["first_differing_step_from_base"] = diffs
            outputs[name] = out
            tensors = adapter_tensors(d)
            with open(os.path.join(d, "adapter_config.json")) as f:
                acfg = json.load(f)
            dst = os.path.join(a.out, name)
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(d, dst)
            adapters_info[name] = dict(
                base_model=base_name, dir=name, base_model_name_or_path=base_rel,
                r=kw["r"], lora_alpha=kw["lora_alpha"], use_rslora=bool(kw.get("use_rslora", False)),
                scaling=info["scaling"], target_modules_requested=kw["target_modules"],
                target_modules=acfg["target_modules"], seed=seed, ab_factor=info["ab_factor"],
                relative_delta=TARGET_REL, modules=info["modules"], tensors=tensors,
                dir_bytes=dir_bytes(dst))
            print(f"  {name}: seed {seed}, factor {info['ab_factor']}, min margin {out['min_top2_margin']}, "
                  f"first differing steps {diffs}, cached generate agrees {out['cached_generate_agrees']}",
                  file=sys.stderr)

            if name == MERGED[0]:
                mname = MERGED[1]
                pm2, _ = load_adapter(base_dir, dst)
                merged = pm2.merge_and_unload()
                md = os.path.join(tmp, mname)
                shutil.rmtree(md, ignore_errors=True)
                merged.save_pretrained(md, safe_serialization=True)
                for fn in BASE_FILES:
                    shutil.copy(os.path.join(base_dir, fn), os.path.join(md, fn))
                mm = load(md)
                mout = run_prompts(mm, prompts, mm)
                assert mout["generated_ids"] == out["generated_ids"], "merged differs from unmerged"
                assert mout["min_top2_margin"] >= MIN_MARGIN
                mout["merged_from"] = MERGED[0]
                mout["same_ids_as_unmerged"] = True
                mout["first_differing_step_from_base"] = diffs
                with torch.no_grad():
                    ldiff = max(float((mm(input_ids=torch.tensor([p]), use_cache=False).logits
                                       - pm(input_ids=torch.tensor([p]), use_cache=False).logits).abs().max())
                                for p in prompts)
                mout["max_abs_logit_diff_vs_unmerged_on_prompts"] = float(f"{ldiff:.3g}")
                outputs[mname] = mout
                mdst = os.path.join(a.out, mname)
                shutil.rmtree(mdst, ignore_errors=True)
                shutil.copytree(md, mdst)
                print(f"  {mname}: min margin {mout['min_top2_margin']}, logits vs unmerged {ldiff:.3g}",
                      file=sys.stderr)
        models[base_name] = dict(dir=base_rel, prompt_names=[p for p, _ in PROMPTS],
                                 prompt_texts=[t for _, t in PROMPTS], prompts=prompts, outputs=outputs)
    shutil.rmtree(tmp)

    out = {
        "about": (
            "Greedy goldens of tiny random LoRA adapters (PEFT format) on tests/data/tiny/mistral, "
            "tests/data/tiny/phi3, tests/data/tiny/gemma3 and tests/data/tiny/olmo2; made by "
            "scripts/make-tiny-lora.py. models.<base>.prompts = token ids of prompt_texts (that model's "
            "tokenizer.json, no BOS added). models.<base>.outputs.<name>: 'base' = "
            "the base model without adapter; an adapter name = the base with that adapter (peft PeftModel, "
            "unmerged, loaded from the adapter dir); 'mistral-all-merged' = the plain model dir of that name "
            "(mistral-all merged by merge_and_unload). Each output: generated_ids[p] = exactly %d greedy "
            "tokens for prompt p (argmax of float32 logits, full recompute every step, eager attention, EOS "
            "not treated specially), top2_margin[p][i] = top1 - top2 logit at generated position i, "
            "first_top5[p] = [[id, logit], ...] at generated position 0, min_top2_margin, "
            "cached_generate_agrees (generate() with the KV cache gives the same ids). adapters.<name>: r, "
            "lora_alpha, use_rslora, scaling (the factor peft applies to B @ A: lora_alpha / r, or "
            "lora_alpha / sqrt(r) with use_rslora), target_modules as written in adapter_config.json, the "
            "adapted modules (model order) and tensors = [[name, shape], ...] in file order (lora_A [r, in], "
            "lora_B [out, r], float32)." % N_GEN),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "tokenizers": tokenizers.__version__,
                     "safetensors": safetensors.__version__},
        "n_gen": N_GEN,
        "min_margin_required": MIN_MARGIN,
        "adapters": adapters_info,
        "models": models,
    }
    gpath = os.path.join(a.out, "goldens.json")
    with open(gpath, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(r, x)) for r, _, fs in os.walk(a.out) for x in fs)
    assert total < MAX_TOTAL, f"lora/ is {total} bytes"
    print(f"wrote {a.out} ({total} bytes)", file=sys.stderr)

    # summary: first 8 ids of each output next to the base's, smallest margin
    for base_name, m in models.items():
        b = m["outputs"]["base"]["generated_ids"]
        for oname, o in m["outputs"].items():
            print(f"{base_name:8s} {oname:20s} min margin {o['min_top2_margin']:.4f}")
            for p, (g, bg) in enumerate(zip(o["generated_ids"], b)):
                print(f"    prompt {PROMPT_LENS[p]:2d} tok: {g[:8]}" + ("" if oname == "base" else f"  base {bg[:8]}"))


if __name__ == "__main__":
    main()
