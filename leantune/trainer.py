"""The training loop: train() -> train_step() -> forward_backward().

`train()` reads top to bottom: set up (caches, model, adapters, memory plan, optimizer), resume,
loop, save, sample, log. Everything a resume needs (adapter weights, optimizer, scheduler, RNG,
data position) goes through `_training_state()` so an interrupted run continues exactly.
SIGTERM and Ctrl-C stop within a named bound (train/stopping.py); a sample that fails while
training is reported and skipped, never the end of the run (its steps would be lost).
"""

from __future__ import annotations

import gc
import logging
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .config import RunConfig
from .distributed import DistContext, shard_of
from .memory.attention_report import AttentionWatch
from .models.family import fp8_load_options, get_family, loader_options
from .planner.feedback.oom import NoPlanFits
from .train import flow_matching as fm
from .train.modes import make_mode
from .train.optim import build_scheduler
from .train.optim_packages import evaluation_point, scalars as optimizer_scalars
from .train.resume_config import apply_learning_rate, check_resume, resolved_config
from .train import stopping
from .train.run_folder import LOCK_NAME, RunFolder, record_written, release_lock, restore_exports
from .train.state import load_latest, rng_state, save_checkpoint, saved_config, set_rng_state
from .train.stopping import StopRequest, Terminated, terminate_as_interrupt  # noqa: F401 (the trainer's names)

log = logging.getLogger("leantune")

@dataclass
class RunPaths:
    """Where a run writes: everything under [output] dir."""

    root: Path
    name: str

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def log_file(self) -> Path:
        return self.root / "train.log"

    @property
    def loss_plot(self) -> Path:
        return self.root / "loss.png"

    @property
    def memory_plot(self) -> Path:
        return self.root / "memory.png"

    @property
    def loss_history(self) -> Path:
        return self.root / "loss.json"

    def lora_file(self, fmt: str, step: int | None = None) -> Path:
        suffix = "" if step is None else f"-step{step:06d}"
        return self.root / f"{self.name}{suffix}_{fmt}.safetensors"


@dataclass
class TrainResult:
    paths: RunPaths
    losses: list[float]
    lora_files: list[Path]
    sample_files: list[Path] = field(default_factory=list)
    final_step: int = 0
    interrupted: bool = False


@dataclass
class Trainee:
    """The pieces a step needs, built once by `_build`."""

    transformer: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data: object                   # leantune.data.cache.CachedData
    batches: object                # its resumable batch iterator
    generator: torch.Generator     # noise and timestep draws: CPU, saved with the state
    device: torch.device
    dtype: torch.dtype
    memory: object | None = None   # leantune.memory.engine.MemoryHandle
    plan: object | None = None
    sources: object | None = None  # the family's sources (resolve_sources): the VAE for samples
    guard: object | None = None    # leantune.planner.feedback.oom.OomGuard when planning from a budget
    calibrator: object | None = None
    last_bucket: tuple[int, int] | None = None
    mode: object = None            # leantune.train.modes: LoraMode or FullMode
    dist: DistContext = field(default_factory=DistContext)   # this process's rank (trivial: one process)
    share_host_weights: bool = False   # [distributed] share_host_weights, for re-plans
    base_adapters: object | None = None   # train/base_adapters.BaseAdapterStack: frozen LoRAs under the trained one
    validation: list = field(default_factory=list)   # [(step, held-out loss)] of [validation], saved with the state
    ema: object | None = None      # train/ema.AdapterEma when [ema] enabled
    disk_dir: Path | None = None   # [memory] disk_dir (the disk tier's folder), for re-plans


def pick_device(cfg: RunConfig) -> torch.device:
    if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


