"""The memory model: predicted peak VRAM, host RAM and step time of any plan, per component.

What it trades: about a second of meta-device work per resolution bucket at construction (weights
counted, activations probed) for estimates that then cost microseconds each, which is what lets
the search try every candidate plan and lets re-planning after an OOM be cheap.

VRAM components at the peak (`memory`), all in bytes:
- weights resident: the blocks that do not stream (and the non-block group unless it streams),
  in the compute dtype or fp8, modulation Linears included or not (weight_bytes.py);
- device tables: tensors the model holds outside its parameters and buffers and copies to the
  device itself at its first forward, keeping the copy (Qwen-Image's rotary tables, 4 MB;
  weight_bytes.device_tables): in every plan, streamed or not; listed only when there are any;
- stream slots: a ring of K slots, each the size of the largest streamed unit, 512-byte aligned;
- adapters: r * (in + out) fp32 parameters per targeted Linear; gradients the same; AdamW keeps
  two fp32 states per parameter, Adafactor one fp32 value per row and per column of each matrix;
- base adapters (resident): frozen LoRAs under the trained one ([model] / [sample] base_adapters,
  train/base_adapters.py; for `leantune sample`, its LoRAs too: Workload.frozen_adapter_bytes,
  fp32), the share that stays on the device: the weights in resident blocks (and in the non-block
  modules unless they stream), and whatever frozen_adapter_tensors does not list (`leantune
  sample`'s LoRAs). A base-adapter weight in a streamed block travels with it, as the engine
  packs it (memory/streaming_units.streams_with_unit): its 512-byte-aligned bytes are part of the
  block's unit, hence of the stream slots, of host RAM (the streamed units, and what packing
  frees) and of the copy time. Listed whenever there are base adapters, 0 when all of them stream;
- another base for previews: with [sample] base, a preview streams that other transformer through
  two slots of its largest unit, [sample]'s base adapters packed in (Workload.preview_adapter_tensors;
  infer/preview_base.py), and holds a copy of the trained adapter,
  beside the training state; its activations are taken as at most the training step's, so the
  term is what that phase adds above the step's peak; listed only with a [sample] base;
- activations: the probe's per-kind values composed over the whole stack (activation_probe.py),
  times the calibrated correction for the bucket; a plan that splits blocks (Plan.split_blocks,
  memory/split_parts.py) is priced from the probe of the split blocks (what they keep, and their
  parts' recompute: a transient of each block's backward, and FLOPs of its backward in timing.py);
- workspace: cuBLAS/cuDNN workspaces (`Machine.workspace`).
The peak is the larger of the backward (activations, plus gradients kept through accumulation)
and the optimizer step (gradients and the optimizer's temporaries), over the workload's buckets.

A full fine-tune (full_model.py) steps each weight inside backward, so its components differ:
- weights resident: as above; fp8 storage holds only the frozen block Linears ([full] exclude);
- stream slots: a streamed block's unit carries its weights *and* their optimizer state;
- optimizer states: the state of the resident trained weights (plus bitsandbytes' 8-bit state of
  every weight, which never moves);
- optimizer step: what the updates add to the activation peak. Each trained tensor's update runs
  inside backward the moment its gradient is complete (train/in_backward.py), and the probe
  records that moment per tensor: the live bytes then above the start of its block's backward,
  its gradient included (activation_probe.py, KindProfile.step_points). The update's temporaries
  (full_model.FullPricing.step_of) are added there, composed over the stack like any other
  transient of a block's backward (compose_activations' bwd_extra; the final layers' tensors in
  their backward, the embedders' and FLUX.2's shared modulation in the first block's of the kind
  they feed); the term is how far the highest of those moments rises above the activation peak.
  The largest tensor (klein-4B's fused qkv+MLP projection, 2.2 GiB of AdamW temporaries) steps at
  the end of its block's backward, when most of that block's activations are freed: pricing it
  on top of the whole activation peak, as this model did first, over-predicted by 11-17 %.
- gradients: 0; each gradient lives from its computation to its update, inside the probe's
  numbers (the probe frees it where the update does).
With the optimizer step of streamed blocks on the host (Plan.optimizer_on_host, full_model.py's
host-step variant), a streamed unit carries its weights only, so the slots shrink by the state
they no longer carry; the optimizer states are still the resident weights' own; the gradients
term is the largest trained tensor's (a streamed one stays on the device until its copy to the
host has run) and the optimizer step term the update temporaries of the largest *resident*
trained tensor (0 if every trained tensor streams), or, with gradient accumulation, the fp32
conversion of the largest streamed gradient on its way to its host accumulator if that is larger,
both on top of the activation peak: the per-moment pricing above is not used for it. Priced per
moment, a host-step plan came out 3.5-5 % *under* the simulated peak (Flux-dev, 1024 px, 4-8
GiB): its peak is the activation peak (a checkpointed block's recompute), which the composed
activations under-count by about 0.3 GiB there, and which these two terms covered. The streamed
weights' state, the host step's transient and the pinned gradient staging are host RAM
(host_model.py); the gradients' device->host copies and the CPU step are time (timing.py).
Host RAM comes from host_model.py, step time from timing.py.

A LoRA whose optimizer step runs on the host (Plan.optimizer_on_host in a LoRA plan, [lora]
optimizer_step; train/lora_host_step.py) keeps no optimizer state and no update temporaries on the
device: "optimizer states" and "optimizer step" are 0, the gradients stay (they exist from backward
until their copy to the host). Host RAM gains "LoRA optimizer step on the host": an fp32 copy of
every adapter, its gradient staging and the optimizer's state (in every phase's peak: the copies
are made when the optimizer is built, before the first step). Step time gains, after the device's
step and not hidden behind it (a global-norm clip needs every gradient): the gradients' copy to
the host, the CPU's step at the rate timed on this machine (lora_host_step.measured_rate) and the
adapters' copy back (`host_step_s`, reported apart).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .activations import compose_activations, step_peak
from .corrections import Calibration, activation_key, bucket_key
from .full_model import FullPricing
from .host_model import frozen_lead, host_breakdown, offloaded_inputs
from .machine import Machine, assumed_machine
from ..memory.plan import Plan
from .timing import StepTime, simulate_step
from .spec_cache import MeasuredModel, effective_storage, measure_model, storage_options
from .optimizer_state import lora_shapes, state_bytes
from .weight_bytes import ModuleWeights, align
from .workload import Workload

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}

@dataclass(frozen=True)
class Estimate:
    """Predicted peak VRAM and host RAM (bytes, per component) and step time (seconds) of a plan."""

    vram: dict[str, int]
    peak_vram: int
    host: dict[str, int]
    peak_host: int
    step_s: float
    compute_s: float
    exposed_s: float                 # compute waiting on copies
    overhead_s: float                # fp8 dequantisation and the optimizer step
    h2d_bytes: int                   # weights (and offloaded inputs) copied per step
    per_bucket: dict[str, dict]      # "HxW" -> {"peak_vram", "activations", "step_s"}
    # full mode, per step: the streamed units written back (weights and state), or, with the
    # optimizer step of streamed blocks on the host, their trained tensors' gradients
    d2h_bytes: int = 0
    host_step_s: float = 0.0         # the step waiting on the CPU's optimizer step (timing.py), not in exposed_s
    disk_bytes: int = 0              # read from the disk tier per step (timing.py)


class MemoryModel:
    """Estimates of one (model, workload, machine): weights measured and activations probed once.

    `model` is the model itself (real or meta weights) or its MeasuredModel (spec_cache.py: what a
    previous plan measured of it), which costs nothing to price again.
    """

    def __init__(self, spec, model: torch.nn.Module | MeasuredModel, workload: Workload,
                 machine: Machine | None = None, calibration: Calibration | None = None):
        if workload.mode == "lora" and workload.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {workload.rank}")
        if not workload.buckets:
            raise ValueError("the workload needs at least one resolution bucket")
        self.spec, self.workload = spec, workload
        self.machine = machine or assumed_machine()
        self.calibration = calibration or Calibration()
        self.measured = model if isinstance(model, MeasuredModel) else measure_model(spec, model, workload)
        self.weights, self.key = self.measured.weights, self.measured.key
        self.dtype_bytes = DTYPE_BYTES.get(workload.dtype, 2)
        # (fp8, fp8_modulation) storages the search tries (spec_cache.storage_options); in full mode
        # fp8 storage holds frozen block Linears only, an option when some are frozen.
        self.storages = storage_options(workload, self.weights)
        # The formats quantized block Linears may take (base_formats.py): fp8 alone unless the
        # workload prices others and this model holds Linears they take; a pinned format is the
        # storage of every plan.
        self.formats = self._base_formats()
        if workload.base_pinned:
            self.storages = [s for s in self.storages if s[0]] or self.storages
        # An fp8 checkpoint's block weights compute through fp8 storage in every plan: probed so.
        # The plainest storage is the reference of the dequantisation cost (timing.py).
        # A LoRA profile is priced at the run's rank from the adapters' share per rank (at_rank).
        self.profiles = {st: {b: self.measured.profile(b, effective_storage(st, self.weights)).at_rank(workload.rank)
                              for b in workload.buckets}
                         for st in {*self.storages, (False, False)}}
        # The same probed with the family's split blocks splitting (Plan.split_blocks), where it has
        # them (spec_cache.splits_blocks); empty: no plan splits (a stored measurement without them too)
        self.split_profiles = ({st: {b: self.measured.profile(b, effective_storage(st, self.weights), split=True)
                                     .at_rank(workload.rank) for b in workload.buckets} for st in self.profiles}
                               if self.measured.split_profiles and workload.mode != "inference" else {})
        self.kinds = [b.kind for b in self.weights.blocks]
        # Per-block numbers every candidate plan sums: computed once, so a search prices ~1000 plans fast.
        db, blocks, nb = self.dtype_bytes, self.weights.blocks, self.weights.non_blocks
        self._index = {b.name: i for i, b in enumerate(blocks)}
        every = [(f, m) for f in (False, True) for m in (False, True)]
        # fp8's keys stay (fp8, modulation); another format's are (fp8, modulation, format)
        every += [(f, m, fmt) for fmt in self.formats if fmt != "fp8" for f, m in every]
        self.full = FullPricing.of(self.weights, workload, db) if workload.mode == "full" else None
        st = self.full.state_packed if self.full else [0] * len(blocks)
        self._bytes = {s: [b.bytes(db, *s) for b in blocks] for s in every}
        self._unit = {s: [b.unit_bytes(db, *s) + st[i] for i, b in enumerate(blocks)] for s in every}
        self._nb_bytes = nb.bytes(db)
        self._own_bytes = self.weights.own_numel * db       # the model's own tensors: resident in every plan
        self._nb_unit = nb.unit_bytes(db) + (self.full.nb_state_packed if self.full else 0)
        # Units without their optimizer state: a plan whose streamed blocks step on the host.
        self._unit_w = {s: [b.unit_bytes(db, *s) for b in blocks] for s in every}
        self._nb_unit_w = nb.unit_bytes(db)
        self._conversion = {s: max([b.largest_conversion(*s) for b in blocks], default=0) for s in every}
        # Per stored key, the weights each block dequantizes in a use and the largest one's elements
        self._quantized = {s: [b.quantized(*(s if len(s) == 3 else (*s, "fp8"))) for b in blocks] for s in every}
        # Base adapters' weights by unit, (raw bytes, packed bytes) per block and for the non-block group
        self._adapters = self._adapter_units(workload.frozen_adapter_tensors)
        self._preview_adapters = self._adapter_units(workload.preview_adapter_tensors)
        self._composed: dict = {}      # (bucket, storage, checkpointing, split) -> activations before calibration
        self._stepped: dict = {}       # full mode: in_backward_step's terms per bucket and plan shape
        self._offloaded: dict = {}     # storage -> offloaded block inputs' pinned bytes
        self._indices: dict = {}       # streamed block names -> (index set, sorted indices)
        self._host_parts: dict = {}    # loaded bytes -> full_host_parts (full mode)

    def _base_formats(self) -> tuple[str, ...]:
        w, wt = self.workload, self.weights
        if w.base_pinned:
            return tuple(w.base_formats) or ("fp8",)
        if w.mode == "full" or wt.prequantized:     # frozen weights only; a file's e4m3 stays e4m3
            return ("fp8",)
        return tuple(f for f in w.base_formats if f == "fp8" or wt.stores_as(f)) or ("fp8",)

    @staticmethod
    def stored_key(plan: Plan) -> tuple:
        """The key of a plan's weight bytes: (fp8, fp8_modulation), with the format when not fp8."""
        return plan.storage if plan.base_format == "fp8" else (*plan.storage, plan.base_format)

    def dequant_extra(self, plan: Plan) -> list[float] | None:
        """Per block, the seconds one use's dequantization costs beyond fp8's (base_formats.py);
        None for fp8 and unquantized plans (the probe prices fp8's)."""
        if plan.base_format == "fp8" or not (plan.fp8 or plan.fp8_modulation):
            return None
        from .base_formats import dequant_extra_s

        m = self.machine
        return [dequant_extra_s(plan.base_format, n, m.hbm, m.flops * self.calibration.flops_scale)
                for n, _ in self._quantized[self.stored_key(plan)]]

    def dequant_transient(self, plan: Plan) -> int:
        """Device bytes the largest dequantization holds beyond fp8's bf16 weight (base_formats.py):
        added to the activation peak of an int8 / NF4 plan."""
        if plan.base_format == "fp8" or not (plan.fp8 or plan.fp8_modulation):
            return 0
        from .base_formats import FORMATS

        largest = max((m for _, m in self._quantized[self.stored_key(plan)]), default=0)
        return int(largest * (FORMATS[plan.base_format].transient_bytes - FORMATS["fp8"].transient_bytes))

    @property
    def splits(self) -> bool:
        """Whether plans may split blocks (Plan.split_blocks): the model's family has split blocks
        and they were probed."""
        return bool(self.split_profiles)

    def profile_of(self, storage, bucket, split: bool = False):
        """The activation profile a plan of `storage` (Plan.storage) computes with at `bucket`, its
        blocks split or not (Plan.split_blocks)."""
        if split and not self.split_profiles:
            raise ValueError("this model's blocks have no split variant (ModelFamily.split_blocks): "
                             "no plan of it splits blocks")
        return (self.split_profiles if split else self.profiles)[storage][bucket]

    # -- parts ---------------------------------------------------------------------------------------
    def activation_peak(self, bucket, fp8: bool, checkpointing: str, modulation: bool = False,
                        split: bool = False) -> int:
        composed = self._composed_activations(bucket, (fp8, modulation), checkpointing, split)
        scales = self.calibration.activation_scale   # measured for this mode, else for another mode
        scale = scales.get(activation_key(bucket, checkpointing, split), scales.get(f"{bucket_key(bucket)}:*", 1.0))
        return int(composed * scale)

    def in_backward_step(self, plan: Plan, bucket) -> dict[str, int]:
        """A full fine-tune's "gradients" and "optimizer step" terms: what its in-backward updates
        add to the activation peak (module docstring). Each trained tensor's update is priced at the
        probe's moment its gradient completes (activations.step_peak), composed over the stack like
        the backward's transients (compose_activations' bwd_extra); the term is how far the highest
        of those moments rises above the activation peak (0 when none does)."""
        full, w = self.full, self.workload
        on_host = self.host_step(plan)
        if on_host:
            # Not yet priced per moment (see the module docstring): the largest gradient and the
            # largest resident tensor's update on top of the activation peak, as before.
            step = full.step_of(self.resident_trained(plan)[1])
            if w.gradient_accumulation > 1:            # a streamed gradient's fp32 copy to its accumulator
                step = max(step, 4 * max((m for _, m in self.streamed_trained(plan)), default=0))
            return {"gradients": full.gradient, "optimizer step": step}
        key = (bucket, plan.storage, plan.checkpointing, plan.split_blocks)
        if key not in self._stepped:
            prof = self.profile_of(plan.storage, bucket, plan.split_blocks)
            seq = [prof.kinds[k] for k in self.kinds]
            on_device = full.step_of
            firsts = {k: i for i, k in reversed(list(enumerate(self.kinds)))}
            extra = []
            for i, k in enumerate(seq):
                x = step_peak(k.step_points, on_device)
                if firsts[self.kinds[i]] == i:          # embedders, shared modulation
                    x = max(x, step_peak(k.nb_first_step_points, on_device))
                extra.append(x)
            stepped = compose_activations(prof, seq, plan.checkpointing, w.mode, extra,
                                          step_peak(prof.post_step_points, on_device))
            over = stepped - self._composed_activations(bucket, plan.storage, plan.checkpointing, plan.split_blocks)
            loose = prof.loose_step_numel
            self._stepped[key] = {"gradients": 0,
                                  "optimizer step": max(0, over, loose * self.dtype_bytes + on_device(loose))}
        return self._stepped[key]

    def _composed_activations(self, bucket, storage, checkpointing: str, split: bool = False) -> int:
        """The activation peak before calibration (compose_activations over the stack), kept."""
        key = (bucket, storage, checkpointing, split)
        if key not in self._composed:
            prof = self.profile_of(storage, bucket, split)
            seq = [prof.kinds[k] for k in self.kinds]
            self._composed[key] = compose_activations(prof, seq, checkpointing, self.workload.mode)
        return self._composed[key]

    def trainable_bytes(self) -> tuple[int, int, int]:
        """(parameter bytes, gradient bytes, optimizer-state bytes) of what trains."""
        if not hasattr(self, "_trainable"):
            self._trainable = self._trainable_bytes()
        return self._trainable

    def _trainable_bytes(self) -> tuple[int, int, int]:
        w = self.workload
        if w.mode == "inference":
            return 0, 0, 0
        if w.mode == "lora":
            shape = (w.rank, w.adapter, w.lokr_factor, w.lokr_decompose_both)     # [lora] type and its options
            n = self.weights.adapter_params(*shape)
            params = grads = 4 * n
            params += 4 * n * w.other_adapters        # the other parts' adapters, resident (no gradients then)
            # Each optimizer's state as it allocates it (optimizer_state.py)
            states = state_bytes(w.optimizer, lora_shapes(self.weights.adapters, *shape)) * (1 + w.other_adapters)
            return params, grads, states
        n = self.weights.numel
        grads = n * self.dtype_bytes
        # AdamW: two fp32 moments. Adafactor factors matrices into row and column statistics; without
        # per-tensor shapes here, its unfactored size (one fp32 per parameter) is the upper bound used.
        states = 8 * n if w.optimizer == "adamw" else 4 * n
        return 0, grads, states   # full: the trained weights are the model's, already counted as weights

    def indices(self, plan: Plan) -> frozenset[int]:
        """Execution-order indices of the plan's streamed blocks."""
        return self._streamed_indices(plan.streamed_blocks)[0]

    def ordered(self, plan: Plan) -> tuple[int, ...]:
        """The same indices in execution order."""
        return self._streamed_indices(plan.streamed_blocks)[1]

    def _streamed_indices(self, names: tuple[str, ...]) -> tuple[frozenset[int], tuple[int, ...]]:
        """(set, sorted) indices of streamed block names, kept per name tuple: a search asks for
        them a dozen times per candidate."""
        found = self._indices.get(names)
        if found is None:
            unknown = [n for n in names if n not in self._index]
            if unknown:
                raise ValueError(f"plan streams unknown blocks {unknown[:3]}")
            idx = frozenset(self._index[n] for n in names)
            found = self._indices[names] = (idx, tuple(sorted(idx)))
        return found

    def _adapter_units(self, tensors) -> tuple[list[tuple[int, int]], tuple[int, int]]:
        """(raw, packed) bytes of the base-adapter weights `tensors` ((module name, bytes), as
        Workload.frozen_adapter_tensors) in each block, in execution order, and in the non-block
        group; a weight in neither stays resident in every plan (not counted here)."""
        blocks = [[0, 0] for _ in self.weights.blocks]
        nb = [0, 0]
        index = {b.name: i for i, b in enumerate(self.weights.blocks)}
        non_blocks = set(self.spec.non_block_modules)
        for name, n in tensors:
            parts = name.split(".")
            where = next((blocks[index[".".join(parts[:k])]] for k in range(1, len(parts))
                          if ".".join(parts[:k]) in index), None)
            if where is None and parts[0] in non_blocks:
                where = nb
            if where is not None:
                where[0] += n
                where[1] += align(n)
        return [tuple(b) for b in blocks], tuple(nb)

    def streamed_adapter_bytes(self, plan: Plan) -> int:
        """Bytes of the base-adapter weights that travel in the plan's streamed units (unaligned)."""
        blocks, nb = self._adapters
        return sum(blocks[i][0] for i in self.indices(plan)) + (nb[0] if plan.stream_non_blocks else 0)

    def unit_weights(self, plan: Plan) -> list[ModuleWeights]:
        """The streamed units in the engine's order (non-block group first, then execution order)."""
        wt = self.weights
        units = [wt.blocks[i] for i in self.ordered(plan)]
        return [wt.non_blocks, *units] if plan.stream_non_blocks else units

    def lora_host_step(self, plan: Plan) -> bool:
        """Whether a LoRA plan steps its adapters on the host (train/lora_host_step.py)."""
        return self.workload.mode == "lora" and plan.optimizer_on_host

    def lora_host_bytes(self) -> int:
        """Host RAM of a LoRA host step: the adapters' fp32 copies and gradient staging (every part's
        adapters) and the optimizer's state."""
        params, _, states = self.trainable_bytes()
        return 2 * params + states

    def host_step(self, plan: Plan) -> bool:
        """Whether the plan's streamed blocks step on the host (a full fine-tune that streams,
        with Plan.optimizer_on_host): their units carry no optimizer state."""
        return self.full is not None and plan.optimizer_on_host and bool(plan.streamed_blocks or plan.stream_non_blocks)

    def units(self, plan: Plan) -> list[int]:
        """Packed bytes of each streamed unit, in the engine's unit order."""
        unit, nb_unit = (self._unit_w, self._nb_unit_w) if self.host_step(plan) else (self._unit, self._nb_unit)
        adapters, nb_adapters = self._adapters        # base adapters travel with their block
        blocks = [unit[self.stored_key(plan)][i] + adapters[i][1] for i in self.ordered(plan)]
        return [nb_unit + nb_adapters[1], *blocks] if plan.stream_non_blocks else blocks

    def parked(self, plan: Plan) -> list[tuple[int, int]] | None:
        """Per streamed unit (the engine's order), its block's bytes (as loaded, as stored) when the
        loader reads it straight into the disk tier (memory/disk_load.py: a LoRA run's disk-tier
        blocks), else (0, 0); None when nothing loads so. The sampler loads whole (mode
        "inference")."""
        disk = self.on_disk(plan)
        if not disk or self.workload.mode not in ("lora",):
            return None
        stored = self._bytes[self.stored_key(plan)]             # fp8, int8 or NF4 rows as the load keeps them
        blocks = [(self._bytes[(False, False)][i], stored[i]) for i in self.ordered(plan)]
        units = [(0, 0)] + blocks if plan.stream_non_blocks else blocks
        return [u if d else (0, 0) for u, d in zip(units, disk)]

    def on_disk(self, plan: Plan) -> list[bool] | None:
        """Per streamed unit (the engine's order), whether its bytes live on disk (Plan.disk_blocks);
        None without the disk tier."""
        if not plan.disk_blocks:
            return None
        disk = set(plan.disk_blocks)
        blocks = [self.weights.blocks[i].name in disk for i in self.ordered(plan)]
        return [False, *blocks] if plan.stream_non_blocks else blocks

    def tiers(self, plan: Plan) -> dict[str, int]:
        """Where the plan keeps the transformer's weights, in bytes: on the GPU (the resident
        weights and the ring of slots), in host RAM (the streamed units' buffers) and on disk
        (the disk tier's units) -- what memory/engine.apply_memory places (device_bytes, and the
        streaming handle's host_bytes and disk_bytes)."""
        vram, _, _ = self.memory(plan)
        units, disk = self.units(plan), self.on_disk(plan) or []
        on_disk = sum(n for n, d in zip(units, disk) if d)
        return {"VRAM": vram["weights resident"] + vram["stream slots"], "host RAM": sum(units) - on_disk,
                "disk": on_disk}

    def streamed_trained(self, plan: Plan) -> list[tuple[int, int]]:
        """(trained parameters, largest trained tensor's elements) of each streamed unit, in the
        engine's unit order (full mode)."""
        full = self.full
        blocks = [(full.trained_numel[i], full.largest[i]) for i in self.ordered(plan)]
        return [(full.nb_trained_numel, full.nb_largest), *blocks] if plan.stream_non_blocks else blocks

    def streamed_pinned_grads(self, plan: Plan) -> list[int]:
        """Pinned bytes each streamed unit's gradient copies reserve (caching host allocator
        rounding), in the engine's unit order (full mode)."""
        full = self.full
        blocks = [full.pinned_grads[i] for i in self.ordered(plan)]
        return [full.nb_pinned_grads, *blocks] if plan.stream_non_blocks else blocks

    def resident_state(self, plan: Plan) -> int:
        """Device bytes of optimizer state outside the streamed units (full mode): the resident
        weights' state, and bitsandbytes' 8-bit state of every weight."""
        full, streamed = self.full, self.indices(plan)
        state = sum(b for i, b in enumerate(full.state) if i not in streamed) + full.device_always
        return state + (0 if plan.stream_non_blocks else full.nb_state)

    def resident_trained(self, plan: Plan) -> tuple[int, int]:
        """(trained parameters, largest trained tensor's elements) outside the streamed units."""
        full, streamed = self.full, self.indices(plan)
        sizes = [(full.trained_numel[i], full.largest[i]) for i in range(len(full.largest)) if i not in streamed]
        if not plan.stream_non_blocks:
            sizes.append((full.nb_trained_numel, full.nb_largest))
        return sum(n for n, _ in sizes), max((m for _, m in sizes), default=0)

    # -- estimates -----------------------------------------------------------------------------------
    def memory(self, plan: Plan) -> tuple[dict[str, int], dict[str, int], dict[str, dict]]:
        """(VRAM components at the peak, host RAM components, per-bucket peaks) of a plan.

        The VRAM components add up to the peak: the backward peak (activations, plus gradients
        when they persist through accumulation) or the optimizer step (gradients and the
        optimizer's temporaries), whichever is larger, on top of what is always there.
        """
        w = self.workload
        streamed = self.indices(plan)
        units = self.units(plan)
        resident = sum(b for i, b in enumerate(self._bytes[self.stored_key(plan)]) if i not in streamed)
        resident += (0 if plan.stream_non_blocks else self._nb_bytes) + self._own_bytes
        slots = min(plan.ring_slots, len(units)) * align(max(units)) if units else 0
        params, grads, states = self.trainable_bytes()
        full = self.full
        if full is not None:          # states of resident weights; streamed ones travel in the slots
            states = self.resident_state(plan)
        # a step updates one part's adapter: the other parts' gradients are None, and AdamW skips them
        opt_tmp = {"lora": 2 * params // (1 + w.other_adapters), "full": 0, "inference": 0}[w.mode]
        if self.lora_host_step(plan):       # state and update on the host (module docstring)
            states, opt_tmp = 0, 0
        keep_grads = w.gradient_accumulation > 1
        static = {"weights resident": resident, "stream slots": slots, "adapters": params,
                  "optimizer states": states, "workspace": self.machine.workspace}
        if self.weights.device_tables:     # the model's own device copies (Qwen-Image's rotary tables)
            static["device tables"] = self.weights.device_tables
        if w.frozen_adapter_bytes:          # [model] / [sample] base_adapters: the resident blocks' share
            static["base adapters (resident)"] = w.frozen_adapter_bytes - self.streamed_adapter_bytes(plan)
        if w.prefix_cache_bytes:            # a sampler's prefix keys and values, held for every step
            static["prefix KV cache"] = w.prefix_cache_bytes
        per_bucket: dict[str, dict] = {}
        worst = None
        for bucket in w.buckets:
            act = self.activation_peak(bucket, plan.fp8, plan.checkpointing, plan.fp8_modulation, plan.split_blocks)
            act += self.dequant_transient(plan)
            if full is not None:      # each weight steps inside backward, when its gradient completes
                part = {"activations": act, **self.in_backward_step(plan, bucket)}
            else:
                backward = {"activations": act, "gradients": grads if keep_grads else 0, "optimizer step": 0}
                step = {"activations": 0, "gradients": grads, "optimizer step": opt_tmp}
                part = backward if sum(backward.values()) >= sum(step.values()) else step
            if w.preview_base_bytes:     # a preview on another base: its ring and the trained adapter's copy
                part = {**part, "another base for previews": max(0, self.preview_ring(plan) + params
                                                                  + act - sum(part.values()))}
            top = sum(static.values()) + sum(part.values())
            per_bucket[bucket_key(bucket)] = {"peak_vram": top, "activations": act}
            if worst is None or top > worst[0]:
                worst = (top, part)
        vram = {**static, **worst[1]}
        order = ["weights resident", "device tables", "stream slots", "adapters", "base adapters (resident)", "gradients",
                 "optimizer states", "optimizer step", "activations", "another base for previews", "workspace"]
        return {k: vram[k] for k in order if k in vram}, self.host(plan), per_bucket

    def preview_ring(self, plan: Plan) -> int:
        """Device bytes of a preview on another base (infer/preview_base.preview_plan): every unit
        of the same architecture streamed through two slots of the largest, in the plan's fp8, with
        [sample]'s base adapters packed in (Workload.preview_adapter_tensors)."""
        storage = self.stored_key(Plan(fp8=plan.fp8, base_format=plan.base_format))
        blocks, nb = self._preview_adapters
        units = [self._nb_unit_w + nb[1], *(u + a[1] for u, a in zip(self._unit_w[storage], blocks))]
        return min(2, len(units)) * align(max(units))

    def host(self, plan: Plan, phases: dict | None = None) -> dict[str, int]:
        """Host RAM components of a plan (host_model.py); `phases` receives its phase totals."""
        offload = 0
        if plan.checkpointing == "offload":
            if plan.storage not in self._offloaded:
                lead = frozen_lead(self.workload.mode, [b.name for b in self.weights.blocks],
                                   [a.name for a in self.weights.adapters])    # their inputs stay on the device
                self._offloaded[plan.storage] = offloaded_inputs(self.workload, self.profiles[plan.storage],
                                                                 self.kinds[lead:])
            offload = self._offloaded[plan.storage]
        idx = self.ordered(plan)
        full = self.full
        on_host = self.host_step(plan)
        key = self.stored_key(plan)
        state = full.state if full else [0] * len(self._bytes[key])
        nb_state = full.nb_state if full else 0
        packed = self.units(plan)
        # What packing frees of each unit: its weights, and its state unless that stays as it is
        # (the host step keeps it in its own tensors).
        # (and the base adapters' weights it packs: they sit on the host beside the stored model
        # until then, attached before the engine is applied)
        adapters, nb_adapters = self._adapters
        kept = [self._bytes[key][i] + (0 if on_host else state[i]) + adapters[i][0] for i in idx]
        unit_stored = ([self._nb_bytes + (0 if on_host else nb_state) + nb_adapters[0], *kept]
                       if plan.stream_non_blocks else kept)
        loaded = sum(self._bytes[(False, False)]) + self._nb_bytes
        stored = sum(self._bytes[key]) + self._nb_bytes + self.workload.frozen_adapter_bytes
        if full and loaded not in self._host_parts:
            self._host_parts[loaded] = full.host_parts(loaded, self.workload.gradient_accumulation)
        parts = self._host_parts[loaded] if full else None
        host_step = None
        if on_host:
            sizes = self.streamed_trained(plan)
            host_step = {
                "state": sum(state[i] for i in idx) + (nb_state if plan.stream_non_blocks else 0),
                "step": full.host_step_of(max(m for _, m in sizes)),
                "staging": 2 * max(self.streamed_pinned_grads(plan)),
            }
        breakdown = host_breakdown(plan, packed, unit_stored, loaded, stored, self._conversion[key], offload,
                              self.workload.host_cache_bytes, full=parts, host_step=host_step,
                              quantizing_load=self.workload.quantizes_on_load,
                              preview_base=self.workload.preview_base_bytes,
                              ema=self.trainable_bytes()[0] if self.workload.ema else 0,
                              disk=self.on_disk(plan), phases=phases, parked=self.parked(plan))
        out = self._with_other_parts(breakdown, stored, phases)
        if self.lora_host_step(plan):       # held from the optimizer's build on: every phase's peak
            extra = self.lora_host_bytes()
            peak = out.pop("peak")
            out = {**out, "LoRA optimizer step on the host (fp32 adapters, gradients, state)": extra,
                   "peak": peak + extra}
            if phases is not None and "steps" in phases:
                phases["steps"] += extra
        return out

    def _with_other_parts(self, out: dict[str, int], stored: int, phases: dict | None = None) -> dict[str, int]:
        """The other parts of a model whose parts compute one at a time (Workload.other_parts), on
        the host as stored in every phase: added to each phase's peak (and to the steps' holdings
        in `phases`, which the disk split leaves room for: search.Planner._disk_split)."""
        n = self.workload.other_parts
        if not n:
            return out
        each = stored + self._own_bytes      # its blocks, non-block modules and own tensors
        out = {**out, "other experts on the host (as stored)": n * each}
        out["peak"] += n * each
        if phases is not None and "steps" in phases:
            phases["steps"] += n * each
        return out

    def timing(self, plan: Plan, bucket, units: list[int]) -> StepTime:
        """Step time of one bucket (timing.py)."""
        full, w = self.full, self.workload
        # a split plan's blocks: what they keep, and their parts' recompute in each block's backward
        # (one more forward of each block: the split probe's backward FLOPs), fp8's reference split alike
        prof = self.profile_of(plan.storage, bucket, plan.split_blocks)
        ref = self.profile_of((False, False), bucket, plan.split_blocks)
        if full is None:
            host = self.lora_host_step(plan)
            t = simulate_step(self.machine, self.calibration, plan, prof, ref, self.kinds,
                              self.ordered(plan), units, w.mode, 0 if host else sum(self.trainable_bytes()),
                              extra_forwards=self.recipe_forwards(), disk=self.on_disk(plan),
                              dequant=self.dequant_extra(plan))
            return self._lora_host_time(t) if host else t
        # The update reads and writes each trained weight and its state, reads its gradient, and
        # touches its temporaries; masters and accumulators cross the bus from pageable memory.
        # (timing.py counts `optimizer_bytes` read and written: the gradient and temporaries count half.)
        accumulators = 8 * full.trained * (w.gradient_accumulation - 1)
        if not self.host_step(plan):
            step_bytes = int(full.trained_weight_bytes + full.state_total
                             + (full.trained * self.dtype_bytes + full.step_coef * full.trained) / 2)
            pageable = (8 * full.trained if full.masters else 0) + accumulators
            return simulate_step(self.machine, self.calibration, plan, prof, ref, self.kinds,
                                 self.ordered(plan), units, w.mode, step_bytes, writeback=True,
                                 inline_pageable=pageable, extra_forwards=self.recipe_forwards())
        # Streamed tensors step on the host: on the device only the resident ones, whose state is
        # the device's; each streamed unit's gradients go to the host, where the CPU steps them at
        # the measured rate (full_model.host_step_rate); their masters never cross the bus.
        n_res = self.resident_trained(plan)[0]
        streamed = self.indices(plan)
        step_bytes = int(n_res * self.dtype_bytes + self.resident_state(plan)
                         + (n_res * self.dtype_bytes + full.step_coef * n_res) / 2)
        pageable = (8 * n_res if full.masters else 0) + accumulators
        rate = full.host_rate()
        host = [(n * self.dtype_bytes, n / rate) for n, _ in self.streamed_trained(plan)]
        return simulate_step(self.machine, self.calibration, plan, prof, ref, self.kinds, sorted(streamed), units,
                             w.mode, step_bytes, inline_pageable=pageable, host_steps=host,
                             extra_forwards=self.recipe_forwards())

    def lora_host_rate(self) -> float:
        """Adapter parameters per second the CPU steps (lora_host_step.measured_rate on this machine,
        kept per machine: lora_host_rate.py)."""
        from .lora_host_rate import lora_host_rate

        return lora_host_rate(self.workload.optimizer, clip=True)

    def _lora_host_time(self, t: StepTime) -> StepTime:
        """A LoRA host step's share added to a step (module docstring): the gradients of the part
        that steps to the host, the CPU's step, every adapter back; none of it hidden."""
        m = self.machine
        params, grads, _ = self.trainable_bytes()
        secs = grads / m.d2h + (grads // 4) / self.lora_host_rate() + params / m.h2d_pinned
        return t._replace(step_s=t.step_s + secs, host_step_s=secs, d2h_bytes=t.d2h_bytes + grads,
                          h2d_bytes=t.h2d_bytes + params)

    def recipe_forwards(self) -> float:
        """Forwards without a graph the recipe adds per step, on average: DOP's base prediction on
        its share of steps and [validation]'s passes (Workload; timing.simulate_step prices each)."""
        return self.workload.dop_share + self.workload.validation_forwards_per_step

    def estimate(self, plan: Plan) -> Estimate:
        vram, host, per_bucket = self.memory(plan)
        units = self.units(plan)
        timing = [self.timing(plan, bucket, units) for bucket in self.workload.buckets]
        for bucket, t in zip(self.workload.buckets, timing):
            per_bucket[bucket_key(bucket)]["step_s"] = t.step_s
        n = len(timing)
        return Estimate(vram=vram, peak_vram=sum(vram.values()), host=host, peak_host=host["peak"],
                        step_s=sum(t.step_s for t in timing) / n, compute_s=sum(t.compute_s for t in timing) / n,
                        exposed_s=sum(t.exposed_s for t in timing) / n,
                        overhead_s=sum(t.overhead_s for t in timing) / n,
                        h2d_bytes=int(sum(t.h2d_bytes for t in timing) / n), per_bucket=per_bucket,
                        d2h_bytes=int(sum(t.d2h_bytes for t in timing) / n),
                        host_step_s=sum(t.host_step_s for t in timing) / n,
                        disk_bytes=int(sum(t.disk_bytes for t in timing) / n))
