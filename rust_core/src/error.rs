//! One error type for the core; the binding layer maps it to Python exceptions.
use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum CoreError {
    /// A column has the wrong length for the table it belongs to.
    #[error("column '{column}': expected {expected} rows, got {got}")]
    Length {
        column: String,
        expected: usize,
        got: usize,
    },
    /// Offsets do not describe a valid ragged layout.
    #[error("offsets: {0}")]
    Offsets(String),
    /// A rule set could not be compiled (bad regular expression, ...).
    #[error("rules '{env}': {problem}")]
    Rules { env: String, problem: String },
    /// A value is out of its domain (NaN reward, gamma outside [0, 1], ...).
    #[error("{what}: {problem}")]
    Value { what: String, problem: String },
}

pub type Result<T> = std::result::Result<T, CoreError>;

pub(crate) fn check_len(column: &str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(CoreError::Length {
            column: column.to_string(),
            expected,
            got,
        });
    }
    Ok(())
}