class _StderrHandler(logging.StreamHandler):
    """Console log lines go to whatever sys.stderr is at the time: the handler is made once per
    process, and a stream captured then (a redirected or since-closed one) must not be kept."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup_logging(paths: RunPaths) -> None:
    paths.root.mkdir(parents=True, exist_ok=True)
    log.setLevel(logging.INFO)
    for h in list(log.handlers):
        if getattr(h, "_leantune_run", False):
            log.removeHandler(h)
    fh = logging.FileHandler(paths.log_file)
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    fh._leantune_run = True
    log.addHandler(fh)
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) for h in log.handlers):
        sh = _StderrHandler()
        sh.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(sh)


# -- the loop ----------------------------------------------------------------------------------------

def train(cfg: RunConfig, resume: bool = False, stop_after: int | None = None, progress: bool = True,
          overwrite: bool = False) -> TrainResult:
    """Train as `cfg` says (a LoRA, or the whole model with [train] mode = "full"). `stop_after` ends early after that many optimizer steps (tests).

    A folder holding another run needs `resume` or `overwrite`; the folder is locked while training
    (train/run_folder.py)."""
    from .accelerate_setup import apply_launch_settings

    cfg, launch_notes = apply_launch_settings(cfg)   # `accelerate launch --config_file` settings the TOML leaves unset
    paths = RunPaths(cfg.resolve(cfg.output.dir), cfg.output.name)
    dist = DistContext.from_config(cfg, pick_device(cfg))
    finished = False
    # A stop the watchdog has to force still leaves the folder unlocked (release_lock: only our own lock).
    unlock = (lambda: release_lock(paths.root / LOCK_NAME)) if dist.is_main else None
    try:
        with terminate_as_interrupt(on_exit=unlock), RunFolder(paths.root, paths.name, resume, overwrite,
                                                               enabled=dist.is_main):
            result = _train(cfg, paths, dist, resume, stop_after, progress, launch_notes)
        finished = True
        return result
    finally:
        dist.close(finished)


def _train(cfg: RunConfig, paths: RunPaths, dist: DistContext, resume: bool, stop_after: int | None,
           progress: bool, launch_notes: list = ()) -> TrainResult:
    if dist.is_main:
        setup_logging(paths)
    else:
        dist.quiet_logging(log)
    for level, note in launch_notes:
        log.log(level, note)
    torch.manual_seed(cfg.train.seed)
    stopping.set_phase("setting up the caches, model and memory plan")
    t = _build(cfg, dist)
    if cfg.ema.enabled:
        from .train.ema import AdapterEma

        t.ema = AdapterEma(t.transformer, cfg.ema.decay, cfg.ema.every)
    start, losses = 0, []
    if resume:
        start, losses = _resume(t, paths, cfg)
    writer = _tensorboard(paths) if dist.is_main else None
    monitor = _monitor(paths, t)
    _reset_peaks(t)
    result = TrainResult(paths, losses, [])
    step = start
    bar = _progress(cfg, start, progress and dist.is_main)
    stop = StopRequest()
    try:
        while step < cfg.train.steps and (stop_after is None or step - start < stop_after):
            t0 = time.perf_counter()
            stopping.set_phase(f"running step {step + 1}")
            watch = AttentionWatch() if step == start else None      # the first step says its kernels
            with stop, (watch or nullcontext()):
                loss = _guarded_step(t, cfg, step + 1)
                step += 1          # inside: an interrupt after the update never saves it as the step before
                if t.ema is not None:
                    t.ema.after_step(step)
            seconds = time.perf_counter() - t0
            said = watch.summary(t.device) if watch is not None else None
            if said:
                log.info(said)
            report = t.memory.step_report() if t.memory is not None else {}   # counters since last step
            _calibrate(t, seconds, report)
            losses.append(loss)
            _log_step(cfg, step, loss, t, writer, monitor, bar, seconds, report)
            if stop.requested:
                raise stop.stop()     # saved below; no sample first: the stop's bound runs (train/stopping.py)
            if cfg.validation.enabled and (step % cfg.validation.every == 0 or step == cfg.train.steps):
                _validate(t, cfg, step, writer)      # before the save: its state holds this step's value
            if cfg.train.save_every and step % cfg.train.save_every == 0 and step < cfg.train.steps:
                _save(t, cfg, paths, step, losses, intermediate=True)
            if cfg.sample.every and cfg.sample.prompts and step % cfg.sample.every == 0 and dist.is_main:
                result.sample_files.extend(_sample_or_report(t, cfg, paths, step, writer))
    except KeyboardInterrupt:
        result.interrupted = True
        if stop.aborted_mid_step:
            log.info("aborted inside step %d; the last saved state is intact", step + 1)
        else:
            log.info("interrupted at step %d: saving a resumable state", step)
            _save(t, cfg, paths, step, losses, intermediate=True)
        raise
    except NoPlanFits:
        log.error("no memory plan fits: saving a resumable state at step %d", step)
        t.mode.drop_partial_step(t)
        _save(t, cfg, paths, step, losses, intermediate=True)
        raise
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.flush()
    result.final_step = step
    result.losses = losses
    result.lora_files = _save(t, cfg, paths, step, losses, intermediate=step < cfg.train.steps)
    if dist.is_main:
        _finish(paths, losses, monitor, writer, t.validation)
    t.mode.close(t)
    if t.memory is not None:
        t.memory.release()          # pinned buffers, slots and the staging thread go now, not at exit
    return result


def train_step(t: Trainee, cfg: RunConfig) -> float:
    """One optimizer step over `gradient_accumulation` micro-batches (the mode runs them and
    steps); returns the mean loss."""
    t.transformer.train()
    loss = t.mode.step(t, lambda scale: forward_backward(t, cfg, next(t.batches), scale=scale))
    t.scheduler.step()
    # Every rank's weighted share: the global batch's loss (and any rank's failure after the vote).
    return t.dist.step_total(loss)


def forward_backward(t: Trainee, cfg: RunConfig, batch, scale: float = 1.0) -> float:
    """Noise the cached latents, predict the velocity, backpropagate the scaled MSE.

    With several processes the batch is this rank's rows of the global batch: the noise and
    timesteps of the whole global batch are drawn (same generator state on every rank) and this
    rank keeps its rows, and the loss is weighted by the rank's share (see distributed.py)."""
    family = get_family(cfg.model.family)
    x0 = batch.latents.to(t.device, torch.float32)                 # (B, C, h, w); clips (B, C, T', h, w)
    h, w = x0.shape[-2:]
    shard = shard_of(batch)
    # the planner calibrates on image buckets (w, h); a clip bucket (w, h, frames) is not one of them
    t.last_bucket = tuple(batch.bucket) if len(batch.bucket) == 2 else None
    noise = torch.randn((shard.global_size, *x0.shape[1:]), generator=t.generator)[shard.rows].to(t.device)
    sigma = fm.sample_sigmas(shard.global_size, fm.sampling_method(cfg.train.timestep_sampling, family), t.generator,
                             sigmoid_scale=cfg.train.sigmoid_scale, shift=cfg.train.shift,
                             image_seq_len=family.image_tokens(h, w))
    if family.training_sigmas is not None:      # a model that owns part of the noise range (a Wan 2.2 expert);
        # on the global batch's levels, so every rank's rows agree (a two-expert run: on one expert)
        sigma = family.training_sigmas(sigma, t.sources, fm.sampling_method(cfg.train.timestep_sampling, family), cfg.train)
    sigma = sigma[shard.rows]
    noisy = fm.add_noise(x0, noise, sigma)
    target = family.pack_latents(fm.velocity_target(x0, noise))     # the transformer's layout
    refs = getattr(batch, "references", None)      # an edit dataset's reference latents (ModelFamily.references)
    weights = getattr(batch, "loss_weights", None)
    if cfg.model.image_to_video:                    # Wan 2.2 TI2V-5B image-to-video (models/wan/ti2v.py)
        refs, weights = _first_frame_kept(x0, weights)

    def predict():
        with _autocast(cfg, t.device):
            return family.predict(t.transformer, family.pack_latents(noisy).to(t.dtype), sigma.to(t.device),
                                  batch.embeds, (h, w), cfg.train.guidance,
                                  **({"references": [r.to(t.device) for r in refs]} if refs else {}))

    prior = getattr(batch, "prior", False)
    if prior and cfg.data.prior_loss == "dop":     # the base's own prediction is the target (train/priors.py)
        from .train.priors import base_prediction

        target = base_prediction(predict, t.transformer)
    pred = predict()
    loss = _loss(family, pred, target, weights, x0) * shard.weight
    if prior:
        loss = loss * cfg.data.prior_weight
    backward = getattr(t.mode, "backward", None)      # an engine that owns backward (DeepSpeed)
    (backward or torch.Tensor.backward)(loss * scale)
    return float(loss.detach())


