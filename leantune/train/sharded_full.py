"""Full fine-tuning on several processes with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Why a mode of its own. The one-process full mode (full_mode.py) steps each weight inside backward
with its own fused optimizer, so that gradients never all exist at once. FSDP2 instead owns the
parameter storage: every weight is a DTensor sharded across ranks, gathered per block for forward
and backward, its gradient reduce-scattered back to the shards. The optimizer then steps each
rank's shards with torch's AdamW, after backward, as usual. Memory per rank: weights, gradients
and AdamW states are each 1/N of the model's (plus one gathered block at a time).

- What trains: the `[full] train` / `exclude` selection, as in one process.
- Sharding: `fully_shard` on every block of the family's spec, then on the root (the embedders
  and the final layer), over all ranks; `[distributed] fsdp_cpu_offload` keeps shards in host RAM
  (under NCCL the group then starts as "cuda:nccl,cpu:gloo", accelerate_setup.group_backend: the
  CPU shards meet it at clipping and at every save's gather).
- Gradients: each rank's loss is already weighted by its share of the global batch (see
  distributed.py); the reduce-scatter averages, so the shards are multiplied by N afterwards
  (a divide factor of 1 would need PREMUL_SUM, which gloo lacks).
- Clipping: global norm over every rank's shards (`clip_grad_norm_` on DTensors).
- Resumable state and exports: the full weights and optimizer state are gathered to rank 0 (a
  collective every rank joins in `state()`), saved in leantune's checkpoint format and exported as
  the one-process full mode does. Resume gives every rank the full state and each keeps its shards.

Streaming cannot be combined (both own where weights live; the config refuses it by key).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..config import DistributedConfig, FullConfig, MemoryConfig, TrainConfig
from ..distributed import launch_env, resolve_strategy
from .full_export import export_files
from .mode_shared import check_resumable
from .trainable import select_trainable

log = logging.getLogger("leantune")


class ShardedFullMode:
    name = "full"

    # FSDP2's fully_shard makes no collective (the mesh is made beforehand, in check_before_load), so a
    # rank can load and shard in its own loading turn (trainer.py, DistContext.local_turns): the
    # machine then holds one whole model at a time beside the others' shards, not one per process.
    shards_in_turn = True

    def __init__(self, train: TrainConfig, full: FullConfig, formats: list[str], *, fsdp_cpu_offload: bool = False,
                 dist=None, load_in_turns: bool = True):
        self.train, self.full, self.formats, self.fsdp_cpu_offload = train, full, list(formats), fsdp_cpu_offload
        self.load_in_turns = load_in_turns
        self._mesh = None
        self.spec = None                          # the family's spec, from prepare()
        self.dist = dist                          # leantune.distributed.DistContext (its Accelerator)
        self.model = None
        self.named: dict[str, torch.nn.Parameter] = {}
        self._gathered: dict | None = None       # rank 0's full weights of the last state() call

    # -- set-up ------------------------------------------------------------------------------------
    def check_before_load(self, meta_model) -> None:
        """Host RAM at the loading moment, priced before any weight is read (every rank at once; the
        device mesh is made here too, so that the loading turns need no collective)."""
        check_loading_host_ram(meta_model(), self._local_world_size(), self._world_size(),
                               self.load_in_turns and self.shards_in_turn, type(self).__name__)
        self._make_mesh()

    def _local_world_size(self) -> int:
        return self.dist.local_world_size if self.dist is not None else 1

    def _make_mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            device = "cuda" if self.train.device != "cpu" and torch.cuda.is_available() else "cpu"
            self._mesh = init_device_mesh(device, (self._world_size(),))
        return self._mesh

    def prepare(self, transformer: torch.nn.Module, spec) -> list[torch.nn.Parameter]:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        self.spec = spec
        self._unfreeze(transformer, "fsdp2")
        mesh = self._make_mesh()
        device = mesh.device_type
        options = {"mesh": mesh}
        if self.fsdp_cpu_offload and device == "cpu":
            raise ValueError("[distributed] fsdp_cpu_offload = true with CPU processes: the shards already live in host "
                             "RAM, and FSDP2's CPUOffloadPolicy needs a CUDA device (it fails with \"Cannot access "
                             "accelerator device when none is available\"); remove the key")
        if self.fsdp_cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy()
        units = [block for _, block in spec.blocks(transformer)] + [transformer]
        for module in units:
            fully_shard(module, **options)
        self.world_size = mesh.size()
        self.model = transformer
        self.named = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
        n = sum(p.numel() for p in self.named.values())
        log.info("full (fsdp2): %d tensors, %.2fM parameters sharded over %d processes", len(self.named), n / 1e6,
                 mesh.size())
        return list(self.named.values())

    def _unfreeze(self, transformer: torch.nn.Module, strategy: str) -> dict[str, torch.nn.Parameter]:
        """The `[full] train` / `exclude` selection trains; everything else is frozen."""
        full = self.full
        if self.train.optimizer != "adamw":
            raise ValueError(f"[train] optimizer = {self.train.optimizer!r} with [distributed] strategy = "
                             f"\"{strategy}\": full fine-tunes on several processes use \"adamw\"")
        named = select_trainable(transformer, full.train, full.exclude)
        if not named:
            raise ValueError(f"[full] train = {full.train} with exclude = {full.exclude} selects no weight")
        transformer.requires_grad_(False)
        for p in named.values():
            p.requires_grad_(True)
        return named

    def _world_size(self) -> int:
        """The run Accelerator's process count (DistContext); the process group's without one."""
        return self.dist.world_size if self.dist is not None else torch.distributed.get_world_size()

    def memory_options(self) -> dict:
        return {}

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        tc = self.train
        return torch.optim.AdamW(params, lr=tc.learning_rate, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay)

    # -- the step ----------------------------------------------------------------------------------
    def step(self, t, micro_batch) -> float:
        t.optimizer.zero_grad(set_to_none=True)
        accum = self.train.gradient_accumulation
        total = sum(micro_batch(1.0 / accum) for _ in range(accum))
        with torch.no_grad():             # reduce-scatter averaged the weighted shares: make it their sum
            for p in t.params:
                if p.grad is not None:
                    p.grad.mul_(self.world_size)
        if self.train.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(t.params, self.train.max_grad_norm)
        t.optimizer.step()
        return total / accum

    def drop_partial_step(self, t) -> None:
        t.optimizer.zero_grad(set_to_none=True)

    # -- resumable state (collective: every rank calls it) ---------------------------------------------
    def _options(self, **kw):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, **kw)

    def state(self, t) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        weights, optim = get_state_dict(self.model, t.optimizer, options=self._options(cpu_offload=True))
        self._gathered = weights
        if not weights:                                  # ranks other than 0 get empty dicts
            return {}
        return {"trainable": {n: weights[n] for n in self.named}, "optimizer": optim}

    def load_state(self, t, state: dict, ckpt: Path) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        check_resumable(ckpt, state["trainable"], dict(self.model.named_parameters()), "[full] train / exclude")
        set_state_dict(self.model, t.optimizer, model_state_dict=state["trainable"],
                       optim_state_dict=state["optimizer"], options=self._options(strict=False))

    # -- exported files ----------------------------------------------------------------------------------
    def export(self, t, paths, step: int, intermediate: bool) -> list[Path]:
        """The whole model from the weights gathered by the last `state()` (rank 0)."""
        access = _GatheredAccess(self.model, self._gathered or {})
        return export_files(self.model, self.spec, access, paths, step, intermediate, formats=self.formats,
                            save_dtype=self.full.save_dtype, keep_last=self.train.keep_last)

    def close(self, t) -> None:
        self._gathered = None


def check_loading_host_ram(meta_model: torch.nn.Module, local: int, world: int, in_turns: bool, what: str) -> int:
    """The host RAM this machine's `local` processes need at once while loading a sharded full
    fine-tune (returned, in bytes), refused with the numbers where more than is available.

    Why: every process reads the whole model into host RAM before it is sharded (FSDP2) or kept
    (ZeRO-2 keeps every weight whole on every rank): loaded at once, 4 processes and FLUX.2-dev are
    ~256 GB at one moment. Loaded in turns (FSDP2), one process holds the whole model while those
    before it hold their 1/world shards."""
    from ..config import ConfigError
    from ..host import host_ram

    model = sum(t.numel() * t.element_size() for t in [*meta_model.parameters(), *meta_model.buffers()])
    need = model + (local - 1) * -(-model // world) if in_turns else local * model
    _, available = host_ram()
    GiB = 2**30
    how = "one after another" if in_turns else "all at once"
    log.info("full (%s): loading needs %.1f GiB of host RAM on this machine (%d processes %s, model %.1f GiB); "
             "%.1f GiB available", what, need / GiB, local, how, model / GiB, available / GiB)
    if need > available:
        hint = ("set [distributed] load_in_turns = true (FSDP2 processes then load one after another, each keeping "
                "only its shard)" if not in_turns else "run fewer processes on this machine, or free host RAM")
        raise ConfigError(f"[train] mode = \"full\" on {local} processes of this machine ({how}): loading needs "
                          f"{need / GiB:.1f} GiB of host RAM (the model is {model / GiB:.1f} GiB) but "
                          f"{available / GiB:.1f} GiB are available; {hint}")
    return need


class ZeroFullMode(ShardedFullMode):
    """Full fine-tune through DeepSpeed ZeRO-2: every process holds the whole (resident) model;
    gradients and AdamW states are partitioned across processes; DeepSpeed reduces the gradients
    in backward, clips globally and steps its partition (with a torch AdamW it wraps, so no
    DeepSpeed optimizer kernel needs compiling). The engine is the run Accelerator's
    (`accelerator.prepare` with the DeepSpeedPlugin made from `deepspeed_config`); the loop drives
    `engine.backward` / `engine.step` itself, as accelerate's own wrapper does, with the
    accumulation boundary the engine counts from `gradient_accumulation_steps`. Checkpoints hold the full fp32 weights and AdamW moments,
    gathered with DeepSpeed's safe_get_full_* (collective) and written by rank 0 in leantune's
    format; resume hands every rank the full tensors (safe_set_full_*)."""

    shards_in_turn = False      # every rank keeps the whole model, and accelerator.prepare is collective

    def check_before_load(self, meta_model) -> None:
        check_loading_host_ram(meta_model(), self._local_world_size(), self._world_size(), False, type(self).__name__)

    def prepare(self, transformer: torch.nn.Module, spec) -> list[torch.nn.Parameter]:
        named = self._unfreeze(transformer, "deepspeed")
        self.model, self.named, self.spec = transformer, named, spec
        self.world_size = self._world_size()
        return list(named.values())

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        opt = super().build_optimizer(params)
        accelerator = getattr(self.dist, "accelerator", None)
        if accelerator is None or accelerator.state.deepspeed_plugin is None:
            raise RuntimeError("[distributed] strategy = \"deepspeed\": the run's Accelerator was made without its "
                               "DeepSpeed plugin (train() makes it; build the mode through train())")
        self.engine, _ = accelerator.prepare(self.model, opt)
        self.zero = self.engine.optimizer            # DeepSpeed's ZeRO-2 optimizer around `opt`
        n = sum(p.numel() for p in params)
        e = self.engine
        log.info("full (deepspeed ZeRO-%d): %d tensors, %.2fM parameters, optimizer states over %d processes; "
                 "bf16 %s, gradient accumulation %d, clipping %g, optimizer offload %s",
                 e.zero_optimization_stage(), len(params), n / 1e6, self.world_size,
                 "on" if e.bfloat16_enabled() else "off", e.gradient_accumulation_steps(), e.gradient_clipping(),
                 "cpu" if e.zero_cpu_offload() else "none")
        return opt                 # the scheduler drives its param groups' lr, which DeepSpeed reads

    def backward(self, loss: torch.Tensor) -> None:
        """The weighted share of this rank; DeepSpeed averages over ranks, so scale to their sum.
        The trainer already divided by the accumulation steps."""
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def step(self, t, micro_batch) -> float:
        accum = self.train.gradient_accumulation
        total = 0.0
        for _ in range(accum):
            total += micro_batch(1.0 / accum)
            self.engine.step()     # steps the optimizer (clipped) at the accumulation boundary only
        return total / accum

    def drop_partial_step(self, t) -> None:
        self.engine.zero_grad()

    def state(self, t) -> dict:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        weights, moments = {}, {}
        for n, p in self.named.items():            # collective: the same order on every rank
            weights[n] = safe_get_full_fp32_param(p).cpu()
            moments[n] = {k: safe_get_full_optimizer_state(p, k).cpu() for k in ("exp_avg", "exp_avg_sq")}
        self._gathered = None
        if not self.is_main():
            return {}
        self._gathered = {**{k: v for k, v in self.model.state_dict().items()}, **weights}
        return {"trainable": weights, "optimizer": {"moments": moments, "step": self._step_count()}}

    def load_state(self, t, state: dict, ckpt: Path) -> None:
        from deepspeed.utils import (lazy_init_hp_params_optimizer_state, safe_set_full_fp32_param,
                                     safe_set_full_optimizer_state)

        check_resumable(ckpt, state["trainable"], dict(self.model.named_parameters()), "[full] train / exclude")
        # AdamW creates its state at the first step: create it now (zeros, then the saved values),
        # and link each weight's slice of it, as DeepSpeed does after that first step.
        step = torch.tensor(float(state["optimizer"]["step"]))
        for i, flat in enumerate(self.zero.single_partition_of_fp32_groups):
            self.zero.optimizer.state[flat] = {"step": step.clone(), "exp_avg": torch.zeros_like(flat),
                                               "exp_avg_sq": torch.zeros_like(flat)}
            lazy_init_hp_params_optimizer_state(self.zero.bit16_groups[i], flat, self.zero.optimizer.state)
        for n, p in self.named.items():
            safe_set_full_fp32_param(p, state["trainable"][n])
            with torch.no_grad():
                p.copy_(state["trainable"][n].to(p.dtype))     # the module's own copy, used by forward
            for k, v in state["optimizer"]["moments"][n].items():
                safe_set_full_optimizer_state(p, v, k)

    def _step_count(self) -> int:
        steps = [int(s["step"]) for s in self.zero.optimizer.state.values() if "step" in s]
        return max(steps, default=0)

    def is_main(self) -> bool:
        return self.dist.is_main if self.dist is not None else torch.distributed.get_rank() == 0


class _GatheredAccess:
    """full_export's weight access over a gathered full state dict (names as the model's)."""

    def __init__(self, model: torch.nn.Module, weights: dict):
        self.names = {id(m): name for name, m in model.named_modules()}
        self.weights = weights

    def get(self, module: torch.nn.Module, attr: str) -> torch.Tensor:
        prefix = self.names[id(module)]
        return self.weights[f"{prefix}.{attr}" if prefix else attr]


def sharded_full_mode(train: TrainConfig, full: FullConfig, memory: MemoryConfig, distributed: DistributedConfig,
                      formats: list[str], dist=None, sample=None):
    """The mode for `[train] mode = "full"` on several processes, or None for one process.
    `dist` is the run's DistContext (its world size and Accelerator); without one the launcher's
    environment says how many processes there are. `sample`: the run's [sample] (refused with FSDP2)."""
    env = launch_env()
    world = dist.world_size if dist is not None and dist.accelerator is not None else (env or {}).get("WORLD_SIZE", 1)
    if world <= 1:
        return None
    strategy = resolve_strategy(distributed.strategy, train.mode)
    m = memory
    if m.streamed_blocks not in (0, [], "none") or m.stream_non_blocks or m.vram_budget is not None:
        raise ValueError("[memory] streamed_blocks / stream_non_blocks / vram_budget with [train] mode = \"full\" on "
                         "several processes: FSDP2 shards the weights and owns where they live; remove them (each "
                         "process then holds 1/N of the weights, gradients and optimizer states)")
    if strategy == "fsdp2":
        if sample is not None and sample.every and sample.prompts:
            # Sampling runs on rank 0 (it alone writes the images); under FSDP2 every block's
            # forward is an all-gather of its shards, which the other ranks would not join (their
            # next step's collectives would pair with rank 0's sampling ones: a hang, or mixed data).
            raise ValueError(f"[sample] every = {sample.every} with [train] mode = \"full\" sharded by FSDP2 "
                             f"on {world} processes: sampling runs on rank 0 alone, and FSDP2's all-gathers need "
                             f"every rank; set [sample] every = 0 (sample the exported model afterwards with "
                             f"`leantune sample`), or use [distributed] strategy = \"deepspeed\" (ZeRO-2 keeps "
                             f"every weight whole on every rank)")
        return ShardedFullMode(train, full, formats, fsdp_cpu_offload=distributed.fsdp_cpu_offload, dist=dist,
                               load_in_turns=distributed.load_in_turns)
    if strategy == "deepspeed":
        if distributed.zero_stage != 2 and distributed.deepspeed_config is None:
            raise ValueError("[distributed] zero_stage = 3: leantune runs DeepSpeed ZeRO-2 only (stage 3 shards the "
                             "weights; use strategy = \"fsdp2\" for that)")
        return ZeroFullMode(train, full, formats, dist=dist)
    raise ValueError(f"[distributed] strategy = {strategy!r} cannot run [train] mode = \"full\"")
