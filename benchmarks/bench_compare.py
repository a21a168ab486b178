"""The paper's comparison table with confidence intervals: SFT, RFT, ETO, Best-of-N (oracle), Q-Evolve.

Per environment and seed: `qevolve evolve --env ENV --preset cpu --iters 2 --seed S --select-on-validation`
with the whole held-out splits (eval_max_tasks 0), then `qevolve compare --select-on-validation` on its run
directory, both through the library (the same functions as the commands; docs/compare.md). Every arm is
chosen among the same number of candidates on validation train tasks. Prints one JSON object: per
environment the per-seed scores, per arm and column the mean and standard error over the seeds, and the
paired bootstrap 95 % intervals of every arm minus RFT, minus SFT and minus GiGPO where it is a row (pairs = the
same task of the same seed; seeds and tasks resampled: compare.paired_bootstrap). --markdown also prints the tables for
docs/compare.md on stderr: the scores, the paired differences, and each arm's budget per seed (epochs x lr x
data of every training stage, the validation scores of the candidates each selection chose from) and each seed's
cost. ``times``: ``evolve_s`` / ``compare_s``, wall seconds of the invocation that finished the seed (after a
resume, only the part after it), and ``evolve_stage_s`` / ``compare_stage_s``, the seconds of the seed's stages
summed from its run manifests, which survive resumes (every attempt of a stage resumed after a kill, the killed
one to its last heartbeat; runs made before 2026-11-28 counted the last attempt only: ``resumed_stages`` says how
many stages took more than one). Resumable:
a seed whose comparison is finished with the same configuration is read, not re-run; an unfinished one
resumes at its last finished stage.

    nice -n 10 python benchmarks/bench_compare.py --envs lamps lamps-hard --seeds 0 1 2 3 4 --runs runs/bench --markdown
    # seeds side by side, one process and core each; finished seeds also kept as small tables that outlive runs/:
    for s in 0 1; do OMP_NUM_THREADS=1 python benchmarks/bench_compare.py --envs lamps-habit --seeds $s \
        --runs runs/bench --keep-tables benchmarks/results/compare_tables & done; wait
    python benchmarks/bench_compare.py --envs lamps-habit --seeds 0 1 2 3 4 --collect \
        --keep-tables benchmarks/results/compare_tables --markdown    # the seeds kept so far, run nothing
    # the summary of given tables (runs' compare/table.json, kept tables, or a file of several seeds' tables),
    # the rows every seed has: seeds whose comparison made only some rows (scripts/rows_first.sh)
    python benchmarks/bench_compare.py --tables benchmarks/results/compare_smollm2_lamps_habit_rows_first_2026-11-30.json \
        --markdown
    # the pretrained model (SmolLM2-135M-Instruct, LoRA), one iteration, the arms' own settings, both cores:
    nice python benchmarks/bench_compare.py --envs lamps --preset cpu-smol --iters 1 --no-select --threads 2 \
        --seeds 0 1 2 --runs runs/smol --markdown
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HELD_OUT = "held-out"  # the column of both splits' tasks together


def evolve_config(env: str, preset: str, seed: int, iters: int, select: bool, eval_max_tasks: int):
    from qevolve_cli.evolve.config import resolve

    return resolve(env, preset, None, {"iters": iters, "seed": seed, "eval_max_tasks": eval_max_tasks,
                                       "select_on_validation": select})


def compare_config(env: str, best_of: int, select: bool, run: Path, add_arms: tuple[str, ...] = ()):
    """The comparison of one seed: the default rows for the run's environment and base model (`compare`'s own:
    no oracle-V row without a solver, no zero-shot row for a randomly initialised base), plus ``add_arms`` (rows
    only made when named, such as rft_2), in the table's order."""
    from qevolve_cli.evolve.compare import ARMS, CompareConfig, default_arms

    arms = set(default_arms(env, run / "base_model")) | set(add_arms)
    return CompareConfig(arms=[a for a in ARMS if a in arms], best_of=best_of, select_on_validation=select)


