// Paged attention: each query row attends keys 0 ..= its position in its sequence (the last
// `window` of them with a sliding window), read through the sequence's block table; decode rows and prefill chunks (causal) alike. Grouped-query: a
// workgroup takes one row, one kv head g and `hpw` of the query heads that share it, so each K and
// V row is loaded once for all of them.
//
// Keys go by in tiles of 64 with an online softmax (running max m, sum l, unnormalised acc):
//   1. thread j scores key j0 + j against every head            -> sc[head][j]
//   2. every thread takes the tile max per head; thread j turns its score into a weight
//      exp(s - m_new)                                          -> ps[head][j]
//   3. thread d rescales its acc[head][d] and adds sum_j ps[head][j] * V[j][d]
//
// A pool larger than one storage binding is split by blocks into parts; the kernel then runs once
// per part, each run skipping keys whose block is elsewhere and carrying (m, l, acc) in `state`.
struct Params {
    rows: u32,         // query rows in this window
    row0: u32,         // first row of the window in the batch
    num_seqs: u32,
    max_blocks: u32,   // block table stride
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    hpw: u32,          // query heads per workgroup
    blk0: u32,         // first block of the pool part bound here
    nblk: u32,         // blocks in that part
    mode: u32,         // bit 0: first part (fresh state); bit 1: last part (write out)
    scale: f32,
    window: u32,       // sliding window: a row sees its last `window` keys only; 0: all
    softcap: f32,      // scores become softcap * tanh(score / softcap); 0: unchanged
    // ALiBi (Alibi in src/backend/mod.rs): slope * (key - query position) added to a score,
    // the slope of the model's head g = alibi_h0 + h being 2^(alibi_l0 (g + 1)) below alibi_p,
    // else 2^(alibi_l0 / 2 (2 (g - alibi_p) + 1)), times alibi_scale (0: no ALiBi)
    alibi_scale: f32,
    alibi_l0: f32,
    alibi_p: u32,
    alibi_h0: u32,
}

