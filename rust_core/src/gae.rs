//! Generalised advantage estimation over ragged trajectories (paper Eq. GAE):
//! `delta_t = r_t + gamma * (1 - done_t) * V(s_{t+1}) - V(s_t)`,
//! `A_t = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}`, restarting at
//! each trajectory (`A` after its last step is 0). `r_t` is the environment
//! reward; the ablation "GAE with r_env + r_aux" passes `reward_aux`.
use crate::error::{check_len, CoreError, Result};
use crate::ragged::check_offsets;
use crate::weights::split_by_offsets;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug)]
pub struct GaeInput<'a> {
    pub offsets: &'a [i64],
    pub reward: &'a [f32],
    /// Optional auxiliary reward added to `reward` (ablation).
    pub reward_aux: Option<&'a [f32]>,
    pub value: &'a [f32],
    pub next_value: &'a [f32],
    pub done: &'a [bool],
    pub gamma: f64,
    pub lambda: f64,
}

/// Advantages for every row (f32, accumulated in f64).
pub fn gae(inp: GaeInput<'_>) -> Result<Vec<f32>> {
    let n = inp.reward.len();
    check_offsets(inp.offsets, n)?;
    check_len("value", n, inp.value.len())?;
    check_len("next_value", n, inp.next_value.len())?;
    check_len("done", n, inp.done.len())?;
    if let Some(aux) = inp.reward_aux {
        check_len("reward_aux", n, aux.len())?;
    }
    for (what, x) in [("gamma", inp.gamma), ("lambda", inp.lambda)] {
        if !(0.0..=1.0).contains(&x) {
            return Err(CoreError::Value { what: what.into(), problem: format!("must be in [0, 1], got {x}") });
        }
    }
    let mut out = vec![0f32; n];
    let chunks = split_by_offsets(&mut out, inp.offsets);
    chunks
        .into_par_iter()
        .zip(inp.offsets.par_windows(2))
        .for_each(|(chunk, w)| {
            let start = w[0] as usize;
            let mut next_adv = 0f64;
            for k in (0..chunk.len()).rev() {
                let i = start + k;
                let not_done = if inp.done[i] { 0.0 } else { 1.0 };
                let mut r = inp.reward[i] as f64;
                if let Some(aux) = inp.reward_aux {
                    r += aux[i] as f64;
                }
                let delta = r + inp.gamma * not_done * inp.next_value[i] as f64 - inp.value[i] as f64;
                next_adv = delta + inp.gamma * inp.lambda * not_done * next_adv;
                chunk[k] = next_adv as f32;
            }
        });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(offsets: &[i64], r: &[f32], v: &[f32], nv: &[f32], d: &[bool], g: f64, l: f64) -> Vec<f32> {
        gae(GaeInput { offsets, reward: r, reward_aux: None, value: v, next_value: nv, done: d, gamma: g, lambda: l }).unwrap()
    }

    #[test]
    fn hand_computed_two_steps() {
        // gamma = lambda = 0.5, one trajectory of 2 steps ending in success.
        // delta_1 = 1 + 0 - 0.5 = 0.5 ; A_1 = 0.5
        // delta_0 = 0 + 0.5*0.5 - 0.25 = 0 ; A_0 = 0 + 0.25*0.5 = 0.125
        let a = run(&[0, 2], &[0.0, 1.0], &[0.25, 0.5], &[0.5, 9.0], &[false, true], 0.5, 0.5);
        assert_eq!(a, vec![0.125, 0.5]);
    }

    #[test]
    fn restarts_per_trajectory() {
        let a = run(&[0, 1, 2], &[1.0, 0.0], &[0.0, 0.0], &[0.0, 0.0], &[true, true], 0.9, 0.9);
        assert_eq!(a, vec![1.0, 0.0]);
    }

    #[test]
    fn truncated_bootstraps() {
        // Not done at the end: bootstrap from next_value.
        let a = run(&[0, 1], &[0.0], &[0.0], &[2.0], &[false], 0.5, 1.0);
        assert_eq!(a, vec![1.0]);
    }

    #[test]
    fn aux_included_by_switch() {
        let aux = [-0.5f32];
        let a = gae(GaeInput { offsets: &[0, 1], reward: &[1.0], reward_aux: Some(&aux), value: &[0.0], next_value: &[0.0], done: &[true], gamma: 0.9, lambda: 0.9 }).unwrap();
        assert_eq!(a, vec![0.5]);
    }

    #[test]
    fn bad_gamma() {
        let e = gae(GaeInput { offsets: &[0, 1], reward: &[1.0], reward_aux: None, value: &[0.0], next_value: &[0.0], done: &[true], gamma: 1.5, lambda: 0.9 });
        assert!(e.is_err());
    }
}
