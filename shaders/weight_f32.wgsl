// Weight access, f32 storage. Prepended to a kernel that declares the binding `w: array<WType>`.
alias WType = f32;

fn load_w(i: u32) -> f32 {
    return w[i];
}
