"""The run's `accelerate.Accelerator`: made once per `train()`, released at its end.

What accelerate does here. It joins the process group the launcher described (torchrun,
`accelerate launch`, `leantune train --gpus N`), places this process on its device (cuda:LOCAL_RANK,
or the CPU), carries the run's mixed precision, and for `[distributed] strategy = "deepspeed"`
builds the DeepSpeed engine from a `DeepSpeedPlugin` (`accelerator.prepare(model, optimizer)`).
Its rank, world size and device are the ones `DistContext` (distributed.py) hands to the rest of
leantune. What it does not do here, and why:
- LoRA gradients are all-reduced by `DistContext.sync_gradients` after the last micro-batch, not
  by the DDP wrapper `accelerator.prepare` would add, for two reasons. (1) DDP reduces from
  autograd hooks inside backward: when one rank runs out of memory the others are already blocked
  in that bucket's all-reduce and cannot re-plan with it; leantune first votes on the step (one
  tiny all-reduce) and reduces only when every rank succeeded. (2) A re-plan sends the weights
  home to the host and applies the new plan, which replaces the adapter parameters' storage; DDP
  builds its gradient buckets over those storages once, at wrap time, and would have to be
  rebuilt after every re-plan. The summed result is DDP's (tested against one process with the
  doubled batch).
- FSDP2 is `fully_shard` on the spec's blocks (train/sharded_full.py): `Accelerator(cpu=True)`
  runs as MULTI_CPU and ignores an FSDP plugin, so the plugin's path could not be tested on CPU,
  and the spec already names the blocks to shard.
- Checkpoints stay leantune's own exact-resume files (no `save_state`).

DeepSpeed on a CPU. `Accelerator(cpu=True)` ignores DeepSpeed (accelerate only enables it
for `cpu=False`), so a DeepSpeed run on CPU processes makes the Accelerator with `cpu=False` and
the gloo backend: DeepSpeed's CPU accelerator then runs the same engine the GPUs do.

One process, several configurations. `AcceleratorState` is a process-wide singleton that refuses
a second configuration, and accelerate writes `ACCELERATE_USE_DEEPSPEED` into the environment.
`release_accelerator` resets the singleton and puts the environment back, so tests (and the UI's
runs) can build one run after another in one process.

`accelerate launch --config_file` settings. accelerate's launcher passes its config as
environment variables (ACCELERATE_MIXED_PRECISION, ACCELERATE_GRADIENT_ACCUMULATION_STEPS,
ACCELERATE_DEEPSPEED_ZERO_STAGE, ...). `apply_launch_settings` maps them onto leantune's keys
where the run's TOML leaves a key unset; a key the TOML sets wins, with a warning naming both.
accelerate launch passes mixed_precision "no" even when nothing chose it, so "no" is taken only
from a DeepSpeed config file that lists it (ACCELERATE_CONFIG_DS_FIELDS).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from .config import ConfigError

log = logging.getLogger("leantune")


@dataclass(frozen=True)
class LaunchSetting:
    env: str            # the variable accelerate launch sets
    section: str        # leantune's section and key
    key: str
    accelerate_key: str  # the key's name in accelerate's config file


# accelerate launch config -> leantune keys (only those leantune has a key for).
LAUNCH_SETTINGS = (
    LaunchSetting("ACCELERATE_MIXED_PRECISION", "train", "mixed_precision", "mixed_precision"),
    LaunchSetting("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "train", "gradient_accumulation",
                  "gradient_accumulation_steps"),
    LaunchSetting("ACCELERATE_GRADIENT_CLIPPING", "train", "max_grad_norm", "gradient_clipping"),
    LaunchSetting("ACCELERATE_DEEPSPEED_ZERO_STAGE", "distributed", "zero_stage", "zero_stage"),
    LaunchSetting("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "distributed", "offload_optimizer",
                  "offload_optimizer_device"),
    LaunchSetting("ACCELERATE_DEEPSPEED_CONFIG_FILE", "distributed", "deepspeed_config", "deepspeed_config_file"),
    LaunchSetting("FSDP_OFFLOAD_PARAMS", "distributed", "fsdp_cpu_offload", "fsdp_offload_params"),
)


def _parse(setting: LaunchSetting, raw: str):
    if setting.key == "mixed_precision":
        if raw not in ("no", "bf16"):
            raise ConfigError(f"accelerate launch: mixed_precision = {raw!r}: leantune trains in \"bf16\" or \"no\"")
        return raw
    if setting.key == "zero_stage":
        if raw not in ("2", "3"):
            raise ConfigError(f"accelerate launch: zero_stage = {raw}: leantune runs DeepSpeed ZeRO stage 2 (or 3 "
                              f"where the config allows it)")
        return int(raw)
    if setting.key == "gradient_accumulation":
        return int(raw)
    if setting.key == "max_grad_norm":
        return float(raw)
    if setting.key == "offload_optimizer":
        if raw not in ("none", "cpu"):
            raise ConfigError(f"accelerate launch: offload_optimizer_device = {raw!r}: leantune offloads the "
                              f"optimizer to \"cpu\" or not at all (\"none\")")
        return raw == "cpu"
    if setting.key == "fsdp_cpu_offload":
        return raw.lower() == "true"
    return raw


def _config_fields() -> set[str]:
    """The DeepSpeed keys accelerate launch took from a config file (it lists them)."""
    return set(filter(None, os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")))


def launcher_strategy() -> str | None:
    """The strategy an `accelerate launch` config chose (DEEPSPEED / FSDP), else None."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return "deepspeed"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "fsdp2"
    return None


