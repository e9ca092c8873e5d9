//! The memory read bandwidth the CPU kernels can hope for: a streaming read of a buffer far
//! larger than the caches, split over the same threads as the kernels (rayon's pool), the
//! roofline for batch-1 decode, which reads every weight once per token.
//!
//!     cargo bench --bench bandwidth                 # 1 GiB, every thread
//!     RAYON_NUM_THREADS=1 cargo bench --bench bandwidth -- 512   # MiB, one thread
//!
//! Prints the median and best GB/s of 15 passes, and a JSON line last.

use rayon::prelude::*;
use std::time::Instant;

/// A sum of the words of `chunk` in 8 independent lanes (the compiler vectorizes it; the
/// sum keeps the reads from being optimised away).
fn read(chunk: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    for w in chunk.chunks_exact(8) {
        for (a, &v) in acc.iter_mut().zip(w) {
            *a = a.wrapping_add(v);
        }
    }
    acc.iter().fold(0, |s, &a| s.wrapping_add(a))
}

fn main() {
    let mib: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(1024);
    let words = mib << 17;
    let threads = rayon::current_num_threads();
    // Written once by the threads that will read it (first touch places the pages).
    let mut buf = vec![0u64; words];
    buf.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
        c.iter_mut()
            .enumerate()
            .for_each(|(j, v)| *v = (i ^ j) as u64)
    });
    let part = words.div_ceil(threads).next_multiple_of(8);
    let mut gbs: Vec<f64> = (0..15)
        .map(|_| {
            let t = Instant::now();
            let s: u64 = buf.par_chunks(part).map(read).sum();
            std::hint::black_box(s);
            (words * 8) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    gbs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let (median, best) = (gbs[gbs.len() / 2], gbs[gbs.len() - 1]);
    println!("read {mib} MiB on {threads} threads: median {median:.1} GB/s, best {best:.1} GB/s");
    println!(
        "{{\"threads\": {threads}, \"mib\": {mib}, \"median_gbs\": {median:.2}, \"best_gbs\": {best:.2}}}"
    );
}