def finished_table(run: Path, cfg, ccfg) -> dict | None:
    """The seed's comparison table when it is finished with this configuration (nothing re-run)."""
    import yaml

    from qevolve_cli.evolve.compare import CompareConfig
    from qevolve_cli.evolve.config import EvolveConfig

    t, cc, ec = run / "compare" / "table.json", run / "compare" / "compare.yaml", run / "config.yaml"
    if not (t.is_file() and cc.is_file() and ec.is_file()):
        return None
    if EvolveConfig.from_dict(yaml.safe_load(ec.read_text())).work_hash() != cfg.work_hash():  # checkpoint
        return None  # intervals and log sinks may differ: they change how the run went, not what it made
    if CompareConfig.from_dict(yaml.safe_load(cc.read_text()) or {}).hash() != ccfg.hash():
        return None
    table = json.loads(t.read_text())
    # a table written before rows were added (by compare from before 2026-11-28) lacks them: not finished
    return table if set(ccfg.arms) <= {r["arm"] for r in table["rows"]} else None


def kept_table(path: Path, cfg, ccfg) -> dict | None:
    """A seed's table kept by --keep-tables (a small JSON: the table and the two configuration hashes) when it
    was made with this configuration: finished seeds survive their run directories (models are large; the
    tables, per-task outcomes included, are a few tens of kB and can be committed)."""
    if not path.is_file():
        return None
    kept = json.loads(path.read_text())
    # the arms come from the run's base model, which may be gone: compare everything else; a row asked for
    # (--add-arms) that the kept table lacks makes the seed run again (its finished stages are kept). The
    # evolve configuration may differ in how it ran (checkpoint frequencies: the same work hash)
    same_work = kept.get("evolve_hash") == cfg.hash() or kept.get("evolve_work_hash") == cfg.work_hash()
    if not same_work or kept.get("compare_hash") != ccfg.replace(arms=kept["arms"]).hash():
        return None
    if "evolve_work_hash" not in kept:  # kept before 2026-11-30: the work hash added, nothing else changed
        _write_kept(path, {**kept, "evolve_work_hash": cfg.work_hash()})
    from qevolve_cli.evolve.compare import DEFAULT_ARMS

    if {a for a in ccfg.arms if a not in DEFAULT_ARMS} - set(kept["arms"]):
        return None
    return kept["table"]


def keep_table(path: Path, cfg, ccfg, table: dict, times: dict | None) -> None:
    """Write a finished seed's table for kept_table, atomically."""
    _write_kept(path, {"evolve_hash": cfg.hash(), "evolve_work_hash": cfg.work_hash(), "compare_hash": ccfg.hash(),
                       "arms": list(ccfg.arms), "times": times, "table": table})


def add_kept_times(path: Path, times: dict) -> dict:
    """Add ``times`` entries the kept table lacks (a table kept before they were recorded, its run directory still
    there); everything else in the file stays as it was. Returns the merged times."""
    kept = json.loads(path.read_text())
    merged = {**times, **(kept.get("times") or {})}
    if merged != kept.get("times"):
        _write_kept(path, {**kept, "times": merged})
    return merged


