//! Step weights of the weighted IQL critic (paper Eq. "step weight"):
//! `w_t = (t/T + d) * 0.5 + 0.5`, `t = 1..T`, `d = 1` when the trajectory ends
//! with a non-zero episodic reward. Switches drop either term (ablations
//! "W-IQL w/o temporal term" and "w/o success term").
use crate::error::{check_len, Result};
use crate::ragged::check_offsets;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WeightOptions {
    /// Keep the temporal term t/T.
    pub temporal: bool,
    /// Keep the success term d.
    pub success: bool,
}

impl Default for WeightOptions {
    fn default() -> Self {
        WeightOptions { temporal: true, success: true }
    }
}

/// Whether each trajectory ends with non-zero episodic reward: the sum of its
/// environment rewards is non-zero. One value per trajectory.
pub fn trajectory_success(offsets: &[i64], reward_env: &[f32]) -> Result<Vec<bool>> {
    check_offsets(offsets, reward_env.len())?;
    Ok(offsets
        .par_windows(2)
        .map(|w| {
            let s: f64 = reward_env[w[0] as usize..w[1] as usize].iter().map(|&r| r as f64).sum();
            s != 0.0
        })
        .collect())
}

/// Step weights for every row. `success` has one entry per trajectory.
pub fn step_weights(offsets: &[i64], success: &[bool], n_rows: usize, opts: WeightOptions) -> Result<Vec<f32>> {
    check_offsets(offsets, n_rows)?;
    check_len("success", offsets.len() - 1, success.len())?;
    let mut out = vec![0f32; n_rows];
    let chunks = split_by_offsets(&mut out, offsets);
    chunks.into_par_iter().zip(success.par_iter()).for_each(|(chunk, &d)| {
        let t_len = chunk.len() as f64;
        let d = if opts.success && d { 1.0 } else { 0.0 };
        for (i, w) in chunk.iter_mut().enumerate() {
            let temporal = if opts.temporal { (i as f64 + 1.0) / t_len } else { 0.0 };
            *w = ((temporal + d) * 0.5 + 0.5) as f32;
        }
    });
    Ok(out)
}

/// Split a mutable row buffer into one slice per trajectory.
pub(crate) fn split_by_offsets<'a, T>(mut buf: &'a mut [T], offsets: &[i64]) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(offsets.len().saturating_sub(1));
    for w in offsets.windows(2) {
        let (head, tail) = buf.split_at_mut((w[1] - w[0]) as usize);
        out.push(head);
        buf = tail;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed() {
        // T = 2 success, T = 1 failure.
        let w = step_weights(&[0, 2, 3], &[true, false], 3, WeightOptions::default()).unwrap();
        assert_eq!(w, vec![(0.5 + 1.0) * 0.5 + 0.5, (1.0 + 1.0) * 0.5 + 0.5, 1.0 * 0.5 + 0.5]);
        let w = step_weights(&[0, 2], &[true], 2, WeightOptions { temporal: false, success: true }).unwrap();
        assert_eq!(w, vec![1.0, 1.0]);
        let w = step_weights(&[0, 4], &[true], 4, WeightOptions { temporal: true, success: false }).unwrap();
        assert_eq!(w, vec![0.625, 0.75, 0.875, 1.0]);
    }

    #[test]
    fn success_from_rewards() {
        let s = trajectory_success(&[0, 2, 4, 4], &[0.0, 1.0, 0.0, 0.0]).unwrap();
        assert_eq!(s, vec![true, false, false]);
    }

    #[test]
    fn length_errors() {
        assert!(step_weights(&[0, 2], &[true, false], 2, WeightOptions::default()).is_err());
        assert!(step_weights(&[0, 3], &[true], 2, WeightOptions::default()).is_err());
    }
}
