//! Bindings of labels, weights, GAE, GiGPO and ragged helpers.
use crate::arrow_io::{bool_vec, f32_slice, i32_slice, i64_slice, import_array, import_chunks, u32_slice, ArrowExport, ChunkedStr, StrArr};
use crate::to_py_err;
use arrow_array::{ArrayRef, BooleanArray, Float32Array, Int64Array, StringArray, StringViewArray, UInt32Array};
use arrow_buffer::ScalarBuffer;
use rayon::prelude::*;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use qevolve_core::{gae, gigpo, labels, weights};
use std::sync::Arc;

fn export(a: ArrayRef) -> ArrowExport {
    ArrowExport::new(a)
}

/// parse_action(text) -> str | None: the command of a ReAct output.
#[pyfunction]
fn parse_action(text: &str) -> Option<String> {
    labels::parse_action(text).map(str::to_owned)
}

/// parse_actions(actions: pa.Array[str]) -> ArrowExport[str, nullable]
#[pyfunction]
fn parse_actions(py: Python<'_>, actions: &Bound<'_, PyAny>) -> PyResult<ArrowExport> {
    let arr = import_array("action", actions)?;
    let col = StrArr::from("action", &arr)?;
    let out: StringArray = py.detach(|| {
        use qevolve_core::StrColumn;
        (0..col.len())
            .map(|i| if col.is_null(i) { None } else { labels::parse_action(col.get(i)) })
            .collect()
    });
    Ok(export(Arc::new(out)))
}

/// offsets_from_ids(ids: pa.Array[str]) -> ArrowExport[int64]
#[pyfunction]
fn offsets_from_ids(py: Python<'_>, ids: &Bound<'_, PyAny>) -> PyResult<ArrowExport> {
    let arrs = import_chunks("traj_id", ids)?;
    let col = ChunkedStr::from("traj_id", &arrs)?;
    let out = py.detach(|| qevolve_core::offsets_from_ids(&col));
    Ok(export(Arc::new(Int64Array::from(out))))
}

/// step_order_offsets(ids, step: int32) -> ArrowExport[int64] | None: the trajectory offsets
/// when every trajectory's rows are adjacent with steps 0, 1, 2, ...; None otherwise.
#[pyfunction]
fn step_order_offsets(py: Python<'_>, ids: &Bound<'_, PyAny>, step: &Bound<'_, PyAny>) -> PyResult<Option<ArrowExport>> {
    // the ids in their chunks as read (no copy into one), the steps as one int32 array
    let (ia, sa) = (import_chunks("traj_id", ids)?, import_array("step", step)?);
    let col = ChunkedStr::from("traj_id", &ia)?;
    let st = i32_slice("step", &sa)?;
    {
        use qevolve_core::StrColumn;
        if st.len() != col.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "column 'step': {} rows, but traj_id has {}",
                st.len(),
                col.len()
            )));
        }
    }
    if col.null_count() > 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "column 'traj_id': {} null values",
            col.null_count()
        )));
    }
    let out = py.detach(|| qevolve_core::step_order_offsets(&col, st));
    Ok(out.map(|o| export(Arc::new(Int64Array::from(o)))))
}

/// broadcast_bool(offsets, per_traj: bool) -> ArrowExport[bool]: each trajectory's value on its rows.
#[pyfunction]
fn broadcast_bool(py: Python<'_>, offsets: &Bound<'_, PyAny>, per_traj: &Bound<'_, PyAny>) -> PyResult<ArrowExport> {
    let o = import_array("offsets", offsets)?;
    let o = i64_slice("offsets", &o)?;
    let v = bool_vec("values", &import_array("values", per_traj)?)?;
    let out = py.detach(|| qevolve_core::broadcast(o, &v)).map_err(to_py_err)?;
    Ok(export(Arc::new(BooleanArray::from(out))))
}

/// trajectory_success(offsets, reward_env) -> ArrowExport[bool] (one per trajectory)
#[pyfunction]
fn trajectory_success(py: Python<'_>, offsets: &Bound<'_, PyAny>, reward_env: &Bound<'_, PyAny>) -> PyResult<ArrowExport> {
    let (o, r) = (import_array("offsets", offsets)?, import_array("reward_env", reward_env)?);
    let (o, r) = (i64_slice("offsets", &o)?, f32_slice("reward_env", &r)?);
    let out = py.detach(|| weights::trajectory_success(o, r)).map_err(to_py_err)?;
    Ok(export(Arc::new(BooleanArray::from(out))))
}