def _write_kept(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_tables(paths: list[Path]) -> dict[str, list[dict]]:
    """The seeds' tables in ``paths``, by environment, each environment's in seed order. A file is one seed's table
    (a run's ``compare/table.json``), a table kept by --keep-tables (``{"table": ...}``) or several seeds'
    tables (``{"seeds": {"0": table, ...}}``). A file that is none of these, two tables of one environment and
    seed, or one environment's tables with other columns stop with one line naming the file."""
    by_env: dict[str, dict[int, tuple[Path, dict]]] = {}
    for path in paths:
        try:
            obj = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"bench_compare: {path}: not a readable JSON file ({e})") from None
        if isinstance(obj, dict) and isinstance(obj.get("seeds"), dict):
            found = list(obj["seeds"].values())
        elif isinstance(obj, dict) and isinstance(obj.get("table"), dict):
            found = [obj["table"]]
        else:
            found = [obj]
        if not found:
            raise SystemExit(f"bench_compare: {path}: field 'seeds' is empty: no table to summarize")
        for t in found:
            if not (isinstance(t, dict) and isinstance(t.get("rows"), list) and isinstance(t.get("columns"), list)
                    and isinstance(t.get("env"), str) and isinstance(t.get("seed"), int)):
                raise SystemExit(f"bench_compare: {path}: not a comparison table (field 'env', 'seed', 'columns' or "
                                 "'rows' missing): give a run's compare/table.json, a kept table or a file of "
                                 "several seeds' tables")
            seeds = by_env.setdefault(t["env"], {})
            if t["seed"] in seeds:
                raise SystemExit(f"bench_compare: {path}: {t['env']} seed {t['seed']} is also in "
                                 f"{seeds[t['seed']][0]}: give each seed once")
            first = next(iter(seeds.values()), None)
            if first is not None and first[1]["columns"] != t["columns"]:
                raise SystemExit(f"bench_compare: {path}: field 'columns' of {t['env']} seed {t['seed']} is "
                                 f"{t['columns']}, but {first[0]} has {first[1]['columns']}: the seeds must be "
                                 "evaluated on the same splits")
            seeds[t["seed"]] = (Path(path), t)
    return {env: [seeds[s][1] for s in sorted(seeds)] for env, seeds in by_env.items()}


def stage_seconds(run: Path) -> dict | None:
    """The seed's cost from its run manifests: the seconds of the finished stages of ``evolve`` (run/manifest.json)
    and of ``compare`` (run/compare/manifest.json), summed. Unlike the invocation's wall time this counts every
    session of a resumed seed, and every attempt of a stage resumed after a kill (``seconds_total``; manifests
    made before 2026-11-28 hold the last attempt only; ``resumed_stages``: how many stages took more than one).
    None when either manifest is missing."""
    from qevolve_cli.evolve.report import stage_times

    if not ((run / "manifest.json").is_file() and (run / "compare" / "manifest.json").is_file()):
        return None
    t = stage_times(run)  # `qevolve report`'s sums: per row (BC, iter k, compare), finished stages only
    compare_s = sum(r["total"] for r in t["rows"] if r["name"] == "compare")
    return {"resumed_stages": len(t["resumed"]), "evolve_stage_s": round(t["total_s"] - compare_s, 1),
            "compare_stage_s": round(compare_s, 1)}


def cost_markdown(env: str, seeds: list[int], times: dict) -> str:
    """One line: per seed, the minutes of evolve and compare summed over their stages (where recorded)."""
    cells = []
    for s in seeds:
        t = times.get(s) or {}
        if "evolve_stage_s" in t:
            cells.append(f"seed {s}: evolve {t['evolve_stage_s'] / 60:.0f} + compare {t['compare_stage_s'] / 60:.0f} min")
    if not cells:
        return ""
    return f"**{env}**, cost summed over the stages of each seed: " + "; ".join(cells) + "\n"


# the paired differences: every arm minus each (GiGPO: does the learned critic beat critic-free step credit)
REFS = {"rft": "RFT", "sft": "SFT", "rft_2": "RFT (2 rounds)", "gigpo": "GiGPO"}


