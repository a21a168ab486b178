//! GiGPO's critic-free step credit (Feng et al. 2025, "Group-in-Group Policy Optimization"; verl-agent's
//! `gigpo/core_gigpo.py`) over ragged trajectories.
//!
//! Trajectories carry an episode-group id (the self-play rollouts of one task in one iteration; a negative
//! id: the trajectory is in no group, its rows get no advantage and take no part in any statistic).
//!
//! * Episode advantage of trajectory i in group g: `A^E_i = (R_i - mean_g R) / (std_g R + eps)`, with
//!   `R_i` the sum of its rewards; `norm = Mean` divides by 1 instead (verl-agent's `mean_norm`).
//! * Anchor groups: the rows of one episode group whose observation strings are equal. The discounted
//!   return `G_t = sum_k gamma^k r_{t+k}` of each row is compared within its anchor group:
//!   `A^S_t = (G_t - mean_a G) / (std_a G + eps)`, 0 for an anchor group of one row.
//! * `A_t = A^E_i + omega * A^S_t`.
//!
//! Conventions follow verl-agent: `std` is the unbiased (n - 1) standard deviation (`torch.std`); a group of
//! one trajectory has mean 0 and std 1 (so `A^E = R_i`), an anchor group of one row mean `G_t` and std 1
//! (so `A^S = 0`). With `EpisodeStats::Steps` the episode mean and std are taken over the group's rows (each
//! row counts its trajectory's return, verl-agent's `compute_mean_std_cross_steps=True`) instead of over
//! its trajectories (the paper's Eq. 3).
use crate::error::{check_len, CoreError, Result};
use crate::ragged::check_offsets;
use crate::StrColumn;
use ahash::AHashMap;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    /// (x - mean) / (std + eps): verl-agent's `mean_std_norm`
    Std,
    /// x - mean: verl-agent's `mean_norm`
    Mean,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EpisodeStats {
    /// mean and std over the group's trajectories (the paper's Eq. 3)
    Trajectories,
    /// over the group's rows, each counting its trajectory's return (verl-agent's default)
    Steps,
}

pub struct GigpoInput<'a, S: StrColumn + ?Sized> {
    pub offsets: &'a [i64],
    /// one per trajectory: its episode group, or < 0 for none
    pub group: &'a [i64],
    /// one per row: the environment reward r_env
    pub reward: &'a [f32],
    /// one per row: the observation the action was taken in (the anchor state's key)
    pub observation: &'a S,
    pub gamma: f64,
    pub omega: f64,
    pub eps: f64,
    pub norm: Norm,
    pub episode_stats: EpisodeStats,
}

/// Per row: the advantage and its two terms (0 outside any group), and the size of the row's anchor group
/// (0 outside any group: the rows without an advantage).
#[derive(Debug, Default, PartialEq)]
pub struct GigpoOutput {
    pub advantage: Vec<f32>,
    pub episode: Vec<f32>,
    pub step: Vec<f32>,
    pub anchor_size: Vec<u32>,
}

/// (mean, std) with verl-agent's convention for one value: (`single_mean`, 1).
fn moments(xs: impl Iterator<Item = f64> + Clone, single_mean: impl FnOnce(f64) -> f64) -> (f64, f64) {
    let (mut n, mut sum) = (0usize, 0f64);
    for x in xs.clone() {
        n += 1;
        sum += x;
    }
    if n <= 1 {
        return (single_mean(sum), 1.0);
    }
    let mean = sum / n as f64;
    let ss: f64 = xs.map(|x| (x - mean) * (x - mean)).sum();
    (mean, (ss / (n - 1) as f64).sqrt())
}

fn scale(x: f64, mean: f64, std: f64, norm: Norm, eps: f64) -> f64 {
    match norm {
        Norm::Std => (x - mean) / (std + eps),
        Norm::Mean => x - mean,
    }
}

