// Per-head RMSNorm of the q and k heads of fused QKV rows ([q: H x D | k: Hkv x D | v: Hkv x D]),
// in place: one workgroup per (row, head), q heads scaled by qw, k heads by kw; v untouched.
struct Params {
    rows: u32,
    heads: u32,     // H + Hkv: the heads that are normalised
    num_heads: u32, // H: heads below this are q heads
    head_dim: u32,
    stride: u32,    // elements per QKV row
    eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> qw: array<f32>;
@group(0) @binding(3) var<storage, read> kw: array<f32>;

var<workgroup> part: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let g = wid.y * nwg.x + wid.x;
    if (g >= p.rows * p.heads) {
        return;
    }
    let t = g / p.heads;
    let h = g % p.heads;
    let base = t * p.stride + h * p.head_dim;
    var ss = 0.0;
    for (var i = lid.x; i < p.head_dim; i += 64u) {
        let v = qkv[base + i];
        ss = fma(v, v, ss);
    }
    part[lid.x] = ss;
    workgroupBarrier();
    // NOTE: every thread sums the 64 partials itself, in the same order, before any write.
    var total = 0.0;
    for (var j = 0u; j < 64u; j++) {
        total += part[j];
    }
    let inv = 1.0 / sqrt(total / f32(p.head_dim) + p.eps);
    for (var i = lid.x; i < p.head_dim; i += 64u) {
        var w = kw[i];
        if (h < p.num_heads) {
            w = qw[i];
        }
        qkv[base + i] = qkv[base + i] * inv * w;
    }
}
