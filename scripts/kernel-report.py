#!/usr/bin/env python3
"""What every CUDA kernel compiles to, with no GPU: NVRTC makes the cubin for each architecture
(the CUDA backend's options, plus ptxas's verbose report), nvdisasm reads its machine code.

    python3 -m pip install --target $PAGODA_CACHE/nvrtc    "nvidia-cuda-nvrtc==13.0.*"
    python3 -m pip install --target $PAGODA_CACHE/nvdisasm "nvidia-cuda-nvdisasm==13.5.*"
    python3 scripts/kernel-report.py [--arch sm_90,sm_80] [--check] [--markdown]

Per kernel and architecture: registers, spill bytes (stores / loads), static shared memory,
global loads by width (16-byte LDG.128 against 8-, 4-, 2- and 1-byte ones), asynchronous copies
to shared memory (LDGSTS), tensor-core instructions (HMMA) and integer dot products (IDP).

`--check` applies the rules of issue 11 and exits 1 on a violation:
  - no kernel spills;
  - a decode kernel (the matvecs, paged attention) loads its weights and K/V 16 bytes at a
    time: it has 16-byte global loads, and no more narrower float loads than 16-byte ones
    (the narrow ones left are scalars: block tables, lengths, scales);
  - a prefill attention kernel (paged_attention_prefill_*) uses tensor cores (HMMA), and each
    KV cache type narrower than f32 (bf16, f16, fp8) has one on sm_90. The
    general kernel (paged_attention_<kv>) stays SIMT: it serves the f32 cache (the exact path),
    head sizes without an instance, and devices without mma.sync;
  - a matvec over weights in GGML blocks (qmatvec_*) multiplies in integers (IDP, dp4a); those
    over super-blocks of 256 (Q2_K .. Q6_K, IQ4_XS) are decode kernels for the 16-byte rule.
    NOTE: those over blocks of 32 are not held to it yet: their lanes load the 4 bytes of a
    block they sum (the CPU's order), and the layout that would give each lane 16 bytes of its
    own needs rows of a multiple of 8 blocks (issue 35 keeps this open).
Known violations, the debt issue 11 is paying off, are listed in scripts/kernel-report.known
("kernel rule" per line, a # comment saying why): they are reported but do not fail, and an
entry that no longer fails is an error too, so that the list only shrinks.
"""
import argparse
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.environ.get("PAGODA_CACHE", os.path.expanduser("~/.cache/pagoda"))

ap = argparse.ArgumentParser()
ap.add_argument("--nvrtc", default=f"{CACHE}/nvrtc/nvidia/cu13/lib/libnvrtc.so.13")
ap.add_argument("--nvdisasm", default=f"{CACHE}/nvdisasm/nvidia/cu13/bin/nvdisasm")
ap.add_argument("--kernels", default=os.path.join(HERE, "..", "kernels"))
ap.add_argument("--arch", default="sm_90,sm_80")
ap.add_argument("--check", action="store_true")
ap.add_argument("--known", default=os.path.join(HERE, "kernel-report.known"))
args = ap.parse_args()

lib = ctypes.CDLL(args.nvrtc)
common = open(os.path.join(args.kernels, "common.cuh")).read()


