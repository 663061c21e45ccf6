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
    p.add_argument("--nodes", type=int, default=1, metavar="M",
                   help="the run trains on M machines (as `leantune train --nodes M`): run this command on each, "
                        "with its --node-rank and machine 0's --master; first of all the whole plan runs on the M "
                        "machines' processes (--gpus per machine, default 1) and machine 0 compares it with one "
                        "process at the whole batch; every machine exits with that verdict")
    p.add_argument("--node-rank", type=int, default=None, metavar="R", help="this machine's place, 0 to M-1 (0 hosts --master)")
    p.add_argument("--master", default=None, metavar="HOST:PORT",
                   help="the address of machine 0 that every machine reaches, and a free port on it")
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
    from .train import check_gpus, check_nodes

    nodes = check_nodes(args)
    if args.gpus is not None:
        check_gpus(args.gpus, cfg)           # what `train --gpus N` refuses, refused here too
    if nodes is not None and nodes.rank != 0:
        from ..check.processes import follow_machine_0

        return follow_machine_0(cfg, nodes, args.gpus or 1, args.config, args.overrides)
    return check_config(cfg, args.steps, args.gpus, nodes)


def check_config(cfg, steps: int = DEFAULT_STEPS, gpus: int | None = None, nodes=None) -> int:
    """Run the check on a loaded config, print its lines; the exit code. `gpus`: the run's process
    count (`--gpus N`); `nodes`: this machine is machine 0 of several (`--nodes M`)."""
    from ..check.run import run_check

    return run_check(cfg, steps, emit=lambda line: print(line, flush=True), progress=_progress, gpus=gpus,
                     nodes=nodes).rc


def _progress(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)
