// Weight access, bf16 storage: WGSL has no bf16, so two values are packed in each u32 (element
// 2i in the low half, 2i+1 in the high half) and widened by a shift: a bf16 is the top 16 bits
// of an f32.
alias WType = u32;

fn load_w(i: u32) -> f32 {
    let word = w[i >> 1u];
    return bitcast<f32>(select(word << 16u, word & 0xffff0000u, (i & 1u) == 1u));
}
