"""`leantune train my.toml [--resume] [--set section.key=value ...]`."""

from __future__ import annotations

import argparse
import sys


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """The config file and `--set` overrides, shared by every verb that reads a run config."""
    p.add_argument("config", help="the run's TOML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=10 (repeatable)")


def configure(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--resume", action="store_true", help="continue from the latest saved state of this run")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the run already in [output] dir (checkpoints, exports, logs) and start again")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="train on N processes of this machine (one per GPU): starts torchrun for you")
    p.add_argument("--nodes", type=int, default=1, metavar="M",
                   help="machines in the run (each runs this command with its own --node-rank; --gpus per machine, "
                        "default 1); needs --node-rank and --master")
    p.add_argument("--node-rank", type=int, default=None, metavar="R", help="this machine's place, 0 to M-1 (0 hosts --master)")
    p.add_argument("--master", default=None, metavar="HOST:PORT",
                   help="the address of machine 0 that every machine reaches, and a free port on it")
    p.add_argument("--check", action="store_true",
                   help="run `leantune check` on this config first (a few steps with and without the plan's memory "
                        "techniques, compared) and train only if every technique held")


def run(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..trainer import train

    cfg = load_config(args.config, args.overrides)      # bad input is reported once, before any launch
    nodes = check_nodes(args)
    if nodes is not None and args.gpus is None:
        args.gpus = 1
    if args.gpus is not None:
        check_gpus(args.gpus, cfg)
    if args.check and not _launched_worker():
        from ..check.run import run_check
        from ..check.processes import follow_machine_0

        # On several processes the check runs them too (check/processes.py): on one machine, or on
        # every machine of the run, each exiting with machine 0's verdict.
        if nodes is not None and nodes.rank != 0:
            rc = follow_machine_0(cfg, nodes, args.gpus, args.config, args.overrides)
        else:
            rc = run_check(cfg, emit=lambda line: print(line, flush=True),
                           progress=lambda line: print(line, file=sys.stderr, flush=True),
                           gpus=args.gpus, nodes=nodes).rc
        if rc:
            print(f"leantune train: the check did not hold (exit code {rc}); not training", file=sys.stderr)
            return rc
    if args.gpus is not None and (args.gpus > 1 or nodes is not None):
        from ..distributed import launch_env, relaunch
        from ..train.state import latest_checkpoint

        if launch_env() is None:
            checkpoints = cfg.resolve(cfg.output.dir) / "checkpoints"
            return relaunch(args.gpus, _argv(args), lambda: latest_checkpoint(checkpoints), nodes=nodes)
    result = train(cfg, resume=args.resume, progress=not args.no_progress, overwrite=args.overwrite)
    if result.lora_files:                 # rank 0 writes them; other processes have nothing to say
        what = "model files" if cfg.train.mode == "full" else "LoRA files"     # a full fine-tune exports the model
        print(f"{what}: {', '.join(str(p) for p in result.lora_files)}")
    return 0


def _launched_worker() -> bool:
    """A process torchrun started for this run (the check ran once, before the launch)."""
    from ..distributed import launch_env

    return launch_env() is not None


def check_nodes(args: argparse.Namespace):
    """`--nodes M --node-rank R --master HOST:PORT` as distributed.Nodes, or None for one machine;
    a missing or contradicting flag is a ConfigError naming it."""
    from ..config import ConfigError
    from ..distributed import Nodes

    if args.nodes == 1:
        if args.node_rank is not None or args.master is not None:
            raise ConfigError("--node-rank and --master are for a run on several machines: give --nodes M (M >= 2) too")
        return None
    if args.nodes < 1:
        raise ConfigError(f"--nodes must be at least 1 (got {args.nodes})")
    if args.node_rank is None or not 0 <= args.node_rank < args.nodes:
        raise ConfigError(f"--nodes {args.nodes}: give this machine's --node-rank, 0 to {args.nodes - 1} "
                          f"(got {args.node_rank})")
    if args.master is None:
        raise ConfigError(f"--nodes {args.nodes}: give --master HOST:PORT, machine 0's address (reachable from every "
                          f"machine) and a free port on it")
    host, _, port = args.master.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--master {args.master!r}: expected HOST:PORT, e.g. 10.0.0.1:29500")
    return Nodes(count=args.nodes, rank=args.node_rank, host=host.strip("[]"), port=int(port))


def check_gpus(gpus: int, cfg) -> None:
    """`--gpus N` starts N processes, one per GPU: refuse what the machine cannot run (64 processes
    on a 2-core machine without a GPU, or a negative count silently run as one)."""
    import os

    import torch

    from ..config import ConfigError

    if gpus < 1:
        raise ConfigError(f"--gpus must be at least 1 (got {gpus})")
    if gpus == 1 and cfg.train.device != "cpu":
        return
    if cfg.train.device == "cpu":
        cores = os.cpu_count() or 1
        if gpus > cores:
            raise ConfigError(f"--gpus {gpus} with [train] device = \"cpu\": this machine has {cores} CPU core(s); "
                              f"give at most --gpus {cores}")
        return
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found == 0:
        raise ConfigError(f"--gpus {gpus}: this machine has no GPU (CUDA is not available), and --gpus starts one "
                          f"process per GPU; leave --gpus out to train on the CPU, or set [train] device = \"cpu\" "
                          f"to run {gpus} CPU processes anyway (for testing; slow)")
    if gpus > found:
        raise ConfigError(f"--gpus {gpus}: this machine has {found} GPU(s); give at most --gpus {found}")


def _argv(args: argparse.Namespace) -> list[str]:
    """This command's arguments without --gpus, for each process torchrun starts."""
    argv = ["train", args.config]
    for o in args.overrides:
        argv += ["--set", o]
    if args.resume:
        argv.append("--resume")
    if args.overwrite:
        argv.append("--overwrite")
    if args.no_progress:
        argv.append("--no-progress")
    return argv
