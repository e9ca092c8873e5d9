// LoRA's expand for one adapter's rows: out[idx[e], c] += wt[e] · Σ_j mid[e, j] · B[c, j]
// B: [n, rank] (w). The rows idx are distinct (checked on the host), so no two invocations
// write one element; each sums over the rank in ascending order with fma.
struct Params {
    rows: u32,
    n: u32,
    rank: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> mid: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<WType>;
@group(0) @binding(3) var<storage, read> idx: array<u32>;
@group(0) @binding(4) var<storage, read> wt: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = (wid.y * nwg.x + wid.x) * 64u + lid.x;
    if (i >= p.rows * p.n) {
        return;
    }
    let e = i / p.n;
    let c = i % p.n;
    var s = 0.0;
    for (var j = 0u; j < p.rank; j++) {
        s = fma(mid[e * p.rank + j], load_w(c * p.rank + j), s);
    }
    let o = idx[e] * p.n + c;
    out[o] = out[o] + wt[e] * s;
}
