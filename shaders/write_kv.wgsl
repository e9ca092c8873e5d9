// Writes each row's K and V (from fused QKV rows) at its slot of the paged caches, for the
// blocks of one part of the pool (a pool larger than one storage binding is split by blocks).
//
//   slot = block * block_size + offset
//   cache part [blocks, Hkv, block_size, D]: element ((block - blk0) * Hkv + g) * block_size + offset) * D + d
struct Params {
    rows: u32,
    row0: u32,
    num_kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    stride: u32,   // elements per QKV row
    k_off: u32,    // where k starts in a QKV row (H x D)
    blk0: u32,     // first block of this part
    nblk: u32,     // blocks in this part
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> slots: array<u32>;
@group(0) @binding(3) var<storage, read_write> kc: array<f32>;
@group(0) @binding(4) var<storage, read_write> vc: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let kv_len = p.num_kv_heads * p.head_dim;
    let i = (wid.y * nwg.x + wid.x) * 64u + lid.x;
    if (i >= p.rows * kv_len) {
        return;
    }
    let t = i / kv_len;
    let e = i % kv_len; // g * D + d
    let g = e / p.head_dim;
    let d = e % p.head_dim;
    let slot = slots[p.row0 + t];
    let block = slot / p.block_size;
    if (block < p.blk0 || block - p.blk0 >= p.nblk) {
        return;
    }
    let dst = (((block - p.blk0) * p.num_kv_heads + g) * p.block_size + slot % p.block_size) * p.head_dim + d;
    let src = t * p.stride + p.k_off + e;
    kc[dst] = qkv[src];
    vc[dst] = qkv[src + kv_len];
}
