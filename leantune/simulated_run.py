"""One training step or one sampling step of a model on the simulated device (simulated.py), through
the code a real run uses, and the bytes it keeps on the GPU.

Training goes through the trainer's own `train_step` (bf16 autocast, the flow-matching loss, and
the mode's step: LoRA's zero_grad / backward / clip / optimizer step, or full fine-tuning's update
of each weight inside backward) with the memory engine applied by `apply_memory`; sampling through
the sampler's `denoise` under `forward_only`. The model is built on the meta device by the caller
(with its LoRA, which peft can add there), given fake parameters here, and never holds a byte of
data. A full fine-tune is prepared by the trainer's FullMode on the fake weights (its optimizer
state is created in fake host RAM) and streamed by its trainable streaming engine.

Computed numbers a step reads back (`float(loss)`) come out as 0: nothing is computed, so a branch
on such a value would always take the same side. Neither the engine nor the step branches on one
(full fine-tuning's per-parameter clipping and Adafactor's norms stay on the device off the CPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

from .models.family import ModelFamily, PromptEmbeds, family_for_model, get_family, text_width
from .family_registry import stock_models
from .spec import ModelSpec
from .memory.plan import Plan
from .memory.simulated import HOST, DeviceMemoryTracker, enable, simulation


@dataclass
class SimulatedStep:
    """Bytes on the simulated GPU: the peak of each step (the last one is the steady state), what
    stays between steps, and the engine's step report."""

    peaks: list[int]
    resident: int                      # live at the end of the last step
    after_setup: int                   # live once the engine placed the model (weights, slots)
    report: dict = field(default_factory=dict)
    seconds: float = 0.0
    host_peak: int = 0                 # fake host-RAM bytes created under the tracker (not process RSS);
                                       # training: over set-up and steps, sampling: of the last step
    host_after_setup: int = 0          # host bytes live once the engine placed the model
    host_live: int = 0                 # host bytes live at the end of the last step
    reports: list[dict] = field(default_factory=list)    # the engine's report of each step

    @property
    def peak(self) -> int:
        return self.peaks[-1]


class _ReadsAsZero(DeviceMemoryTracker):
    """The tracker, plus: reading a computed fake tensor's value (`.item()`, `float()`) gives 0.
    Values the fake mode knows (tensors made from Python data, such as the optimizer's step
    count) read as themselves."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and getattr(args[0], "constant", None) is None:
            return 0.0 if args[0].is_floating_point() else 0
        return super().__torch_dispatch__(func, types, args, kwargs)


def fake_parameters(model: nn.Module, device: torch.device | str = HOST) -> nn.Module:
    """Replace every parameter and buffer of a meta-built `model` by a fake tensor of the same shape
    and dtype on `device` (host RAM), keeping requires_grad and shared tensors shared. Call inside
    the FakeTensorMode the step runs in."""
    memo: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in memo:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            memo[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if param else new
        return memo[id(t)]

    for m in model.modules():
        for k, p in m._parameters.items():
            if p is not None:
                m._parameters[k] = fake(p, True)
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = fake(b, False)
        # Plain tensor attributes built in __init__ (Qwen-Image's rotary tables `pos_freqs`): they
        # were made on meta too, and are read like buffers.
        for k, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and v.is_meta:
                setattr(m, k, fake(v, False))
    return model


def _embeds(model: nn.Module, batch: int, text_rows: int, dtype: torch.dtype,
            family: ModelFamily | None = None) -> PromptEmbeds:
    """Prompt embeddings as the cache holds them: the text sequence (B, rows, the family's text
    width: models/family.text_width) and the pooled vector (B, pooled_projection_dim)."""
    cfg = model.config
    width = text_width(family or family_for_model(model), cfg)
    return PromptEmbeds(t5=torch.empty(batch, text_rows, width, dtype=dtype),
                        pooled=torch.empty(batch, getattr(cfg, "pooled_projection_dim", 0), dtype=dtype))


def training_references(family: ModelFamily, config, bucket: tuple[int, int], batch_size: int, dtype: torch.dtype,
                        count: int | None = None) -> list[torch.Tensor] | None:
    """An edit family's reference latents as the trainer's batch holds them (data/cache.py Batch
    .references: per reference slot (B, C, h, w), host RAM), each of the target's aspect at the
    size the family encodes it for the bucket (ReferenceConditioning.size: the bucket's area at
    the reference's aspect; Qwen-Image-2.1's pipeline size, 1024² of area, whatever the bucket). `count` of them; by default as many as the planner prices a step of
    this family with (probed_references: Qwen-Image-Edit's probe inputs carry one, FLUX.2's none).
    None: no references (the batch of a dataset without them)."""
    count = probed_references(family, config, bucket) if count is None else count
    if count and family.references is None:
        raise ValueError(f"simulate_training: family {family.name!r} takes no reference images")
    if count and count > family.references.most:
        raise ValueError(f"simulate_training: {count} references, but {family.name} takes at most "
                         f"{family.references.most}")
    if not count:
        return None
    # a reference of the target's aspect, at the size the family encodes it for this bucket (the
    # bucket's area, or Qwen-Image-2.1's fixed 1024² pipeline size: data/references.encoded_size)
    width, height = family.references.size(bucket[1], bucket[0], (bucket[1], bucket[0]))     # (w, h) as data/ gives them
    h, w = height // family.vae_scale_factor, width // family.vae_scale_factor
    return [torch.empty(batch_size, family.latent_channels, h, w, dtype=dtype) for _ in range(count)]


def probed_references(family: ModelFamily, config, bucket: tuple[int, int]) -> int:
    """How many references of the target's size the planner's activation probe feeds a step of
    `family` (its probe_inputs, on meta): the image tokens beyond the target's, in targets."""
    if family.references is None:
        return 0
    h, w = bucket[0] // family.vae_scale_factor, bucket[1] // family.vae_scale_factor
    hidden = family.probe_inputs(config, 1, (h, w), 8, torch.bfloat16)["hidden_states"]
    target = family.image_tokens(h, w)
    return (hidden.shape[1] - target) // target if hidden.dim() == 3 else 0


