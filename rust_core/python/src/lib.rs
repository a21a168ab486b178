//! The thin PyO3 layer: Arrow columns in, Arrow columns out, the GIL released
//! around every computation, and core errors turned into Python exceptions in
//! one place ([`to_py_err`]). No algorithm lives here.
mod arrow_io;
mod core_fns;
mod prefix_fns;

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use qevolve_core::CoreError;

create_exception!(_core, CoreDataError, PyValueError, "Invalid input to the qevolve data core.");

/// Convert a core error into the module's exception (the only place that does).
pub(crate) fn to_py_err(e: CoreError) -> PyErr {
    CoreDataError::new_err(e.to_string())
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("CoreDataError", m.py().get_type::<CoreDataError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<arrow_io::ArrowExport>()?;
    m.add_class::<arrow_io::ArrowSchemaExport>()?;
    m.add_function(wrap_pyfunction!(arrow_io::schema_with_metadata, m)?)?;
    core_fns::register(m)?;
    prefix_fns::register(m)?;
    Ok(())
}