def summarize(tables: list[dict], n_boot: int) -> dict:
    """Per arm: mean / s.e. over seeds of every column and of the held-out tasks together; paired bootstrap
    intervals of the arm minus RFT and minus SFT on the same tasks."""
    from qevolve_cli.evolve.compare import mean_se, paired_bootstrap

    cols = tables[0]["columns"]
    # the rows every seed has (a row added with --add-arms to some seeds only is left out until all have it)
    arms = [r["arm"] for r in tables[0]["rows"] if all(r["arm"] in {x["arm"] for x in t["rows"]} for t in tables)]
    by = [{r["arm"]: r for r in t["rows"]} for t in tables]

    def tasks_of(row, col):
        return row["per_task"][col] if col != HELD_OUT else {f"{c}:{k}": v for c in cols
                                                               for k, v in row["per_task"][c].items()}

    out: dict = {}
    for arm in arms:
        s: dict = {"method": by[0][arm]["method"], "oracle": by[0][arm]["oracle"], "columns": {}}
        for col in cols + [HELD_OUT]:
            vals = []
            for b in by:
                pt = tasks_of(b[arm], col)
                vals.append(sum(pt.values()) / len(pt) if pt else float("nan"))
            m, se = mean_se(vals)
            c: dict = {"mean": round(m, 4), "se": round(se, 4), "per_seed": [round(v, 4) for v in vals]}
            for ref in REFS:
                if ref == arm or ref not in arms:  # a reference every seed has
                    continue
                diffs = []
                for b in by:
                    a_t, r_t = tasks_of(b[arm], col), tasks_of(b[ref], col)
                    if set(a_t) != set(r_t):
                        raise SystemExit(f"bench_compare: {arm} and {ref} were evaluated on different tasks ({col})")
                    diffs.append([a_t[k] - r_t[k] for k in sorted(a_t)])
                ci = paired_bootstrap(diffs, n_boot=n_boot)
                c[f"minus_{ref}"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in ci.items()}
            s["columns"][col] = c
        s["self_play_steps"] = [b[arm]["self_play_steps"] for b in by]
        s["eval_steps"] = [b[arm]["eval_steps"] for b in by]
        s["selection"] = [b[arm].get("selection") for b in by]
        out[arm] = s
    return out


