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
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="the run trains on N processes (as `leantune train --gpus N`): after the one-process "
                        "variants, the whole plan runs on N processes (torchrun) and is compared with one process "
                        "at the N-times batch")
    p.description = (
        "Run a few steps of the config's run from one seed without any memory technique (the reference) and "
        "once per technique its plan uses (streaming in poison mode, fp8 storage, checkpointing and its "
        "offload, the host optimizer step, the whole plan), and compare losses, every trained parameter's "
        "gradient and the trained weights: bitwise for the exact techniques, within a stated tolerance for "
        "fp8; with --gpus N, the whole plan on N processes against one process at the N-times batch. "
        "Nothing is written to the run's [output] dir. Exit 0: held; 1: a technique differs; "
        "2: config error; 3: the reference does not fit this machine. See docs/check.md.")


def run(args: argparse.Namespace) -> int:
    from ..config import ConfigError, load_config

    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1 (got {args.steps})")
    cfg = load_config(args.config, args.overrides)
    if args.gpus is not None:
        from .train import check_gpus

        check_gpus(args.gpus, cfg)           # what `train --gpus N` refuses, refused here too
    return check_config(cfg, args.steps, args.gpus)


def check_config(cfg, steps: int = DEFAULT_STEPS, gpus: int | None = None) -> int:
    """Run the check on a loaded config, print its lines; the exit code. `gpus`: the run's process
    count (`--gpus N`)."""
    from ..check.run import run_check

    return run_check(cfg, steps, emit=lambda line: print(line, flush=True), progress=_progress, gpus=gpus).rc


def _progress(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)
