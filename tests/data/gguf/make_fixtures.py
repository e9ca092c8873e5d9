#!/usr/bin/env python3
"""Makes the dequantization fixtures for src/models/gguf/ (the GGUF reader).

For every GGML type that Pagoda dequantizes, writes
  <TYPE>.blocks  a few blocks of random bytes (f16 scale fields set to random finite values in [-2, 2])
  <TYPE>.f32  what the independent reference `gguf.quants.dequantize` (gguf==0.19.0) makes of them,
              as little-endian f32.
Deterministic (fixed seed). usage: python3 make_fixtures.py [OUTDIR]   (default: this script's folder)
"""
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

rng = np.random.default_rng(20240611)


def f16_scales(n):
    """n random finite f16 values in [-2, 2], never exactly zero, as raw bytes (n, 2)."""
    v = rng.uniform(-2.0, 2.0, size=n).astype(np.float16)
    v[v == 0] = np.float16(0.5)
    return v.view(np.uint8).reshape(n, 2)


def finite_halfwords(n, to_half):
    """n random finite 16-bit floats (f16 or bf16 bit patterns) as raw bytes."""
    x = rng.normal(0.0, 3.0, size=n).astype(np.float32)
    x[::7] *= 1e-3  # also some small magnitudes (f16: subnormals)
    return to_half(x).view(np.uint8)


def bf16_bits(x):
    return (x.view(np.uint32) >> 16).astype(np.uint16)


# byte offsets of the f16 scale fields inside one block
SCALE_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ4_NL: [0], T.IQ4_XS: [0],
}
N_BLOCKS = {32: 24, 256: 6}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    os.makedirs(out, exist_ok=True)
    total = 0
    for ty in [T.F32, T.F16, T.BF16, *SCALE_FIELDS]:
        block, size = GGML_QUANT_SIZES[ty]
        if ty == T.F32:
            raw = rng.normal(0.0, 3.0, size=200).astype(np.float32).view(np.uint8)
        elif ty == T.F16:
            raw = finite_halfwords(200, lambda x: x.astype(np.float16))
        elif ty == T.BF16:
            raw = finite_halfwords(200, bf16_bits)
        else:
            n = N_BLOCKS[block]
            blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
            for off in SCALE_FIELDS[ty]:
                blocks[:, off:off + 2] = f16_scales(n)
            raw = blocks.reshape(-1)
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        ref = np.asarray(dequantize(raw, ty), dtype=np.float32).reshape(-1)
        assert np.isfinite(ref).all(), ty.name
        assert ref.size * size == raw.size * block, ty.name
        raw.tofile(os.path.join(out, f"{ty.name}.blocks"))
        ref.astype("<f4").tofile(os.path.join(out, f"{ty.name}.f32"))
        total += raw.size + 4 * ref.size
        print(f"{ty.name:7} {ref.size:5} values")
    print(f"{total} bytes in {out}")


if __name__ == "__main__":
    main()
