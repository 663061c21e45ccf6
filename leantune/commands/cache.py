"""`leantune cache my.toml`: fill the latent and text-embedding caches of a config, nothing else.

Useful before a long run (the encoders are then never loaded by `train`) and to check a dataset:
unreadable images and corrupt entries are reported, and the counts show what was reused.
"""

from __future__ import annotations

import argparse
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the run's TOML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value (repeatable), e.g. --set data.batch_size=2")


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def run(args: argparse.Namespace) -> int:
    from leantune.config import load_config, parse_size
    from leantune.data.cache import CacheError, model_dtype, prepare_caches, sample_prompts, sample_references
    from leantune.data.dataset import DataError
    from leantune.models.weights import LoadError

    cfg = load_config(args.config, args.overrides)
    device = _device(cfg.train.device)
    dtype = model_dtype(cfg.model)
    try:
        data = prepare_caches(cfg.data, cfg.model, cfg.base_dir, device, dtype,
                              extra_prompts=sample_prompts(cfg.sample),
                              sample_references=sample_references(cfg.sample),
                              ram_budget=parse_size(cfg.memory.ram_budget) if cfg.memory.ram_budget else None)
    except (DataError, CacheError, LoadError) as e:   # bad input: a message naming the file, no traceback
        print(f"leantune cache: {e}", file=sys.stderr)
        return 1
    lat, txt = data.stats["latents"], data.stats["text"]
    print(f"cache: {cfg.resolve(cfg.data.cache_dir)}")
    print(f"latents: {lat.hits} hits, {lat.misses} misses, {lat.recomputed} recomputed")
    print(f"text: {txt.hits} hits, {txt.misses} misses, {txt.recomputed} recomputed")
    print(f"{data.num_items} samples in {len(data.buckets)} bucket(s), {data.batches_per_epoch} batches per epoch")
    return 0
