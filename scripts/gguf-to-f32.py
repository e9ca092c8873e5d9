#!/usr/bin/env python3
"""Writes an all-F32 copy of a GGUF file (every quantized tensor dequantized), so that llama.cpp
can be compared with Pagoda at the same precision. Tensors keep llama.cpp's layout and names;
metadata is copied unchanged.

usage: gguf-to-f32.py IN.gguf OUT.gguf      (needs: pip install gguf==0.19.0 numpy)
"""
import sys
import numpy as np
from gguf import GGUFReader, GGUFWriter, GGUFValueType, GGMLQuantizationType
from gguf.quants import dequantize


def main():
    src, dst = sys.argv[1], sys.argv[2]
    r = GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name == "general.alignment":
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
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            a = np.asarray(t.data, dtype=np.float32).reshape(shape)
        else:
            a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        w.add_tensor(t.name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
