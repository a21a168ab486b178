//! qevolve_core: the pure data core of qevolve.
//!
//! Everything here works on plain slices and small traits, with no Python and
//! no Arrow types, so that `cargo test` exercises the algorithms directly. The
//! PyO3 layer in `rust_core/python` adapts Arrow columns to these signatures.
//!
//! Ragged trajectories are described by `offsets`: trajectory `i` owns rows
//! `offsets[i]..offsets[i + 1]` (length `n_traj + 1`, starting at 0, ending at
//! the number of rows, non-decreasing).

pub mod error;
pub mod gae;
pub mod gigpo;
pub mod labels;
pub mod prefix;
pub mod ragged;
pub mod weights;

pub use error::CoreError;
pub use ragged::{broadcast, check_offsets, offsets_from_ids, step_order_offsets};

/// A column of strings, indexable by row. Implemented for `&[S: AsRef<str>]`
/// here and for Arrow string arrays in the binding layer.
pub trait StrColumn: Sync {
    fn len(&self) -> usize;
    fn get(&self, i: usize) -> &str;
    /// Whether row `i` is null (missing). Defaults to never.
    fn is_null(&self, _i: usize) -> bool {
        false
    }
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether rows `i` and `j` hold equal strings. Layouts that can answer without reading the
    /// strings (Arrow string views: equal views, or different lengths/prefixes) override it.
    fn eq_rows(&self, i: usize, j: usize) -> bool {
        self.get(i) == self.get(j)
    }
}

impl<S: AsRef<str> + Sync> StrColumn for [S] {
    fn len(&self) -> usize {
        <[S]>::len(self)
    }
    fn get(&self, i: usize) -> &str {
        self[i].as_ref()
    }
}

impl<S: AsRef<str> + Sync> StrColumn for Vec<S> {
    fn len(&self) -> usize {
        <[S]>::len(self)
    }
    fn get(&self, i: usize) -> &str {
        self[i].as_ref()
    }
}
