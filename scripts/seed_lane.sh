#!/usr/bin/env bash
# Run benchmarks/bench_compare.py for ENV:SEED pairs one after another (one "lane"), each seed resumable,
# keeping each finished seed's table in benchmarks/results/compare_tables (the tables docs/compare.md is
# collected from). Usage: scripts/seed_lane.sh CODE_DIR RUNS_DIR ENV:SEED [ENV:SEED ...]
#   CODE_DIR: the checkout to run (a git worktree, so that editing main does not change a running seed)
#   RUNS_DIR: where the run directories live (a seed found there resumes from its finished stages)
# Extra bench_compare.py flags: LANE_FLAGS="--add-arms rft_2" scripts/seed_lane.sh ...
# (scripts/rows_first.sh runs the rows of a seed that need no learned critic first, in the same run directory)
set -u
code=$1; runs=$2; shift 2
py=${PYTHON:-$HOME/.cache/qevolve/venv/bin/python}
for es in "$@"; do
  env=${es%%:*}; seed=${es##*:}
  echo "== $(date -u +%FT%TZ) lane: $env seed $seed" >&2
  (cd "$code" && PYTHONPATH="$code" "$py" benchmarks/bench_compare.py --envs "$env" --seeds "$seed" --threads 1 \
     --runs "$runs" --keep-tables "$code/benchmarks/results/compare_tables" ${LANE_FLAGS:-} --verbose) \
    || echo "== lane: $env seed $seed failed (rc $?)" >&2
done