def _host_batch(model: nn.Module, family: ModelFamily, bucket: tuple[int, int], batch_size: int, text_rows: int,
                dtype: torch.dtype, references: int | None = None, frames: int = 1):
    """A cached batch as the trainer's data loader yields it: latents (B, C, H/f, W/f), a clip's
    (B, C, frames, H/f, W/f) for `frames` latent frames, prompt embeddings and an edit family's
    reference latents (training_references) in host RAM."""
    h, w = bucket[0] // family.vae_scale_factor, bucket[1] // family.vae_scale_factor
    refs = training_references(family, model.config, bucket, batch_size, dtype, references)
    embeds = ((refs and family.references.text_sees_images
               and _embeds_with_slots(model, family, (h, w), batch_size, text_rows, dtype, len(refs)))
              or _embeds(model, batch_size, text_rows, dtype, family))
    if frames > 1:                      # a clip's latents; its bucket (w, h, frames), as the data loader's
        return SimpleNamespace(latents=torch.empty(batch_size, family.latent_channels, frames, h, w, dtype=dtype),
                               embeds=embeds, bucket=(bucket[1], bucket[0], frames), references=refs)
    return SimpleNamespace(latents=torch.empty(batch_size, family.latent_channels, h, w, dtype=dtype),
                           embeds=embeds, bucket=bucket, references=refs)


