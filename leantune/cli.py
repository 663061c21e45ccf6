"""`leantune <verb>`: each verb lives in leantune/commands/<verb>.py with `configure(parser)` and `run(args)`,
except `ui`, whose verb lives with the page it serves (leantune/ui/command.py): the page drives the
other commands, so it sits above them and no command imports it.

Commands are imported only when used, so `leantune plan` does not pay for importing diffusers.
Bad input (a config, a dataset, a model or LoRA file, a checkpoint) ends in one paragraph that
names the file and the key, never in a traceback: a traceback is kept for real faults.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

DESCRIPTION = ("Fine-tune LoRAs for Flux.1 on the GPU memory you have, and sample from them. "
               "Run `leantune <command> --help` for a command's options.")

VERBS = {
    "train": "train a LoRA from a TOML config",
    "sample": "generate images, optionally with LoRAs, on a VRAM budget",
    "check": "run a few steps with and without the plan's memory techniques and compare (parity proof)",
    "plan": "print the memory plan for a config or a model/budget, without loading weights",
    "cache": "fill the latent and text-embedding caches for a config",
    "convert": "convert a LoRA file between ComfyUI/kohya and diffusers formats",
    "demo": "train a LoRA on a tiny Flux (or SD3.5) built offline (CPU, about a minute)",
    "ui": "a local web page to prepare a dataset, plan, train, watch and sample",
}
VERB_MODULES = {"ui": "leantune.ui.command"}    # the rest: leantune.commands.<verb>
# Verbs that run no attention on a GPU in their own process (the page starts the others as commands
# of their own): no cuDNN guard, and `leantune plan` answered from its cache does not import torch.
NO_ATTENTION_VERBS = frozenset({"plan", "convert", "ui"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leantune", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="verb", required=True)
    for verb, help_text in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        module = importlib.import_module(VERB_MODULES.get(verb, f"leantune.commands.{verb}"))
        module.configure(p)
        p.set_defaults(_module=module)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the input is wrong", each raised with a message naming the file/key.

    Imported only when an error is being handled, so the commands keep their lazy imports.
    """
    from leantune.data.cache import CacheError
    from leantune.data.dataset import DataError
    from leantune.demo import DemoFolderError
    from leantune.io import UnreadableFileError, UnsafeFileError
    from leantune.planner.feedback.oom import NoPlanFits
    from leantune.planner.workload import InfeasibleBudget
    from leantune.models.weights import LoadError
    from leantune.train.lora_formats import LoraFormatError
    from leantune.disk import DiskFullError
    from leantune.train.run_folder import RunFolderError
    from leantune.train.state import CheckpointError
    from leantune.distributed import ShardedOutOfMemory, WorkerFailed

    return (ShardedOutOfMemory, DataError, CacheError, DemoFolderError, LoadError, UnsafeFileError, UnreadableFileError, LoraFormatError,
            InfeasibleBudget, NoPlanFits, CheckpointError, FileNotFoundError, FloatingPointError, RunFolderError,
            DiskFullError, WorkerFailed)


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """leantune's own warnings (unreadable images, corrupt cache entries) are messages for the
    user: print them without the source line Python adds. Other libraries' keep the default."""
    if category.__module__.startswith("leantune"):
        return f"warning: {message}\n"
    return _default_format_warning(message, category, filename, lineno, line)


_default_format_warning = warnings.formatwarning


def main(argv: list[str] | None = None) -> int:
    from leantune.quiet import quiet_third_party

    quiet_third_party()          # before any command imports diffusers / transformers
    args = build_parser().parse_args(argv)
    from leantune.config import ConfigError

    warnings.formatwarning = _format_warning
    if args.verb not in NO_ATTENTION_VERBS:
        from leantune.memory.attention_kernels import guard_process

        guard_process()          # cuDNN attention off for every CUDA command (caching, sampling), not only training
    try:
        return int(args._module.run(args) or 0)
    except ConfigError as e:
        print(f"leantune {args.verb}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        if getattr(e, "signal_name", None) == "SIGTERM":       # trainer.Terminated, distributed.LauncherStopped
            print(f"leantune {args.verb}: stopped by SIGTERM", file=sys.stderr)
            return 143
        print(f"leantune {args.verb}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from leantune.distributed import peer_lost

        if peer_lost(e):
            rank = os.environ.get("RANK", "?")
            print(f"leantune {args.verb} [rank {rank}]: lost contact with another process of this run "
                  f"({str(e).strip().splitlines()[0][:200]}); the launcher names which one stopped", file=sys.stderr)
            return 1
        if not isinstance(e, user_errors()):
            raise
        print(f"leantune {args.verb}: {e}", file=sys.stderr)
        return 1
    finally:
        warnings.formatwarning = _default_format_warning


if __name__ == "__main__":
    sys.exit(main())
