// out[idx[r], :] += w[r] * y[r, :]. The rows idx are distinct (checked on the host), so no two
// invocations write one element.
struct Params {
    rows: u32,
    dim: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read> idx: array<u32>;
@group(0) @binding(3) var<storage, read> w: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = (wid.y * nwg.x + wid.x) * 64u + lid.x;
    if (i >= p.rows * p.dim) {
        return;
    }
    let r = i / p.dim;
    let d = i % p.dim;
    let o = idx[r] * p.dim + d;
    out[o] = out[o] + w[r] * y[i];
}
