// out[r, i] = silu(gate_up[r, i]) * gate_up[r, ffn + i]: the gate and up projections fused.
struct Params {
    rows: u32,
    ffn: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> gu: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = (wid.y * nwg.x + wid.x) * 64u + lid.x;
    if (i >= p.rows * p.ffn) {
        return;
    }
    let r = i / p.ffn;
    let c = i % p.ffn;
    let g = gu[r * 2u * p.ffn + c];
    let u = gu[r * 2u * p.ffn + p.ffn + c];
    out[i] = g / (1.0 + exp(-g)) * u;
}
