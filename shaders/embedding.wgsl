// out[t, :] = w[ids[row0 + t] - vocab0, :] for the ids that fall in this chunk of the table
// (a table larger than one storage binding is split by rows, one dispatch per chunk).
struct Params {
    rows: u32,
    dim: u32,
    row0: u32,
    vocab0: u32,  // first table row of this chunk
    vocab_n: u32, // table rows in this chunk
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read> w: array<WType>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = (wid.y * nwg.x + wid.x) * 64u + lid.x;
    if (i >= p.rows * p.dim) {
        return;
    }
    let t = i / p.dim;
    let d = i % p.dim;
    let id = ids[p.row0 + t];
    if (id >= p.vocab0 && id - p.vocab0 < p.vocab_n) {
        out[i] = load_w((id - p.vocab0) * p.dim + d);
    }
}