def _embeds_with_slots(model: nn.Module, family: ModelFamily, latent_hw: tuple[int, int], batch_size: int,
                       text_rows: int, dtype: torch.dtype, references: int) -> PromptEmbeds | None:
    """A cached caption of a family whose text encoder sees the references (Qwen-Image-2.1): its
    rows lengthened by each reference's tags and image slots, the slots zero rows (the cache's
    layout, models/qwen_image21), laid out as the planner's probe lays them (probe_inputs: the
    text rows it gives and which of them its `img_mask` marks as slots). The rows are fake; the
    values they stand for (simulated.stands_for) carry the slots, which the step reads to place
    each reference's latent tokens. None for a family whose probe lays out no slots (Qwen-Image-Edit's
    text holds its references' vision tokens as values, none the transformer replaces)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from .memory.simulated import stands_for
    from .models.family import prices_references

    if not prices_references(family):   # its probe lays out no reference rows (Qwen-Image-Edit's)
        return None
    with _disable_current_modes():      # real host tensors: the probe's layout (its img_mask) keeps its values
        probe = family.probe_inputs(model.config, batch_size, latent_hw, text_rows, dtype, references=references)
        if "img_mask" not in probe:
            return None
        rows = probe["encoder_hidden_states"].shape[1]
        # (B, rows, D), a view of (B, rows, 1): 0 at a slot, 1 elsewhere
        values = (~probe["img_mask"][:, :rows].bool()).to(dtype)[:, :, None].expand(
            batch_size, rows, text_width(family, model.config))
    embeds = _embeds(model, batch_size, rows, dtype, family)
    stands_for(embeds.t5, values)
    return embeds


def simulate_training(model: nn.Module, spec: ModelSpec, cfg, plan: Plan, bucket: tuple[int, int], *,
                      text_length: int | None = None, steps: int = 1, references: int | None = None,
                      frames: int = 1) -> SimulatedStep:
    """`steps` training steps of `model` (meta-built) under `plan` on the simulated GPU, as the
    trainer runs them for `cfg` (a RunConfig: [train] mode, optimizer, clipping, mixed precision,
    timestep sampling; [full]; [data] batch size and text length; [model] family).
    `text_length` is in sequence rows (default: the family's rows for [data] max_text_length).
    An edit family's step is fed `references` reference latents of the target's size, as its
    dataset's batches are (default: as many as the planner prices its step with, training_references).
    A video family's step takes clips of `frames` latent frames (1: images).

    LoRA ([train] mode = "lora"): `model` comes with its adapters (peft adds them on meta), base
    frozen. The optimizer's states exist before the first measured step (one optimizer step on
    zero gradients creates them, as a real first step would), so every measured step is a
    steady-state step: a second model step would measure the same peak, at twice the cost.

    Full ([train] mode = "full"): `model` comes unprepared (see `unprepare_full`); the trainer's
    FullMode prepares it here on the fake host weights, as a real run does after loading: it picks
    the trained weights and creates their zero optimizer state beside them (in host RAM, counted
    in `host_peak`), and the memory engine gets FullMode's trainable streaming. The states exist
    from the start, but the first step still finds the ring slots empty: the last of `steps` is
    the steady state (slots kept valid from the step before), and its report is that step's copies.
    """
    from .train.modes import make_mode
    from .train.optim import build_scheduler
    from .trainer import Trainee, train_step
    from .memory.engine import apply_memory

    from .train.fused_optim import STATE_SUFFIX

    if any(name.endswith(STATE_SUFFIX) for name, _ in model.named_modules()):
        raise ValueError("simulate_training: the model carries optimizer-state modules from an earlier "
                         "FullMode.prepare; call unprepare_full(model, mode) first (the simulation prepares it)")
    device = enable()
    family = get_family(cfg.model.family)
    text_length = text_length or family.text_rows(cfg.data.max_text_length)
    dtype = next(p.dtype for n, p in model.named_parameters() if "lora_" not in n and p.is_floating_point())
    tracker = _ReadsAsZero()
    t0 = time.perf_counter()
    peaks: list[int] = []
    reports: list[dict] = []
    with simulation(tracker):
        fake_parameters(model)
        mode = make_mode(cfg)
        if mode.name == "full":
            params = mode.prepare(model, spec)
        else:
            params = [p for p in model.parameters() if p.requires_grad]
        handle = apply_memory(model, spec, plan, device, host_device=HOST, **mode.memory_options())
        after_setup = tracker.live.get(str(device), 0)
        host_after_setup = tracker.live.get(HOST, 0)
        if hasattr(mode, "use_plan"):          # a LoRA's step on the device or the host, as the trainer does
            mode.use_plan(plan)
        optimizer = mode.build_optimizer(params)
        if mode.name != "full":                # (the optimizer's own tensors: host copies for a host step)
            _create_optimizer_states(optimizer, [p for g in optimizer.param_groups for p in g["params"]])
        batch = _host_batch(model, family, bucket, cfg.data.batch_size, text_length, dtype, references, frames)
        t = Trainee(transformer=model, params=params, optimizer=optimizer,
                    scheduler=build_scheduler(optimizer, cfg.train), data=None, batches=iter(lambda: batch, None),
                    generator=torch.Generator().manual_seed(0), device=device, dtype=dtype, memory=handle,
                    plan=plan, mode=mode)
        host_peak = tracker.peak.get(HOST, 0)            # loading, optimizer state, packing
        for _ in range(steps):
            tracker.reset_peak()
            train_step(t, cfg)
            peaks.append(tracker.peak.get(str(device), 0))
            host_peak = max(host_peak, tracker.peak.get(HOST, 0))
            reports.append(handle.step_report())
        resident = tracker.live.get(str(device), 0)
        host_live = tracker.live.get(HOST, 0)
        handle.release()
        if mode.name == "full":
            mode.close(t)
    return SimulatedStep(peaks, resident, after_setup, reports[-1] if reports else {}, time.perf_counter() - t0,
                         host_peak, host_after_setup, host_live, reports)


def unprepare_full(model: nn.Module, mode) -> None:
    """Undo FullMode.prepare on a meta model (planned on before the simulation): its hooks and
    optimizer-state modules go, so the simulation's own FullMode prepares the faked model afresh
    (prepare keys its state by Parameter, and fake_parameters makes new ones)."""
    mode.stepper.remove()
    mode.optimizer.remove_holders(model)


def _create_optimizer_states(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def simulate_sampling(model: nn.Module, spec: ModelSpec, plan: Plan, size: tuple[int, int], *,
                      text_length: int = 512, steps: int = 1, guidance: float = 3.5,
                      family: ModelFamily | None = None, cfg_batched: bool = True) -> SimulatedStep:
    """`steps` denoising steps of one image of `size` (height, width) under `plan`, through the
    sampler's own `denoise` with the engine in forward-only mode, as `leantune sample` runs it
    (with classifier-free guidance, SD3.5, the negative and positive halves in one batch, or one
    after the other with `cfg_batched` False). `text_length` is in sequence rows; `family`
    defaults to the model's."""
    from .infer.sampler import default_schedule, denoise
    from .memory.engine import apply_memory

    device = enable()
    family = family or family_for_model(model)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    tracker = _ReadsAsZero()
    t0 = time.perf_counter()
    peaks: list[int] = []
    with simulation(tracker), torch.no_grad():
        fake_parameters(model)
        model.eval().requires_grad_(False)
        handle = apply_memory(model, spec, plan, device, host_device=HOST)
        handle.forward_only(True)
        after_setup = tracker.live.get(str(device), 0)
        embeds = _embeds(model, 1, text_length, dtype, family)
        schedule = default_schedule(model, family)
        report = {}
        for _ in range(steps):
            tracker.reset_peak()
            denoise(model, [embeds], [0], width=size[1], height=size[0], steps=1, guidance=guidance,
                    schedule=schedule, device=device, dtype=dtype, negative=embeds, family=family,
                    cfg_batched=cfg_batched)
            peaks.append(tracker.peak.get(str(device), 0))
            report = handle.step_report()
        resident = tracker.live.get(str(device), 0)
        host_peak = tracker.peak.get(HOST, 0)
        handle.release()
    return SimulatedStep(peaks, resident, after_setup, report, time.perf_counter() - t0, host_peak)


