// out[r, col0 + c] = sum_k x[r, k] * w[c, k] (+ bias[col0 + c]) for up to 8 rows of x (decode),
// on software rasterisers: there a load costs a loop over the SIMD lanes whether it goes through
// workgroup memory or not, so each thread reads its TN weight rows straight from the buffer, once,
// and feeds each value to all MR rows; no workgroup memory, no barriers.
//
// Each output is accumulated by one thread in ascending k with fma, as in matmul.wgsl: the same
// bits as the tiled kernel gives the row in a larger step.
override MR: u32 = 1u; // rows of x, 1 ..= 8
override TN: u32 = 8u; // consecutive output columns per thread, MR * TN <= 64

struct Params {
    m: u32,
    k: u32,
    n: u32,
    ldo: u32,
    col0: u32,
    has_bias: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<WType>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let c0 = ((wid.y * nwg.x + wid.x) * 64u + lid.x) * TN;
    if (c0 >= p.n) {
        return;
    }
    var acc: array<f32, 64>;
    var xr: array<f32, 8>;
    for (var k = 0u; k < p.k; k++) {
        for (var r = 0u; r < MR; r++) {
            xr[r] = x[min(r, p.m - 1u) * p.k + k];
        }
        for (var j = 0u; j < TN; j++) {
            // columns past the end read the last one; their sums are never written
            let wv = load_w(min(c0 + j, p.n - 1u) * p.k + k);
            for (var r = 0u; r < MR; r++) {
                acc[r * TN + j] = fma(xr[r], wv, acc[r * TN + j]);
            }
        }
    }
    for (var r = 0u; r < MR; r++) {
        for (var j = 0u; j < TN; j++) {
            let c = c0 + j;
            if (r < p.m && c < p.n) {
                var v = acc[r * TN + j];
                if (p.has_bias != 0u) {
                    v += bias[p.col0 + c];
                }
                out[r * p.ldo + p.col0 + c] = v;
            }
        }
    }
}
