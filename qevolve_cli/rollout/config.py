"""Configuration of ``qevolve rollout`` / ``qevolve eval`` (mirrored by ``configs/rollout.yaml``).

Temperature default: the paper's hyper-parameter table lists an "exploration
temperature" of 2.0, while its Limitations paragraph says the loop collects
data with *greedy* rollouts. Greedy decoding makes the 3 samples per task
identical in deterministic environments, and T = 2.0 without nucleus
filtering turns a 7B chat model's output into noise, so the default here is
``temperature: 1.0`` with ``top_p: 1.0`` (plain sampling from the policy);
``--temperature 2.0`` reproduces the table's value and ``--temperature 0``
the greedy reading. Evaluation is greedy (``eval_temperature: 0``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from qevolve_cli.config import ConfigBase, field
from qevolve_cli.env_names import ENV_NAMES as ENVS  # noqa: E402 - one list of environments
from qevolve_cli.errors import ConfigError

SPLITS = ("train", "test_seen", "test_unseen", "test")
ENV_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class RolloutConfig(ConfigBase):
    env: str = field("textcraft", help="Environment.", choices=ENVS)
    split: str = field("train", help="Task split.", choices=SPLITS)
    n_per_task: int = field(3, help="Trajectories per task (paper: 3).", ge=1)
    max_tasks: int = field(0, help="Use only the first N tasks of the split (0 = all; ALFWorld and TextCraft "
                           "tasks come in a fixed mixed order, so N is a sample of the split).", ge=0)
    temperature: float = field(1.0, help="Sampling temperature for rollouts (0 = greedy; paper table: 2.0, "
                               "paper Limitations: greedy; see docs/rollout.md).", ge=0.0)
    top_p: float = field(1.0, help="Nucleus sampling mass (1 = off).", gt=0.0, le=1.0)
    eval_temperature: float = field(0.0, help="Temperature of `qevolve eval` (0 = greedy).", ge=0.0)
    max_new_tokens: int = field(256, help="Maximum tokens generated per turn.", ge=1)
    max_context: int = field(0, help="Context length in tokens (0 = the model's maximum; paper: 4096, "
                             "ALFWorld 3600). Longer prompts keep the instruction and the most recent turns.", ge=0)
    max_steps: int = field(0, help="Turns per episode (0 = the environment's limit: SciWorld 24, ALFWorld 30, "
                           "WebShop 10, TextCraft 40).", ge=0)
    backend: str = field("hf", help="Generation backend.", choices=("hf", "vllm", "openai"))
    base_url: str = field("", help="OpenAI-compatible server URL for --backend openai (e.g. http://127.0.0.1:8000/v1).")
    served_model: str = field("", help="Model name sent to the OpenAI-compatible server (default: the policy path, "
                              "or the adapter directory's name with --adapter).")
    api_key_env: str = field("OPENAI_API_KEY", help="Name of the environment variable that holds the API key of "
                             "the OpenAI-compatible server (--backend openai; sent as a Bearer token, never written "
                             "or printed; unset = no key). The name, not the key (docs/rollout.md).")
    device: str = field("auto", help="Device of the hf backend (auto, cpu, cuda, cuda:N).")
    dtype: str = field("auto", help="Model dtype (auto = bfloat16 on GPU and on CPUs with avx512_bf16/AMX, else float32; docs/performance.md).",
                       choices=("auto", "float32", "bfloat16", "float16"))
    threads: int = field(0, help="CPU threads of the hf backend (0 = half the cores; more threads than free cores "
                         "slow generation down sharply).", ge=0)
    kv_reuse: bool = field(True, help="hf backend on CPU: keep each episode's KV cache between its steps and compute "
                           "only the new prompt tokens (false = re-prefill the whole transcript every step).")
    kv_cache_mb: int = field(2048, help="Memory cap of the kept KV caches in MiB (least recently used evicted first; "
                             "counted in the stats as kv_evictions).", ge=1)
    gen_batch_size: int = field(64, help="Maximum prompts per hf generate call.", ge=1)
    workers: int = field(2, help="Environment worker processes.", ge=1)
    envs_per_worker: int = field(4, help="Live episodes per worker (live batch = workers x envs_per_worker).", ge=1)
    lanes: int = field(2, help="Live episodes are split into this many lanes: the policy generates for one lane while "
                       "the workers step the others (1 = one batch per round, no overlap).", ge=1)
    env_timeout_s: float = field(120.0, help="Seconds one environment call may take before its worker is restarted.",
                                 gt=0.0)
    request_timeout_s: float = field(300.0, help="HTTP timeout of the openai backend.", gt=0.0)
    seed: int = field(0, help="Random seed (same seed -> same trajectories with the hf backend on CPU).")
    iteration: int = field(1, help="Evolving iteration recorded in the table (0 = BC policy / expert).", ge=0)
    retry_failed: bool = field(True, help="--resume re-runs episodes recorded as failed (worker crash, timeout).")
    candidates: int = field(1, help="Critic reranking: sample N candidates per step, play the best by Q - V.", ge=1)
    candidate_temperature: float = field(1.0, help="Temperature of the reranking candidates.", ge=0.0)
    shard: str = field("", help="Play only shard I/N (0-based) of the run's (task, sample) pairs: a contiguous "
                       "block, with the trajectory ids and seeds of the unsharded run (\"\" = all; docs/rollout.md).")

    #: added after runs were made (and where the key comes from changes no trajectory): old runs still resume
    HASH_OMIT_AT_DEFAULT = ("api_key_env",)

    def hash_extra(self) -> dict[str, Any]:
        from qevolve_cli.envs.splits import task_order_tag

        tag = task_order_tag(self.env, self.max_tasks)  # which first N tasks (ALFWorld, TextCraft: a mixed order)
        return {"task_order": tag} if tag else {}

    def validate(self, source=None, prefix: str = "") -> None:
        if self.backend == "openai" and not self.base_url:
            raise ConfigError(source, prefix + "base_url", "required with backend openai")
        if not ENV_VAR_NAME.fullmatch(self.api_key_env):  # the value is not echoed: it may be a key pasted here
            raise ConfigError(source, prefix + "api_key_env", "must be the name of an environment variable (letters, "
                              "digits and _, e.g. OPENAI_API_KEY) that holds the key, not the key itself")
        if self.shard:
            from qevolve_cli.shard import parse_shard

            try:
                parse_shard(self.shard)
            except ValueError as e:
                raise ConfigError(source, prefix + "shard", str(e)) from None