def _first_frame_kept(x0: torch.Tensor, weights: torch.Tensor | None):
    """A first-frame-conditioned clip batch's (references, loss weights): each clip's own clean first
    latent frame (B, C, 1, h, w) is its condition (the family's predict puts it in place of the noisy
    one, its tokens at timestep 0, as its image-to-video pipeline samples), and the loss is taken on
    the other latent frames only. A batch of one latent frame (still images) has nothing past the
    condition to predict: it trains unconditioned, as it is."""
    if x0.dim() != 5 or x0.shape[2] < 2:
        return None, weights
    keep = torch.ones_like(x0[:, :1])                                  # (B, 1, T', h, w)
    keep[:, :, 0] = 0
    if weights is not None:
        keep = keep * weights.to(x0.device).reshape(*weights.shape[:2], -1, *weights.shape[-2:])
    return [x0[:, :, :1]], keep


def _loss(family, pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None, x0: torch.Tensor):
    """The flow-matching loss; with a masked batch, each latent cell weighted by its mask (the
    (B, 1, h, w) weights broadcast over the channels and packed as the latents are)."""
    if weights is None:
        return fm.flow_matching_loss(pred, target)
    packed = family.pack_latents(weights.to(x0.device).expand_as(x0).contiguous())
    return fm.masked_flow_matching_loss(pred, target, packed)


def _autocast(cfg: RunConfig, device: torch.device):
    """bf16 autocast without its cast cache: the cache keeps the bf16 cast of every fp32 leaf that
    requires grad (every trained weight of a full fine-tune with [model] dtype = "fp32") until the
    forward's autocast exits, which for streamed blocks is a bf16 copy of all of them on the device
    (about 24 GB for Flux-dev), unpriced and defeating streaming. Each use casts afresh instead; a
    weight is used once per forward, so nothing is cast twice."""
    if cfg.train.mixed_precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=False)
    return torch.autocast(device_type=device.type, enabled=False)


# -- set-up ----------------------------------------------------------------------------------------

def _cut(model, spec, keep_blocks: dict | None):
    """`model` cut to `keep_blocks` (models/block_subset.py), or as it is without."""
    if keep_blocks:
        from .models.block_subset import keep_blocks as cut

        cut(model, spec, keep_blocks)
    return model


def _build(cfg: RunConfig, dist: DistContext | None = None, keep_blocks: dict | None = None) -> Trainee:
    """The run of `cfg`, built: caches filled, model loaded and placed, adapters and optimizer.
    `keep_blocks` ({list attr: indices}; `leantune check` on a model too large to compare whole):
    the transformer is cut to those blocks as soon as it is built (models/block_subset.py)."""
    from .config import parse_size
    from .data.cache import model_dtype, prepare_caches, sample_prompts, sample_references, sample_shape
    dist = dist or DistContext()
    family = get_family(cfg.model.family)
    device = dist.device or pick_device(cfg)      # the Accelerator's device (cuda:LOCAL_RANK on several GPUs)
    dtype = model_dtype(cfg.model)
    adapters = _read_base_adapters(cfg, family)   # read and checked before the caches are filled
    ram_budget = parse_size(cfg.memory.ram_budget) if cfg.memory.ram_budget else None
    data = dist.main_first(lambda: prepare_caches(cfg.data, cfg.model, cfg.base_dir, device, dtype,
                                                  extra_prompts=sample_prompts(cfg.sample),
                                                  sample_references=sample_references(cfg.sample),
                                                  ram_budget=ram_budget, validation=cfg.validation,
                                                  sample_shape=sample_shape(cfg.sample, cfg.data)))
    # (filled once, then read by all)
    sources = family.resolve_sources(cfg.model, Path(cfg.base_dir))
    mode = make_mode(cfg, dist)
    base_options = loader_options(cfg.memory)     # a file's e4m3 modulation stays e4m3 unless asked
    if cfg.memory.base_format in ("nf4", "int8"):   # NF4 / int8 rows as read (memory/*_storage.py), priced so on meta
        base_options = base_options | _fp8_load_options(cfg)
    meta_model = _once(lambda: _cut(family.load_transformer(sources, dtype=dtype, device="meta", **base_options),
                                    family.spec, keep_blocks))
    mode.check_before_load(meta_model)            # host RAM, before any weight is read
    machine = _agreed_machine(cfg, dist, device)
    planned = _plan_before_load(cfg, family.spec, meta_model, machine)    # (plan, planner, budget) under a budget
    # Block Linears the plan stores in fp8 are quantized as they are read.
    options = base_options | _fp8_load_options(cfg, planned[0] if planned else None)

    def load(in_turn: bool, shared=None) -> tuple:
        spill = _loading_spill(cfg, family.spec, meta_model, planned)
        with _parking(spill):
            transformer = _cut(family.load_transformer(sources, dtype=dtype, device="cpu", **options), family.spec,
                               keep_blocks)
        log.info("model: %s from %s (%s)", family.describe(transformer), sources.transformer, cfg.model.dtype)
        if spill is not None:
            log.info("model: %d blocks (%.2f GB) loaded straight to the disk tier (%s)", spill.parked_blocks,
                     spill.parked_bytes / 2**30, cfg.memory.disk_dir)
        try:
            params = mode.prepare(transformer, family.spec)
            stack = _attach_base_adapters(transformer, adapters)     # frozen, before the engine places the model
            return (transformer, params, stack, *_apply_memory(cfg, transformer, device, mode, dist, in_turn, shared,
                                                               machine, planned, spill))
        finally:
            if spill is not None:
                spill.close()

    in_turns = mode.name == "lora" or getattr(mode, "shards_in_turn", False)   # FSDP2: load and shard in the turn
    if dist.distributed and in_turns and cfg.distributed.load_in_turns:
        # One loading peak at a time on each machine (the frozen base is the same on every rank).
        # The meta build first, on every rank at once: it imports the loader's modules (seconds
        # of CPU per process), which inside the turns each rank would pay while the others wait.
        meta_model()
        shared = dist.shared_host(cfg.distributed.share_host_weights, mode.name) if mode.name == "lora" else None
        loaded = dist.local_turns(lambda: load(True, shared), shared)
    else:
        loaded = load(False)
    transformer, params, stack, plan, memory, planner, budget = loaded
    if hasattr(mode, "use_plan"):           # a LoRA's optimizer step on the device or the host
        mode.use_plan(plan)
    optimizer = mode.build_optimizer(params)
    scheduler = build_scheduler(optimizer, cfg.train)
    generator = torch.Generator().manual_seed(cfg.train.seed)
    batches = dist.shard_batches(data, cfg.train.seed, cfg.data.batch_size)
    t = Trainee(transformer, params, optimizer, scheduler, data, batches, generator, device, dtype, memory, plan,
                sources, mode=mode, dist=dist, share_host_weights=cfg.distributed.share_host_weights,
                base_adapters=stack, disk_dir=cfg.resolve(cfg.memory.disk_dir))
    if planner is not None:
        from .planner.corrections import CalibrationStore
        from .planner.feedback.calibrate import PlanCalibrator
        from .planner.feedback.oom import OomGuard

        t.guard = OomGuard(planner, budget, plan, lambda new: _replan(t, new))   # owns the plan and budget
        t.calibrator = PlanCalibrator(t.guard, CalibrationStore())
    return t


