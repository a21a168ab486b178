//! Arrow C data interface (PyCapsule protocol) in and out of Python.
//!
//! Inputs: any object with `__arrow_c_array__` (a pyarrow Array) or a one-array
//! `__arrow_c_stream__` (a Polars Series). The buffers are imported zero-copy. Outputs: an [`ArrowExport`] object that pyarrow
//! (`pa.array(obj)`) or Polars consume zero-copy.
use arrow_array::ffi::{from_ffi, to_ffi, FFI_ArrowArray, FFI_ArrowSchema};
use arrow_array::ffi_stream::{ArrayStreamReader, FFI_ArrowArrayStream};
use arrow_array::{make_array, Array, ArrayRef};
use arrow_array::cast::AsArray;
use arrow_schema::{DataType, Schema};
use std::collections::HashMap;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyTuple};
use std::ffi::CStr;

const SCHEMA_NAME: &CStr = c"arrow_schema";
const ARRAY_NAME: &CStr = c"arrow_array";
const STREAM_NAME: &CStr = c"arrow_array_stream";

/// Import an Arrow array from an object implementing `__arrow_c_array__` (a pyarrow Array, a
/// core result) or `__arrow_c_stream__` of exactly one array (a one-chunk Polars Series: no
/// pyarrow needed, which saves its 0.1-0.2 s import in short CLI runs).
pub fn import_array(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<ArrayRef> {
    if obj.hasattr("__arrow_c_array__")? {
        return import_c_array(name, obj);
    }
    if obj.hasattr("__arrow_c_stream__")? {
        return import_c_stream(name, obj);
    }
    Err(PyTypeError::new_err(format!(
        "column '{name}': expected an Arrow array (a Polars Series or pyarrow.Array), got {}",
        obj.get_type().name()?
    )))
}

fn import_c_array(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<ArrayRef> {
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

/// Import every chunk of a column: one array for `__arrow_c_array__`, each array of a stream
/// (a Polars Series read from Parquet has one chunk per row group; copying them into one costs
/// 15 ms per million strings in a fresh process, more than the pass that reads them).
pub fn import_chunks(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<ArrayRef>> {
    if !obj.hasattr("__arrow_c_array__")? && obj.hasattr("__arrow_c_stream__")? {
        return stream_chunks(name, obj);
    }
    Ok(vec![import_array(name, obj)?])
}

fn stream_chunks(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<ArrayRef>> {
    let cap = obj.call_method0("__arrow_c_stream__")?;
    let cap = cap.cast::<PyCapsule>()?;
    let ptr = cap.pointer_checked(Some(STREAM_NAME))?.cast::<FFI_ArrowArrayStream>();
    let err = |e: arrow_schema::ArrowError| PyValueError::new_err(format!("column '{name}': cannot import Arrow stream: {e}"));
    // SAFETY: the capsule holds an unreleased FFI_ArrowArrayStream (PyCapsule protocol);
    // `from_raw` moves it out and leaves a released one behind for the capsule's destructor.
    let reader = unsafe { ArrayStreamReader::from_raw(ptr.as_ptr()) }.map_err(err)?;
    reader.collect::<Result<Vec<ArrayRef>, _>>().map_err(err)
}

fn import_c_stream(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<ArrayRef> {
    let mut chunks = stream_chunks(name, obj)?;
    match chunks.len() {
        1 => Ok(chunks.pop().unwrap()),
        0 => Err(PyValueError::new_err(format!("column '{name}': the Arrow stream has no array"))),
        n => Err(PyValueError::new_err(format!(
            "column '{name}': expected one chunk, got {n} (rechunk the Series first)"
        ))),
    }
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
    fn eq_rows(&self, i: usize, j: usize) -> bool {
        match self {
            StrArr::View(a) => view_rows_eq(a, i, j),
            _ => self.get(i) == self.get(j),
        }
    }
}

impl StrArr<'_> {
    pub fn null_count(&self) -> usize {
        match self {
            StrArr::Utf8(a) => a.null_count(),
            StrArr::Large(a) => a.null_count(),
            StrArr::View(a) => a.null_count(),
        }
    }
}

/// Rows `i` and `j` of a string-view array are equal. A view is 16 bytes: the length, then the
/// first 4 bytes, then (up to 12 bytes) the rest inline or (longer) the buffer and offset of the
/// whole string. Equal views are equal strings; different length-and-prefix words, or different
/// inline views, are different strings; only long strings with the same length and prefix at
/// different places are compared byte by byte. Tables read from Parquet repeat a trajectory's id
/// as the same view, so a run of equal ids costs one 16-byte comparison per row.
fn view_rows_eq(a: &arrow_array::StringViewArray, i: usize, j: usize) -> bool {
    let views = a.views();
    let (vi, vj) = (views[i], views[j]);
    if vi == vj {
        return true;
    }
    if (vi as u64) != (vj as u64) || (vi as u32) <= 12 {
        return false;
    }
    a.value(i) == a.value(j)
}

/// A string column made of several chunks (a Polars Series read from Parquet), indexed by row.
pub struct ChunkedStr<'a> {
    chunks: Vec<StrArr<'a>>,
    /// first row of each chunk, then the total
    starts: Vec<usize>,
    /// the chunk of the last lookup: passes go row by row, so it is almost always the next one's
    hint: std::sync::atomic::AtomicUsize,
}

impl<'a> ChunkedStr<'a> {
    pub fn from(name: &str, arrays: &'a [ArrayRef]) -> PyResult<Self> {
        let mut starts = vec![0usize];
        let mut chunks = Vec::with_capacity(arrays.len());
        for a in arrays {
            chunks.push(StrArr::from(name, a)?);
            starts.push(starts.last().unwrap() + a.len());
        }
        Ok(ChunkedStr { chunks, starts, hint: std::sync::atomic::AtomicUsize::new(0) })
    }

    pub fn null_count(&self) -> usize {
        self.chunks.iter().map(|c| c.null_count()).sum()
    }

    /// (chunk, row within it) of row `i`
    #[inline]
    fn locate(&self, i: usize) -> (usize, usize) {
        use std::sync::atomic::Ordering::Relaxed;
        let h = self.hint.load(Relaxed);
        if h + 1 < self.starts.len() && self.starts[h] <= i && i < self.starts[h + 1] {
            return (h, i - self.starts[h]);
        }
        let c = self.starts.partition_point(|&s| s <= i) - 1;
        self.hint.store(c, Relaxed);
        (c, i - self.starts[c])
    }
}

impl qevolve_core::StrColumn for ChunkedStr<'_> {
    fn len(&self) -> usize {
        *self.starts.last().unwrap()
    }
    fn get(&self, i: usize) -> &str {
        let (c, r) = self.locate(i);
        self.chunks[c].get(r)
    }
    fn is_null(&self, i: usize) -> bool {
        let (c, r) = self.locate(i);
        self.chunks[c].is_null(r)
    }
    fn eq_rows(&self, i: usize, j: usize) -> bool {
        let ((ci, ri), (cj, rj)) = (self.locate(i), self.locate(j));
        if ci == cj {
            self.chunks[ci].eq_rows(ri, rj)
        } else {
            self.chunks[ci].get(ri) == self.chunks[cj].get(rj)
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

/// An Arrow schema, consumed through `__arrow_c_schema__` (e.g. Polars' `write_parquet(arrow_schema=...)`).
#[pyclass(module = "qevolve_cli._core", name = "ArrowSchemaExport")]
pub struct ArrowSchemaExport {
    schema: Schema,
}

#[pymethods]
impl ArrowSchemaExport {
    fn __arrow_c_schema__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        let ffi = FFI_ArrowSchema::try_from(&self.schema).map_err(|e| PyValueError::new_err(e.to_string()))?;
        PyCapsule::new_with_value(py, ffi, SCHEMA_NAME)
    }

    /// The key-value metadata (for tests and debugging).
    fn metadata(&self) -> HashMap<String, String> {
        self.schema.metadata().iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

/// schema_with_metadata(schema, metadata) -> ArrowSchemaExport: `schema` (any object with
/// `__arrow_c_schema__` of a struct type, e.g. a Polars Schema) with its top-level key-value
/// metadata replaced by `metadata`.
#[pyfunction]
pub fn schema_with_metadata(schema: &Bound<'_, PyAny>, metadata: HashMap<String, String>) -> PyResult<ArrowSchemaExport> {
    if !schema.hasattr("__arrow_c_schema__")? {
        return Err(PyTypeError::new_err(format!(
            "expected an Arrow schema (an object with __arrow_c_schema__), got {}",
            schema.get_type().name()?
        )));
    }
    let cap = schema.call_method0("__arrow_c_schema__")?;
    let cap = cap.cast::<PyCapsule>()?;
    let ptr = cap.pointer_checked(Some(SCHEMA_NAME))?.cast::<FFI_ArrowSchema>();
    // SAFETY: the capsule holds a valid FFI_ArrowSchema (PyCapsule protocol); it is only borrowed.
    let parsed = Schema::try_from(unsafe { ptr.as_ref() })
        .map_err(|e| PyValueError::new_err(format!("cannot import Arrow schema: {e}")))?;
    Ok(ArrowSchemaExport { schema: parsed.with_metadata(metadata) })
}
