"""qevolve: Q-Evolve for LLM agents on long-horizon text environments.

The package is split so that light commands start fast: nothing here imports
torch; modules that need it (models, critic, policy, rollout) import it
themselves.
"""

__version__ = "0.1.0"
