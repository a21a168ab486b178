"""The critic's fit ladder (qevolve_cli/critic/ladder.py) on tables whose answers are known."""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from qevolve_cli.critic.config import CriticConfig
from qevolve_cli.critic.credit import within_traj_corr
from qevolve_cli.critic.diagnostics import verdict, warning_line
from qevolve_cli.critic.ladder import (
    failed_trend,
    fit_ladder,
    ladder_line,
    ladder_problems,
    td_residuals,
    terminal_fit,
)


def test_terminal_fit_by_hand():
    q = np.array([0.9, 0.2, 0.7, 0.5, 0.1])
    r = np.array([1.0, 0.0, 0.0, 0.0, -0.2])
    done = np.array([True, False, True, False, True])
    ok = np.array([True, True, False, False, False])
    t = terminal_fit(q, r, done, ok)
    assert t["all"] == {"n": 3, "mae": pytest.approx((0.1 + 0.7 + 0.3) / 3, abs=1e-4)}
    assert t["successful"] == {"n": 1, "mae": pytest.approx(0.1, abs=1e-4)}
    assert t["failed"] == {"n": 2, "mae": pytest.approx(0.5, abs=1e-4)}
    # rows that are not terminal have no effect, whatever they hold
    q2 = q.copy()
    q2[~done] = 123.0
    assert terminal_fit(q2, r, done, ok) == t


def test_td_residuals_against_a_reference_loop():
    rng = np.random.default_rng(0)
    n, g, m = 50, 0.9, 0.7
    q, qbar, v, vn, r, w = (rng.normal(size=n) for _ in range(6))
    w = np.abs(w) + 0.1
    done = rng.random(n) < 0.3
    got = td_residuals(q, qbar, v, vn, r, done, w, g, m)
    num_td = num_ex = num_gap = den = 0.0
    for i in range(n):
        y = r[i] + (0.0 if done[i] else g * vn[i])  # V(s') of a terminal never counts
        num_td += w[i] * abs(q[i] - y)
        d = qbar[i] - v[i]
        num_ex += w[i] * (m if d >= 0 else 1 - m) * d * d
        num_gap += w[i] * d
        den += w[i]
    assert got["td_q_mae"] == pytest.approx(num_td / den, abs=1e-4)
    assert got["expectile_v"] == pytest.approx(num_ex / den, abs=1e-5)
    assert got["qbar_minus_v"] == pytest.approx(num_gap / den, abs=1e-4)
    # a next value after a terminal step has no effect
    vn2 = vn.copy()
    vn2[done] = 1e6
    assert td_residuals(q, qbar, v, vn2, r, done, w, g, m) == got


def test_failed_trend_sees_v_rise_along_failures():
    traj = np.array(["a"] * 4 + ["b"] * 4)
    step = np.array([0, 1, 2, 3] * 2)
    v = np.array([0.1, 0.2, 0.3, 0.4, 0.9, 0.8, 0.7, 0.6])
    rising = failed_trend(traj, step, v, np.array([True] * 4 + [False] * 4))
    falling = failed_trend(traj, step, v, np.array([False] * 4 + [True] * 4))
    assert rising["corr_step"] == pytest.approx(1.0) and rising["by_quarter"] == [0.1, 0.2, 0.3, 0.4]
    assert falling["corr_step"] == pytest.approx(-1.0)


def test_within_traj_corr_removes_the_outcome():
    # a trajectory-level offset alone: no within-trajectory credit
    t = ["a", "a", "b", "b"]
    assert within_traj_corr(t, [1, 1, 0, 0], [0.5, -0.5, 0.5, -0.5]) is None
    # deviations (0.5, -0.5, 0.5, -0.5) and (0.3, -0.3, 0.1, -0.1): 0.4 / sqrt(1 * 0.2)
    assert within_traj_corr(t, [1.0, 0.0, 5.0, 4.0], [0.3, -0.3, 0.1, -0.1]) == pytest.approx(0.4 / 0.2 ** 0.5)
    assert within_traj_corr(t, [1.0, 0.0, 5.0, 4.0], [9.3, 8.7, 0.3, -0.3]) == pytest.approx(1.0)


