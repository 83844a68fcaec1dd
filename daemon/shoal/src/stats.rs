//! Small numeric helpers shared by the calibrator and the benchmarks.

use anyhow::{bail, Result};

/// Split points for `k` stages of `n_layer` layers, as even as the period allows.
pub fn even_split(n_layer: u32, k: u32, period: u32) -> Result<Vec<u32>> {
    let mut points = Vec::new();
    for i in 1..k {
        let ideal = f64::from(i) * f64::from(n_layer) / f64::from(k) / f64::from(period);
        let p = (ideal.round() as u32) * period;
        if p == 0 || p >= n_layer || points.last().is_some_and(|&l| p <= l) {
            bail!("cannot split {n_layer} layers into {k} stages on a period of {period}");
        }
        points.push(p);
    }
    Ok(points)
}

/// The median of `v` (sorted in place); `v` must not be empty.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