def apply_launch_settings(cfg) -> tuple[object, list[tuple[int, str]]]:
    """`cfg` with the settings of an `accelerate launch` config where the TOML leaves the key unset
    (a new RunConfig; `cfg` is not changed), and the (logging level, message) lines that say what
    was taken or overridden, for the run's log. A key set in both with different values keeps the
    TOML's. Without accelerate launch (no ACCELERATE_* variables) `cfg` comes back unchanged."""
    updates: dict[str, dict] = {}
    said, notes = [], []
    strategy = launcher_strategy()
    if strategy is not None and "strategy" not in cfg.distributed.model_fields_set:
        if cfg.train.mode == "full":
            updates.setdefault("distributed", {})["strategy"] = strategy
            said.append(f"[distributed] strategy = \"{strategy}\"")
        elif strategy == "deepspeed":
            notes.append((logging.INFO, "accelerate launch asked for DeepSpeed: a LoRA run reduces its adapter gradients "
                                        "itself (ddp semantics, leantune/distributed.py); ZeRO applies to [train] mode = "
                                        "\"full\""))
    for s in LAUNCH_SETTINGS:
        raw = os.environ.get(s.env)
        if raw is None or raw == "":
            continue
        if s.section == "distributed" and (cfg.train.mode != "full"
                                           or strategy != ("fsdp2" if s.key == "fsdp_cpu_offload" else "deepspeed")):
            continue                  # ZeRO / FSDP settings concern full fine-tunes only
        value = _parse(s, raw)
        if s.key == "mixed_precision" and value == "no" and "mixed_precision" not in _config_fields():
            continue                  # accelerate launch's default, not a choice (it always passes one)
        section = getattr(cfg, s.section)
        current = getattr(section, s.key)
        if s.key in section.model_fields_set:
            if current != value:
                notes.append((logging.WARNING, f"[{s.section}] {s.key} = {current!r} in the run's TOML overrides "
                                               f"accelerate launch's {s.accelerate_key} = {raw!r}"))
            continue
        if current != value:
            updates.setdefault(s.section, {})[s.key] = value
            said.append(f"[{s.section}] {s.key} = {value!r}")
    if said:
        notes.insert(0, (logging.INFO, "from the accelerate launch config: " + ", ".join(said)))
    if not updates:
        return cfg, notes
    new = {name: getattr(cfg, name).model_copy(update=values) for name, values in updates.items()}
    return cfg.model_copy(update=new), notes


def group_backend(dcfg, cpu: bool, strategy: str) -> str:
    """The backend the run's process group starts with: `[distributed] backend` ("auto": gloo for CPU
    processes, NCCL on GPUs), and for FSDP2 with `fsdp_cpu_offload` under NCCL the device map
    "cuda:nccl,cpu:gloo". Why: offloaded shards are CPU DTensors, and they meet the default group at
    the step's `clip_grad_norm_` (clipping is on by default) and at every save's `full_tensor()`;
    NCCL alone has no CPU backend and fails there ("No backend type associated with device type
    cpu"; pytorch#148532, torchtune#1977). accelerate does the same for its own FSDP launches, which
    leantune does not use (it shards itself)."""
    backend = dcfg.backend if dcfg.backend != "auto" else ("gloo" if cpu else "nccl")
    if backend == "nccl" and strategy == "fsdp2" and dcfg.fsdp_cpu_offload:
        return "cuda:nccl,cpu:gloo"
    return backend


