"""Policy learning: behaviour cloning, BPPO and AWR (``qevolve policy``).

Library entry point: :func:`qevolve_cli.policy.trainer.train_policy`
(re-exported lazily here so that importing the package does not import torch).
"""
from __future__ import annotations

from qevolve_cli.policy.config import OBJECTIVES, PolicyConfig, load_policy_config


def train_policy(*args, **kwargs):
    """See :func:`qevolve_cli.policy.trainer.train_policy`."""
    from qevolve_cli.policy.trainer import train_policy as _tp

    return _tp(*args, **kwargs)


__all__ = ["OBJECTIVES", "PolicyConfig", "load_policy_config", "train_policy"]
