#!/usr/bin/env bash
# The rows of a comparison that need no learned critic first, in benchmarks/bench_compare.py's own run directory:
# the evolve run up to its iteration-1 labels (stopped as soon as they are written, before the critic), then
# `qevolve compare --resume` with only those rows (default: SFT, RFT and the oracle-V row). A session-sized
# piece of a SmolLM2 seed on 2 cores (about 2 h on lamps-habit); the rest of the seed (critic, BPPO, the
# other rows) resumes in the same directory with scripts/seed_lane.sh and the same flags.
# Usage: scripts/rows_first.sh CODE_DIR RUNS_DIR ENV SEED
#   LANE_FLAGS: bench_compare flags that name the run (default "--preset cpu-smol --iters 1 --no-select");
#   ARMS: the rows (default "sft, rft, qevolve_oracle_v"); THREADS: torch threads (default 2)
#   STOP_AT: the evolve stage after which bench_compare is stopped (default iter_1/label). With
#     STOP_AT=iter_1/eval_test_unseen ARMS="sft, rft, qevolve, qevolve_oracle_v" a seed whose rows came first gets
#     its critic, BPPO step and Q-Evolve row before ETO, zero-shot and Best-of-N (which seed_lane.sh adds later)
set -u
code=$1; runs=$2; env=$3; seed=$4
flags=${LANE_FLAGS:---preset cpu-smol --iters 1 --no-select}
preset=$(sed -n 's/.*--preset \([^ ]*\).*/\1/p' <<< "$flags"); preset=${preset:-cpu}
run=$runs/$env-$preset-s$seed
py=${PYTHON:-$HOME/.cache/qevolve/venv/bin/python}
export PYTHONPATH=$code
stop_at=${STOP_AT:-iter_1/label}
reached() {  # the run's manifest says the stage $stop_at is done
  "$py" -c 'import json, pathlib, sys
m = pathlib.Path(sys.argv[1]) / "manifest.json"
st = json.loads(m.read_text()).get("stages", {}) if m.exists() else {}
sys.exit(0 if st.get(sys.argv[2], {}).get("status") == "done" else 1)' "$run" "$stop_at"
}
if ! reached; then
  # shellcheck disable=SC2086  # the flags are words
  (cd "$code" && exec "$py" benchmarks/bench_compare.py --envs "$env" --seeds "$seed" --runs "$runs" $flags \
     --threads "${THREADS:-2}" --verbose) &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 20
    if reached; then
      echo "== $(date -u +%FT%TZ) $run: $stop_at done, bench_compare stopped (the rest resumes with seed_lane.sh)" >&2
      kill "$pid"; wait "$pid"; break
    fi
  done
  reached || { echo "== $run: evolve stopped before $stop_at" >&2; exit 1; }
fi
echo "== $(date -u +%FT%TZ) $run: compare ${ARMS:-sft, rft, qevolve_oracle_v}" >&2
cd "$code" && OMP_NUM_THREADS=${THREADS:-2} exec "$py" -m qevolve_cli compare --run-dir "$run" --resume \
  --set "arms=[${ARMS:-sft, rft, qevolve_oracle_v}]" --json