def _read_base_adapters(cfg: RunConfig, family) -> tuple | None:
    """[model] and [sample] base_adapters read as the family's LoRAs, and a [sample] base checked to
    be of the run's family: a bad file is an error now, naming its key, not at the first preview.
    None when the run has neither."""
    if cfg.sample.base is not None:
        from .models.other_base import check_other_base

        check_other_base(cfg.model, cfg.resolve(cfg.sample.base), "[sample] base")
    if not cfg.model.base_adapters and cfg.sample.base_adapters is None:
        return None
    from .train.base_adapters import check_adapters, read_run_adapters

    training, sampling = read_run_adapters(cfg.model, cfg.sample, cfg.resolve, family.spec.lora_keys)
    sources = family.resolve_sources(cfg.model, Path(cfg.base_dir))
    meta = family.load_transformer(sources, dtype=torch.float32, device="meta", **loader_options(cfg.memory))
    check_adapters(meta, [*training, *(sampling or ())])     # shapes only: a LoRA of another model is named now
    previews = bool(cfg.sample.every and cfg.sample.prompts)
    return training, sampling if previews else None          # no previews: [sample]'s checked, not attached


def _attach_base_adapters(transformer, adapters: tuple | None):
    """The run's BaseAdapterStack on `transformer` (train/base_adapters.py), or None without one."""
    if adapters is None:
        return None
    from .train.base_adapters import BaseAdapterStack

    return BaseAdapterStack(transformer, *adapters)


def _fp8_load_options(cfg: RunConfig, plan=None) -> dict:
    """family.fp8_load_options for this run (`plan`: the planner's, chosen before loading under a
    vram_budget): a full fine-tune's trained weights are not quantized. [memory] base_format = "nf4"
    (or "int8"): the block Linears become NF4 (int8 ConvRot) rows as they are read, whatever the
    plan (memory/nf4_storage.py, int8_storage.py)."""
    from .train.trainable import trains_name

    trained = None
    if cfg.train.mode == "full":
        full = cfg.full
        trained = lambda name: trains_name(name, full.train, full.exclude)   # noqa: E731
    if cfg.memory.base_format in ("nf4", "int8"):
        # the modulation Linears in the format too where the plan quantizes them (as it prices them)
        mod = {"quantize_modulation": True} if getattr(plan, "fp8_modulation", False) else {}
        return {"quantize_fp8": cfg.memory.base_format, **mod, **({"trained": trained} if trained else {})}
    return fp8_load_options(cfg.memory, trained, plan)


def _once(build):
    """`build()` called on first use only (the meta model: the host-RAM check and the planner share it)."""
    made = []

    def get():
        if not made:
            made.append(build())
        return made[0]
    return get


def _plan_before_load(cfg: RunConfig, spec, meta_model, machine) -> tuple | None:
    """Under a vram_budget: (plan, planner, budget) chosen on the meta-built model, before any weight
    is read, so the load can store what the plan keeps (fp8 block Linears quantized as they are
    read) instead of loading in bf16 and quantizing afterwards. None without a budget.

    The planner needs shapes and dtypes only, and they are the loaded model's: the meta build is
    the same loader with the same options; the adapters mode.prepare adds and which weights it
    marks trainable are not read from the model (the workload prices them), so this is the plan
    the loaded model would get (tests/test_plan_before_load.py). Measuring the loaded model
    instead would now see the quantized block weights as a checkpoint's own e4m3 weights."""
    if cfg.memory.vram_budget is None:
        return None
    from .planner.from_config import choose_plan, planner_for_config

    planner, budget = planner_for_config(cfg, spec, meta_model(), machine)
    plan = choose_plan(planner, budget, cfg)
    planner.keep_base_format(plan)       # an int8 / NF4 base is loaded so: a re-plan keeps its format
    if cfg.train.mode == "lora":
        planner.keep_step_place(plan)    # the LoRA's optimizer is built where this plan steps it
    return plan, planner, budget


