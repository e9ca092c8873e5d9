#!/usr/bin/env python3
"""Writes an all-F32 copy of a GGUF file (every quantized tensor dequantized), so that llama.cpp
can be compared with Pagoda at the same precision; or, with a type, a copy whose matrices are
stored in F16 or Q8_0 (what `llama-quantize` makes; the 1-D tensors, norms and biases, stay
F32). Tensors keep llama.cpp's layout and names; metadata is copied unchanged.

usage: gguf-to-f32.py IN.gguf OUT.gguf [f32|f16|q8_0]     (needs: pip install gguf==0.19.0 numpy)
"""
import sys
import numpy as np
from gguf import GGUFReader, GGUFWriter, GGUFValueType, GGMLQuantizationType
from gguf.quants import dequantize, quantize


def main():
    src, dst = sys.argv[1], sys.argv[2]
    to = sys.argv[3] if len(sys.argv) > 3 else "f32"
    if to not in ("f32", "f16", "q8_0"):
        sys.exit(f"unknown type {to}: f32, f16 or q8_0")
    r = GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment", "general.file_type"):
            continue
        t = f.types[0]
        if t == GGUFValueType.ARRAY:
            sub = f.types[1]
            if sub == GGUFValueType.STRING:
                val = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            else:
                val = [f.parts[i].tolist()[0] for i in f.data]
            w.add_key_value(name, val, t, sub_type=sub)
        elif t == GGUFValueType.STRING:
            w.add_key_value(name, bytes(f.parts[f.data[0]]).decode("utf-8"), t)
        else:
            w.add_key_value(name, f.parts[f.data[0]].tolist()[0], t)
    # llama.cpp's LLAMA_FTYPE: ALL_F32 0, MOSTLY_F16 1, MOSTLY_Q8_0 7
    w.add_uint32("general.file_type", {"f32": 0, "f16": 1, "q8_0": 7}[to])
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            a = np.asarray(t.data, dtype=np.float32).reshape(shape)
        else:
            a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        a = np.ascontiguousarray(a)
        if a.ndim == 2 and to == "f16":
            w.add_tensor(t.name, a.astype(np.float16))
        elif a.ndim == 2 and to == "q8_0" and a.shape[-1] % 32 == 0:
            q = quantize(a, GGMLQuantizationType.Q8_0)
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