pub fn gigpo<S: StrColumn + ?Sized>(inp: &GigpoInput<'_, S>) -> Result<GigpoOutput> {
    let n = inp.reward.len();
    check_offsets(inp.offsets, n)?;
    let n_traj = inp.offsets.len() - 1;
    check_len("group", n_traj, inp.group.len())?;
    check_len("observation", n, inp.observation.len())?;
    if !(0.0..=1.0).contains(&inp.gamma) {
        return Err(CoreError::Value { what: "gamma".into(), problem: format!("must be in [0, 1], got {}", inp.gamma) });
    }
    if !(inp.eps.is_finite() && inp.eps >= 0.0) {
        return Err(CoreError::Value { what: "eps".into(), problem: format!("must be finite and >= 0, got {}", inp.eps) });
    }
    if !inp.omega.is_finite() {
        return Err(CoreError::Value { what: "omega".into(), problem: format!("must be finite, got {}", inp.omega) });
    }
    if let Some(i) = inp.reward.iter().position(|r| !r.is_finite()) {
        return Err(CoreError::Value { what: "reward_env".into(), problem: format!("not finite at row {i}") });
    }
    // the trajectories of each group, in table order (a sort by group id, stable)
    let mut order: Vec<usize> = (0..n_traj).filter(|&t| inp.group[t] >= 0).collect();
    order.sort_by_key(|&t| inp.group[t]);
    let mut groups: Vec<&[usize]> = Vec::new();
    let mut s = 0;
    for e in 1..=order.len() {
        if e == order.len() || inp.group[order[e]] != inp.group[order[s]] {
            groups.push(&order[s..e]);
            s = e;
        }
    }
    let rows = |t: usize| inp.offsets[t] as usize..inp.offsets[t + 1] as usize;
    // per group: (row, A^E, A^S, anchor size) of each of its rows
    let parts: Vec<Vec<(usize, f64, f64, u32)>> = groups
        .par_iter()
        .map(|trajs| {
            let ret: Vec<f64> = trajs.iter().map(|&t| rows(t).map(|i| inp.reward[i] as f64).sum()).collect();
            let (mean_e, std_e) = match inp.episode_stats {
                EpisodeStats::Trajectories => moments(ret.iter().copied(), |_| 0.0),
                EpisodeStats::Steps => moments(
                    trajs.iter().zip(&ret).flat_map(|(&t, &r)| std::iter::repeat_n(r, rows(t).len())),
                    |_| 0.0,
                ),
            };
            let mut out: Vec<(usize, f64, f64, u32)> = Vec::new();
            let mut g_of: Vec<f64> = Vec::new(); // discounted return of each row of `out`
            let mut anchor: AHashMap<&str, Vec<usize>> = AHashMap::new(); // observation -> indices into out
            for (&t, &r) in trajs.iter().zip(&ret) {
                let a_e = scale(r, mean_e, std_e, inp.norm, inp.eps);
                let first = out.len();
                for i in rows(t) {
                    anchor.entry(inp.observation.get(i)).or_default().push(out.len());
                    out.push((i, a_e, 0.0, 0));
                    g_of.push(0.0);
                }
                let mut g = 0f64;
                for k in (first..out.len()).rev() {
                    g = inp.reward[out[k].0] as f64 + inp.gamma * g;
                    g_of[k] = g;
                }
            }
            for members in anchor.values() {
                let (mean_s, std_s) = moments(members.iter().map(|&k| g_of[k]), |g| g);
                for &k in members {
                    out[k].2 = scale(g_of[k], mean_s, std_s, inp.norm, inp.eps);
                    out[k].3 = members.len() as u32;
                }
            }
            out
        })
        .collect();
    let mut res = GigpoOutput {
        advantage: vec![0.0; n],
        episode: vec![0.0; n],
        step: vec![0.0; n],
        anchor_size: vec![0; n],
    };
    for part in parts {
        for (i, a_e, a_s, size) in part {
            res.advantage[i] = (a_e + inp.omega * a_s) as f32;
            res.episode[i] = a_e as f32;
            res.step[i] = a_s as f32;
            res.anchor_size[i] = size;
        }
    }
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(offsets: &[i64], group: &[i64], reward: &[f32], obs: &[&str], norm: Norm) -> GigpoOutput {
        gigpo(&GigpoInput {
            offsets,
            group,
            reward,
            observation: obs,
            gamma: 0.5,
            omega: 1.0,
            eps: 0.0,
            norm,
            episode_stats: EpisodeStats::Trajectories,
        })
        .unwrap()
    }

    #[test]
    fn two_trajectories_share_the_first_state() {
        // group 0: traj a (a0 -> a1, reward 1 at the end), traj b (one step, reward 0); both start in "s"
        // R = [1, 0]: mean 0.5, unbiased std sqrt(0.5); A^E = +-0.5 / sqrt(0.5) = +-sqrt(0.5)
        // G: a0 = 0.5, a1 = 1, b0 = 0; anchor "s" = {a0, b0}: mean 0.25, std sqrt(0.125)
        let o = run(&[0, 2, 3], &[0, 0], &[0.0, 1.0, 0.0], &["s", "t", "s"], Norm::Std);
        let h = 0.5f64.sqrt();
        let s = 0.25 / 0.125f64.sqrt();
        assert_eq!(o.anchor_size, vec![2, 1, 2]);
        let want = [h + s, h, -h - s];
        for (a, w) in o.advantage.iter().zip(want) {
            assert!((*a as f64 - w).abs() < 1e-6, "{a} vs {w}");
        }
    }

    #[test]
    fn singleton_group_and_outside_rows() {
        // one trajectory in group 3 (verl-agent: mean 0, std 1, A^E = R), one outside any group
        let o = run(&[0, 1, 2], &[3, -1], &[2.0, 5.0], &["s", "s"], Norm::Std);
        assert_eq!(o.advantage, vec![2.0, 0.0]);
        assert_eq!(o.anchor_size, vec![1, 0]); // "s" of the outside row is not in the anchor group
        let m = run(&[0, 1, 2], &[3, 3], &[2.0, 4.0], &["s", "x"], Norm::Mean);
        assert_eq!(m.advantage, vec![-1.0, 1.0]);
    }

    #[test]
    fn bad_inputs() {
        let e = gigpo(&GigpoInput {
            offsets: &[0, 1],
            group: &[0, 0],
            reward: &[1.0],
            observation: &["s"][..],
            gamma: 0.9,
            omega: 1.0,
            eps: 1e-6,
            norm: Norm::Std,
            episode_stats: EpisodeStats::Trajectories,
        });
        assert!(matches!(e, Err(CoreError::Length { .. })));
    }
}
