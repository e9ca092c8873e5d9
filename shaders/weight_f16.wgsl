// Weight access, f16 storage (adapter feature `shader-f16`); math stays f32.
enable f16;

alias WType = f16;

fn load_w(i: u32) -> f32 {
    return f32(w[i]);
}
