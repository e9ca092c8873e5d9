// LoRA's shrink for one adapter's rows: mid[e, j] = x[idx[e], :] · A[j, :]   A: [rank, k] (w)
// One invocation per output, summed over k in ascending order with fma: a row's values do not
// depend on the other rows.
struct Params {
    rows: u32,
    k: u32,
    rank: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<WType>;
@group(0) @binding(3) var<storage, read> idx: array<u32>;
@group(0) @binding(4) var<storage, read_write> mid: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = (wid.y * nwg.x + wid.x) * 64u + lid.x;
    if (i >= p.rows * p.rank) {
        return;
    }
    let e = i / p.rank;
    let j = i % p.rank;
    let x0 = idx[e] * p.k;
    var s = 0.0;
    for (var l = 0u; l < p.k; l++) {
        s = fma(x[x0 + l], load_w(j * p.k + l), s);
    }
    mid[i] = s;
}
