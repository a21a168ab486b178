"""What frozen backbone features hold of the exact value V* (docs/critic.md, "Which layer, which backbone").

For one `qevolve evolve` run on a lamps environment (an exact solver), its iteration-1 labelled table is
replayed for V* (the optimal value with the steps left) and "reachable" (V* > 0). A ridge probe (numpy,
standardised features, alpha chosen by an inner grouped CV) predicts V* from each backbone's hidden state at
the state's end, per layer, in 5 folds grouped by trajectory (each trajectory scored by a probe that never saw
it) and by task (unseen tasks). It gives the ceiling of a linear head on those features: the feature critic's
heads are small MLPs on the same features, trained by TD instead of on V*.

The features come from `qevolve_cli.critic.features` (the feature critic's own extraction and cache, beside
the table), so a layer probed here is a layer the critic can read (`feature_layer`).

    python benchmarks/bench_probe.py runs/hab-s0                                  # base model and BC policy
    python benchmarks/bench_probe.py runs/hab-s0 --models base_model bc/policy /models/smollm2 --layers 1 2 -1
    python benchmarks/bench_probe.py runs/hab-s0 --context-turns 1                # the last-turn view

Prints one JSON object: per model and layer, for each grouping, R² / Pearson r of V* and the AUC of the
prediction for "reachable", and the features' pass time; plus the baseline probe on [step, steps_left] alone.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qevolve_cli import schema  # noqa: E402
from qevolve_cli.critic.credit import auc  # noqa: E402
from qevolve_cli.envs.oracle import oracle_value, replay  # noqa: E402

ALPHAS = (0.1, 1.0, 10.0, 100.0, 1000.0)


def ridge_fit(x: np.ndarray, y: np.ndarray, alpha: float) -> tuple[np.ndarray, float]:
    """Ridge on standardised ``x`` (n, d): (w, b) with the intercept unpenalised."""
    xm, ym = x.mean(0), y.mean()
    xc = x - xm
    w = np.linalg.solve(xc.T @ xc + alpha * np.eye(x.shape[1]), xc.T @ (y - ym))
    return w, float(ym - xm @ w)


def folds(groups: np.ndarray, k: int, seed: int = 0) -> list[np.ndarray]:
    """Row masks of ``k`` folds, whole groups each (a fixed shuffle of the groups)."""
    u = np.unique(groups)
    rng = np.random.default_rng(seed)
    rng.shuffle(u)
    part = {g: i % k for i, g in enumerate(u)}
    f = np.array([part[g] for g in groups])
    return [f == i for i in range(k)]


def probe(x: np.ndarray, y: np.ndarray, groups: np.ndarray, k: int = 5) -> np.ndarray:
    """Out-of-fold predictions of ``y`` from ``x``: per outer fold, alpha chosen by an inner grouped 3-fold CV."""
    mu, sd = x.mean(0), x.std(0) + 1e-6
    z = (x - mu) / sd
    pred = np.zeros_like(y)
    for test in folds(groups, k):
        tr = ~test
        best, best_err = ALPHAS[0], np.inf
        for a in ALPHAS:
            err = 0.0
            for inner in folds(groups[tr], 3, seed=1):
                w, b = ridge_fit(z[tr][~inner], y[tr][~inner], a)
                err += float(np.sum((z[tr][inner] @ w + b - y[tr][inner]) ** 2))
            if err < best_err:
                best, best_err = a, err
        w, b = ridge_fit(z[tr], y[tr], best)
        pred[test] = z[test] @ w + b
    return pred


def scores(pred: np.ndarray, y: np.ndarray, reach: np.ndarray) -> dict:
    r2 = 1 - np.sum((pred - y) ** 2) / np.sum((y - y.mean()) ** 2)
    r = np.corrcoef(pred, y)[0, 1] if pred.std() > 0 else 0.0
    return {"r2": round(float(r2), 3), "r": round(float(r), 3),
            "auc_reachable": round(auc(pred[reach], pred[~reach]) or 0.5, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a qevolve evolve run directory on a lamps environment (iteration 1 labelled)")
    ap.add_argument("--models", nargs="+", default=["base_model", "bc/policy"],
                    help="backbones: directories inside the run, or paths (full checkpoints)")
    ap.add_argument("--layers", nargs="+", type=int, default=None, help="hidden-state layers (default: every one)")
    ap.add_argument("--context-turns", type=int, default=0, help="the view (0: whole transcript; K: the last K turns)")
    ap.add_argument("--gamma", type=float, default=0.95)
    ap.add_argument("--max-length", type=int, default=None)
    a = ap.parse_args()

    from qevolve_cli.critic.features import cached_features
    from qevolve_cli.tokenizer import load_tokenizer

    table = a.run / "iter_1" / "labeled.parquet"
    df = schema.sort_steps(schema.drop_failed(pl.read_parquet(table)))
    max_steps = None
    rollout_cfg = a.run / "stages" / "rollout_1.yaml"
    if rollout_cfg.is_file():
        import yaml

        max_steps = (yaml.safe_load(rollout_cfg.read_text()) or {}).get("max_steps")
    recs = replay(df, source=table, max_steps=max_steps)
    y = np.array([oracle_value(r["d"], r["left"], a.gamma) for r in recs])
    left = np.array([r["left"] for r in recs], np.float64)
    reach = y > 0
    by_traj = df["traj_id"].to_numpy()
    by_task = df["task_id"].to_numpy()
    out: dict = {"bench": "probe", "run": str(a.run), "steps": df.height, "trajectories": int(df["traj_id"].n_unique()),
                 "tasks": int(df["task_id"].n_unique()), "context_turns": a.context_turns, "models": {}}
    base = np.stack([df["step"].to_numpy().astype(np.float64), left], 1)
    out["step_and_steps_left"] = {"by_trajectory": scores(probe(base, y, by_traj), y, reach),
                                  "by_task": scores(probe(base, y, by_task), y, reach)}
    for m in a.models:
        mdir = a.run / m if (a.run / m).is_dir() else Path(m)
        import json as _json

        n_layers = int(_json.loads((mdir / "config.json").read_text())["num_hidden_layers"])
        tok = load_tokenizer(mdir, require_chat_template=True)
        res = {}
        for layer in a.layers or list(range(1, n_layers + 1)):
            t0 = time.perf_counter()
            feats, info = cached_features(df, tok, mdir, layer=layer, context_turns=a.context_turns,
                                          max_length=a.max_length, window_context=1.0,
                                          cache_dir=a.run / "iter_1" / "features")
            x = feats["h_s"].astype(np.float64)
            res[str(layer)] = {"by_trajectory": scores(probe(x, y, by_traj), y, reach),
                               "by_task": scores(probe(x, y, by_task), y, reach),
                               "with_steps_left_by_trajectory": scores(probe(np.concatenate([x, left[:, None]], 1), y,
                                                                            by_traj), y, reach),
                               "features_seconds": round(time.perf_counter() - t0, 1), "cached": info["cached"]}
            print(f"{m} layer {layer}: {res[str(layer)]['by_trajectory']}", file=sys.stderr)
        out["models"][m] = res
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