def compile_cubin(name, src, arch):
    """(cubin bytes, ptxas log) of one file for one architecture."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None)
    assert rc == 0, rc
    # NOTE: the CUDA backend's nvrtc_options (src/backend/cuda/mod.rs), plus the report
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "-DPG_WARP_SIZE=32", "--ptxas-options=-v"]
    if tensor_cores(arch):
        opts.append("-DPG_TENSOR_CORES=1")
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    log = log.value.decode(errors="replace")
    if rc != 0:
        sys.exit(f"{name} does not compile for {arch}:\n{log[:2000]}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    assert lib.nvrtcGetCUBIN(prog, cubin) == 0
    return cubin.raw, log


def ptxas_report(log):
    """kernel -> (registers, spill stores, spill loads, shared bytes) from ptxas's log."""
    out, cur, spill, smem = {}, None, (0, 0), 0
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur, spill, smem = m.group(1), (0, 0), 0
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spill = (int(m.group(1)), int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            s = re.search(r"(\d+) bytes smem", line)
            smem = int(s.group(1)) if s else 0
            out[cur] = (int(m.group(1)), spill[0], spill[1], smem)
    return out


def sass_counts(cubin):
    """kernel -> counts of the instructions that matter, from nvdisasm's listing."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([args.nvdisasm, "--print-code", f.name], check=True,
                              capture_output=True, text=True).stdout
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\w+):", line)
        if m:
            cur = m.group(1)
            out[cur] = {"ldg128": 0, "ldg64": 0, "ldg32": 0, "ldg16": 0, "ldg8": 0,
                        "ldgsts": 0, "hmma": 0, "idp": 0}
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if not (m and cur):
            continue
        op = m.group(1)
        parts = op.split(".")
        c = out[cur]
        if parts[0] == "LDG":
            if "128" in parts:
                c["ldg128"] += 1
            elif "64" in parts:
                c["ldg64"] += 1
            elif "U16" in parts or "S16" in parts:
                c["ldg16"] += 1
            elif "U8" in parts or "S8" in parts:
                c["ldg8"] += 1
            else:
                c["ldg32"] += 1
        elif parts[0] == "LDGSTS":
            c["ldgsts"] += 1
        elif parts[0] == "HMMA":
            c["hmma"] += 1
        elif parts[0] == "IDP":
            c["idp"] += 1
    return out


def tensor_cores(arch):
    """mma.sync with bf16 and f16 inputs: sm_80 on (arch_has_tensor_cores in the backend)."""
    return int(re.sub(r"\D", "", arch)) >= 80


def decode_kernel(k):
    # NOTE: of the matvecs over GGUF blocks, only the super-block ones (K-quants, IQ4_XS) are
    # held to the 16-byte rule yet; see the module's note.
    block256 = k.startswith("qmatvec_") and k.endswith(("_k", "_xs"))
    return k.startswith("matvec_") or k.startswith("paged_attention_decode_") or block256


def prefill_attention(k):
    return k.startswith("paged_attention_prefill_")


MMA_KV_TYPES = ("bf16", "f16", "fp8")


rows, violations = [], set()
for arch in args.arch.split(","):
    for f in sorted(glob.glob(os.path.join(args.kernels, "*.cu"))):
        name = os.path.basename(f)
        src = open(f).read().replace('#include "common.cuh"', common)
        cubin, log = compile_cubin(name, src, arch)
        regs = ptxas_report(log)
        sass = sass_counts(cubin)
        for k in sorted(regs):
            r, ss, sl, smem = regs[k]
            c = sass.get(k, {})
            narrow = c.get("ldg64", 0) + c.get("ldg32", 0)
            rows.append((arch, name, k, r, ss, sl, smem, c))
            if arch != "sm_90":
                continue
            if ss or sl:
                violations.add((k, "spills"))
            if decode_kernel(k) and (c.get("ldg128", 0) == 0 or narrow > c.get("ldg128", 0)):
                violations.add((k, "narrow-loads"))
            if prefill_attention(k) and c.get("hmma", 0) == 0:
                violations.add((k, "no-hmma"))
            if k.startswith("qmatvec_") and c.get("idp", 0) == 0:
                violations.add((k, "no-idp"))
        if arch == "sm_90" and name == "attention.cu":
            for kv in MMA_KV_TYPES:
                if not any(prefill_attention(k) and f"_{kv}_" in k for k in regs):
                    violations.add((f"paged_attention_prefill_{kv}", "missing"))

print("| arch | file | kernel | registers | spills (B, st / ld) | smem (B) | LDG 16 B | 8 B | 4 B | 2 / 1 B | LDGSTS | HMMA | IDP |")
print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for arch, name, k, r, ss, sl, smem, c in rows:
    g = lambda key: c.get(key, 0)
    print(f"| {arch} | {name} | `{k}` | {r} | {ss} / {sl} | {smem} | {g('ldg128')} | {g('ldg64')} | "
          f"{g('ldg32')} | {g('ldg16')} / {g('ldg8')} | {g('ldgsts')} | {g('hmma')} | {g('idp')} |")

known = set()
if os.path.exists(args.known):
    for line in open(args.known):
        line = line.split("#")[0].split()
        if len(line) == 2:
            known.add(tuple(line))
print()
for k, rule in sorted(violations):
    print(f"{'known' if (k, rule) in known else 'NEW'} violation (sm_90): {k} {rule}")
new = violations - known
stale = known - violations
for k, rule in sorted(stale):
    print(f"STALE: {k} {rule} is listed in {os.path.basename(args.known)} but passes (or is gone): remove it")
if args.check and (new or stale):
    sys.exit(1)
