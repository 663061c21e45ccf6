"""`leantune check my.toml [--steps N] [--set section.key=value ...]`: the engine's parity proof on
the run's own model, data and plan (leantune/check/, docs/check.md).

Exit codes: 0 every technique held, 1 one differs (or the run failed), 2 a config error, 3 the
plain model (the reference) does not fit this machine, so nothing was compared.
"""

from __future__ import annotations

import argparse

from .train import add_config_arguments

DEFAULT_STEPS = 2


def configure(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                   help=f"optimizer steps per variant (default {DEFAULT_STEPS}); every variant starts from the "
                        f"config's seed")
    p.description = (
        "Run a few steps of the config's run from one seed without any memory technique (the reference) and "
        "once per technique its plan uses (streaming in poison mode, fp8 storage, checkpointing and its "
        "offload, the host optimizer step, the whole plan), and compare losses, every trained parameter's "
        "gradient and the trained weights: bitwise for the exact techniques, within a stated tolerance for "
        "fp8. Nothing is written to the run's [output] dir. Exit 0: held; 1: a technique differs; "
        "2: config error; 3: the reference does not fit this machine. See docs/check.md.")


def run(args: argparse.Namespace) -> int:
    from ..config import ConfigError, load_config

    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1 (got {args.steps})")
    cfg = load_config(args.config, args.overrides)
    return check_config(cfg, args.steps)


def check_config(cfg, steps: int = DEFAULT_STEPS) -> int:
    """Run the check on a loaded config, print its lines; the exit code."""
    from ..check.run import run_check

    return run_check(cfg, steps, emit=lambda line: print(line, flush=True), progress=_progress).rc


def _progress(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)
