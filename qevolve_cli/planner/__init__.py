"""``qevolve plan``: memory per GPU and wall time of every stage of an evolve run, before it is queued.

* :mod:`qevolve_cli.planner.memory`: the model's shape from its ``config.json`` (no weights), bytes per GPU
  of weights, LoRA, optimiser state, gradients, activations and the vLLM KV cache under each ZeRO stage /
  tensor-parallel size;
* :mod:`qevolve_cli.planner.tokens`: token counts measured on trajectory tables (prompt and completion
  tokens per step, steps per task);
* :mod:`qevolve_cli.planner.plan`: the per-stage verdicts and wall times of a run (docs/cluster.md);
* :mod:`qevolve_cli.planner.probe`: real peaks measured under DeepSpeed (the memory model's check).
"""