/// step_weights(offsets, success, n_rows, temporal=True, success_term=True) -> ArrowExport[float32]
#[pyfunction]
#[pyo3(signature = (offsets, success, n_rows, temporal=true, success_term=true))]
fn step_weights(
    py: Python<'_>,
    offsets: &Bound<'_, PyAny>,
    success: &Bound<'_, PyAny>,
    n_rows: usize,
    temporal: bool,
    success_term: bool,
) -> PyResult<ArrowExport> {
    let o = import_array("offsets", offsets)?;
    let o = i64_slice("offsets", &o)?;
    let s = bool_vec("success", &import_array("success", success)?)?;
    let opts = weights::WeightOptions { temporal, success: success_term };
    let out = py.detach(|| weights::step_weights(o, &s, n_rows, opts)).map_err(to_py_err)?;
    Ok(export(Arc::new(Float32Array::from(out))))
}

/// gae(offsets, reward, value, next_value, done, gamma, lam, reward_aux=None) -> ArrowExport[float32]
#[pyfunction]
#[pyo3(signature = (offsets, reward, value, next_value, done, gamma, lam, reward_aux=None))]
#[allow(clippy::too_many_arguments)]
fn gae_advantages(
    py: Python<'_>,
    offsets: &Bound<'_, PyAny>,
    reward: &Bound<'_, PyAny>,
    value: &Bound<'_, PyAny>,
    next_value: &Bound<'_, PyAny>,
    done: &Bound<'_, PyAny>,
    gamma: f64,
    lam: f64,
    reward_aux: Option<&Bound<'_, PyAny>>,
) -> PyResult<ArrowExport> {
    let o = import_array("offsets", offsets)?;
    let r = import_array("reward_env", reward)?;
    let v = import_array("value", value)?;
    let nv = import_array("next_value", next_value)?;
    let d = bool_vec("done", &import_array("done", done)?)?;
    let aux = reward_aux.map(|a| import_array("reward_aux", a)).transpose()?;
    let aux_slice = match &aux {
        Some(a) => Some(f32_slice("reward_aux", a)?),
        None => None,
    };
    let inp = gae::GaeInput {
        offsets: i64_slice("offsets", &o)?,
        reward: f32_slice("reward_env", &r)?,
        reward_aux: aux_slice,
        value: f32_slice("value", &v)?,
        next_value: f32_slice("next_value", &nv)?,
        done: &d,
        gamma,
        lambda: lam,
    };
    let out = py.detach(|| gae::gae(inp)).map_err(to_py_err)?;
    Ok(export(Arc::new(Float32Array::from(out))))
}

/// gigpo_advantages(offsets, group: int64 per trajectory (< 0: in no group), reward, observation, gamma,
/// omega, eps, norm ("std" | "mean"), episode_stats ("trajectories" | "steps"))
/// -> (advantage: float32, null outside the groups; episode term; step term; anchor_size: uint32, 0 outside)
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn gigpo_advantages(
    py: Python<'_>,
    offsets: &Bound<'_, PyAny>,
    group: &Bound<'_, PyAny>,
    reward: &Bound<'_, PyAny>,
    observation: &Bound<'_, PyAny>,
    gamma: f64,
    omega: f64,
    eps: f64,
    norm: &str,
    episode_stats: &str,
) -> PyResult<(ArrowExport, ArrowExport, ArrowExport, ArrowExport)> {
    let bad = |what: &str, got: &str, choices: &str| {
        pyo3::exceptions::PyValueError::new_err(format!("{what}: expected one of {choices}, got {got:?}"))
    };
    let norm = match norm {
        "std" => gigpo::Norm::Std,
        "mean" => gigpo::Norm::Mean,
        other => return Err(bad("norm", other, "std, mean")),
    };
    let episode_stats = match episode_stats {
        "trajectories" => gigpo::EpisodeStats::Trajectories,
        "steps" => gigpo::EpisodeStats::Steps,
        other => return Err(bad("episode_stats", other, "trajectories, steps")),
    };
    let (o, g, r) = (import_array("offsets", offsets)?, import_array("group", group)?, import_array("reward_env", reward)?);
    let obs = import_chunks("observation", observation)?;
    let obs = ChunkedStr::from("observation", &obs)?;
    let inp = gigpo::GigpoInput {
        offsets: i64_slice("offsets", &o)?,
        group: i64_slice("group", &g)?,
        reward: f32_slice("reward_env", &r)?,
        observation: &obs,
        gamma,
        omega,
        eps,
        norm,
        episode_stats,
    };
    let out = py.detach(|| gigpo::gigpo(&inp)).map_err(to_py_err)?;
    let valid: Vec<bool> = out.anchor_size.iter().map(|&s| s > 0).collect();
    let adv = Float32Array::new(ScalarBuffer::from(out.advantage), Some(valid.into()));
    Ok((
        export(Arc::new(adv)),
        export(Arc::new(Float32Array::from(out.episode))),
        export(Arc::new(Float32Array::from(out.step))),
        export(Arc::new(UInt32Array::from(out.anchor_size))),
    ))
}

