"""`leantune <verb>`: each verb lives in leantune/commands/<verb>.py with `configure(parser)` and `run(args)`.

Commands are imported only when used, so `leantune plan` does not pay for importing diffusers.
"""

from __future__ import annotations

import argparse
import importlib
import sys

VERBS = {
    "train": "train a LoRA from a TOML config",
    "sample": "generate images, optionally with LoRAs, on a VRAM budget",
    "plan": "print the memory plan for a config or a model/budget, without loading weights",
    "cache": "fill the latent and text-embedding caches for a config",
    "convert": "convert a LoRA file between ComfyUI/kohya and diffusers formats",
    "demo": "train a LoRA on a tiny Flux built offline (CPU, about two minutes)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leantune", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    for verb, help_text in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        module = importlib.import_module(f"leantune.commands.{verb}")
        module.configure(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from leantune.config import ConfigError

    try:
        return int(args._module.run(args) or 0)
    except ConfigError as e:
        print(f"leantune {args.verb}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"leantune {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
