// Rotate-half RoPE, in place, on the q and k heads of fused QKV rows
// ([q: H x D | k: Hkv x D | v: Hkv x D]); one thread per (row, head, i < D/2).
struct Params {
    rows: u32,
    row0: u32,      // first row of this window in the batch (positions are indexed by batch row)
    heads: u32,     // H + Hkv: the heads that rotate
    head_dim: u32,
    stride: u32,    // elements per QKV row
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> positions: array<u32>;
@group(0) @binding(3) var<storage, read> cos_t: array<f32>;
@group(0) @binding(4) var<storage, read> sin_t: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let half = p.head_dim / 2u;
    let i = (wid.y * nwg.x + wid.x) * 64u + lid.x;
    if (i >= p.rows * p.heads * half) {
        return;
    }
    let t = i / (p.heads * half);
    let h = (i / half) % p.heads;
    let j = i % half;
    let pos = positions[p.row0 + t];
    let c = cos_t[pos * half + j];
    let s = sin_t[pos * half + j];
    let base = t * p.stride + h * p.head_dim;
    let x1 = qkv[base + j];
    let x2 = qkv[base + j + half];
    qkv[base + j] = x1 * c - x2 * s;
    qkv[base + j + half] = x2 * c + x1 * s;
}
