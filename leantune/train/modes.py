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
from ..models.family import get_family
from .flow_matching import sampling_method
from .full_mode import FullMode
from .lora_mode import LoraMode
from .parts_lora import PartsLoraMode
from .sharded_full import sharded_full_mode


def make_mode(cfg: RunConfig, dist=None):
    """The mode object for `[train] mode` (`dist`: the run's DistContext, for the sharded full modes).
    Part of the trainer's entry: the one place below it that reads the whole config, handing each
    mode the sections it uses."""
    if cfg.train.mode == "full":
        # several processes: FSDP2 / ZeRO-2 own the weights
        sharded = sharded_full_mode(cfg.train, cfg.full, cfg.memory, cfg.distributed, cfg.output.formats, dist,
                                    sample=cfg.sample)
        if sharded is not None:
            return sharded
        return FullMode(cfg.train, cfg.full, cfg.output.formats, cfg.memory.ram_budget)
    if cfg.model.expert == "both":          # Wan 2.2 A14B's two experts in one run (parts_lora.py)
        return PartsLoraMode(cfg.lora, cfg.train, cfg.output.formats, init_from=cfg.resolve(cfg.lora.init_from),
                             run_notes=lora_run_notes(cfg), shared=cfg.lora.experts == "shared")
    return LoraMode(cfg.lora, cfg.train, cfg.output.formats, init_from=cfg.resolve(cfg.lora.init_from),
                    run_notes=lora_run_notes(cfg))


def lora_run_notes(cfg: RunConfig) -> dict:
    """The run's settings a LoRA file's header records (kohya's ss_* keys), besides rank and alpha."""
    tc = cfg.train
    return {
        "ss_output_name": cfg.output.name, "ss_learning_rate": tc.learning_rate, "ss_optimizer": tc.optimizer,
        "ss_lr_scheduler": tc.lr_scheduler, "ss_resolution": ",".join(str(r) for r in cfg.data.resolutions),
        "ss_seed": tc.seed, "ss_guidance_scale": tc.guidance,
        "ss_timestep_sampling": sampling_method(tc.timestep_sampling, get_family(cfg.model.family)),
    }
