#!/bin/bash
# A policy (or critic) stage data-parallel over 2 nodes x 8 GPUs with plain torchrun (docs/cluster.md).
# Run the same line on both nodes; HEAD is the first node's address, reachable from the other.
#
#   node 0:  HEAD=10.0.0.1 bash examples/torchrun_two_nodes.sh
#   node 1:  HEAD=10.0.0.1 bash examples/torchrun_two_nodes.sh
#
# The run directory (here runs/alf) must be the same shared path on both nodes. Rerun the same lines to
# resume after a failure (same number of nodes and GPUs, same ZeRO stage).
set -euo pipefail
: "${HEAD:?set HEAD to the first node's address}"
torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" --rdzv-id qevolve-policy \
  -m qevolve_cli policy --objective bppo --data runs/alf/iter_1/advantages.parquet \
  --model runs/alf/bc/policy --ref runs/alf/bc/policy --config runs/alf/stages/policy_1.yaml \
  --set deepspeed=configs/deepspeed/zero2.json --out runs/alf/iter_1/policy --quiet
