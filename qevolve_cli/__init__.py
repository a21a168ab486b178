"""qevolve: Q-Evolve for LLM agents on long-horizon text environments.

The package is split so that light commands start fast: nothing here imports
torch; modules that need it (models, critic, policy, rollout) import it
themselves.
"""

__version__ = "0.1.0"

import warnings as _warnings

# PEFT 0.21 calls a transformers attribute deprecated in transformers 5; users cannot act on it.
_warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
