//! Arrow C data interface (PyCapsule protocol) in and out of Python.
//!
//! Inputs: any object with `__arrow_c_array__` (a pyarrow Array). The buffers
//! are imported zero-copy. Outputs: an [`ArrowExport`] object that pyarrow
//! (`pa.array(obj)`) or Polars consume zero-copy.
use arrow_array::ffi::{from_ffi, to_ffi, FFI_ArrowArray, FFI_ArrowSchema};
use arrow_array::{make_array, Array, ArrayRef};
use arrow_array::cast::AsArray;
use arrow_schema::DataType;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyTuple};
use std::ffi::CStr;

const SCHEMA_NAME: &CStr = c"arrow_schema";
const ARRAY_NAME: &CStr = c"arrow_array";

/// Import an Arrow array from an object implementing `__arrow_c_array__`.
pub fn import_array(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<ArrayRef> {
    if !obj.hasattr("__arrow_c_array__")? {
        return Err(PyTypeError::new_err(format!(
            "column '{name}': expected an Arrow array (pyarrow.Array), got {}",
            obj.get_type().name()?
        )));
    }
    let tuple = obj.call_method0("__arrow_c_array__")?;
    let tuple = tuple.cast::<PyTuple>()?;
    let schema_cap = tuple.get_item(0)?;
    let schema_cap = schema_cap.cast::<PyCapsule>()?;
    let array_cap = tuple.get_item(1)?;
    let array_cap = array_cap.cast::<PyCapsule>()?;
    let schema_ptr = schema_cap.pointer_checked(Some(SCHEMA_NAME))?.cast::<FFI_ArrowSchema>();
    let array_ptr = array_cap.pointer_checked(Some(ARRAY_NAME))?.cast::<FFI_ArrowArray>();
    // SAFETY: the capsules follow the Arrow PyCapsule protocol; we move the
    // array out (leaving a released one behind, as the protocol requires) and
    // borrow the schema for the duration of the import.
    let data = unsafe {
        let array = std::ptr::replace(array_ptr.as_ptr(), FFI_ArrowArray::empty());
        from_ffi(array, schema_ptr.as_ref())
    }
    .map_err(|e| PyValueError::new_err(format!("column '{name}': cannot import Arrow array: {e}")))?;
    Ok(make_array(data))
}

/// An exported Arrow array, consumed through `__arrow_c_array__`.
#[pyclass(module = "qevolve_cli._core", name = "ArrowExport")]
pub struct ArrowExport {
    array: Option<ArrayRef>,
}

impl ArrowExport {
    pub fn new(array: ArrayRef) -> Self {
        ArrowExport { array: Some(array) }
    }
}

#[pymethods]
impl ArrowExport {
    #[pyo3(signature = (requested_schema=None))]
    fn __arrow_c_array__<'py>(
        &mut self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyCapsule>, Bound<'py, PyCapsule>)> {
        let _ = requested_schema;
        let array = self
            .array
            .take()
            .ok_or_else(|| PyValueError::new_err("ArrowExport already consumed"))?;
        let (ffi_array, ffi_schema) =
            to_ffi(&array.to_data()).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let schema = PyCapsule::new_with_value(py, ffi_schema, SCHEMA_NAME)?;
        let array = PyCapsule::new_with_value(py, ffi_array, ARRAY_NAME)?;
        Ok((schema, array))
    }

    fn __len__(&self) -> usize {
        self.array.as_ref().map(|a| a.len()).unwrap_or(0)
    }
}

/// A borrowed string column over any of Arrow's three string layouts.
pub enum StrArr<'a> {
    Utf8(&'a arrow_array::StringArray),
    Large(&'a arrow_array::LargeStringArray),
    View(&'a arrow_array::StringViewArray),
}

impl<'a> StrArr<'a> {
    pub fn from(name: &str, a: &'a ArrayRef) -> PyResult<Self> {
        Ok(match a.data_type() {
            DataType::Utf8 => StrArr::Utf8(a.as_string::<i32>()),
            DataType::LargeUtf8 => StrArr::Large(a.as_string::<i64>()),
            DataType::Utf8View => StrArr::View(a.as_string_view()),
            other => {
                return Err(PyTypeError::new_err(format!(
                    "column '{name}': expected strings, got Arrow type {other}"
                )))
            }
        })
    }
}

impl qevolve_core::StrColumn for StrArr<'_> {
    fn len(&self) -> usize {
        match self {
            StrArr::Utf8(a) => a.len(),
            StrArr::Large(a) => a.len(),
            StrArr::View(a) => a.len(),
        }
    }
    fn get(&self, i: usize) -> &str {
        match self {
            StrArr::Utf8(a) => a.value(i),
            StrArr::Large(a) => a.value(i),
            StrArr::View(a) => a.value(i),
        }
    }
    fn is_null(&self, i: usize) -> bool {
        match self {
            StrArr::Utf8(a) => a.is_null(i),
            StrArr::Large(a) => a.is_null(i),
            StrArr::View(a) => a.is_null(i),
        }
    }
}

macro_rules! prim_slice {
    ($fn_name:ident, $arrow_ty:ty, $dt:pat, $label:expr) => {
        /// Borrow a primitive column without nulls as a slice.
        #[allow(dead_code)]
        pub fn $fn_name<'a>(name: &str, a: &'a ArrayRef) -> PyResult<&'a [<$arrow_ty as arrow_array::ArrowPrimitiveType>::Native]> {
            match a.data_type() {
                $dt => {}
                other => {
                    return Err(PyTypeError::new_err(format!(
                        "column '{name}': expected {}, got Arrow type {other}", $label
                    )))
                }
            }
            if a.null_count() > 0 {
                return Err(PyValueError::new_err(format!("column '{name}': {} null values", a.null_count())));
            }
            Ok(a.as_primitive::<$arrow_ty>().values().as_ref())
        }
    };
}

prim_slice!(f32_slice, arrow_array::types::Float32Type, DataType::Float32, "float32");
prim_slice!(i64_slice, arrow_array::types::Int64Type, DataType::Int64, "int64");
prim_slice!(u32_slice, arrow_array::types::UInt32Type, DataType::UInt32, "uint32");
prim_slice!(i32_slice, arrow_array::types::Int32Type, DataType::Int32, "int32");

/// A boolean column without nulls, unpacked.
pub fn bool_vec(name: &str, a: &ArrayRef) -> PyResult<Vec<bool>> {
    if a.data_type() != &DataType::Boolean {
        return Err(PyTypeError::new_err(format!(
            "column '{name}': expected bool, got Arrow type {}",
            a.data_type()
        )));
    }
    if a.null_count() > 0 {
        return Err(PyValueError::new_err(format!("column '{name}': {} null values", a.null_count())));
    }
    Ok(a.as_boolean().values().iter().collect())
}