def make_accelerator(cfg, device: torch.device, strategy: str, world_size: int):
    """The run's Accelerator (see the module docstring). Returns (accelerator, saved_env) for
    `release_accelerator`."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    saved = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    AcceleratorState._reset_state(True)          # a run never inherits another run's configuration
    dcfg = cfg.distributed
    cpu = device.type == "cpu"
    backend = group_backend(dcfg, cpu, strategy)
    deepspeed = strategy == "deepspeed" and world_size > 1
    # The strategy is leantune's decision (resolve_strategy); accelerate must not pick DeepSpeed or
    # FSDP from the launcher's variables on its own.
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true" if deepspeed else "false"
    os.environ["ACCELERATE_USE_FSDP"] = "false"
    # The launcher's settings are in `cfg` already (apply_launch_settings) and the DeepSpeed config
    # below is complete; the plugin would refuse a config beside the launcher's DeepSpeed fields.
    for k in [k for k in os.environ if k.startswith(("ACCELERATE_DEEPSPEED_", "ACCELERATE_GRADIENT_"))
              or k in ("ACCELERATE_CONFIG_DS_FIELDS", "ACCELERATE_MIXED_PRECISION")]:
        del os.environ[k]
    kwargs = {"mixed_precision": cfg.train.mixed_precision, "cpu": cpu and not deepspeed}
    if world_size > 1:
        import datetime

        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(
            backend=backend, timeout=datetime.timedelta(minutes=dcfg.timeout_minutes))]
    if deepspeed:
        _ninja_on_path()

        ds = deepspeed_config(cfg, world_size)
        # DeepSpeed's own bf16 (a bf16 module, fp32 masters) is on only for a bf16 model; the
        # forward's autocast stays the trainer's either way, as in one process.
        kwargs["mixed_precision"] = "bf16" if ds.get("bf16", {}).get("enabled") else "no"
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=ds)
    try:
        accelerator = Accelerator(**kwargs)
    except BaseException:
        release_accelerator(saved)
        raise
    return accelerator, saved


def _ninja_on_path() -> None:
    """DeepSpeed compiles its CPU communication op at its first use with torch's extension builder,
    which runs `ninja` from PATH. pip installs ninja (a DeepSpeed dependency) beside this Python,
    which is on PATH only in an activated environment: put that folder on PATH when no ninja is."""
    import shutil
    import sys

    if shutil.which("ninja") is None:
        here = os.path.dirname(sys.executable)
        if os.path.exists(os.path.join(here, "ninja")):
            os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")


def release_accelerator(saved_env: dict[str, str]) -> None:
    """Forget the Accelerator's process-wide state and put accelerate's variables back."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    for k in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        if k not in saved_env:
            del os.environ[k]
    os.environ.update(saved_env)


def deepspeed_config(cfg, world_size: int) -> dict:
    """The DeepSpeed config a run means: `[distributed] deepspeed_config` as written, else the
    keys of [distributed], [data] and [train] in DeepSpeed's terms (the usual accelerate setup:
    ZeRO-2, no optimizer offload, bf16, the run's accumulation and clipping)."""
    d, tc = cfg.distributed, cfg.train
    if d.deepspeed_config is not None:
        path = cfg.resolve(d.deepspeed_config)
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"[distributed] deepspeed_config = {d.deepspeed_config!r}: cannot read {path}: {e}") from None
    zero = {"stage": d.zero_stage, "offload_optimizer": {"device": "cpu" if d.offload_optimizer else "none"},
            "overlap_comm": False, "contiguous_gradients": True}
    extra = {}
    if d.offload_optimizer:
        # The offloaded fp32 partitions are stepped on the CPU by the run's torch AdamW (DeepSpeed's
        # CPUAdam would need its C++ op compiled on every machine); DeepSpeed refuses a client
        # optimizer with offload unless told this is meant.
        extra["zero_force_ds_cpu_optimizer"] = False
    return {**extra,
        "train_micro_batch_size_per_gpu": cfg.data.batch_size,
        "gradient_accumulation_steps": tc.gradient_accumulation,
        "train_batch_size": cfg.data.batch_size * tc.gradient_accumulation * world_size,
        "gradient_clipping": tc.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": tc.mixed_precision == "bf16" and cfg.model.dtype == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }

