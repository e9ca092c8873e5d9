// out[r] = index of the largest value of row r (ties: the lowest index; NaN never wins; a row
// with no value above -inf gives 0), one workgroup per row.
struct Params {
    rows: u32,
    cols: u32,
    neg_inf: f32, // -inf, passed in: WGSL has no infinity literal
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

var<workgroup> best_v: array<f32, 64>;
var<workgroup> best_i: array<u32, 64>;

const NONE: u32 = 0xffffffffu;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = wid.y * nwg.x + wid.x;
    if (r >= p.rows) {
        return;
    }
    var bv = p.neg_inf;
    var bi = NONE;
    for (var j = lid.x; j < p.cols; j += 64u) {
        let v = x[r * p.cols + j];
        if (v > bv) {
            bv = v;
            bi = j;
        }
    }
    best_v[lid.x] = bv;
    best_i[lid.x] = bi;
    workgroupBarrier();
    if (lid.x == 0u) {
        for (var j = 1u; j < 64u; j++) {
            let v = best_v[j];
            let i = best_i[j];
            if (i != NONE && (v > bv || (v == bv && i < bi))) {
                bv = v;
                bi = i;
            }
        }
        out[r] = select(bi, 0u, bi == NONE);
    }
}
