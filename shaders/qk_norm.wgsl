// RMSNorm of the q and k parts of fused QKV rows ([q: H x D | k: Hkv x D | v: Hkv x D]), in place,
// in spans (each head: Qwen3, Gemma 3; all of q and all of k: OLMo 2): one workgroup per
// (row, span), q spans scaled by qw, k spans by kw; v untouched. With own_weights span i is
// scaled by row i of qw / kw; with center it is a LayerNorm without bias (the mean subtracted,
// then the variance of x - mean, as PyTorch computes it): StableLM's and Cohere's per-head norms.
struct Params {
    rows: u32,
    spans: u32,   // q spans + k spans: the spans that are normalised
    q_spans: u32, // spans below this are q spans
    q_span: u32,  // values in a q span
    k_span: u32,  // values in a k span
    stride: u32,  // elements per QKV row
    eps: f32,
    own_weights: u32,
    center: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> qw: array<f32>;
@group(0) @binding(3) var<storage, read> kw: array<f32>;

var<workgroup> part: array<f32, 64>;

// The sum of every thread's `v`, the same in every thread: each sums the 64 partials itself, in
// the same order, before any write.
fn block_total(lid: u32, v: f32) -> f32 {
    part[lid] = v;
    workgroupBarrier();
    var total = 0.0;
    for (var j = 0u; j < 64u; j++) {
        total += part[j];
    }
    // NOTE: every thread has read the partials before a second reduction overwrites them.
    workgroupBarrier();
    return total;
}

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
    var span = h - p.q_spans;
    if (is_q) {
        span = h;
    }
    var w0 = 0u;
    if (p.own_weights != 0u) {
        w0 = span * n;
    }
    var mean = 0.0;
    if (p.center != 0u) {
        var s = 0.0;
        for (var i = lid.x; i < n; i += 64u) {
            s += qkv[base + i];
        }
        mean = block_total(lid.x, s) / f32(n);
    }
    var ss = 0.0;
    for (var i = lid.x; i < n; i += 64u) {
        let v = qkv[base + i] - mean;
        ss = fma(v, v, ss);
    }
    let inv = 1.0 / sqrt(block_total(lid.x, ss) / f32(n) + p.eps);
    for (var i = lid.x; i < n; i += 64u) {
        var w = kw[w0 + i];
        if (is_q) {
            w = qw[w0 + i];
        }
        qkv[base + i] = (qkv[base + i] - mean) * inv * w;
    }
}
