"""`qevolve label` and `qevolve inspect`: real files, CliRunner and subprocess runs."""
from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from conftest import run_qevolve
from reference import ref_gae, ref_label, ref_weights
from typer.testing import CliRunner

from qevolve_cli import schema
from qevolve_cli.cli import app
from qevolve_cli.config import configs_dir, load_yaml
from qevolve_cli.synthetic import synthetic_table

runner = CliRunner()


@pytest.fixture
def buffers(tmp_path):
    expert = synthetic_table(5, mean_steps=6, seed=1, source="expert", iteration=0, p_success=1.0)
    selfp = synthetic_table(8, mean_steps=6, seed=2, source="self", iteration=1)
    pe, ps = tmp_path / "expert.parquet", tmp_path / "self.parquet"
    schema.write_table(expert, pe)
    schema.write_table(selfp, ps)
    return pe, ps


def test_label_matches_references(tmp_path, buffers):
    pe, ps = buffers
    before = (pe.read_bytes(), ps.read_bytes())
    out = tmp_path / "labeled.parquet"
    r = runner.invoke(app, ["label", str(pe), str(ps), "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert (pe.read_bytes(), ps.read_bytes()) == before  # inputs untouched
    df = schema.read_table(out)
    assert summary["steps"] == df.height == pl.read_parquet(pe).height + pl.read_parquet(ps).height
    rule = {"env": "sciworld", **load_yaml(configs_dir() / "labels.yaml")["sciworld"]}
    want = [ref_label(rule, a, o, n) for a, o, n in zip(df["action"], df["observation"], df["next_observation"], strict=True)]
    assert df["aux_kind"].to_list() == [k for _, k in want]
    assert np.allclose(df["reward_aux"].to_numpy(), [r for r, _ in want])
    per = df.group_by("traj_id", maintain_order=True).agg(pl.len(), pl.col("reward_env").sum())
    lengths, success = per["len"].to_list(), (per["reward_env"] != 0).to_list()
    assert np.allclose(df["weight"].to_numpy(), ref_weights(lengths, success), rtol=1e-6)
    assert df.filter(pl.col("source") == "expert")["success"].all()
    assert "advantage" not in df.columns


def test_label_advantage_from_values(tmp_path, buffers):
    pe, _ = buffers
    d = schema.read_table(pe)
    rng = np.random.default_rng(0)
    d = d.with_columns(pl.Series("value", rng.normal(size=d.height), dtype=pl.Float32),
                       pl.Series("next_value", rng.normal(size=d.height), dtype=pl.Float32))
    src = tmp_path / "with_values.parquet"
    schema.write_table(d, src)
    out = tmp_path / "adv.parquet"
    r = runner.invoke(app, ["label", str(src), "--out", str(out)])
    assert r.exit_code == 0, r.output
    df = schema.read_table(out)
    lengths = df.group_by("traj_id", maintain_order=True).len()["len"].to_list()
    nv = np.where(df["done"].to_numpy(), 0.0, df["next_value"].to_numpy())
    assert np.all(df.filter(pl.col("done"))["next_value"].to_numpy() == 0.0)  # V(terminal) = 0
    want = ref_gae(lengths, df["reward_env"].to_list(), df["value"].to_list(), nv.tolist(), df["done"].to_list(), 0.95, 0.95)
    assert np.allclose(df["advantage"].to_numpy(), want, atol=1e-5)
    # the td ablation is GAE with lambda = 0
    out2 = tmp_path / "td.parquet"
    assert runner.invoke(app, ["label", str(src), "--out", str(out2), "--advantage", "td"]).exit_code == 0
    td = schema.read_table(out2)
    want_td = ref_gae(lengths, td["reward_env"].to_list(), td["value"].to_list(), nv.tolist(), td["done"].to_list(), 0.95, 0.0)
    assert np.allclose(td["advantage"].to_numpy(), want_td, atol=1e-5)


def test_label_step_limit_fills_steps_left_where_missing(tmp_path, buffers):
    """--step-limit N: rows without steps_left (the expert table has no such column) get N - step; the values a
    rollout wrote are kept; without the flag the expert rows stay null and the default config's hash is the one
    runs made before the field had (they resume)."""
    import dataclasses
    import hashlib

    from qevolve_cli.labeling import LabelConfig

    pe, ps = buffers
    selfp = schema.read_table(ps)
    own = (20 - pl.col("step")).cast(pl.Int32).alias("steps_left")  # a limit of its own, to tell them apart
    src = tmp_path / "self_sl.parquet"
    schema.write_table(selfp.with_columns(own), src)
    for flag, want_expert in ((["--step-limit", "9"], True), ([], False)):
        out = tmp_path / f"l{len(flag)}.parquet"
        r = runner.invoke(app, ["label", str(pe), str(src), "--out", str(out), *flag])
        assert r.exit_code == 0, r.output
        df = schema.read_table(out)
        s, e = df.filter(pl.col("source") == "self"), df.filter(pl.col("source") == "expert")
        assert df["steps_left"].dtype == pl.Int32
        assert (s["steps_left"] == 20 - s["step"]).all()
        if want_expert:
            assert (e["steps_left"] == 9 - e["step"]).all() and e.height > 0
        else:
            assert e["steps_left"].null_count() == e.height > 0
    out = tmp_path / "e.parquet"
    assert runner.invoke(app, ["label", str(pe), "--out", str(out), "--step-limit", "4"]).exit_code == 0
    e = schema.read_table(out)
    assert (e["steps_left"] == 4 - e["step"]).all() and (e["step"] >= 4).any()  # past the limit: negative
    assert "steps_left" not in schema.read_table(pe).columns
    d = dataclasses.asdict(LabelConfig())
    d.pop("step_limit")
    d.pop("window_context")
    for k in ("gamma", "omega", "eps", "norm", "episode_stats"):  # GiGPO's fields (issue 69), omitted at default too
        d.pop(f"gigpo_{k}")
    assert LabelConfig().hash() == hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert LabelConfig(step_limit=9).hash() != LabelConfig().hash() != LabelConfig(window_context=1.0).hash()
    r = runner.invoke(app, ["label", str(pe), "--out", str(tmp_path / "x.parquet"), "--step-limit", "0"])
    assert r.exit_code == 2 and r.output == "error: --step-limit: must be > 0, got 0\n"


def test_label_no_retrospective_ablation(tmp_path, buffers):
    pe, ps = buffers
    out = tmp_path / "norr.parquet"
    assert runner.invoke(app, ["label", str(ps), "--out", str(out), "--no-retrospective"]).exit_code == 0
    df = schema.read_table(out)
    assert (df["reward_aux"] == 0).all() and (df["aux_kind"] == "none").all()


def test_label_config_file_drops_weight_terms(tmp_path, buffers):
    _, ps = buffers
    cfg = tmp_path / "c.yaml"
    cfg.write_text("label:\n  weight_temporal: false\n  weight_success: false\n")
    out = tmp_path / "w.parquet"
    assert runner.invoke(app, ["label", str(ps), "--out", str(out), "--config", str(cfg)]).exit_code == 0
    assert (schema.read_table(out)["weight"] == 0.5).all()


@pytest.mark.parametrize(
    "make_bad,needle",
    [
        (lambda d: d.with_columns(pl.lit(float("nan")).cast(pl.Float32).alias("reward_env")), "column 'reward_env'"),
        (lambda d: d.drop("action"), "column 'action': missing column"),
        (lambda d: d.with_columns(pl.lit("mars").alias("env")), "no labelling rules for environment 'mars'"),
    ],
)
def test_label_bad_input_one_line_error(tmp_path, buffers, make_bad, needle):
    _, ps = buffers
    bad = tmp_path / "bad.parquet"
    make_bad(pl.read_parquet(ps)).write_parquet(bad)
    out = tmp_path / "out.parquet"
    r = runner.invoke(app, ["label", str(bad), "--out", str(out)])
    assert r.exit_code == 2
    assert needle in r.stderr and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
    assert not out.exists()


def test_label_refuses_to_overwrite_input(buffers):
    pe, _ = buffers
    r = runner.invoke(app, ["label", str(pe), "--out", str(pe)])
    assert r.exit_code == 2 and "overwrite an input" in r.stderr


def test_label_rejects_trajectory_in_two_inputs(tmp_path, buffers):
    pe, _ = buffers
    r = runner.invoke(app, ["label", str(pe), str(pe), "--out", str(tmp_path / "o.parquet")])
    assert r.exit_code == 2 and "also appears in" in r.stderr


def test_label_bad_config(tmp_path, buffers):
    _, ps = buffers
    cfg = tmp_path / "c.yaml"
    cfg.write_text("label:\n  gamma: 3\n")
    r = runner.invoke(app, ["label", str(ps), "--out", str(tmp_path / "o.parquet"), "--config", str(cfg)])
    assert r.exit_code == 2 and "field 'gamma'" in r.stderr and "<= 1.0" in r.stderr
    cfg.write_text("label:\n  gama: 0.9\n")
    r = runner.invoke(app, ["label", str(ps), "--out", str(tmp_path / "o.parquet"), "--config", str(cfg)])
    assert r.exit_code == 2 and "unknown key" in r.stderr


def test_subprocess_label_then_inspect(tmp_path, buffers):
    pe, ps = buffers
    out = tmp_path / "lab.parquet"
    r = run_qevolve("label", pe, ps, "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    r = run_qevolve("inspect", out, "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    df = pl.read_parquet(out)
    assert stats["trajectories"] == df["traj_id"].n_unique() == 13
    assert stats["steps"] == df.height
    assert stats["trajectories_by_source"] == {"expert": 5, "self": 8}
    assert sum(stats["steps_by_aux_kind"].values()) == df.height
    assert stats["success_rate"] == pytest.approx(df.group_by("traj_id").agg(pl.col("success").first())["success"].mean())
    human = run_qevolve("inspect", out)
    assert human.returncode == 0 and "success_rate" in human.stdout
    missing = run_qevolve("inspect", tmp_path / "nope.parquet")
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr


def test_label_does_not_import_torch(tmp_path, buffers):
    pe, _ = buffers
    code = (
        "import sys; from qevolve_cli.labeling import label_tables; "
        f"label_tables([{str(pe)!r}], {str(tmp_path / 'x.parquet')!r}); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    import subprocess
    import sys

    from conftest import qevolve_env

    r = subprocess.run([sys.executable, "-c", code], env=qevolve_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("model", ["tiny_model_dir", "smollm2_dir"])
def test_label_with_tokenizer_adds_positions(tmp_path, buffers, model, request):
    pe, ps = buffers
    out = tmp_path / "pos.parquet"
    model_dir = request.getfixturevalue(model)
    r = run_qevolve("label", pe, ps, "--tokenizer", model_dir, "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["prefix"]["fallback_trajectories"] == 0
    df = schema.read_table(out)
    for c in ("pos_s", "pos_sa", "pos_next", "seq_len"):
        assert df[c].null_count() == 0
    assert (df["pos_s"] < df["pos_sa"]).all() and (df["pos_sa"] < df["pos_next"]).all()
    assert (df["pos_next"] < df["seq_len"]).all()
    # within a trajectory (no truncation here) the next state of step t is the state of step t+1
    nxt = df.with_columns(pl.col("pos_s").shift(-1).over("traj_id").alias("s_next")).drop_nulls("s_next")
    assert (nxt["pos_next"] == nxt["s_next"]).all()
    # the positions are the slow per-prefix reference's with this tokenizer's chat template
    from transformers import AutoTokenizer

    from qevolve_cli.prefix import POS_COLUMNS, reference_positions

    ref = reference_positions(df.drop(list(POS_COLUMNS)), AutoTokenizer.from_pretrained(model_dir))
    assert df.select(POS_COLUMNS).to_dicts() == ref.select(POS_COLUMNS).to_dicts()


def test_advantage_kind_without_values(tmp_path, buffers):
    """--advantage without critic values is an error; a config asking for gae_aux just labels (evolve's first pass)."""
    _, ps = buffers
    r = runner.invoke(app, ["label", str(ps), "--out", str(tmp_path / "a.parquet"), "--advantage", "gae_aux"])
    assert r.exit_code == 2 and "needs critic values" in r.stderr and not (tmp_path / "a.parquet").exists()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("label:\n  advantage: gae_aux\n")
    r = runner.invoke(app, ["label", str(ps), "--out", str(tmp_path / "b.parquet"), "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    assert "advantage" not in schema.read_table(tmp_path / "b.parquet").columns


def test_inspect_reports_critic_diagnostics_and_warns_on_flat_values(tmp_path, buffers):
    pe, ps = buffers
    out = tmp_path / "lab.parquet"
    assert run_qevolve("label", pe, ps, "--out", out).returncode == 0
    df = pl.read_parquet(out)
    # V = 1 on successful trajectories, 0 on failed ones: a perfect ranking (AUC 1) whatever the returns
    good = df.with_columns(pl.col("success").cast(pl.Float32).alias("value"),
                           pl.col("success").cast(pl.Float32).alias("next_value"),
                           pl.when(pl.col("success")).then(0.1).otherwise(-0.1).cast(pl.Float32).alias("advantage"))
    schema.write_table(good, tmp_path / "good.parquet")
    r = run_qevolve("inspect", tmp_path / "good.parquet", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)["critic_diagnostics"]
    assert d["auc_v"] == pytest.approx(1.0) and d["failed_self_pos_adv"] == 0.0 and d["problems"] == []
    assert "warning" not in r.stderr
    flat = good.with_columns(pl.lit(-0.11, pl.Float32).alias("value"), pl.lit(-0.11, pl.Float32).alias("next_value"),
                             pl.lit(0.05, pl.Float32).alias("advantage"))
    schema.write_table(flat, tmp_path / "flat.parquet")
    r = run_qevolve("inspect", tmp_path / "flat.parquet")
    assert r.returncode == 0, r.stderr
    assert "critic" in r.stdout
    warn = [ln for ln in r.stderr.splitlines() if "warning" in ln]
    assert len(warn) == 1 and "AUC of V for success 0.50" in warn[0] and "docs/critic.md" in warn[0]


def test_label_imports_stay_light(tmp_path, buffers):
    """`qevolve label` (no --tokenizer/--critic) imports neither pandas, pyarrow (nor numpy) nor torch: their
    imports were 0.6 s of a 1M-step label run (benchmarks/bench_core.py, compact table); pyarrow and numpy
    alone 0.1-0.2 s. Columns reach the Rust core as Polars Series (Arrow streams)."""
    import subprocess
    import sys

    from tests.conftest import ROOT, qevolve_env

    expert, self_play = buffers
    # the console script's path (`main`: only the label command is registered); rich (0.04 s) is not
    # needed for the one summary line either
    code = ("import sys; from qevolve_cli.cli import main\n"
            "sys.argv = ['qevolve'] + sys.argv[1:]\n"
            "try: main()\n"
            "except SystemExit as e: assert e.code in (0, None), e.code\n"
            "print(sorted(m for m in ('pandas', 'pyarrow', 'numpy', 'torch', 'transformers', 'rich')"
            " if m in sys.modules))")
    out = tmp_path / "l.parquet"
    p = subprocess.run([sys.executable, "-c", code, "label", str(expert), str(self_play), "--out", str(out)],
                       cwd=ROOT, env=qevolve_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout
    assert "wrote" in p.stderr and "trajectories" in p.stderr  # the summary line, without rich
    df = pl.read_parquet(out)
    assert {"reward_aux", "aux_kind", "success", "weight"} <= set(df.columns)
