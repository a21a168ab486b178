"""Measure real memory peaks of a training step under DeepSpeed, to check the planner's memory model.

Run under a launcher (every rank measures itself)::

    DS_ACCELERATOR=cpu MALLOC_MMAP_THRESHOLD_=65536 torchrun --standalone --nproc_per_node 2 \
        -m qevolve_cli.planner.probe CASES.json OUT_DIR

``CASES.json``: a list of ``{"name", "model": <dir with config.json>, "zero": 2|3, "lora_r": 0 (full) | r,
"tokens": n}``. Each case builds the model from its config with random weights (fp32 on CPU, bf16 on
CUDA), wraps it in qevolve's DeepSpeed backend (:func:`qevolve_cli.training.train_loop`, the path of
``qevolve policy``) and runs two optimiser steps of the causal-LM loss on one sequence of ``n`` random
tokens. Measured per rank: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the growth of the peak
resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` before each case) over the resident set
before the model was built. ``MALLOC_MMAP_THRESHOLD_`` makes glibc return every freed block of 64 KiB or
more to the system, so one case's freed memory is not counted in, or hidden from, the next. A first
small case warms up the imports and the process group and is not reported.
Writes ``OUT_DIR/rank<R>.json``: ``{name: {"peak": bytes, "init_peak": bytes (after the engine was
built, before the first step)}}``.
"""
from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def measure(case: dict[str, Any], deepspeed_dir: Path) -> dict[str, int]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qevolve_cli.training import Hooks, TrainArgs, train_loop
    from qevolve_cli.training.backends import deepspeed as ds_backend

    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_peak()
        base = _status("VmRSS")
    cfg = AutoConfig.from_pretrained(case["model"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16 if cuda else torch.float32,
                                             attn_implementation="sdpa")
    if case.get("lora_r"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=int(case["lora_r"]), lora_alpha=2 * int(case["lora_r"]),
                                                 target_modules="all-linear", lora_dropout=0.0))
    n = int(case["tokens"])
    ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
    marks: dict[str, int] = {}

    def peak() -> int:
        return (torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")) - base

    def loss_fn(m, micro, ctx):
        x = ids.to(ctx["device"])
        return m(input_ids=x, labels=x).loss, {}

    args = TrainArgs(epochs=1, lr=1e-4, warmup_ratio=0.0, deepspeed=deepspeed_dir / f"zero{case['zero']}.json",
                     device="cuda" if cuda else "cpu", quiet=True, desc=case["name"])
    hooks = Hooks(on_epoch_start=lambda e, m: marks.setdefault("init_peak", peak()))
    train_loop(model, lambda e: [[0], [0]], loss_fn, args, hooks=hooks)
    out = {"peak": peak(), "init_peak": marks["init_peak"]}
    while ds_backend._ENGINES:  # free the engine before the next case
        ds_backend._ENGINES.pop().destroy()
    del model
    gc.collect()
    return out


def main(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cases = json.loads(Path(argv[0]).read_text())
    out_dir = Path(argv[1])
    from qevolve_cli.config import configs_dir

    ds_dir = Path(argv[2]) if len(argv) > 2 else configs_dir() / "deepspeed"
    results: dict[str, Any] = {}
    for i, case in enumerate(cases):
        r = measure(case, ds_dir)
        if i > 0 or not case.get("warmup"):
            results[case["name"]] = r
    rank = int(os.environ.get("RANK", "0"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