# -- planned cases: the planner's plan for a budget, simulated, next to its prediction -------------------

GiB = 2**30
CASE_RAM_BUDGET = 64 * GiB     # host RAM the LoRA cases plan for: a typical GPU machine, not this one
# Full fine-tunes plan with no host-RAM limit, as `leantune plan` does without --ram on a machine with
# no GPU: their host RAM
# (weights + optimizer state: ~69 GiB for Flux-dev with bf16 AdamW moments) is reported, not a constraint.


# The architectures a case can run: `leantune plan --model` names -> (family, config shipped in
# models/configs/, text tokens it samples with), every family's stock models (family_registry.py).
MODELS = {name: (family, model.config, model.text_tokens) for name, (family, model) in stock_models().items()}


def meta_model(name: str = "flux-dev", blocks: tuple[int, ...] | None = None) -> nn.Module:
    """The full-size architecture `name` (MODELS) on meta (bf16), built through its family's
    diffusers class from the packaged config; `blocks` gives fewer blocks of full width, one count
    per block list in planner.meta.BLOCK_COUNT_KEYS order (Flux: double, single; SD3: joint, its
    last block the context-pre-only one)."""
    import diffusers

    from .models.component_files import packaged_config
    from .planner.meta import BLOCK_COUNT_KEYS, meta_from_config

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    family, config_name, _ = MODELS[name]
    conf = dict(packaged_config(config_name))
    keys = list(BLOCK_COUNT_KEYS[family].values())
    if blocks is not None:
        if len(blocks) != len(keys):
            raise ValueError(f"{name}: blocks gives {len(blocks)} counts, its block lists are {keys}")
        conf.update({k: n for k, n in zip(keys, blocks) if n is not None})
    entry = get_family(family)
    # the family's meta class where it has one (Qwen-Image-2.1: a forward that reads its token
    # layout from a host slot mask, which also runs on fake weights), as `leantune plan --model` builds it
    cls = entry.meta_transformer_class() if entry.meta_transformer_class else getattr(diffusers, entry.transformer_classes[0])
    model = meta_from_config(cls, conf)
    if entry.split_blocks is not None:      # the blocks training runs, as the family's loader gives them
        entry.split_blocks(model)
    return model


def meta_flux_dev(num_layers: int | None = None, num_single_layers: int | None = None) -> nn.Module:
    """Flux.1-dev's architecture on meta (bf16), optionally with fewer blocks of full width."""
    return meta_model("flux-dev", (num_layers, num_single_layers))


def as_fp8_checkpoint(model: nn.Module, spec: ModelSpec, modulation: bool = True,
                      quantized_on_load: bool = False) -> nn.Module:
    """The meta model as a loader gives it from an fp8 file (ComfyUI's `*_fp8_e4m3fn.safetensors`:
    every block Linear weight e4m3 with its per-row scale, modulation included), or, with
    `quantized_on_load`, from a bf16 file it quantizes while reading (memory/fp8.py's block-scaled
    e4m3: a scale per SCALE_BLOCK input features; the modulation Linears only with `modulation`).
    What load_into_empty does on the meta device; no file needed at full size."""
    from .memory.fp8 import scale_blocks
    from .models.component_loading import fp8_block_weights, keep_fp8_hooks

    _, attach = keep_fp8_hooks(model, spec, modulation)
    for name in sorted(fp8_block_weights(model, spec, modulation)):
        module = model.get_submodule(name[: -len(".weight")])
        w = module.weight
        module.weight = nn.Parameter(torch.empty(w.shape, dtype=torch.float8_e4m3fn, device="meta"), requires_grad=False)
        attach(name, torch.empty(w.shape[0], scale_blocks(w.shape[1]) if quantized_on_load else 1, device="meta"))
    return model


