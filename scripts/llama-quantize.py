#!/usr/bin/env python3
"""A GGUF quantized by llama.cpp's own quantizer (llama_model_quantize, as `llama-quantize`
does), through llama-cpp-python: the Q6_K and IQ4_XS files of the CPU benchmarks (issue 41).

usage: llama-quantize.py IN.gguf OUT.gguf TYPE        (TYPE: Q6_K, IQ4_XS, IQ4_NL, Q3_K_M, ...)
needs: pip install llama-cpp-python
"""
import sys

import llama_cpp as L


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    src, out, name = sys.argv[1:]
    ftype = getattr(L, f"LLAMA_FTYPE_MOSTLY_{name}", None)
    if ftype is None:
        sys.exit(f"unknown type {name}")
    params = L.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = L.llama_model_quantize(src.encode(), out.encode(), params)
    if rc != 0:
        sys.exit(f"llama_model_quantize failed ({rc})")


main()
