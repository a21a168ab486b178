"""Learning check: Q-Evolve vs BC and RFT (filtered self-imitation, no critic), two iterations, several seeds.

For each environment and seed, through the library (the same functions as the sub-commands):

* shared by every arm: the tiny base model, the expert data, BC, the BC evaluation, the
  iteration-1 rollout of the BC policy, its labels and the iteration-1 critic;
* arms, each continued from the same BC policy with the same rollout seeds:
  - ``bc``       the BC policy itself (iteration 0);
  - ``rft``      BC continued on expert + the successful self trajectories collected so far (no
                 critic; the filtered self-imitation baseline), same lr/epochs as the BPPO stage;
  - ``qe_gae``   Q-Evolve, process reward GAE over r_env (the paper);
  - ``qe_gae_aux`` Q-Evolve, GAE over r_env + r_aux (the paper's ablation row);
* the policy step of every arm (RFT, BPPO) is chosen per seed among a few candidates (:data:`GRID`:
  the preset, 0.2x its lr, and for BPPO the same with standardised advantages) by greedy success on
  a validation slice: the last 40 tasks of the *train* split, disjoint from the expert and rollout
  tasks. Only the selected candidate is evaluated on the held-out splits;
* iteration 2: every arm rolls out its own iteration-1 policy (same seed), the Q-Evolve arms
  train a new critic on expert + that rollout, then BPPO / RFT again with the candidate chosen at
  iteration 1 (the iteration-2 preset lr, scaled the same way);
* greedy evaluation of every policy on held-out ``test_seen`` and ``test_unseen`` (the first
  ``eval_max_tasks`` tasks of each, as the preset says; the same tasks for every arm).

Prints ONE JSON object: per seed and arm the held-out success and number of tasks per split and
iteration, the critic diagnostics of every critic (held-out slice of the training buffer), stage
times; then mean and standard error over seeds per arm, split and iteration, and of ``held_out``:
every task of the held-out splits pooled, each counted once (each split's success weighted by its
tasks; docs/results.md, "Held out"). Nothing is tuned on the
held-out splits: the presets were chosen on the critic's held-out slice of training rollouts.

    python benchmarks/bench_learning.py --env lamps --seeds 0 1 2 --runs runs/learning
    python benchmarks/bench_learning.py --env textcraft --seeds 0 1 2 --runs runs/learning
    python benchmarks/bench_learning.py --env lamps --seeds 0 --iters 1 --arms bc qe_gae

``--runs DIR`` keeps every stage's output; running again skips finished stages (resume).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = ("bc", "rft", "qe_gae", "qe_gae_aux")

# Policy-step candidates of each arm, chosen per seed on VAL_TASKS train tasks (never on the held-out splits).
# lr_scale multiplies the preset's lr of the iteration; the first candidate is the preset itself.
# Iteration 2 reuses the candidate chosen at iteration 1 (with iteration 2's preset lr).
GRID = {
    "rft": [{}, {"lr_scale": 0.2}],
    "qe": [{}, {"lr_scale": 0.2}, {"normalize_advantage": True}, {"lr_scale": 0.2, "normalize_advantage": True}],
}
VAL_TASKS = 40
# The candidates are relative to the policy step the presets had when the learning check was run
# (lamps: lr 5e-4 / 2.5e-4). The lamps preset now has the step chosen here (0.2x: 1e-4 / 5e-5), so
# the base is pinned: a fresh run reproduces docs/learning_check.md and reuses its run directories.
BASE_POLICY_LR = {"lamps": {1: 5.0e-4, 2: 2.5e-4}}


def cand_dir(cand: dict) -> str:
    """Directory of a candidate policy: ``policy`` for the preset, else ``policy_lr0.2_norm`` style."""
    parts = []
    if cand.get("lr_scale", 1.0) != 1.0:
        parts.append(f"lr{cand['lr_scale']:g}")
    if cand.get("normalize_advantage"):
        parts.append("norm")
    return "_".join(["policy"] + parts)


def log(msg: str) -> None:
    print(f"[bench_learning] {msg}", file=sys.stderr, flush=True)


COLLECT_ONLY = False  # --collect: read what finished, run nothing


def stage(path: Path, fn, times: dict, name: str):
    """Run ``fn`` unless ``path`` exists (files are written atomically by the library)."""
    if path.exists() or COLLECT_ONLY:
        return
    t0 = time.perf_counter()
    fn()
    times[name] = round(time.perf_counter() - t0, 1)


def eval_scores(table: Path) -> dict:
    import polars as pl

    df = pl.read_parquet(table)
    failed = df.filter(pl.col("error").is_not_null())["traj_id"].n_unique()
    if failed:  # a crashed episode is not a policy failure: refuse to score it
        raise SystemExit(f"{table}: {failed} episodes crashed (column 'error'); delete the table and rerun")
    per = df.group_by("traj_id").agg(pl.col("reward_env").sum().alias("r"), pl.len().alias("steps"))
    return {"success": float((per["r"] > 0).mean()), "avg_reward": float(per["r"].mean()), "tasks": per.height}


def rollout_success(table: Path) -> float:
    import polars as pl

    per = pl.read_parquet(table).group_by("traj_id").agg(pl.col("reward_env").sum())
    return float((per["reward_env"] > 0).mean())


def critic_summary(critic_dir: Path) -> dict:
    s = json.loads((critic_dir / "summary.json").read_text())
    d = s.get("diagnostics", {})
    keep = ("on", "trajectories", "bellman_q", "td_v", "ev_return", "auc_v", "auc_v0", "v_std",
            "failed_self_pos_adv", "success_self_pos_adv", "problems")
    return {"epochs_run": s.get("epochs_run"), "early_stopped_at": s.get("early_stopped_at"),
            "restored_epoch": s.get("restored_epoch"), "seconds": s.get("seconds"),
            **{k: d.get(k) for k in keep}}


def advantage_summary(table: Path) -> dict:
    """On the whole labelled buffer: share of failed self steps with A > 0, mean A of invalid/format steps."""
    import polars as pl

    df = pl.read_parquet(table, columns=["source", "success", "aux_kind", "advantage"])
    f = df.filter((pl.col("source") == "self") & ~pl.col("success"))
    s = df.filter((pl.col("source") == "self") & pl.col("success"))
    bad = df.filter(pl.col("aux_kind").is_in(["invalid", "format", "repeat"]))
    return {"failed_self_pos_adv": float((f["advantage"] > 0).mean()) if f.height else None,
            "success_self_pos_adv": float((s["advantage"] > 0).mean()) if s.height else None,
            "penalised_steps_mean_adv": float(bad["advantage"].mean()) if bad.height else None}


def run_seed(env: str, preset: str, seed: int, iters: int, arms: list[str], run: Path) -> dict:
    import polars as pl

    from qevolve_cli import schema
    from qevolve_cli.critic.trainer import train_critic
    from qevolve_cli.envs.expert import collect_expert
    from qevolve_cli.evolve.config import resolve
    from qevolve_cli.labeling import label_tables
    from qevolve_cli.models.tiny import create_tiny_model
    from qevolve_cli.policy.trainer import train_policy
    from qevolve_cli.rollout.evaluate import run_eval
    from qevolve_cli.rollout.loop import run_rollout

    cfg = resolve(env, preset, overrides={"iters": max(iters, 1), "seed": seed,
                                           "policy_step": "bppo"})  # its arms continue BC (BPPO, RFT)
    run.mkdir(parents=True, exist_ok=True)
    times: dict = {}
    res: dict = {"seed": seed, "run_dir": str(run), "scores": {}, "critics": {}, "advantages": {},
                 "train_rollout_success": {}}
    arch, size = cfg.init_model.split(":")
    base = run / "base_model"
    stage(base, lambda: create_tiny_model(base, arch=arch, size=size, seed=seed), times, "base_model")
    expert = run / "expert.parquet"

    def collect():
        df = collect_expert(env, "train", limit=cfg.expert_limit or None, workers=cfg.expert_workers)
        schema.write_table(df, expert, producer="bench_learning: expert")

    stage(expert, collect, times, "expert")
    bc = run / "bc" / "policy"
    stage(bc, lambda: train_policy(cfg.stage("bc", 0), expert, base, bc, quiet=True), times, "bc")

    def evaluate(arm: str, k: int, policy: Path) -> None:
        for split in cfg.eval_splits:
            e_cfg = cfg.stage("rollout", max(k, 1)).replace(split=split, max_tasks=cfg.eval_max_tasks, iteration=k)
            tag = policy.name.removeprefix("policy")  # "" for the preset candidate (and BC), "_lr0.2" ...
            out = run / arm / f"iter_{k}" / f"eval_{split}{tag}.parquet"
            stage(out, lambda e_cfg=e_cfg, out=out: run_eval(e_cfg, policy, out, resume=True), times,
                  f"{arm}/iter_{k}/eval_{split}")
            if out.exists():
                res["scores"].setdefault(arm, {}).setdefault(split, {})[f"iter_{k}"] = eval_scores(out)

    evaluate("bc", 0, bc)
    for arm in arms:
        if arm != "bc":
            res["scores"].setdefault(arm, {})
            for split in cfg.eval_splits:  # iteration 0 of every arm is the shared BC policy
                if split in res["scores"].get("bc", {}):
                    res["scores"][arm].setdefault(split, {})["iter_0"] = res["scores"]["bc"][split]["iter_0"]

    # validation: the last VAL_TASKS tasks of the *train* split (disjoint from the expert and rollout tasks,
    # which are the first ones), greedy like the held-out evaluation. Policy-step settings are chosen here.
    from qevolve_cli.envs.splits import list_tasks

    train_tasks = list_tasks(env, "train")
    n = len(train_tasks)  # expert_limit / max_tasks 0 = every train task
    used = max(cfg.expert_limit or n, cfg.stage("rollout", 1).max_tasks or n)
    val_tasks = train_tasks[-VAL_TASKS:]
    disjoint = used + VAL_TASKS <= n
    if not disjoint:
        log(f"{env}: the validation tasks are among the first {used} train tasks that the experts or the "
            "rollouts use (not disjoint)")

    def val_score(policy: Path, out: Path, name: str) -> float | None:
        v_cfg = cfg.stage("rollout", 1).replace(split="train", max_tasks=0, iteration=0)
        stage(out, lambda: run_eval(v_cfg, policy, out, resume=True, tasks=val_tasks), times, name)
        return eval_scores(out)["success"] if out.exists() else None

    res["validation"] = {"tasks": len(val_tasks), "disjoint": disjoint,
                         "bc": val_score(bc, run / "bc" / "iter_0" / "val.parquet", "bc/iter_0/val")}

    def select(arm: str, k: int, grid: list[dict], train) -> tuple[Path, dict] | None:
        """Train every candidate of ``grid`` (``train(cand, out)``), score each on the validation tasks,
        return the best one's (policy, candidate) (ties: the earlier candidate, the preset first)."""
        best, best_v, scores = None, -1.0, {}
        for cand in grid:
            name = cand_dir(cand)
            out = run / arm / f"iter_{k}" / name
            stage(out, lambda cand=cand, out=out: train(cand, out), times, f"{arm}/iter_{k}/{name}")
            if not out.exists():
                continue
            v = val_score(out, out.parent / f"val_{name}.parquet", f"{arm}/iter_{k}/val_{name}")
            scores[name] = v
            if v is not None and v > best_v:
                best, best_v = (out, cand), v
        res["validation"].setdefault(arm, {})[f"iter_{k}"] = {"candidates": scores,
                                                              "selected": best[0].name if best else None}
        return best

    policies: dict[str, Path | None] = {arm: bc for arm in arms if arm != "bc"}
    chosen: dict[str, list[dict]] = {}  # the candidate selected at iteration 1, reused at iteration 2
    successes: dict[str, list[Path]] = {arm: [] for arm in policies}
    for k in range(1, iters + 1):
        r_cfg = cfg.stage("rollout", k).replace(split="train")
        l_cfg = cfg.stage("label", k)
        c_cfg = cfg.stage("critic", k)
        p_cfg = cfg.stage("policy", k)
        if k in BASE_POLICY_LR.get(env, {}):
            p_cfg = p_cfg.replace(lr=BASE_POLICY_LR[env][k])
        shared = k == 1  # iteration 1 starts every arm from BC: one rollout, one critic
        rollouts: dict[str, Path] = {}
        for arm, pol in policies.items():
            if pol is None:
                continue
            key = "shared" if shared else arm
            ro = run / key / f"iter_{k}" / "rollout.parquet"
            stage(ro, lambda ro=ro, pol=pol, r_cfg=r_cfg: run_rollout(r_cfg, pol, ro, resume=True,
                                                                      producer="bench_learning"),
                  times, f"{key}/iter_{k}/rollout")
            if ro.exists():
                rollouts[arm] = ro
                res["train_rollout_success"][f"{key}/iter_{k}"] = rollout_success(ro)
        new: dict[str, Path | None] = {}
        for arm, pol in policies.items():
            key = "shared" if shared else arm
            if arm not in rollouts:
                new[arm] = None
                continue
            grid = GRID["rft" if arm == "rft" else "qe"] if k == 1 else chosen.get(arm, [])

            def cfg_of(cand: dict, base=p_cfg):
                return base.replace(lr=base.lr * cand.get("lr_scale", 1.0),
                                    normalize_advantage=cand.get("normalize_advantage", base.normalize_advantage))

            if arm == "rft":
                ok = pl.read_parquet(rollouts[arm])
                ok = ok.filter(pl.col("traj_id").is_in(
                    ok.group_by("traj_id").agg(pl.col("reward_env").sum()).filter(pl.col("reward_env") > 0)["traj_id"]
                    .to_list()))
                succ = run / arm / f"iter_{k}" / "successes.parquet"
                if not succ.exists():
                    succ.parent.mkdir(parents=True, exist_ok=True)
                    schema.write_table(ok, succ, producer="bench_learning: rft successes")
                successes[arm].append(succ)
                data = run / arm / f"iter_{k}" / "rft_data.parquet"
                if not data.exists():
                    frames = [pl.read_parquet(expert)] + [pl.read_parquet(p) for p in successes[arm]]
                    schema.write_table(pl.concat(frames, how="diagonal_relaxed"), data, producer="bench_learning: rft")

                def train(cand, out, pol=pol, data=data):
                    train_policy(cfg_of(cand).replace(objective="bc", bc_source="all"), data, pol, out, quiet=True)
            else:
                labeled = run / key / f"iter_{k}" / "labeled.parquet"
                stage(labeled, lambda labeled=labeled, ro=rollouts[arm], l_cfg=l_cfg:
                      label_tables([expert, ro], labeled, l_cfg, tokenizer=base),
                      times, f"{key}/iter_{k}/label")
                critic = run / key / f"iter_{k}" / "critic"
                stage(critic, lambda critic=critic, labeled=labeled, c_cfg=c_cfg: train_critic(c_cfg, labeled, base, critic),
                      times, f"{key}/iter_{k}/critic")
                if (critic / "summary.json").exists():
                    res["critics"][f"{key}/iter_{k}"] = critic_summary(critic)
                kind = "gae" if arm == "qe_gae" else "gae_aux"
                adv = run / arm / f"iter_{k}" / "advantages.parquet"
                a_cfg = l_cfg.replace(advantage=kind)
                stage(adv, lambda adv=adv, labeled=labeled, critic=critic, a_cfg=a_cfg:
                      label_tables([labeled], adv, a_cfg, critic=critic), times, f"{arm}/iter_{k}/advantage")
                if adv.exists():
                    res["advantages"][f"{arm}/iter_{k}"] = advantage_summary(adv)

                def train(cand, out, pol=pol, adv=adv):
                    train_policy(cfg_of(cand), adv, pol, out, ref=pol, quiet=True)
            best = select(arm, k, grid, train)
            new[arm] = best[0] if best else None
            if best is not None:
                if k == 1:
                    chosen[arm] = [best[1]]
                evaluate(arm, k, best[0])
        policies = new
    res["stage_seconds"] = times
    return res


