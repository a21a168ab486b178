#!/bin/bash
# Rollouts with a model that does not fit one GPU: vLLM's OpenAI-compatible server with tensor
# parallelism over 4 GPUs of this node, and qevolve's openai backend as its client (docs/cluster.md).
# `qevolve plan --env alfworld --model M --gpus 8` gives the smallest tensor-parallel size that fits.
set -euo pipefail
MODEL=${MODEL:-/shared/models/Llama-2-70b-hf}
CUDA_VISIBLE_DEVICES=0,1,2,3 vllm serve "$MODEL" --tensor-parallel-size 4 --max-model-len 3600 \
  --gpu-memory-utilization 0.85 --port 8000 &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf http://127.0.0.1:8000/v1/models >/dev/null; do sleep 5; done
qevolve rollout --env alfworld --policy "$MODEL" --split train --iteration 1 --backend openai \
  --base-url http://127.0.0.1:8000/v1 --workers 16 --out runs/alf/iter_1/rollout.parquet --resume