fn alibi_slope(h: u32) -> f32 {
    let g = p.alibi_h0 + h;
    var e = 0.5 * p.alibi_l0 * f32(2u * (g - p.alibi_p) + 1u);
    if (g < p.alibi_p) {
        e = p.alibi_l0 * f32(g + 1u);
    }
    return p.alibi_scale * exp2(e);
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> query_start: array<u32>;
@group(0) @binding(3) var<storage, read> seq_lens: array<u32>;
@group(0) @binding(4) var<storage, read> block_tables: array<u32>;
@group(0) @binding(5) var<storage, read> kc: array<f32>;
@group(0) @binding(6) var<storage, read> vc: array<f32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;
@group(0) @binding(8) var<storage, read_write> state: array<f32>;

const TILE: u32 = 64u;
const NEG: f32 = -3.0e38;    // below any score; marks keys that are not in this part
const NONE: u32 = 0xffffffffu;
const MAXH: u32 = 16u;       // hpw <= 16
const MAXA: u32 = 32u;       // hpw * ceil(D / 64) <= 32

var<workgroup> qs: array<f32, 1024>;   // [hpw][D], hpw * D <= 1024
var<workgroup> sc: array<f32, 1024>;   // [hpw][TILE]
var<workgroup> ps: array<f32, 1024>;   // [hpw][TILE]
var<workgroup> kb: array<u32, 64>;     // element offset of each key of the tile, or NONE
var<workgroup> wg_keys: u32;
var<workgroup> wg_seq: u32;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let t = wid.x;
    let g = wid.y;
    let d_h = p.head_dim;
    let rep = p.num_heads / p.num_kv_heads;
    let h0 = g * rep + wid.z * p.hpw;               // first query head of this workgroup
    let nh = min(p.hpw, rep - wid.z * p.hpw);
    let dc = (d_h + 63u) / 64u;                     // dims per thread
    let stride = (p.num_heads + 2u * p.num_kv_heads) * d_h;
    let tg = p.row0 + t;

    if (lid.x == 0u) {
        // the sequence of this row: query_start[s] <= tg < query_start[s + 1]
        var lo = 0u;
        var hi = p.num_seqs;
        while (hi - lo > 1u) {
            let mid = (lo + hi) / 2u;
            if (query_start[mid] <= tg) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        wg_seq = lo;
        // the last row of the sequence sits at position seq_len - 1
        wg_keys = seq_lens[lo] - (query_start[lo + 1u] - 1u - tg);
    }
    let n_keys = workgroupUniformLoad(&wg_keys);
    let s = wg_seq;
    var k_first = 0u;
    if (p.window > 0u && n_keys > p.window) {
        k_first = n_keys - p.window;
    }

    for (var i = lid.x; i < nh * d_h; i += 64u) {
        qs[i] = qkv[t * stride + h0 * d_h + i];
    }

    var m: array<f32, MAXH>;
    var l: array<f32, MAXH>;
    var corr: array<f32, MAXH>;
    var acc: array<f32, MAXA>;
    for (var hh = 0u; hh < nh; hh++) {
        let sbase = (t * p.num_heads + h0 + hh) * (d_h + 2u);
        if ((p.mode & 1u) != 0u) {
            m[hh] = NEG;
            l[hh] = 0.0;
        } else {
            m[hh] = state[sbase + d_h];
            l[hh] = state[sbase + d_h + 1u];
            for (var c = 0u; c < dc; c++) {
                let d = lid.x + 64u * c;
                if (d < d_h) {
                    acc[hh * dc + c] = state[sbase + d];
                }
            }
        }
    }
    workgroupBarrier();

    for (var j0 = k_first; j0 < n_keys; j0 += TILE) {
        // 1. scores
        let j = j0 + lid.x;
        var base = NONE;
        if (j < n_keys) {
            let blk = block_tables[s * p.max_blocks + j / p.block_size];
            if (blk >= p.blk0 && blk - p.blk0 < p.nblk) {
                base = (((blk - p.blk0) * p.num_kv_heads + g) * p.block_size + j % p.block_size) * d_h;
            }
        }
        kb[lid.x] = base;
        for (var hh = 0u; hh < nh; hh++) {
            var score = NEG;
            if (base != NONE) {
                var dot = 0.0;
                for (var d = 0u; d < d_h; d++) {
                    dot = fma(qs[hh * d_h + d], kc[base + d], dot);
                }
                score = dot * p.scale;
                if (p.softcap > 0.0) {
                    let e = exp(-2.0 * abs(score / p.softcap));
                    score = p.softcap * sign(score) * (1.0 - e) / (1.0 + e);
                }
                if (p.alibi_scale != 0.0) {
                    score += alibi_slope(h0 + hh) * (f32(j) - f32(n_keys - 1u));
                }
            }
            sc[hh * TILE + lid.x] = score;
        }
        workgroupBarrier();
        // 2. weights
        for (var hh = 0u; hh < nh; hh++) {
            var tmax = NEG;
            for (var jj = 0u; jj < TILE; jj++) {
                tmax = max(tmax, sc[hh * TILE + jj]);
            }
            let m_new = max(m[hh], tmax);
            let sj = sc[hh * TILE + lid.x];
            ps[hh * TILE + lid.x] = select(0.0, exp(sj - m_new), sj > NEG);
            corr[hh] = exp(m[hh] - m_new);
            m[hh] = m_new;
        }
        workgroupBarrier();
        // 3. values
        let tile_n = min(TILE, n_keys - j0);
        for (var hh = 0u; hh < nh; hh++) {
            var lsum = 0.0;
            for (var jj = 0u; jj < tile_n; jj++) {
                lsum += ps[hh * TILE + jj];
            }
            l[hh] = l[hh] * corr[hh] + lsum;
            for (var c = 0u; c < dc; c++) {
                let d = lid.x + 64u * c;
                if (d < d_h) {
                    var a = acc[hh * dc + c] * corr[hh];
                    for (var jj = 0u; jj < tile_n; jj++) {
                        let b = kb[jj];
                        if (b != NONE) {
                            a = fma(ps[hh * TILE + jj], vc[b + d], a);
                        }
                    }
                    acc[hh * dc + c] = a;
                }
            }
        }
        workgroupBarrier();
    }

    for (var hh = 0u; hh < nh; hh++) {
        let h = h0 + hh;
        if ((p.mode & 2u) != 0u) {
            let inv = 1.0 / l[hh];
            for (var c = 0u; c < dc; c++) {
                let d = lid.x + 64u * c;
                if (d < d_h) {
                    out[(t * p.num_heads + h) * d_h + d] = acc[hh * dc + c] * inv;
                }
            }
        } else {
            let sbase = (t * p.num_heads + h) * (d_h + 2u);
            for (var c = 0u; c < dc; c++) {
                let d = lid.x + 64u * c;
                if (d < d_h) {
                    state[sbase + d] = acc[hh * dc + c];
                }
            }
            if (lid.x == 0u) {
                state[sbase + d_h] = m[hh];
                state[sbase + d_h + 1u] = l[hh];
            }
        }
    }
}