def test_problems_name_the_rung_with_its_numbers():
    lad = {"terminal": {"failed": {"n": 49, "mae": 0.68}, "successful": {"n": 120, "mae": 0.04}},
           "solver": {"v_corr_tabular": 0.2, "credit": -0.07, "credit_tabular": 0.63}}
    bad = ladder_problems(lad)
    assert bad[0] == "does not fit its own terminal transitions: mean |Q - r| 0.68 over 49 failed endings"
    assert "corr +0.20" in bad[1]
    assert bad[2] == ("no step credit: within-trajectory correlation with the exact advantages -0.07 (the exact "
                      "tabular critic of the same data: +0.63)")
    d = {"fit_ladder": lad, "n_success": 30, "n_failed": 30, "ev_return": 0.5, "auc_v": 0.8, "v_std": 0.2}
    assert verdict(d) == bad  # the held-out figures are fine: the ladder alone says it has not learned
    w = warning_line(d)
    assert w.startswith("warning: the critic has not learned (training data: does not fit its own terminal")
    assert "docs/critic.md#the-fit-ladder" in w
    # both endings missed (TextCraft's tiny critic): one problem, the failed endings first
    both = {"terminal": {"failed": {"n": 48, "mae": 0.15}, "successful": {"n": 298, "mae": 0.78}}}
    assert ladder_problems(both) == ["does not fit its own terminal transitions: mean |Q - r| 0.15 over 48 failed "
                                     "endings and 0.78 over 298 successful endings"]
    good = {"terminal": {"failed": {"n": 49, "mae": 0.05}}, "solver": {"v_corr_tabular": 0.9, "credit": 0.4}}
    assert ladder_problems(good) == [] and warning_line({**d, "fit_ladder": good}) is None


def _solver_table() -> pl.DataFrame:
    """lamps-habit: expert demonstrations plus episodes that mostly take the best command and sometimes a random
    one (real environment, labelled): some succeed, some run out of steps."""
    import copy

    from qevolve_cli.envs.builtin import optimal_steps
    from qevolve_cli.envs.expert import collect_expert
    from qevolve_cli.envs.registry import list_tasks, make_env
    from qevolve_cli.labeling import LabelConfig, label_frame
    from qevolve_cli.react import format_react

    exp = collect_expert("lamps-habit", "train", limit=6)
    rng = np.random.default_rng(0)
    cmds = ["go east", "go west", "turn on lamp", "look"]
    rows = []
    for k, task in enumerate(list_tasks("lamps-habit", "train", 6)):
        for rep in range(3):
            env = make_env("lamps-habit")
            obs = env.reset(task)
            t = 0
            while True:
                def dist(c: str, env=env) -> int:
                    e = copy.deepcopy(env)
                    e.step(c)
                    room, lit = e.state()
                    return optimal_steps(room, lit, e.targets, e.ordered)

                best = min(cmds[:3], key=dist)
                cmd = best if rng.random() < 0.75 else str(rng.choice(cmds))
                nxt, r, done, _ = env.step(cmd)
                rows.append(dict(traj_id=f"self:{k}:{rep}", env="lamps-habit", task_id=task.task_id, split="train",
                                 source="self", iteration=1, step=t, instruction=env.instruction, observation=obs,
                                 action=format_react("Go.", cmd), command=cmd, next_observation=nxt,
                                 reward_env=float(r), done=bool(done), steps_left=env._episode_max_steps - t))
                obs, t = nxt, t + 1
                if done:
                    break
    self_df = pl.DataFrame(rows).with_columns(pl.col("iteration").cast(pl.Int32), pl.col("step").cast(pl.Int32),
                                              pl.col("reward_env").cast(pl.Float32), pl.col("steps_left").cast(pl.Int32))
    exp = exp.with_columns(pl.lit(None, pl.Int32).alias("steps_left"))  # filled by label's step limit
    df = pl.concat([exp.select(self_df.columns), self_df], how="vertical_relaxed")
    out, _ = label_frame(df, LabelConfig(step_limit=26))
    return out


def test_solver_rungs_on_known_values():
    """V = the exact tabular fixed point itself: correlation 1 and exactly the tabular critic's credit; a constant
    V: no credit, named in the problems."""
    from qevolve_cli.critic.credit import exact_references

    df = _solver_table()
    cfg = CriticConfig()
    reward = (df["reward_env"] + df["reward_aux"]).to_numpy()
    weight = df["weight"].to_numpy()
    ref = exact_references(df, cfg.gamma, cfg.diag_lambda, cfg.expectile, reward, weight)
    assert ref["v_tab"].std() > 0 and (~df["success"]).sum() > 0
    cols = {"value": ref["v_tab"].astype(np.float32), "next_value": ref["nv_tab"].astype(np.float32),
            "q_value": ref["v_tab"].astype(np.float32)}
    rows = np.arange(df.height)
    lad = fit_ladder(df, cols, rows, reward, weight, cfg)
    s = lad["solver"]
    assert s["v_corr_tabular"] == pytest.approx(1.0) and s["credit"] == s["credit_tabular"]
    assert s["credit"] > 0.3
    flat = {k: np.full(df.height, 0.5, np.float32) for k in cols}
    lad_flat = fit_ladder(df, flat, rows, reward, weight, cfg)
    assert lad_flat["solver"]["credit"] is None or abs(lad_flat["solver"]["credit"]) < 0.35
    assert any(p.startswith("no step credit") or "tabular fixed point" in p for p in ladder_problems(lad_flat))
    assert "credit" in ladder_line(lad) and "corr(V, tabular) +1.00" in ladder_line(lad)