fn rule_spec(d: &Bound<'_, PyDict>) -> PyResult<labels::RuleSpec> {
    fn get<'py, T: for<'a> FromPyObject<'a, 'py>>(d: &Bound<'py, PyDict>, k: &str, default: T) -> PyResult<T> {
        match d.get_item(k)? {
            Some(v) => v.extract::<T>().map_err(|e| {
                pyo3::exceptions::PyValueError::new_err(format!("rules field '{k}': {}", Into::<PyErr>::into(e)))
            }),
            None => Ok(default),
        }
    }
    Ok(labels::RuleSpec {
        env: get(d, "env", String::new())?,
        r_fmt: get(d, "r_fmt", 0.0f32)?,
        r_inv: get(d, "r_inv", 0.0f32)?,
        r_repeat: get(d, "r_repeat", 0.0f32)?,
        invalid_patterns: get(d, "invalid_patterns", Vec::<String>::new())?,
        repeat_enabled: get(d, "repeat_enabled", true)?,
        repeat_exempt_commands: get(d, "repeat_exempt_commands", Vec::<String>::new())?,
    })
}

/// label_steps(action, observation, next_observation, env_code: pa.Array[uint32], rules: list[dict])
/// -> (ArrowExport[float32] reward_aux, ArrowExport[str] aux_kind)
#[pyfunction]
fn label_steps(
    py: Python<'_>,
    action: &Bound<'_, PyAny>,
    observation: &Bound<'_, PyAny>,
    next_observation: &Bound<'_, PyAny>,
    env_code: &Bound<'_, PyAny>,
    rules: Vec<Bound<'_, PyDict>>,
) -> PyResult<(ArrowExport, ArrowExport)> {
    let a = import_array("action", action)?;
    let o = import_array("observation", observation)?;
    let n = import_array("next_observation", next_observation)?;
    let c = import_array("env", env_code)?;
    let (a, o, n) = (StrArr::from("action", &a)?, StrArr::from("observation", &o)?, StrArr::from("next_observation", &n)?);
    let c = u32_slice("env", &c)?;
    let compiled = rules
        .iter()
        .map(|d| rule_spec(d).and_then(|s| labels::Rules::compile(&s).map_err(to_py_err)))
        .collect::<PyResult<Vec<_>>>()?;
    let (r, kinds) = py
        .detach(|| {
            labels::label_steps(&a, &o, &n, c, &compiled).map(|(r, k)| (r, kind_views(&k)))
        })
        .map_err(to_py_err)?;
    Ok((export(Arc::new(Float32Array::from(r))), export(Arc::new(kinds))))
}

/// The kind names as a string-view array. Every name fits inline in its 16-byte view (<= 12
/// bytes), so there is no data buffer: one view per kind is made once and copied per row (a
/// builder appending 1M values took 10-20 ms). Polars takes views as they are.
fn kind_views(kinds: &[labels::AuxKind]) -> StringViewArray {
    use labels::AuxKind::*;
    let table: [u128; 4] = [None, Format, Invalid, Repeat].map(|k| arrow_array::builder::make_view(k.as_str().as_bytes(), 0, 0));
    let views: Vec<u128> = kinds.par_iter().map(|&k| table[k as usize]).collect();
    // SAFETY: each view is a valid inline view of a UTF-8 string of <= 12 bytes; no buffers needed
    unsafe { StringViewArray::new_unchecked(ScalarBuffer::from(views), Arc::from(Vec::new()), Option::None) }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(parse_action, m)?)?;
    m.add_function(wrap_pyfunction!(parse_actions, m)?)?;
    m.add_function(wrap_pyfunction!(offsets_from_ids, m)?)?;
    m.add_function(wrap_pyfunction!(step_order_offsets, m)?)?;
    m.add_function(wrap_pyfunction!(broadcast_bool, m)?)?;
    m.add_function(wrap_pyfunction!(trajectory_success, m)?)?;
    m.add_function(wrap_pyfunction!(step_weights, m)?)?;
    m.add_function(wrap_pyfunction!(gae_advantages, m)?)?;
    m.add_function(wrap_pyfunction!(gigpo_advantages, m)?)?;
    m.add_function(wrap_pyfunction!(label_steps, m)?)?;
    Ok(())
}