def training_config(size: int, budget: int, rank: int = 16, family: str = "flux", *, mode: str = "lora",
                    optimizer: str = "adamw", state_dtype: str = "fp32", streamed_step: str = "auto",
                    ram_budget: int | None = None):
    """The RunConfig of a training run at one square resolution with a VRAM budget (defaults otherwise:
    batch 1, the family's text tokens (Flux 512, SD3 256), bf16 autocast). `mode` "lora": attention+MLP
    targets of `rank`; "full": every weight trains ([full] defaults: bf16 weights with stochastic
    rounding, gradients clipped per parameter), `state_dtype` the AdamW moments' dtype."""
    from .config import validate

    trains = ({"full": {"state_dtype": state_dtype, "streamed_step": streamed_step}} if mode == "full"
              else {"lora": {"rank": rank}})
    ram = ram_budget if ram_budget is not None else None if mode == "full" else CASE_RAM_BUDGET
    memory = {"vram_budget": f"{budget}B"} | ({} if ram is None else {"ram_budget": f"{ram}B"})
    return validate({"model": {"path": "unused", "family": family},
                     "data": {"datasets": [{"path": "unused"}], "resolutions": [size]},
                     "train": {"mode": mode, "optimizer": optimizer}, **trains, "memory": memory})


def planned_case(what: str, size: int, budget: int, blocks: tuple[int, ...] | None = None,
                 plan: Plan | None = None, model_name: str = "flux-dev", optimizer: str = "adamw",
                 state_dtype: str = "fp32", fp8_base: bool = False, streamed_step: str = "auto",
                 rank: int = 16, references: int | None = None, ram_budget: int | None = None,
                 resolution: tuple[int, int] | None = None, frames: int | None = None) -> dict:
    """The planner's plan for `budget` bytes of VRAM (or `plan` as given), priced by the planner
    and run on the simulated device: a LoRA training step ("train"), a full fine-tuning step
    ("full", every weight trains with `optimizer` and, for AdamW, `state_dtype` moments) or a
    sampling step ("sample") at size x size pixels, on `model_name` (MODELS; or `blocks` blocks of
    full width, see meta_model); a training step of an edit family with `references` reference
    images per target (None: as many as the planner's probe prices by default, training_references),
    priced and fed to the step at the size the family encodes them; `ram_budget` the host RAM a
    training case plans for (default: LoRA CASE_RAM_BUDGET, full unlimited). A training case of a
    video family at `resolution` (height, width; default size x size) takes clips of `frames`
    pixel frames (a length its VAE encodes, 4k+1 for Wan), priced as `leantune plan --frames`. Sampling a family with classifier-free guidance plans, as `leantune sample` does,
    for the doubled batch (negative and positive halves in one forward) and, when no plan fits it,
    for one half at a time ("cfg_batched" in the result).

    Returns the plan, the planner's predicted peak with its workspace term and the budget's margin
    apart, the simulated peak, and their ratio (prediction without workspace / simulation); the
    predicted host RAM and the simulation's fake host bytes; the predicted and simulated bytes
    copied per step (H2D, and D2H, the write-back of a full fine-tune). Call with the simulated
    device enabled before any backward (see simulated.enable).

    A full fine-tune is planned as the trainer plans it, after FullMode.prepare (the optimizer
    state modules exist); the simulation then prepares its faked model afresh (unprepare_full)
    and runs two steps, the second the steady state (simulate_training).
    """
    from .planner.corrections import Calibration
    from .planner.from_config import workload_from_config
    from .planner.machine import assumed_machine
    from .planner.search import Planner
    from .planner.workload import UNLIMITED_RAM, Budget, InfeasibleBudget, Workload
    from .train.modes import make_mode

    enable()
    model = meta_model(model_name, blocks)
    if fp8_base:
        as_fp8_checkpoint(model, get_family(MODELS[model_name][0]).spec)
    family = get_family(MODELS[model_name][0])
    spec = family.spec
    text_rows = family.text_rows(MODELS[model_name][2])
    bucket = tuple(resolution) if resolution is not None else (size, size)          # (height, width)
    if (frames is not None or resolution is not None) and what == "sample":
        raise ValueError("planned_case: resolution and frames are for the training cases")
    latent_frames = 1 if frames is None else family.video.latent_frames(frames) if family.video is not None else 0
    if not latent_frames:
        raise ValueError(f"planned_case: {model_name} trains on images; frames is for a video family")
    machine = assumed_machine(vram_total=budget)

    budget_obj = Budget(vram=budget, ram=ram_budget if ram_budget is not None and what != "sample"
                        else UNLIMITED_RAM if what == "full" else CASE_RAM_BUDGET)
    if what in ("train", "full"):
        cfg = training_config(size, budget, rank=rank, family=family.name, mode="full" if what == "full" else "lora",
                              optimizer=optimizer, state_dtype=state_dtype, streamed_step=streamed_step,
                              ram_budget=ram_budget)
        mode = make_mode(cfg)
        mode.prepare(model, spec)
        # `references` references per target, as an edit dataset's targets have them (the planner
        # prices them as `leantune plan --references` does; the step is fed them, training_references)
        workload = dataclasses.replace(workload_from_config(cfg, model), buckets=(bucket,), frames=latent_frames)
        workloads = [workload if references is None else dataclasses.replace(workload, references=references)]
    elif what == "sample":
        model.eval().requires_grad_(False)
        workloads = [Workload(mode="inference", batch_size=factor, buckets=((size, size),), text_length=text_rows,
                              autocast=False, dtype=torch.bfloat16)
                     for factor in ((2, 1) if family.sampling.guidance == "cfg" else (1,))]
    else:
        raise ValueError(f"unknown case {what!r}: 'train', 'full' or 'sample'")
    out = {"model": model_name, "what": what, "size": size, "budget": budget, "blocks": blocks,
           "margin": budget_obj.margin_bytes, "references": references, "resolution": list(bucket), "frames": frames}
    if what == "full":
        out.update(optimizer=optimizer, state_dtype=state_dtype)
    for workload in workloads:           # the doubled CFG batch first, then one half at a time
        planner = Planner(spec, model, workload, machine, Calibration())
        try:
            chosen = plan or planner.plan(budget_obj)
            break
        except InfeasibleBudget as e:
            infeasible = {**out, "infeasible": str(e), "needed": e.needed_vram}
    else:
        return infeasible
    batched = workload.batch_size == 2
    est = planner.estimate(chosen)
    if what == "train" and plan is None and chosen.fp8 and not fp8_base and workload.quantizes_on_load:
        # The trainer reads a bf16 file straight into e4m3 when the plan it chose before loading
        # stores fp8 (models/family.fp8_load_options), and the planner prices that load: the engine
        # gets the model such a load gives, built afresh (the LoRA attached after the load, as the
        # trainer attaches it).
        model = as_fp8_checkpoint(meta_model(model_name, blocks), spec, modulation=chosen.fp8_modulation,
                                  quantized_on_load=True)
        mode = make_mode(cfg)
        mode.prepare(model, spec)
    if what == "train":
        sim = simulate_training(model, spec, cfg, chosen, bucket, references=references, frames=latent_frames)
    elif what == "full":
        unprepare_full(model, mode)
        sim = simulate_training(model, spec, cfg, chosen, bucket, steps=2, references=references,
                                frames=latent_frames)
    else:
        sim = simulate_sampling(model, spec, chosen, (size, size), text_length=text_rows, family=family,
                                cfg_batched=batched)
        out["cfg_batched"] = batched if family.sampling.guidance == "cfg" else None
    workspace = est.vram["workspace"]
    return {**out, "plan": chosen.describe(), "fp8": chosen.fp8, "fp8_modulation": chosen.fp8_modulation,
            "checkpointing": chosen.checkpointing,
            "streamed": len(chosen.streamed_blocks), "stream_non_blocks": chosen.stream_non_blocks,
            "ring": chosen.ring_slots, "predicted": est.peak_vram, "workspace": workspace,
            "breakdown": dict(est.vram), "simulated": sim.peak, "simulated_steps": sim.peaks,
            "after_setup": sim.after_setup, "ratio": (est.peak_vram - workspace) / sim.peak,
            "seconds": sim.seconds, "report": sim.report,
            "host_predicted": est.peak_host, "host_breakdown": dict(est.host), "host_simulated": sim.host_peak,
            "host_after_setup": sim.host_after_setup, "host_live": sim.host_live,
            "h2d_predicted": est.h2d_bytes, "d2h_predicted": est.d2h_bytes,
            "h2d_simulated": _h2d(sim.report), "d2h_simulated": sim.report.get("bytes_d2h", 0),
            "h2d_simulated_steps": [_h2d(r) for r in sim.reports]}