def _agreed_machine(cfg: RunConfig, dist: DistContext, device: torch.device):
    """Several processes planning for a budget: the one machine they all plan for, probed on every
    rank before any loads and agreed (DistContext.agree_machine), so every rank makes the same
    plan. None otherwise (the planner probes its own)."""
    if cfg.memory.vram_budget is None or not dist.distributed:
        return None
    from .planner import from_config

    return dist.agree_machine(from_config.with_disk_tier(cfg, from_config.probe_machine(device)))


def _loading_spill(cfg: RunConfig, spec, meta_model, planned: tuple | None):
    """The disk tier's loading file (memory/disk_load.BlockSpill) for the blocks this run reads
    from disk, so the loader parks them as it reads them instead of holding the whole transformer
    in host RAM; None without a disk tier or when no block goes to disk. Under a vram_budget the
    planner's plan names the blocks; otherwise the engine's own rule on the meta-built model
    ([memory] ram_budget, disk_load.blocks_for_room)."""
    if cfg.memory.disk_dir is None or cfg.train.mode == "full":
        return None
    if planned is not None:
        blocks = planned[0].disk_blocks
    else:
        from .memory.disk_load import blocks_for_room
        from .memory.engine import resolve_plan
        from .planner.from_config import explicit_disk_room

        meta = meta_model()
        blocks = blocks_for_room(meta, spec, resolve_plan(cfg.memory, spec, meta), explicit_disk_room(cfg.memory))
    if not blocks:
        return None
    from .memory.disk_load import BlockSpill

    return BlockSpill(cfg.resolve(cfg.memory.disk_dir), blocks)


def _parking(spill):
    """weights.parking(spill) around the transformer's load, or nothing without a spill."""
    if spill is None:
        return nullcontext()
    from .models.weights import parking

    return parking(spill)


def _apply_memory(cfg: RunConfig, transformer, device, mode, dist: DistContext | None = None, in_turn: bool = False,
                  shared=None, machine=None, planned: tuple | None = None, parked=None) -> tuple:
    """The memory plan: the planner's when a budget is given, else the explicit [memory] choices.
    `in_turn`: this process applies it in its loading turn (DistContext.local_turns) with the shared
    host buffers `shared`, without collectives; else every rank applies it together. `planned`:
    (plan, planner, budget) already chosen before loading (_plan_before_load), used as they are.

    Returns (plan, handle, planner, budget); planner and budget are None without a budget.
    """
    from .memory.engine import resolve_plan

    planner = budget = None
    spec = get_family(cfg.model.family).spec
    if planned is not None:
        plan, planner, budget = planned
    elif cfg.memory.vram_budget is not None:
        from .planner.from_config import choose_plan, planner_for_config

        planner, budget = planner_for_config(cfg, spec, transformer, machine)
        plan = choose_plan(planner, budget, cfg)
    else:
        plan = resolve_plan(cfg.memory, spec, transformer)
        if cfg.train.mode == "full" and cfg.full.streamed_step == "host" and (plan.streamed_blocks or plan.stream_non_blocks):
            plan = replace(plan, optimizer_on_host=True)
    log.info("memory plan: %s", plan.describe(lora=cfg.train.mode == "lora"))
    disk = _disk_options(cfg) | ({"parked": parked} if parked is not None else {})
    if in_turn:
        from .memory.engine import apply_memory

        handle = apply_memory(transformer, spec, plan, device, host_buffers=shared, **disk, **mode.memory_options())
    else:
        handle = _apply_engine(cfg.distributed.share_host_weights, spec, transformer, plan, device, mode,
                               dist or DistContext(), **({"disk": disk} if disk else {}))
    if handle.plan.disk_blocks != plan.disk_blocks:       # [memory] ram_budget put these on disk
        plan = handle.plan
        log.info("memory plan: %d streamed blocks read from disk (%s)", len(plan.disk_blocks), cfg.memory.disk_dir)
    return plan, handle, planner, budget


def _disk_options(cfg: RunConfig) -> dict:
    """apply_memory's disk tier options of [memory] disk_dir: the folder, and, for the explicit
    [memory] choices (no vram_budget: no planner prices the host), the host bytes the streamed
    blocks may take under [memory] ram_budget; the blocks beyond them go to disk. Under a
    vram_budget the planner's plan names its disk_blocks itself."""
    if cfg.memory.disk_dir is None:
        return {}
    options = {"disk_dir": cfg.resolve(cfg.memory.disk_dir)}
    if cfg.memory.vram_budget is None:
        from .planner.from_config import explicit_disk_room

        options["disk_room"] = explicit_disk_room(cfg.memory)
    return options


def _apply_engine(share_host_weights: bool, spec, transformer, plan, device, mode, dist: DistContext,
                  disk: dict | None = None):
    """apply_memory; several processes on one machine share one host copy of the streamed weights
    ([distributed] share_host_weights). `disk`: the disk tier's options (_disk_options)."""
    from .memory.engine import apply_memory

    shared = dist.shared_host(share_host_weights, mode.name)
    return dist.local_main_first(lambda: apply_memory(transformer, spec, plan, device, host_buffers=shared,
                                                      **(disk or {}), **mode.memory_options()), shared)


