//! Bindings of tokenised prefix indexing (`qevolve_core::prefix`).
use crate::arrow_io::{i64_slice, import_array, ArrowExport, StrArr};
use crate::to_py_err;
use arrow_array::builder::{Int32Builder, ListBuilder};
use arrow_array::{BooleanArray, Int32Array};
use pyo3::prelude::*;
use qevolve_core::prefix;
use std::sync::Arc;

/// PrefixIndexer(tokenizer_json: str): a tokenizer loaded once, shared by all calls.
#[pyclass(frozen, module = "qevolve_cli._core")]
pub struct PrefixIndexer {
    inner: prefix::PrefixIndexer,
}

#[pymethods]
impl PrefixIndexer {
    #[new]
    fn new(py: Python<'_>, tokenizer_json: &str) -> PyResult<Self> {
        let inner = py.detach(|| prefix::PrefixIndexer::from_json(tokenizer_json)).map_err(to_py_err)?;
        Ok(Self { inner })
    }

    /// index(texts: pa.Array[str], char_ends: pa.Array[int64], end_offsets: pa.Array[int64])
    /// -> (positions: int32 per end, -1 where unchecked; seq_len: int32 per text; ok: bool per text)
    fn index(
        &self,
        py: Python<'_>,
        texts: &Bound<'_, PyAny>,
        char_ends: &Bound<'_, PyAny>,
        end_offsets: &Bound<'_, PyAny>,
    ) -> PyResult<(ArrowExport, ArrowExport, ArrowExport)> {
        let t = import_array("texts", texts)?;
        let t = StrArr::from("texts", &t)?;
        let e = import_array("char_ends", char_ends)?;
        let o = import_array("end_offsets", end_offsets)?;
        let (e, o) = (i64_slice("char_ends", &e)?, i64_slice("end_offsets", &o)?);
        let out = py.detach(|| self.inner.index(&t, e, o)).map_err(to_py_err)?;
        Ok((
            ArrowExport::new(Arc::new(Int32Array::from(out.positions))),
            ArrowExport::new(Arc::new(Int32Array::from(out.seq_len))),
            ArrowExport::new(Arc::new(BooleanArray::from(out.ok))),
        ))
    }

    /// encode(texts: pa.Array[str]) -> list<int32> array of token ids (no special tokens added).
    fn encode(&self, py: Python<'_>, texts: &Bound<'_, PyAny>) -> PyResult<ArrowExport> {
        let t = import_array("texts", texts)?;
        let t = StrArr::from("texts", &t)?;
        let ids = py.detach(|| self.inner.encode_many(&t)).map_err(to_py_err)?;
        let total: usize = ids.iter().map(Vec::len).sum();
        let mut b = ListBuilder::with_capacity(Int32Builder::with_capacity(total), ids.len());
        for row in ids {
            b.values().append_slice(&row.iter().map(|&x| x as i32).collect::<Vec<_>>());
            b.append(true);
        }
        Ok(ArrowExport::new(Arc::new(b.finish())))
    }

    /// encode_lengths(texts) -> int32 token counts (the single-pass lower bound).
    fn encode_lengths(&self, py: Python<'_>, texts: &Bound<'_, PyAny>) -> PyResult<ArrowExport> {
        let t = import_array("texts", texts)?;
        let t = StrArr::from("texts", &t)?;
        let ids = py.detach(|| self.inner.encode_many(&t)).map_err(to_py_err)?;
        Ok(ArrowExport::new(Arc::new(Int32Array::from(
            ids.iter().map(|r| r.len() as i32).collect::<Vec<_>>(),
        ))))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PrefixIndexer>()?;
    Ok(())
}