def _h2d(report: dict) -> int:
    """Bytes a step copied host -> device, as the planner counts them: streamed units and restored
    offloaded block inputs."""
    return report.get("bytes_h2d", 0) + report.get("offload_bytes_h2d", 0)


def _run_cases(cases: list[dict]) -> list[dict]:
    enable()
    return [planned_case(**c) for c in cases]


def run_in_fresh_process(cases: list[dict]) -> list[dict]:
    """`planned_case(**c)` for each case, in a new Python process: autograd must not have run a
    backward before the simulated device is set up (simulated.enable), which a test runner or an
    application may already have done."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # An executor, not a Pool: a worker that dies raises BrokenProcessPool instead of hanging.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run_cases, cases).result()


# -- the text-encoding phase (the caching phase's encode) on the simulated GPU -------------------------------

def _joined(t, partner):
    """A real tensor `t` as a fake one beside `partner` (its fake mode, its device)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode([partner]).from_tensor(t).to(partner.device)


def _parse_to(args, kwargs):
    """(device, dtype) that a Tensor.to(*args, **kwargs) call asks for (args without self)."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.arange, torch.linspace, torch.zeros,
              torch.ones, torch.full, torch.empty, torch.meshgrid}


class _LayoutOnHost(torch.overrides.TorchFunctionMode):
    """Inside the simulation, what a text encoder computes from its token ids and image grids (the
    layout: positions, image-token masks, per-image lengths, rotary indices) stays a real host
    tensor, so it is computed exactly, while every tensor with bytes on the device is fake.

    - a tensor made on the host from Python or numpy data, or by a factory (arange, zeros, ...), is
      real (the tokenizer's ids, the image processor's grids and pixels, the indices computed from them);
    - a real integer or bool tensor moved to the simulated device stays the real host tensor (its
      bytes on a GPU are a few kB); a real floating one (an image's pixels) becomes a fake tensor
      of the bytes it has there;
    - an op on real tensors only runs for real (the fake mode and the tracker suspended);
    - where a real tensor meets a fake one it joins the fake one's device, a real bool index
      becomes its real positions (a fake one would be data-dependent), repeat_interleave by real
      counts gets its output size.
    The numbers selected are not computed, only shapes and bytes, which the layout decides as it
    does with real weights."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import is_fake
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_leaves, tree_map

        from .memory.simulated import BACKEND

        kwargs = dict(kwargs or {})
        if func in _FROM_DATA and (kwargs.get("device") is None or torch.device(kwargs["device"]).type == "cpu"):
            with _disable_current_modes():          # the tokenizer's ids, the processor's grids and pixels
                return func(*args, **kwargs)
        if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor) and not is_fake(args[0]):
            device, dtype = _parse_to(args[1:], kwargs)
            if device is not None and device.type == BACKEND:
                t = args[0]
                if not (t.is_floating_point() or t.is_complex()):
                    if dtype is None or dtype == t.dtype:
                        return t
                    with _disable_current_modes():
                        return t.to(dtype)
                from torch._guards import detect_fake_mode

                return detect_fake_mode().from_tensor(t).to(device=device, dtype=dtype or t.dtype)
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        partner = next((t for t in leaves if is_fake(t)), None)
        if partner is None:
            device = kwargs.get("device")
            if leaves and not any(t.is_meta for t in leaves) and (device is None or torch.device(device).type == "cpu"):
                with _disable_current_modes():
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        if not any(isinstance(t, torch.Tensor) and not is_fake(t) for t in leaves):
            return func(*args, **kwargs)
        if func in (torch.Tensor.__setitem__, torch.Tensor.__getitem__) and len(args) >= 2:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            with _disable_current_modes():        # a (B, L) mask -> its (rows, cols) positions
                index = tuple(j for i in index for j in (i.nonzero(as_tuple=True) if isinstance(i, torch.Tensor)
                                                         and not is_fake(i) and i.dtype == torch.bool else (i,)))
            args = (args[0], index if isinstance(args[1], tuple) or len(index) > 1 else index[0], *args[2:])
        if func in (torch.Tensor.repeat_interleave, torch.repeat_interleave) and len(args) >= 2 \
                and isinstance(args[1], torch.Tensor) and not is_fake(args[1]):
            with _disable_current_modes():
                kwargs.setdefault("output_size", int(args[1].sum()))

        def join(t):
            return _joined(t, partner) if isinstance(t, torch.Tensor) and not is_fake(t) else t
        return func(*tree_map(join, args), **tree_map(join, kwargs))


