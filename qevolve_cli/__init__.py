"""qevolve: Q-Evolve for LLM agents on long-horizon text environments.

The package is split so that light commands start fast: nothing here imports
torch; modules that need it (models, critic, policy, rollout) import it
themselves.
"""

__version__ = "0.1.0"

import warnings as _warnings

# PEFT 0.21 calls a transformers attribute deprecated in transformers 5; users cannot act on it.
_warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)


def _quiet_deepspeed_import() -> None:
    """Keep stdout clean for results when DeepSpeed is installed.

    transformers/accelerate import DeepSpeed whenever it is installed (e.g. in
    ``save_pretrained``), and on a machine without a GPU its accelerator detection
    logs a warning *on stdout*, which would corrupt ``--json`` output. Where no
    NVIDIA device exists, select its CPU accelerator explicitly (no warning); a
    value set by the user wins.
    """
    import os

    if "DS_ACCELERATOR" not in os.environ and not os.path.exists("/dev/nvidiactl"):
        os.environ["DS_ACCELERATOR"] = "cpu"


_quiet_deepspeed_import()
