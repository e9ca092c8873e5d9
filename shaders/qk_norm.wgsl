// RMSNorm of the q and k parts of fused QKV rows ([q: H x D | k: Hkv x D | v: Hkv x D]), in place,
// in spans (each head: Qwen3, Gemma 3; all of q and all of k: OLMo 2): one workgroup per
// (row, span), q spans scaled by qw, k spans by kw; v untouched.
struct Params {
    rows: u32,
    spans: u32,   // q spans + k spans: the spans that are normalised
    q_spans: u32, // spans below this are q spans
    q_span: u32,  // values in a q span
    k_span: u32,  // values in a k span
    stride: u32,  // elements per QKV row
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
    if (g >= p.rows * p.spans) {
        return;
    }
    let t = g / p.spans;
    let h = g % p.spans;
    let is_q = h < p.q_spans;
    var n = p.k_span;
    var base = t * p.stride + p.q_spans * p.q_span + (h - p.q_spans) * p.k_span;
    if (is_q) {
        n = p.q_span;
        base = t * p.stride + h * p.q_span;
    }
    var ss = 0.0;
    for (var i = lid.x; i < n; i += 64u) {
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
    let inv = 1.0 / sqrt(total / f32(n) + p.eps);
    for (var i = lid.x; i < n; i += 64u) {
        var w = kw[i];
        if (is_q) {
            w = qw[i];
        }
        qkv[base + i] = qkv[base + i] * inv * w;
    }
}
