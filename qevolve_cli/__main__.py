"""Entry point of ``python -m qevolve_cli`` and of the ``qevolve`` console script."""
import gc

import qevolve_cli


def startup_without_gc() -> None:
    """Run the start-up imports without the cyclic garbage collector.

    They (Polars, Typer, the command) allocate some 10^5 long-lived objects, and the collector
    walking them again and again costs 20-40 ms of a short command such as `label`. It stays off
    until the command's body starts: commands.common.run_command turns it back on, except for a
    short command without model code that asks to finish without it. Only :func:`main` calls this:
    a process that merely imports this module (a multiprocessing worker started with "spawn"
    re-imports it as ``__mp_main__``) keeps its collector.
    """
    gc.disable()
    qevolve_cli._gc_off_for_startup = True


def main() -> None:
    startup_without_gc()
    from qevolve_cli.launcher import die_with_launcher

    die_with_launcher()  # a worker of torchrun / deepspeed dies with its launcher (qevolve_cli/launcher.py)
    from qevolve_cli.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
