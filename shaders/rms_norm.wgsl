// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w, one workgroup per row.
struct Params {
    rows: u32,
    dim: u32,
    eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> part: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = wid.y * nwg.x + wid.x;
    if (r >= p.rows) {
        return;
    }
    let base = r * p.dim;
    var ss = 0.0;
    for (var i = lid.x; i < p.dim; i += 64u) {
        let v = x[base + i];
        ss = fma(v, v, ss);
    }
    part[lid.x] = ss;
    workgroupBarrier();
    // NOTE: every thread sums the 64 partials itself, in the same order: one barrier, no tree.
    var total = 0.0;
    for (var j = 0u; j < 64u; j++) {
        total += part[j];
    }
    let inv = 1.0 / sqrt(total / f32(p.dim) + p.eps);
    for (var i = lid.x; i < p.dim; i += 64u) {
        out[base + i] = x[base + i] * inv * w[i];
    }
}