def markdown(env: str, seeds: list[int], summary: dict, columns: list[str]) -> str:
    """Two tables: mean ± s.e. per column (per-seed values in brackets); paired 95 % intervals vs RFT and SFT (and
    RFT with two rounds, where the seeds have that row)."""
    cols = columns + [HELD_OUT]
    refs = [r for r in REFS if any(f"minus_{r}" in s["columns"][cols[0]] for s in summary.values())]

    def pct(x):
        return f"{100 * x:.1f}"

    lines = [f"**{env}**, seeds {', '.join(map(str, seeds))}: average final reward x100, mean ± s.e. over seeds "
             "(per seed)", "", "| method | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for s in summary.values():
        cells = [f"{pct(s['columns'][c]['mean'])} ± {pct(s['columns'][c]['se'])} "
                 f"({', '.join(pct(v) for v in s['columns'][c]['per_seed'])})" for c in cols]
        name = f"*{s['method']}*" if s["oracle"] else s["method"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"**{env}**: paired difference x100 [bootstrap 95 % interval], same tasks and seeds", "",
              "| method | " + " | ".join(f"{c} − {REFS[r]}" for r in refs for c in cols) + " |",
              "|---|" + "---|" * (len(refs) * len(cols))]
    for s in summary.values():
        cells = []
        for ref in refs:
            for c in cols:
                d = s["columns"][c].get(f"minus_{ref}")
                cells.append("–" if d is None else f"{pct(d['mean'])} [{pct(d['lo'])}, {pct(d['hi'])}]")
        lines.append(f"| {s['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _stage(b: dict) -> str:
    """One training stage of an arm's budget: ``RFT 48 ep x lr 2e-03 x 189 traj`` (DPO: with its beta)."""
    beta = f" β {b['dpo_beta']:g}" if "dpo_beta" in b else ""
    return f"{b['stage']} {b['epochs']:g} ep x lr {b['lr']:.0e} x {b['data']} {b['unit']}{beta}"


def _candidates(sel: dict) -> str:
    """A selection's validation scores x100, candidate by candidate, the chosen one bold: ``[52.5/42.5/**72.5**]``."""
    vals = [f"{100 * c['val_avg_reward']:.1f}" for c in sel["candidates"]]
    vals[sel["chosen_index"]] = f"**{vals[sel['chosen_index']]}**"
    return "[" + "/".join(vals) + "]"


def budget_cell(row: dict) -> str:
    """What one arm of one seed trained on, stage by stage, each selected stage followed by its candidates'
    validation scores (the arm's own selections are its last stages: Q-Evolve's BC is SFT's)."""
    stages = [_stage(b) for b in row.get("budget") or []]
    sel = row.get("selection")
    sels = [] if sel is None else sel if isinstance(sel, list) else [sel]
    for i, s in enumerate(sels):
        k = len(stages) - len(sels) + i
        if 0 <= k < len(stages):
            stages[k] += " " + _candidates(s)
    if sel is None and row.get("selection_note"):
        stages.append(f"({row['selection_note']})")
    return "; ".join(stages) or "–"


def budget_markdown(env: str, seeds: list[int], tables: list[dict]) -> str:
    """Per arm and seed: the epochs x lr x data of every training stage and the validation scores (x100) of the
    candidates each selection chose from (issue: say the budget in the table)."""
    arms = [(r["arm"], r["method"]) for r in tables[0]["rows"]]
    by = [{r["arm"]: r for r in t["rows"]} for t in tables]
    lines = [f"**{env}**: what each arm trained on (epochs x lr x data) and the validation success x100 of the "
             "candidates it was chosen from (chosen in bold)", "",
             "| method | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for arm, method in arms:
        lines.append(f"| {method} | " + " | ".join(budget_cell(b[arm]) if arm in b else "–" for b in by) + " |")
    return "\n".join(lines) + "\n"


def env_result(env: str, seeds: list[int], tables: list[dict], n_boot: int, md: bool, times: dict | None = None) -> dict:
    """One environment's entry of the JSON (seeds, columns, the summary; the times when given); with ``md`` the
    tables for docs/compare.md on stderr: scores and paired differences, budgets, and the cost where recorded."""
    summary = summarize(tables, n_boot)
    if md:
        print(markdown(env, seeds, summary, tables[0]["columns"]), file=sys.stderr, flush=True)
        print(budget_markdown(env, seeds, tables), file=sys.stderr, flush=True)
        if times and (cost := cost_markdown(env, seeds, times)):
            print(cost, file=sys.stderr, flush=True)
    times_entry = {"times": times} if times is not None else {}
    return {"seeds": seeds, "columns": tables[0]["columns"], **times_entry, "summary": summary}


def summarize_files(paths: list[Path], n_boot: int, md: bool) -> None:
    """--tables: the summary of the given tables, by environment (the JSON of a run, without times)."""
    result: dict = {"tables": [str(p) for p in paths], "envs": {}}
    for env, tables in read_tables(paths).items():
        result["envs"][env] = env_result(env, [t["seed"] for t in tables], tables, n_boot, md)
    print(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--envs", "--env", nargs="+", default=["lamps", "lamps-hard"])
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--best-of", type=int, default=6)
    ap.add_argument("--eval-max-tasks", type=int, default=0, help="0 = the whole held-out splits.")
    ap.add_argument("--no-select", action="store_true", help="Without --select-on-validation (the arms' own "
                                                             "settings).")
    ap.add_argument("--boot", type=int, default=10000, help="Bootstrap replicates.")
    ap.add_argument("--runs", type=Path, default=None, help="Keep run directories here (default: a temp dir); a "
                                                            "rerun with the same DIR skips finished seeds.")
    ap.add_argument("--collect", action="store_true", help="Only read finished seeds (run nothing).")
    ap.add_argument("--keep-tables", type=Path, default=None, help="Also keep each finished seed's table "
                                                                   "(per-task outcomes, configuration hashes) "
                                                                   "in DIR/ENV-PRESET-sSEED.json, and read "
                                                                   "finished seeds from there: a seed kept "
                                                                   "there is not re-run even when its run "
                                                                   "directory is gone.")
    ap.add_argument("--tables", type=Path, nargs="+", default=None,
                    help="Only summarize these tables (run nothing; --envs, --seeds and the run flags are not used): "
                         "runs' compare/table.json, kept tables or files of several seeds' tables (read_tables). "
                         "The rows every seed has are summarized.")
    ap.add_argument("--markdown", action="store_true", help="Also print the tables for docs/compare.md (stderr).")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training stages (1: seeds side by "
                                                           "side on the tiny model; 2 for --preset cpu-smol, whose "
                                                           "rollouts also take 2: rollout.threads).")
    ap.add_argument("--add-arms", nargs="+", default=[], choices=["rft_2"],
                    help="Rows made only when named: rft_2 (RFT again on its own rollouts, the control for Q-Evolve's "
                         "second iteration). Seeds kept without it run again; their finished stages are kept.")
    ap.add_argument("--reconfigure", action="store_true",
                    help="Resume seeds whose runs were started with another configuration (a changed preset) when "
                         "the new one leaves their finished stages unchanged (`qevolve evolve --reconfigure`).")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    select = not a.no_select
    if a.tables:
        summarize_files(a.tables, a.boot, a.markdown)
        return

    import torch

    torch.set_num_threads(max(1, a.threads))
    from qevolve_cli.evolve.compare import run_compare
    from qevolve_cli.evolve.loop import run_evolve

    root = a.runs or Path(tempfile.mkdtemp(prefix="qevolve-compare-"))
    echo = (lambda m: print(m, file=sys.stderr, flush=True)) if a.verbose else (lambda _m: None)
    result: dict = {"preset": a.preset, "seeds": a.seeds, "iters": a.iters, "best_of": a.best_of,
                    "select_on_validation": select, "eval_max_tasks": a.eval_max_tasks, "runs": str(root), "envs": {}}
    for env in a.envs:
        tables, done_seeds, times = [], [], {}
        for seed in a.seeds:
            run = root / f"{env}-{a.preset}-s{seed}"
            cfg = evolve_config(env, a.preset, seed, a.iters, select, a.eval_max_tasks)
            kept = a.keep_tables / f"{env}-{a.preset}-s{seed}.json" if a.keep_tables else None
            ccfg = compare_config(env, a.best_of, select, run, tuple(a.add_arms))
            table = kept_table(kept, cfg, ccfg) if kept else None
            from_kept = table is not None
            table = table or finished_table(run, cfg, ccfg)
            if table is None and not a.collect:
                t0 = time.perf_counter()
                run_evolve(cfg, run, resume=True, echo=echo, quiet=not a.verbose, reconfigure=a.reconfigure)
                t1 = time.perf_counter()
                ccfg = compare_config(env, a.best_of, select, run, tuple(a.add_arms))  # the base model exists now
                table = run_compare(run, ccfg, resume=True, echo=echo, quiet=not a.verbose)
                times[seed] = {"evolve_s": round(t1 - t0, 1), "compare_s": round(time.perf_counter() - t1, 1)}
            # the cost, from the run directory when it holds this very comparison
            same_run = table is not None and (not from_kept or finished_table(run, cfg, ccfg) is not None)
            st = stage_seconds(run) if same_run else None
            if from_kept:  # the kept times; stage sums added from the run directory when it is still there
                times[seed] = add_kept_times(kept, st) if st else json.loads(kept.read_text()).get("times") or {}
            elif table is not None:
                times[seed] = {**times.get(seed, {}), **(st or {})}
                if kept:
                    keep_table(kept, cfg, ccfg, table, times[seed])
            if table is None:
                print(f"{env} seed {seed}: not finished (skipped)", file=sys.stderr, flush=True)
                continue
            tables.append(table)
            done_seeds.append(seed)
            print(f"{env} seed {seed}: " + json.dumps({r["arm"]: {c: s["avg_reward"] for c, s in r["scores"].items()}
                                                        for r in table["rows"]}), file=sys.stderr, flush=True)
        if not tables:
            continue
        result["envs"][env] = env_result(env, done_seeds, tables, a.boot, a.markdown, times)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