class _Inline:
    """An executor that runs each submission at once in the caller's thread (see _workers_inline)."""

    def __init__(self, *args, **kwargs):
        pass

    def submit(self, fn, *args, **kwargs):
        from concurrent.futures import Future

        fut = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:           # the caller sees it at .result(), as from a worker
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True, **kwargs) -> None:
        pass


@contextlib.contextmanager
def _workers_inline():
    """The streamed encoder's copy worker (memory/host_buffers.Stager's thread) runs in the caller's
    thread: the fake mode and the tracker are per thread, and a worker would see neither. Run when
    it is submitted, a prefetched block's buffer exists from when the block is asked for until it
    is installed, which is the overlap's worst case (the running block and the next: what the
    phase's price holds)."""
    from .memory import host_buffers

    real = host_buffers.ThreadPoolExecutor
    host_buffers.ThreadPoolExecutor = _Inline
    try:
        yield
    finally:
        host_buffers.ThreadPoolExecutor = real


def _caption_of(tokenizer, family: ModelFamily, rows: int) -> str:
    """A caption the family's template makes `rows` rows of (family.caption_tokens with `tokenizer`)."""
    n = rows
    for _ in range(8):
        caption = "x" * max(n, 1)
        got = family.caption_tokens(tokenizer, [caption])[0]
        if got == rows:
            return caption
        n += rows - got
    raise ValueError(f"no caption of {rows} rows with this tokenizer (last: {got})")


