//! Summary statistics: mean and percentiles (linear interpolation between closest ranks, as
//! numpy's default), in whatever unit the caller measured.

use serde::{Deserialize, Serialize};

/// The `p`-th percentile (0 ..= 100) of sorted data, interpolating linearly between the two
/// closest ranks: rank `p/100 · (n − 1)`. 0 for no data.
///
/// ```text
///   sorted:  x0   x1   x2   x3        p = 50, n = 4: rank 1.5
///                  └──┬──┘            → x1 + 0.5·(x2 − x1)
/// ```
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (rank - lo as f64) * (sorted[hi] - sorted[lo])
}

pub fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Count, mean, extremes and the percentiles a latency table shows. All zero for no data.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Summary {
    pub count: usize,
    pub mean: f64,
    pub min: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    /// Summarises values in any order; NaNs are ignored.
    pub fn of(values: &[f64]) -> Summary {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return Summary::default();
        }
        v.sort_by(f64::total_cmp);
        Summary {
            count: v.len(),
            mean: mean(&v),
            min: v[0],
            p50: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p95: percentile(&v, 95.0),
            p99: percentile(&v, 99.0),
            max: v[v.len() - 1],
        }
    }

    /// The same summary with every figure multiplied by `k` (seconds to milliseconds, say).
    pub fn scaled(self, k: f64) -> Summary {
        Summary {
            count: self.count,
            mean: self.mean * k,
            min: self.min * k,
            p50: self.p50 * k,
            p90: self.p90 * k,
            p95: self.p95 * k,
            p99: self.p99 * k,
            max: self.max * k,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn percentiles_of_one_to_a_hundred() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        // numpy.percentile(range(1, 101), [0, 50, 90, 95, 99, 100])
        assert!(close(percentile(&v, 0.0), 1.0));
        assert!(close(percentile(&v, 50.0), 50.5));
        assert!(close(percentile(&v, 90.0), 90.1));
        assert!(close(percentile(&v, 95.0), 95.05));
        assert!(close(percentile(&v, 99.0), 99.01));
        assert!(close(percentile(&v, 100.0), 100.0));
    }

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v = [10.0, 20.0, 30.0, 40.0];
        assert!(close(percentile(&v, 50.0), 25.0));
        assert!(close(percentile(&v, 25.0), 17.5));
        assert!(close(percentile(&v, 75.0), 32.5));
        assert!(close(percentile(&[7.0], 99.0), 7.0));
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn summary_sorts_ignores_nan_and_scales() {
        let s = Summary::of(&[3.0, f64::NAN, 1.0, 2.0, 4.0, 5.0]);
        assert_eq!(s.count, 5);
        assert!(close(s.mean, 3.0) && close(s.p50, 3.0));
        assert!(close(s.min, 1.0) && close(s.max, 5.0));
        assert!(close(s.p90, 4.6) && close(s.p99, 4.96));
        let ms = s.scaled(1000.0);
        assert!(close(ms.p50, 3000.0) && ms.count == 5);
        assert_eq!(Summary::of(&[]), Summary::default());
    }
}