def _replan(t: Trainee, plan) -> None:
    """Swap the memory setup for `plan` (after an OOM or a calibration): weights go home to the
    host first so nothing is ever duplicated on the GPU, partial gradients are dropped."""
    t.mode.drop_partial_step(t)
    disk = getattr(t, "disk_dir", None)
    spill = None
    if t.memory is not None:
        handle, t.memory = t.memory, None       # if applying `plan` fails, the weights stay home
        on_disk = handle.streaming.disk_blocks if handle.streaming is not None else ()
        if disk is not None and on_disk:        # read back one at a time into a loading file, not RAM
            from .memory.disk_load import BlockSpill

            spill = BlockSpill(disk, on_disk)
        # The frozen base stays as it is: fp8 weights e4m3 (no bf16 copy, no requantizing), shared
        # host weights on the shared pages (no private copy per process).
        handle.remove(device="cpu", keep_fp8=True, keep_host=True, park=spill)
    t.plan = plan
    options = {"disk_dir": disk} | ({"parked": spill} if spill is not None else {})
    try:
        t.memory = _apply_engine(t.share_host_weights, t.mode.spec, t.transformer, plan, t.device, t.mode, t.dist,
                                 **({"disk": options} if disk is not None else {}))
    finally:
        if spill is not None:
            spill.close()
    log.info("memory plan now: %s", plan.describe(lora=getattr(t.mode, "name", "") == "lora"))


def _guarded_step(t: Trainee, cfg: RunConfig, step: int) -> float:
    """train_step under the OOM guard: a step that ran out of memory is redone on the same batch,
    noise and timesteps (data position and generator are rewound), so no sample is lost."""
    if t.guard is None:
        return t.dist.agreed_step(lambda: train_step(t, cfg), step)
    position, noise_state = t.batches.state_dict(), t.generator.get_state()
    attempts = {"n": 0}

    def attempt() -> float:
        if attempts["n"]:
            t.batches.load_state_dict(position)
            t.generator.set_state(noise_state)
        attempts["n"] += 1
        return t.dist.agreed_step(lambda: train_step(t, cfg), step)

    try:
        return t.guard.run(attempt, step=step)
    except NoPlanFits:
        # The state saved next must be the one before this step, so a resume redoes it.
        t.batches.load_state_dict(position)
        t.generator.set_state(noise_state)
        raise


def _calibrate(t: Trainee, seconds: float, report: dict) -> None:
    """First CUDA steps: compare the step's peak with the prediction; re-plan once if it was off.
    Reads the peak without resetting it: the memory monitor reads it next and resets it."""
    if t.calibrator is None or t.device.type != "cuda" or t.last_bucket is None:
        return
    guard = getattr(t, "guard", None)
    if guard is not None and guard.planner.workload.frames != 1:   # priced for clips: a still's step would
        return                                                      # rescale their activations
    if t.calibrator.replanned or t.calibrator.seen >= t.calibrator.steps:
        return
    peak, seconds, report = t.dist.agree_observation(torch.cuda.max_memory_allocated(), seconds, report or None)
    t.calibrator.observe(t.last_bucket, peak, seconds, report)


def _reset_peaks(t: Trainee) -> None:
    """Start the peak statistics at step 1: caching, loading and the machine probe are not a step."""
    if t.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _training_state(t: Trainee, losses: list[float]) -> dict:
    return {
        **t.mode.state(t),                         # "trainable" weights and "optimizer" state
        "scheduler": t.scheduler.state_dict(),     # lr_lambdas are plain functions: stored as None
        "rng": rng_state(t.generator, t.device),
        "data": t.batches.state_dict(),
        "losses": list(losses),
        "validation": [[s, v] for s, v in t.validation],
        **({"ema": t.ema.state()} if t.ema is not None else {}),
        "world_size": t.dist.world_size,
    }


def _resume(t: Trainee, paths: RunPaths, cfg: RunConfig) -> tuple[int, list[float]]:
    found = load_latest(paths.checkpoints)      # falls back past a corrupt latest save
    if found is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {paths.checkpoints}")
    ckpt, step, state = found
    changes = check_resume(saved_config(ckpt), cfg, ckpt)
    exact = t.dist.check_resume(state, ckpt, cfg.distributed.allow_world_size_change)
    t.mode.load_state(t, state, ckpt)
    t.scheduler.load_state_dict(state["scheduler"])
    apply_learning_rate(changes, t.optimizer, t.scheduler)
    set_rng_state(state["rng"], t.generator, t.device)
    strict = exact and not changes.data_order_changed and not cfg.data.allow_dataset_change
    try:
        t.batches.load_state_dict(state["data"], strict=strict)
    except ValueError as e:
        from .errors import CheckpointError

        raise CheckpointError(
            f"{ckpt}: {e} although the config did not change: images were added or removed in a dataset folder "
            f"(or their sizes changed their buckets), so the saved batch order of this epoch cannot continue. Put the "
            f"dataset back as it was, or set [data] allow_dataset_change = true (e.g. --set "
            f"data.allow_dataset_change=true) to continue at the start of the next epoch (weights, optimizer and "
            f"step count are kept; the rest of this epoch is skipped)") from None
    t.validation = [(int(s), float(v)) for s, v in state.get("validation", [])]
    if t.ema is not None:
        if "ema" in state:
            t.ema.load_state(state["ema"], ckpt)
        else:
            log.warning("%s holds no [ema] average (the run had none): it starts from step %d", ckpt, step)
    log.info("resumed from %s at step %d", ckpt, step)
    restore_exports(t, paths, step, cfg.train.steps, cfg.output.formats)
    return step, list(state["losses"])


