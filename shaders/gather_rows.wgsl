// out[i, :] = x[rows[row0 + i], :].
struct Params {
    rows: u32,
    dim: u32,
    row0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> idx: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = (wid.y * nwg.x + wid.x) * 64u + lid.x;
    if (i >= p.rows * p.dim) {
        return;
    }
    let r = i / p.dim;
    let d = i % p.dim;
    out[i] = x[idx[p.row0 + r] * p.dim + d];
}
