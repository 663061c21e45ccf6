"""Build one variant with the trainer's own `_build`, run its steps, record what it computed.

What is recorded, per optimizer step: the loss, and every trained parameter's gradient as the
optimizer receives it; after the last step, the trained weights. Where the gradient is caught
depends on how the mode steps:
- LoRA mode steps once after backward (`optimizer.step()`): an optimizer step pre-hook clones
  `p.grad` of every parameter the optimizer holds (after clipping, what the update reads). A
  parameter the optimizer does not hold, or whose `.grad` never arrived, is recorded as None.
- Full mode steps each weight inside backward (train/in_backward.py) and frees its gradient at
  once, so no hook after backward sees it: the fused optimizer's `step_param` is wrapped on this
  instance to clone the gradient it is handed (the accumulated one, before per-parameter
  clipping). The weights are read where they live between steps (`mode.state`: a streamed
  block's host buffer, after its write-backs), so a write-back that never happened shows.
- A full fine-tune sharded over several processes (FSDP2, DeepSpeed ZeRO) steps torch's AdamW on
  each rank's shards: no rank ever holds a whole gradient (FSDP2 reduce-scatters it into shards,
  ZeRO reduces it into partitions and frees it inside its step), so no gradient is recorded (each
  step's dict is empty) and the check compares the updates instead (compare.compare_updates). The
  weights are `mode.state`'s, gathered whole on rank 0 (a collective every rank joins).
Everything recorded is copied to host memory (fp32 gradients of the trained parameters per step,
and the trained weights once), then the variant's memory is released before the next is built.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch


@dataclass
class Record:
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor | None]] = field(default_factory=list)   # per step, by name
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    peak_vram: int | None = None          # CUDA: torch's peak allocated over the steps; None on CPU
    report: dict = field(default_factory=dict)     # the engine's counters of the last step
    initial: dict[str, torch.Tensor] = field(default_factory=dict)   # LoRA: the adapters as built
    started_from_reference: list[str] = field(default_factory=list)  # LoRA: the ones set to the reference's
    before: dict[str, torch.Tensor] = field(default_factory=dict)    # full mode, when asked: the weights as loaded
    error: str | None = None              # the run failed: "ExceptionType: message"
    out_of_memory: bool = False


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def record_variant(cfg, steps: int, start: dict[str, torch.Tensor] | None = None, raise_build: bool = False,
                   keep_blocks: dict | None = None, dist=None, weights_before: bool = False) -> Record:
    """Build `cfg`'s run (a variant config) and run `steps` optimizer steps; a failure is recorded,
    not raised (a fault the check looks for may well raise). `raise_build`: a failure to build
    other than running out of memory is raised instead (the reference: bad data or model files
    are the user's input errors, reported as such by the command).

    `start` (LoRA mode): the reference's adapter weights as built. The same seed does not give the
    same adapters under every plan (with fp8 storage the block Linears are e4m3 when peft adds the
    adapters, and their initialisation draws other random numbers), so a variant whose adapters
    were built otherwise is started from the reference's, and `started_from_reference` names them:
    what is compared is then the technique, not the draw. `keep_blocks`: run the model cut to those
    blocks (models/block_subset.py; the check on a model too large to compare whole). `dist`: this
    process's DistContext when the run is one rank of several (processes.py), else one process.
    `weights_before`: also record the trained weights before the first step (`before`; the
    several-processes check of a full fine-tune compares updates, which start there)."""
    from .. import trainer
    from ..errors import is_out_of_memory

    rec = Record()
    torch.manual_seed(cfg.train.seed)          # as train() does before _build: adapter init, data order
    try:
        t = trainer._build(cfg, dist, keep_blocks=keep_blocks)
    except Exception as e:                     # noqa: BLE001
        if raise_build and not is_out_of_memory(e):
            raise
        rec.error, rec.out_of_memory = f"building the run: {_said(e)}", is_out_of_memory(e)
        gc.collect()
        return rec
    try:
        names = {id(p): n for n, p in t.transformer.named_parameters()}
        host_step = getattr(t.mode, "host_step", None)      # a LoRA stepped on the host: its optimizer's
        if host_step is not None:                          # parameters are the host copies of the adapters
            names.update({id(h): names[id(d)] for d, h in zip(host_step.device_params, host_step.host_params)
                          if id(d) in names})
        trained = [n for n, p in t.transformer.named_parameters() if p.requires_grad]
        if getattr(t.mode, "name", "") == "lora":
            rec.initial = {n: _host_copy(p) for n, p in t.transformer.named_parameters() if p.requires_grad}
            if start is not None:
                rec.started_from_reference = _start_from(t, start, rec.initial)
        if weights_before:
            rec.before = {n: _host_copy(v) for n, v in t.mode.state(t).get("trainable", {}).items()}
        current: dict = {}
        undo, caught = _catch_gradients(t, names, current)
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
            torch.cuda.reset_peak_memory_stats(t.device)
        try:
            for _ in range(steps):
                current.clear()
                t0 = time.perf_counter()
                loss = trainer.train_step(t, cfg)
                if t.device.type == "cuda":
                    torch.cuda.synchronize(t.device)
                rec.step_s.append(time.perf_counter() - t0)
                rec.losses.append(float(loss))
                rec.grads.append({n: current.get(n) for n in trained} if caught else {})
                rec.report = t.memory.step_report(wait=True) if t.memory is not None else {}
            if t.device.type == "cuda":
                rec.peak_vram = torch.cuda.max_memory_allocated(t.device)
            # (a sharded mode's state() is collective and whole on rank 0 only: the others get {})
            rec.weights = {n: _host_copy(v) for n, v in t.mode.state(t).get("trainable", {}).items()}
        finally:
            undo()
    except Exception as e:                     # noqa: BLE001 (what failed is the finding)
        rec.error = _said(e)
        rec.out_of_memory = is_out_of_memory(e)
    finally:
        _release(t)
    return rec


def _said(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def _start_from(t, start: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> list[str]:
    """Set the adapters that differ from `start` to it; their names."""
    named = dict(t.transformer.named_parameters())
    changed = [n for n, v in own.items() if n in start and not torch.equal(v, start[n])]
    with torch.no_grad():
        for n in changed:
            named[n].copy_(start[n].to(named[n].device, named[n].dtype))
    return changed


def _catch_gradients(t, names: dict[int, str], current: dict):
    """Install the gradient capture for `t`'s mode (module docstring); returns (its undo, whether
    gradients are caught: not in a sharded full fine-tune, whose gradients are never whole)."""
    opt = t.optimizer
    if getattr(t.mode, "name", "") == "full":
        if not hasattr(opt, "step_param"):           # FSDP2 / ZeRO: torch's AdamW on the shards
            return (lambda: None), False
        original = opt.step_param

        def step_param(p, g, *args, **kwargs):
            name = names.get(id(p))
            if name is not None and g is not None:
                current[name] = _host_copy(g).float()
            return original(p, g, *args, **kwargs)

        opt.step_param = step_param
        return (lambda: opt.__dict__.pop("step_param", None)), True

    def pre_hook(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = names.get(id(p))
                if name is not None:
                    current[name] = None if p.grad is None else _host_copy(p.grad).float()

    handle = opt.register_step_pre_hook(pre_hook)
    return handle.remove, True


def _release(t) -> None:
    """The variant's memory goes now (pinned buffers, slots, hooks), before the next is built."""
    try:
        t.mode.close(t)
    finally:
        if t.memory is not None:
            t.memory.release()
        gc.collect()
        if t.device.type == "cuda":
            torch.cuda.empty_cache()