def mean_se(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"mean": None, "se": None, "n": 0}
    m = statistics.fmean(xs)
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None
    return {"mean": m, "se": se, "n": len(xs)}


def pooled(scores: dict[str, float], tasks: dict[str, int]) -> float:
    """The held-out success: every task of the splits counted once (each split's success weighted by its tasks)."""
    n = sum(tasks.values())
    return sum(scores[s] * tasks[s] for s in scores) / n if n else 0.0


def held_out(sc: dict, splits: list[str], k: int) -> float | None:
    """One seed's held-out success of one arm at iteration ``k`` (None unless every split was evaluated)."""
    cells = {s: sc.get(s, {}).get(f"iter_{k}") for s in splits}
    if any(c is None or c.get("success") is None for c in cells.values()):
        return None
    return pooled({s: c["success"] for s, c in cells.items()}, {s: c["tasks"] for s, c in cells.items()})


def aggregate(seeds: list[dict], arms: list[str], splits: list[str], iters: int) -> dict:
    """Mean ± s.e. over the seeds per arm, iteration and split, and of the held-out success (pooled)."""
    out: dict = {}
    for arm in arms:
        for split in splits + ["held_out"]:
            for k in range(0, iters + 1 if arm != "bc" else 1):
                vals = []
                for r in seeds:
                    sc = r["scores"].get(arm, {})
                    if split == "held_out":
                        vals.append(held_out(sc, splits, k))
                    else:
                        vals.append(sc.get(split, {}).get(f"iter_{k}", {}).get("success"))
                out.setdefault(arm, {}).setdefault(split, {})[f"iter_{k}"] = mean_se(vals)
    return out


