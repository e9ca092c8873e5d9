#!/usr/bin/env python3
"""Registers and spills of every CUDA kernel for sm_90, from NVRTC's ptxas log: no GPU needed.

    python3 -m pip install --target ~/.cache/pagoda/nvrtc "nvidia-cuda-nvrtc==13.0.*"
    L=~/.cache/pagoda/nvrtc/nvidia/cu13/lib
    LD_LIBRARY_PATH=$L python3 scripts/kernel-report.py $L/libnvrtc.so.13 kernels

Prints a Markdown table row per kernel: file, kernel, registers, spill stores / loads (bytes).
The options are the CUDA backend's (`nvrtc_options`), with ptxas's verbose report added.
"""
import ctypes
import glob
import os
import re
import sys

lib = ctypes.CDLL(sys.argv[1])
kdir = sys.argv[2]
common = open(os.path.join(kdir, "common.cuh")).read()
def compile_log(name, src):
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"--std=c++17", b"-DPG_WARP_SIZE=32", b"--ptxas-options=-v"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, buf)
    return rc, buf.value.decode(errors="replace")
for f in sorted(glob.glob(os.path.join(kdir, "*.cu"))):
    src = open(f).read().replace('#include "common.cuh"', common)
    rc, log = compile_log(os.path.basename(f), src)
    cur = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m: cur = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur: spill = m.groups()
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            print(f"| {os.path.basename(f)} | `{cur}` | {m.group(1)} | {spill[1]} / {spill[2]} |")
    if rc != 0: print("FAILED", f, log[:500])