def _save(t: Trainee, cfg: RunConfig, paths: RunPaths, step: int, losses: list[float], intermediate: bool) -> list[Path]:
    """Resumable state (always) and the mode's files (per-step names while training, final at the
    end), written by rank 0 only (every rank holds the same trainable weights)."""
    from .io import atomic_write_json

    stopping.set_phase(f"saving step {step}")
    with stopping.saving():                   # a first stop signal waits for the save (train/stopping.py)
        state = _training_state(t, losses)    # every rank: a sharded mode gathers the weights here
        if not t.dist.is_main:
            return []
        from .disk import disk_full_guard

        save_checkpoint(paths.checkpoints, step, state, keep_last=cfg.train.keep_last, config=resolved_config(cfg))
        with disk_full_guard(paths.root, None, f"the resumable state of step {step} is saved; --resume writes "
                                               f"these files from it"):
            atomic_write_json(paths.loss_history, {"step": step, "loss": losses,
                                                   **({"validation": [[s, v] for s, v in t.validation]}
                                                      if t.validation else {})})
            files = t.mode.export(t, paths, step, intermediate)
            if t.ema is not None:                     # <name>_ema_<format> beside the live files
                from .train.ema import export_ema

                files = files + export_ema(t, paths, step, intermediate)
            record_written(paths.root, files)         # what --overwrite may delete (run_folder.py)
    log.info("saved step %d: %s", step, ", ".join(str(f) for f in files))
    return files


# -- logging, samples, plots ---------------------------------------------------------------------------

def _tensorboard(paths: RunPaths):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(paths.tensorboard))


def _monitor(paths: RunPaths, t: Trainee):
    from .memory.monitor import MemoryMonitor

    predicted = (t.plan.notes or {}).get("predicted_peak_vram") if t.plan is not None else None
    return MemoryMonitor(paths.root, predicted_peak_bytes=predicted)


def _progress(cfg: RunConfig, start: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.steps, initial=start, desc="train", dynamic_ncols=True)


def _log_step(cfg, step, loss, t: Trainee, writer, monitor, bar, seconds, report: dict) -> None:
    lr = t.scheduler.get_last_lr()[0]
    if not math.isfinite(loss):
        raise FloatingPointError(f"step {step}: loss is {loss}; stopping (the last saved state is intact)")
    mem = monitor.record(step, writer)
    streaming = _streaming_summary(report)
    extra = optimizer_scalars(t.optimizer)
    if writer is not None:
        writer.add_scalar("loss", loss, step)
        writer.add_scalar("lr", lr, step)
        writer.add_scalar("seconds_per_step", seconds, step)
        for k, v in extra.items():              # Prodigy's d and d * lr (train/optim_packages.py)
            writer.add_scalar(k, v, step)
        for k, v in report.items():
            if isinstance(v, (int, float)):
                writer.add_scalar(f"memory_engine/{k}", v, step)
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", s_it=f"{seconds:.2f}", mem=mem)
    if step % cfg.train.log_every == 0:
        ranks = t.dist.rank_memory(monitor.samples[-1] if monitor.samples else None)
        said = "".join(f" {k.split('/', 1)[1]} {v:.3g}" for k, v in extra.items())
        log.info("step %d loss %.5f lr %.3g%s %.2fs/it %s%s%s", step, loss, lr, said, seconds, mem, streaming, ranks)


def _validate(t: Trainee, cfg: RunConfig, step: int, writer) -> None:
    """The held-out loss at this step (train/validation.py): logged, in TensorBoard as
    loss/validation, kept for the loss plot and the state."""
    from .train.validation import validation_loss

    if not t.data.validation_samples:
        return
    stopping.set_phase(f"measuring the validation loss at step {step}")
    with evaluation_point(t.optimizer):      # schedule-free: the averaged weights (train/optim_packages.py)
        value = validation_loss(t, cfg, t.data.validation_batches(), _loss, _autocast)
    t.validation = [(s, v) for s, v in t.validation if s != step] + [(step, value)]
    if writer is not None:
        writer.add_scalar("loss/validation", value, step)
    log.info("step %d validation loss %.5f (%d held-out sample(s), %d noise levels)", step, value,
             len(t.data.validation_samples), len(cfg.validation.sigmas))


def _streaming_summary(report: dict) -> str:
    """', streamed 1.20 GB in 0.051 s (stall 0.002 s), 2 slots' when blocks streamed this step."""
    if not report or not report.get("bytes_h2d"):
        return ""
    return (f", streamed {report['bytes_h2d'] / 1e9:.2f} GB in {report['copy_s']:.3f} s "
            f"(stall {report['stall_s']:.3f} s, {report['demand_fetches']} on demand), {report['slots']} slots")


def _sample_or_report(t: Trainee, cfg: RunConfig, paths: RunPaths, step: int, writer=None) -> list[Path]:
    """The step's samples ([path]), or [] with one error line when drawing them fails: a sample is
    a view of the training, and its fault (a size the memory cannot hold, a decode that fails)
    must not end the run and lose the steps since the last save. Training goes on; the next
    sample step tries again. A stop signal (KeyboardInterrupt) is not a fault and passes."""
    stopping.set_phase(f"sampling at step {step}")
    try:
        with evaluation_point(t.optimizer):   # schedule-free: the averaged weights, y restored after
            if t.ema is not None and cfg.ema.sample:          # [ema] sample: drawn from the average
                with t.ema.swapped_in():
                    return [_sample(t, cfg, paths, step, writer)]
            return [_sample(t, cfg, paths, step, writer)]
    except Exception as e:
        problem = str(e).strip().splitlines()[0][:300] if str(e).strip() else "no message"
        log.error("step %d: the in-training sample failed (%s: %s); training goes on without it, the [sample] "
                  "settings are worth a look", step, type(e).__name__, problem)
    gc.collect()                              # the failed sample's tensors (its traceback is gone now)
    if t.device.type == "cuda":
        torch.cuda.empty_cache()
    return []


