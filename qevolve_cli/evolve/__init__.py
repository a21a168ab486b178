"""The self-evolving loop (`qevolve evolve`) and its run directory."""
