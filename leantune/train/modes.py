"""Training modes: what trains, how one optimizer step runs, what a resumable state holds and
which files a run exports. The trainer's loop is the same for every mode and asks the mode object:

- `check_before_load(meta)`      refuse what cannot fit before the weights load (full: host RAM);
- `prepare(transformer, spec)`   make the trainable parameters (LoRA: add adapters; full: unfreeze
                                 the selected weights), before the memory engine is applied;
- `memory_options()`             extra arguments for `apply_memory` (full mode: an engine that
                                 streams trainable weights and writes them back);
- `build_optimizer(params)`      after the memory plan is applied;
- `step(t, micro_batch)`         one optimizer step over the micro-batches (full mode steps inside
                                 backward, so gradients never all exist at once);
- `state(t)` / `load_state(...)` the trainable weights and the optimizer state, for exact resume;
- `export(...)`                  the files a user takes away (LoRA files, or the whole model).

`[train] mode` picks one: "lora" (`LoraMode`, lora_mode.py) or "full" (`FullMode`, full_mode.py;
on several processes `ShardedFullMode`, sharded_full.py). This module only chooses: it is the top of
the modes, and no mode imports it (what they share is in mode_shared.py).
"""

from __future__ import annotations

from ..config import RunConfig
from .full_mode import FullMode
from .lora_mode import LoraMode
from .sharded_full import sharded_full_mode


def make_mode(cfg: RunConfig, dist=None):
    """The mode object for `[train] mode` (`dist`: the run's DistContext, for the sharded full modes)."""
    if cfg.train.mode == "full":
        sharded = sharded_full_mode(cfg, dist)    # several processes: FSDP2 owns the weights
        if sharded is not None:
            return sharded

        return FullMode(cfg)
    return LoraMode(cfg)
