// out[r, col0 + c] = sum_k x[r, k] * w[c, k] (+ bias[col0 + c]) over one row chunk of a weight
// (a weight larger than one storage binding is split by rows and dispatched chunk by chunk).
//
// A workgroup computes a tile of BM = WG_Y*TM rows of x by BN = WG_X*TN rows of w; each thread
// owns TM x TN outputs, strided by the workgroup size. Both operands are staged BK values of k
// at a time in workgroup memory, k-major:
//
//            k0 .. k0+BK                      thread (tx, ty) owns rows ty + WG_Y*i and
//   xs  [BK][BM]  (x tile, transposed)        columns tx + WG_X*j, i < TM, j < TN
//   ws  [BK][BN]  (w tile, transposed)
//
// The tile shape is set by override constants: 8x8 threads of 8x8 outputs (a 64x64 tile) for
// prefill, 64x1 threads of MRx1 outputs for decode (MR = 1, 2, 4 or 8 rows; the weight tile is
// still read once, coalesced). Every output is accumulated by one thread, in ascending k, with
// fma, whatever the tile shape: a row's result does not depend on how many rows share the step.
override WG_X: u32 = 8u;
override WG_Y: u32 = 8u;
override TM: u32 = 8u;
override TN: u32 = 8u;
const BK: u32 = 16u;
const S: u32 = 65u; // tile stride: 64 + 1 keeps the transposed stores free of bank conflicts

struct Params {
    m: u32,        // rows of x in this window
    k: u32,
    n: u32,        // rows of w in this chunk
    ldo: u32,      // row stride of out (all columns of the weight)
    col0: u32,     // first output column of this chunk
    has_bias: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<WType>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

var<workgroup> xs: array<f32, 1040>; // BK * S
var<workgroup> ws: array<f32, 1040>;

@compute @workgroup_size(WG_X, WG_Y)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let bm = WG_Y * TM;
    let bn = WG_X * TN;
    let nt = WG_X * WG_Y;
    let tid = lid.y * WG_X + lid.x;
    let row0 = wid.y * bm;
    let colb = wid.x * bn;
    var acc: array<f32, 64>;
    var b: array<f32, 8>;
    for (var k0 = 0u; k0 < p.k; k0 += BK) {
        for (var idx = tid; idx < bm * BK; idx += nt) {
            let r = idx / BK;
            let c = idx % BK;
            let gr = row0 + r;
            let gk = k0 + c;
            var v = 0.0;
            if (gr < p.m && gk < p.k) {
                v = x[gr * p.k + gk];
            }
            xs[c * S + r] = v;
        }
        for (var idx = tid; idx < bn * BK; idx += nt) {
            let r = idx / BK;
            let c = idx % BK;
            let gn = colb + r;
            let gk = k0 + c;
            var v = 0.0;
            if (gn < p.n && gk < p.k) {
                v = load_w(gn * p.k + gk);
            }
            ws[c * S + r] = v;
        }
        workgroupBarrier();
        let kend = min(BK, p.k - k0);
        for (var kk = 0u; kk < kend; kk++) {
            for (var j = 0u; j < TN; j++) {
                b[j] = ws[kk * S + lid.x + WG_X * j];
            }
            for (var i = 0u; i < TM; i++) {
                let a = xs[kk * S + lid.y + WG_Y * i];
                for (var j = 0u; j < TN; j++) {
                    acc[i * TN + j] = fma(a, b[j], acc[i * TN + j]);
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < TM; i++) {
        let r = row0 + lid.y + WG_Y * i;
        for (var j = 0u; j < TN; j++) {
            let c = colb + lid.x + WG_X * j;
            if (r < p.m && c < p.n) {
                var v = acc[i * TN + j];
                if (p.has_bias != 0u) {
                    v += bias[p.col0 + c];
                }
                out[r * p.ldo + p.col0 + c] = v;
            }
        }
    }
}
