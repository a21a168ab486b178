//! Ragged layout helpers: offsets of trajectories inside a flat row table.
use crate::error::{CoreError, Result};
use crate::StrColumn;

/// Validate `offsets` for a table of `n_rows` rows.
pub fn check_offsets(offsets: &[i64], n_rows: usize) -> Result<()> {
    if offsets.is_empty() {
        return Err(CoreError::Offsets("empty (need at least [0])".into()));
    }
    if offsets[0] != 0 {
        return Err(CoreError::Offsets(format!("must start at 0, got {}", offsets[0])));
    }
    for w in offsets.windows(2) {
        if w[1] < w[0] {
            return Err(CoreError::Offsets(format!("decreasing: {} then {}", w[0], w[1])));
        }
    }
    let last = *offsets.last().unwrap();
    if last as usize != n_rows || last < 0 {
        return Err(CoreError::Offsets(format!(
            "must end at the row count {n_rows}, got {last}"
        )));
    }
    Ok(())
}

/// Offsets of the runs of equal ids (rows of one trajectory must be adjacent).
pub fn offsets_from_ids<C: StrColumn + ?Sized>(ids: &C) -> Vec<i64> {
    let n = ids.len();
    let mut out = Vec::with_capacity(n / 8 + 2);
    out.push(0);
    for i in 1..n {
        if !ids.eq_rows(i, i - 1) {
            out.push(i as i64);
        }
    }
    if n > 0 {
        out.push(n as i64);
    }
    out
}

/// Repeat each trajectory's value over its rows: row `r` of trajectory `i` gets `per_traj[i]`.
pub fn broadcast<T: Copy + Default + Send + Sync>(offsets: &[i64], per_traj: &[T]) -> Result<Vec<T>> {
    let n_rows = offsets.last().copied().unwrap_or(0).max(0) as usize;
    check_offsets(offsets, n_rows)?;
    if per_traj.len() + 1 != offsets.len() {
        return Err(CoreError::Offsets(format!(
            "{} trajectories in the offsets but {} values",
            offsets.len() - 1,
            per_traj.len()
        )));
    }
    let mut out = vec![T::default(); n_rows];
    for (w, &v) in offsets.windows(2).zip(per_traj) {
        out[w[0] as usize..w[1] as usize].fill(v);
    }
    Ok(out)
}

