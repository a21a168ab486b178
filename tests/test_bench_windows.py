"""benchmarks/bench_windows.py on a real subprocess run: long trajectories keep every step with windows."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from qevolve_cli.schema import write_table
from qevolve_cli.synthetic import synthetic_table
from tests.conftest import qevolve_env

ROOT = Path(__file__).resolve().parent.parent


def test_windows_train_every_step_that_one_sequence_drops(tiny_model_dir, tmp_path):
    table = tmp_path / "long.parquet"
    write_table(synthetic_table(6, mean_steps=8, obs_words=30, env="textcraft", seed=1), table)
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_windows.py"), "--model", str(tiny_model_dir),
                        "--tables", str(table), "--max-length", "600", "--window-context", "1", "0.5"],
                       capture_output=True, text=True, env=qevolve_env(), timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)["results"]["textcraft"]["max_length_600"]
    pol, cri = r["policy"], r["critic"]
    assert pol["one_sequence"]["share_trained"] < 1.0 and cri["skip_long"]["share_trained"] < 1.0
    for rule in ("windows_1", "windows_0.5"):
        assert pol[rule]["share_trained"] == 1.0 and cri[rule]["share_trained"] == 1.0
        assert pol[rule]["tokens_vs_one_sequence"] > 1.0
    # windows with room are shared by more steps: fewer sequences and tokens than one window per step
    assert pol["windows_0.5"]["sequences"] < pol["windows_1"]["sequences"]
    assert cri["windows_0.5"]["tokens"] < cri["windows_1"]["tokens"]
