"""The environments and their step limits: the one list, importable without the environment package
(``qevolve_cli.envs`` loads its base classes and task splits; the command-line options need only
the names). ``qevolve_cli.envs.registry`` re-exports both.

Step limits (the paper's "maximum episode length"; TextCraft is our choice):
WebShop 10, SciWorld 24, ALFWorld 30, TextCraft 40 (expert plans: median 6, max 48 steps).
"""
MAX_STEPS = {"webshop": 10, "sciworld": 24, "alfworld": 30, "textcraft": 40, "lamps": 16,
             "lamps-hard": 25, "lamps-habit": 26}
# lamps, lamps-hard, lamps-habit: envs/builtin.py (lamps-hard, lamps-habit: each task also has its own budget)
ENV_NAMES = tuple(MAX_STEPS)
BUILTIN_ENVS = ("lamps", "lamps-hard", "lamps-habit")
"""The environments built into the project (``envs/builtin.py``: one variant each, an exact solver each)."""