/// Offsets of the trajectories when the table is in step order, else `None`.
///
/// "Step order" is what every table qevolve writes: the rows of each trajectory are adjacent
/// (no id starts two runs) and their steps are 0, 1, 2, ... . One pass over the rows plus a
/// hash set of the run-start ids (one per trajectory, not one per row). Null ids are the
/// caller's to refuse (this sees them as empty strings).
pub fn step_order_offsets<C: StrColumn + ?Sized>(ids: &C, step: &[i32]) -> Option<Vec<i64>> {
    let n = ids.len();
    assert_eq!(step.len(), n, "ids and step must have the same length");
    let mut out = Vec::with_capacity(n / 8 + 2);
    if n == 0 {
        out.push(0);
        return Some(out);
    }
    let mut starts = ahash::AHashSet::with_capacity(n / 8 + 1);
    if step[0] != 0 {
        return None;
    }
    out.push(0);
    starts.insert(ids.get(0));
    for i in 1..n {
        if !ids.eq_rows(i, i - 1) {
            // a new run: it starts at step 0 and its id has not started a run before
            if step[i] != 0 || !starts.insert(ids.get(i)) {
                return None;
            }
            out.push(i as i64);
        } else if step[i] != step[i - 1].wrapping_add(1) {
            return None;
        }
    }
    out.push(n as i64);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_runs() {
        let ids = vec!["a", "a", "b", "c", "c", "c"];
        assert_eq!(offsets_from_ids(&ids), vec![0, 2, 3, 6]);
        let empty: Vec<&str> = vec![];
        assert_eq!(offsets_from_ids(&empty), vec![0]);
    }

    #[test]
    fn offsets_checked() {
        assert!(check_offsets(&[0, 2, 5], 5).is_ok());
        assert!(check_offsets(&[0], 0).is_ok());
        assert!(check_offsets(&[], 0).is_err());
        assert!(check_offsets(&[1, 5], 5).is_err());
        assert!(check_offsets(&[0, 3, 2, 5], 5).is_err());
        assert!(check_offsets(&[0, 4], 5).is_err());
    }

    /// The plain definition: runs of equal ids, each id one run, steps 0..len-1 in each run.
    fn reference_step_order(ids: &[&str], step: &[i32]) -> Option<Vec<i64>> {
        let offs = offsets_from_ids(&ids.to_vec());
        let mut seen = std::collections::HashSet::new();
        for w in offs.windows(2) {
            if !seen.insert(ids[w[0] as usize]) {
                return None;
            }
            for (k, r) in (w[0]..w[1]).enumerate() {
                if step[r as usize] != k as i32 {
                    return None;
                }
            }
        }
        Some(offs)
    }

    #[test]
    fn step_order_hand_cases() {
        let ok = step_order_offsets(&vec!["a", "a", "b", "c", "c", "c"], &[0, 1, 0, 0, 1, 2]);
        assert_eq!(ok, Some(vec![0, 2, 3, 6]));
        let empty: Vec<&str> = vec![];
        assert_eq!(step_order_offsets(&empty, &[]), Some(vec![0]));
        // an id that starts two runs
        assert_eq!(step_order_offsets(&vec!["a", "b", "a"], &[0, 0, 0]), None);
        // a gap, a repeat, a run not starting at 0, a decreasing step
        assert_eq!(step_order_offsets(&vec!["a", "a", "a"], &[0, 1, 3]), None);
        assert_eq!(step_order_offsets(&vec!["a", "a"], &[0, 0]), None);
        assert_eq!(step_order_offsets(&vec!["a", "a", "b"], &[1, 2, 0]), None);
        assert_eq!(step_order_offsets(&vec!["a", "a", "b", "b"], &[0, 1, 1, 0]), None);
        // wrapping: i32::MAX followed by i32::MIN is not "+1"
        assert_eq!(step_order_offsets(&vec!["a", "a"], &[i32::MAX, i32::MIN]), None);
    }

    #[test]
    fn step_order_equals_the_reference_on_a_grid() {
        // every table of up to 5 rows over ids {a, b} and steps {0, 1, 2}
        let idv = ["a", "b"];
        for n in 0..=5usize {
            let total = 6usize.pow(n as u32);
            for code in 0..total {
                let (mut ids, mut step, mut c) = (vec![], vec![], code);
                for _ in 0..n {
                    ids.push(idv[c % 2]);
                    step.push(((c / 2) % 3) as i32);
                    c /= 6;
                }
                assert_eq!(step_order_offsets(&ids, &step), reference_step_order(&ids, &step), "{ids:?} {step:?}");
            }
        }
    }

    #[test]
    fn broadcast_repeats_per_trajectory_values() {
        assert_eq!(broadcast(&[0, 2, 2, 5], &[true, false, true]).unwrap(), vec![true, true, true, true, true]);
        assert_eq!(broadcast(&[0, 1, 3], &[7i32, 9]).unwrap(), vec![7, 9, 9]);
        assert_eq!(broadcast::<bool>(&[0], &[]).unwrap(), Vec::<bool>::new());
        // plain loop reference on ragged lengths
        let offs = [0i64, 3, 4, 4, 9];
        let vals = [1u8, 2, 3, 4];
        let mut want = vec![];
        for t in 0..vals.len() {
            for _ in offs[t]..offs[t + 1] {
                want.push(vals[t]);
            }
        }
        assert_eq!(broadcast(&offs, &vals).unwrap(), want);
        assert!(broadcast(&[0, 2], &[true, false]).is_err());
        assert!(broadcast(&[0, 3, 2], &[true, false]).is_err());
    }
}