def _sample(t: Trainee, cfg: RunConfig, paths: RunPaths, step: int, writer=None) -> Path:
    from .infer.images import save_png
    from .infer.sampler import sample_during_training

    family = get_family(cfg.model.family)
    cfg_guidance = family.sampling.guidance == "cfg"
    frames = sample_frames(cfg, family)

    # Prompts (and, for classifier-free guidance, the negative prompt) were encoded with the captions
    # (no text encoder reload); the VAE is loaded only for the decode and dropped again, so training
    # keeps its memory.
    # An edit family's samples are conditioned on the sample references (cached: their latents as
    # the pipeline encodes them, the prompts encoded with them when the text encoder reads images).
    refs = bool(t.data.sample_text_refs)
    embeds = t.data.prompt_embeds(cfg.sample.prompts, references=refs)
    negative = t.data.prompt_embeds([cfg.sample.negative_prompt], references=refs) if cfg_guidance else None
    vae = lambda: family.load_vae(t.sources, t.dtype, "cpu")      # noqa: E731
    if frames > 1:                             # a video: the causal video VAE decodes it (infer/video.py)
        vae = lambda: family.video.load_vae(t.sources, t.dtype, "cpu")      # noqa: E731
    references = t.data.sample_reference_latents() or None
    stack = t.base_adapters
    if cfg.sample.base is not None and frames > 1:
        raise ValueError("[sample] base previews images; with [sample] frames > 1 drop [sample] base or set frames = 1")
    if cfg.sample.base is not None:            # another base of the family (infer/preview_base.py)
        grid = _sample_on_other_base(t, cfg, family, embeds, vae, negative, references)
    else:
        with stack.for_sampling() if stack is not None else nullcontext():   # [sample] base_adapters
            grid = sample_during_training(t.transformer, vae, embeds, cfg.sample, memory_handle=t.memory,
                                          device=t.device, dtype=t.dtype, negative=negative, references=references,
                                          family=family, schedule=preview_schedule(cfg, family, t.transformer),
                                          frames=frames)
    if frames > 1:
        from .infer.video import save_training_video

        return save_training_video(grid, paths.samples / f"step-{step:06d}.mp4", family.video.fps, writer, step)
    out = paths.samples / f"step-{step:06d}.png"
    model = str(cfg.resolve(cfg.sample.base)) if cfg.sample.base is not None else str(t.sources.transformer)
    adapters = stack.describe("sampling") if stack is not None else ""
    # Image i of the grid (left to right) is prompt i with seed + i.
    save_png(grid, out, {"prompt": list(cfg.sample.prompts), "seed": cfg.sample.seed, "steps": cfg.sample.steps,
                         "guidance": cfg.sample.guidance, "width": cfg.sample.width, "height": cfg.sample.height,
                         "loras": f"{cfg.output.name} (training, step {step})", "model": model,
                         "training_step": step, **({"base_adapters": adapters} if adapters else {}),
                         **({"negative_prompt": cfg.sample.negative_prompt} if cfg_guidance else {}),
                         **({"references": ", ".join(str(r.path) for r in t.data.sample_references)}
                            if t.data.sample_references else {})})
    log.info("samples: %s", out)
    return out


def sample_frames(cfg: RunConfig, family) -> int:
    """Frames of the run's samples: [sample] frames, unset: [data] max_frames for a video family
    (the length it trains at), 1 for an image family (which cannot sample more)."""
    frames = cfg.sample.frames
    if family.video is None:
        if frames not in (None, 1):
            raise ValueError(f"[sample] frames = {frames}: family = \"{family.name}\" samples images; remove the key")
        return 1
    frames = cfg.data.max_frames if frames is None else frames
    try:
        family.video.latent_frames(frames)
    except ValueError as e:
        raise ValueError(f"[sample] frames = {frames}: {e}") from None
    return frames


def preview_schedule(cfg: RunConfig, family, transformer):
    """The sampling schedule of the previews on the trained base, as `leantune sample` takes it
    (infer/run.py): [model] variant, else what the transformer tells, with a diffusers folder's own
    scheduler config (a Krea 2 Turbo folder's fixed mu, a Z-Image base folder's shift 6.0)."""
    variant = cfg.model.variant if cfg.model.variant != "auto" else family.sampling.variant(transformer)
    path = cfg.resolve(cfg.model.path)
    return family.sampling.schedule(variant, path if path.is_dir() else None)


def _sample_on_other_base(t: Trainee, cfg: RunConfig, family, embeds, vae, negative, references):
    """The preview grid on [sample] base, loaded for this preview and dropped after it."""
    from .infer.preview_base import sample_on_other_base
    from .models.other_base import load_other_base

    path = cfg.resolve(cfg.sample.base)
    stack = t.base_adapters
    adapters = stack.sampling if stack is not None else []
    t0 = time.perf_counter()

    def load():
        model = load_other_base(cfg.model, path, Path(cfg.base_dir), t.dtype, "cpu", **loader_options(cfg.memory))
        log.info("samples: %s loaded for the preview in %.1f s", path, time.perf_counter() - t0)
        return model

    fp8 = bool(t.plan is not None and t.plan.fp8)
    return sample_on_other_base(t.transformer, load, adapters, embeds, cfg.sample, family=family, vae=vae,
                                device=t.device, dtype=t.dtype, base_path=path, fp8=fp8, negative=negative,
                                references=references, schedule_folder=path if path.is_dir() else None,
                                variant=cfg.sample.base_variant)


def plot_losses(losses: list[float], path: Path, validation: list | None = None) -> Path:
    """Raw per-step loss and its moving average, and the held-out loss at its steps, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .io import atomic_write

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = list(range(1, len(losses) + 1))
    ax.plot(steps, losses, alpha=0.35, label="loss")
    window = max(1, len(losses) // 20)
    if window > 1:
        avg = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
               for i in range(len(losses))]
        ax.plot(steps, avg, label=f"moving average ({window})")
    if validation:
        ax.plot([s for s, _ in validation], [v for _, v in validation], "o-", label="validation (fixed noise)")
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching loss")
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
    return path


def _finish(paths: RunPaths, losses, monitor, writer, validation=None) -> None:
    if losses:
        plot_losses(losses, paths.loss_plot, validation)
    monitor.plot(paths.memory_plot)
    log.info(monitor.summary())
    if writer is not None:
        writer.close()
