#!/bin/bash
# The same stage with DeepSpeed's own launcher (pdsh over passwordless ssh) and a hostfile
# (docs/cluster.md). examples/hostfile lists the nodes and their GPU slots; start this on the first one.
set -euo pipefail
deepspeed --hostfile examples/hostfile --master_addr "$(head -n1 examples/hostfile | cut -d' ' -f1)" \
  --module qevolve_cli critic --data runs/alf/iter_1/labeled.parquet --model /shared/models/Llama-2-7b-hf \
  --config runs/alf/stages/critic_1.yaml --set deepspeed=configs/deepspeed/zero2.json \
  --set gradient_checkpointing=true --out runs/alf/iter_1/critic --quiet
