//! What tensor parallelism's all-reduce costs on the CPU: `LocalComm::all_reduce_sum` of
//! `[T, hidden]` activations across N worker threads (the in-process communicator, staged
//! through host memory), at the sizes a step of SmolLM2-135M (hidden 576) sends, twice per
//! layer.
//!
//!     cargo bench --bench allreduce               # 2 and 3 ranks, T = 1, 16, 64, 512
//!     cargo bench --bench allreduce -- 3 64       # ranks, then rows
//!
//! Prints the median time of one all-reduce per (ranks, rows), and per SmolLM2 step
//! (30 layers × 2 all-reduces + the embedding's one), as JSON lines.

use pagoda::backend::{Backend, CpuBackend};
use pagoda::parallel::{Communicator, LocalGroup};
use std::time::Instant;

const HIDDEN: usize = 576;
const PER_STEP: usize = 30 * 2 + 1;

fn median_us(ranks: usize, rows: usize, iters: usize) -> f64 {
    let be = CpuBackend::new();
    let comms = LocalGroup::new(ranks);
    let n = rows * HIDDEN;
    let times: Vec<Vec<f64>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                let be = &be;
                s.spawn(move || {
                    let data: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 0.01).collect();
                    let mut buf = be.upload_f32(&data).unwrap();
                    let mut t = Vec::with_capacity(iters);
                    for _ in 0..iters {
                        Communicator::<CpuBackend>::barrier(c).unwrap();
                        let t0 = Instant::now();
                        c.all_reduce_sum(be, &mut buf, n).unwrap();
                        t.push(t0.elapsed().as_secs_f64() * 1e6);
                    }
                    t
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // NOTE: a collective ends when its slowest rank is done: the max over ranks per round.
    let mut per_round: Vec<f64> = (0..iters)
        .map(|i| times.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect();
    per_round.sort_by(f64::total_cmp);
    per_round[iters / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (ranks, rows): (Vec<usize>, Vec<usize>) = match args.split_first() {
        Some((&r, rest)) if !rest.is_empty() => (vec![r], rest.to_vec()),
        Some((&r, _)) => (vec![r], vec![1, 16, 64, 512]),
        None => (vec![2, 3], vec![1, 16, 64, 512]),
    };
    for &n in &ranks {
        for &t in &rows {
            let us = median_us(n, t, if t >= 512 { 50 } else { 300 });
            println!(
                "{{\"ranks\": {n}, \"rows\": {t}, \"bytes\": {}, \"all_reduce_us\": {us:.1}, \"per_step_ms\": {:.2}}}",
                t * HIDDEN * 4,
                us * PER_STEP as f64 / 1e3
            );
        }
    }
}