def simulate_text_encoding(model_name: str = "qwen-image-2.1", references: int = 0, *, batch: int | None = None,
                           max_length: int | None = None) -> dict:
    """The caching phase's text encoding of `model_name`'s full-size encoder on the simulated GPU,
    through the family's own `encode_prompts` as the cache calls it: a batch of `batch` captions
    without references (default: the phase's batch, 8), or one caption with `references`
    reference images (an RGBA image of 1024² each, resized and fed to the vision tower as the
    pipeline does), the encoder in host RAM, streamed onto the device layer by layer (the vision
    tower unit by unit). Each caption is `family.text_rows(max_length)` rows, the planner's price.

    Qwen-Image-2.1 only for now (Qwen3-VL-8B, built on meta from models/configs/qwen3_vl_8b.json and
    given fake weights). The tokenizer and image processor are the tiny presets' (a byte-level BPE
    of a few hundred tokens, Qwen3-VL's image geometry): the ids they give stand in for Qwen3's (the
    config's special-token ids set to theirs); a caption's rows are made the planner's count, but
    the system message the template drops after the encode has the tiny vocabulary's length, not
    Qwen3's (`encoder_tokens`: what the language model ran on, (batch, tokens)). Returns the predicted and simulated device peaks, host bytes."""
    from PIL import Image
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from .models.component_files import packaged_config
    from .tiny import qwen_image21 as tq
    from .tiny.qwen_image import _token_id

    family_name, _, tokens = MODELS[model_name]
    family = get_family(family_name)
    if family.name != "qwen-image-2.1":
        raise ValueError(f"simulate_text_encoding: {model_name} is not simulated yet (Qwen-Image-2.1 is)")
    max_length = max_length or tokens
    rows = family.text_rows(max_length)
    batch = batch or (1 if references else 8)
    processor = tq.qwen3_vl_processor()
    tok = processor.tokenizer
    if getattr(tok, "chat_template", None) is None:
        tok.chat_template = tq.QWEN3_VL_TEMPLATE
    config = {k: v for k, v in packaged_config("qwen3_vl_8b").items() if not k.startswith("_")}
    config.update(image_token_id=_token_id(tok, "<|image_pad|>"), video_token_id=_token_id(tok, "<|video_pad|>"),
                  vision_start_token_id=_token_id(tok, "<|vision_start|>"),
                  vision_end_token_id=_token_id(tok, "<|vision_end|>"))
    with torch.device("meta"):
        encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**config)).to(torch.bfloat16).eval()
    phase = family.text_phase(rows, references=references) if references else family.text_phase(rows)
    caption = _caption_of(tok, family, rows)
    images = [Image.new("RGBA", (1024, 1024), (200, 120, 40, 255)) for _ in range(references)]
    device = enable()
    tracker = _ReadsAsZero()
    t0 = time.perf_counter()
    with simulation(tracker), torch.no_grad():
        fake_parameters(encoder)
        host_setup = tracker.live.get(HOST, 0)
        encoders = SimpleNamespace(tokenizer=tok, image_processor=processor.image_processor, text_encoder=encoder,
                                   device=device)
        tracker.reset_peak()
        seen, patches = [], []          # the tokens the language model runs on, the patches the tower reads
        hooks = [encoder.model.language_model.layers[0].register_forward_pre_hook(
                     lambda m, args: seen.append(tuple(args[0].shape[:2]))),
                 encoder.model.visual.blocks[0].register_forward_pre_hook(
                     lambda m, args: patches.append(int(args[0].shape[0])))]
        with _workers_inline(), _LayoutOnHost():
            embeds, lengths = family.encode_prompts([caption] * batch, encoders, max_length=max_length,
                                                    images=[images] * batch if references else None)
        for h in hooks:
            h.remove()
        peak = tracker.peak.get(str(device), 0)
        host_peak = tracker.peak.get(HOST, 0)
        shape = tuple(embeds.t5.shape)
        del embeds
    predicted = phase["device"]
    part = (max(phase["edit"]["device"], phase["edit"]["tower_device"]) if references else phase["device"])
    return {"model": model_name, "what": "text_encoding", "references": references, "batch": batch, "rows": rows,
            "encoded_shape": shape, "lengths": [int(n) for n in lengths],
            "encoder_tokens": seen[0] if seen else None, "vision_patches": patches[0] if patches else None,
            "predicted": predicted, "predicted_this_encode": part, "simulated": peak,
            "ratio": part / peak if peak else None, "host_predicted": phase["host"],
            "host_streamed_predicted": phase.get("host_streamed"), "host_simulated": host_peak,
            "host_after_setup": host_setup, "phase": phase, "seconds": time.perf_counter() - t0}
