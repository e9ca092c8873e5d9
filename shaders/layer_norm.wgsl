// LayerNorm with bias: out[r, :] = (x[r, :] - mean) / sqrt(var + eps) * w + b, one workgroup
// per row, the mean first and then the variance of x - mean (as PyTorch computes it).
struct Params {
    rows: u32,
    dim: u32,
    eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> b: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

var<workgroup> part: array<f32, 64>;

// Every thread sums the 64 partials itself, in the same order.
fn total() -> f32 {
    var t = 0.0;
    for (var j = 0u; j < 64u; j++) {
        t += part[j];
    }
    return t;
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = wid.y * nwg.x + wid.x;
    // NOTE: no early return: every thread of the workgroup reaches every barrier.
    let live = r < p.rows;
    let base = r * p.dim;
    var s = 0.0;
    if (live) {
        for (var i = lid.x; i < p.dim; i += 64u) {
            s += x[base + i];
        }
    }
    part[lid.x] = s;
    workgroupBarrier();
    let mean = total() / f32(p.dim);
    workgroupBarrier();
    var ss = 0.0;
    if (live) {
        for (var i = lid.x; i < p.dim; i += 64u) {
            let d = x[base + i] - mean;
            ss = fma(d, d, ss);
        }
    }
    part[lid.x] = ss;
    workgroupBarrier();
    let inv = 1.0 / sqrt(total() / f32(p.dim) + p.eps);
    if (live) {
        for (var i = lid.x; i < p.dim; i += 64u) {
            out[base + i] = (x[base + i] - mean) * inv * w[i] + b[i];
        }
    }
}