def markdown(seeds: list[dict], agg: dict, arms: list[str], splits: list[str], iters: int) -> str:
    """The held-out table of docs/learning_check.md: per seed and arm, seen / unseen success (%) per
    iteration, then mean ± standard error over seeds (held-out: every task of the splits pooled once)."""
    pct = lambda x: "–" if x is None else f"{100 * x:.1f}"  # noqa: E731
    cols = [(a, k) for a in arms for k in (range(0, 1) if a == "bc" else range(1, iters + 1))]
    head = "| seed | " + " | ".join(f"{a} it{k}" for a, k in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for r in seeds:
        cells = []
        for a, k in cols:
            sc = r["scores"].get(a, {})
            cells.append(" / ".join(pct(sc.get(sp, {}).get(f"iter_{k}", {}).get("success")) for sp in splits))
        lines.append(f"| {r['seed']} ({' / '.join(splits)}) | " + " | ".join(cells) + " |")
    for sp in splits + ["held_out"]:
        cells = []
        for a, k in cols:
            m = agg.get(a, {}).get(sp, {}).get(f"iter_{k}", {})
            cells.append("–" if m.get("mean") is None else
                         f"{100 * m['mean']:.1f} ± {100 * (m['se'] or 0):.1f}")
        lines.append(f"| **mean ± s.e., {sp}** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="lamps", choices=("lamps", "textcraft"))
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--runs", default="runs/learning", help="Directory of the run directories (kept; resumable).")
    ap.add_argument("--collect", action="store_true", help="Only read the stages that finished (no training).")
    ap.add_argument("--markdown", action="store_true", help="Also print the held-out table as Markdown on stderr.")
    args = ap.parse_args()
    global COLLECT_ONLY
    COLLECT_ONLY = args.collect

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    arms = ["bc"] + [a for a in args.arms if a != "bc"]
    t0 = time.perf_counter()
    seeds = []
    for s in args.seeds:
        log(f"{args.env} seed {s} ...")
        r = run_seed(args.env, args.preset, s, args.iters, arms, Path(args.runs) / args.env / f"seed{s}")
        seeds.append(r)
        log(f"{args.env} seed {s}: " + json.dumps({a: {sp: {k: round(v['success'], 3) for k, v in d.items()}
                                                       for sp, d in r["scores"][a].items()} for a in arms}))
    from qevolve_cli.evolve.config import resolve

    splits = list(resolve(args.env, args.preset).eval_splits)
    out = {"benchmark": "learning_check", "env": args.env, "preset": args.preset, "iters": args.iters,
           "arms": arms, "seeds": seeds, "mean_se": aggregate(seeds, arms, splits, args.iters),
           "total_s": round(time.perf_counter() - t0, 1), "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    if args.markdown:
        print(markdown(seeds, out["mean_se"], arms, splits, args.iters), file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
