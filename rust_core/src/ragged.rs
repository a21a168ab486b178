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
        if ids.get(i) != ids.get(i - 1) {
            out.push(i as i64);
        }
    }
    if n > 0 {
        out.push(n as i64);
    }
    out
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
}
