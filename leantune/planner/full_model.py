"""Full fine-tuning in the memory model: what training every weight adds beyond the weights.

What it trades: a few milliseconds at planner construction (one small optimizer step measured on
the CPU per optimizer setting) for prices that follow what the trainer really allocates, read from
train/fused_optim.py, train/in_backward.py and memory/trainable_streaming.py:

- Optimizer state per trained tensor, exactly as `fused_optim.initial_state` creates it (built on
  the meta device from the tensor's shape): AdamW two moments in fp32 or bf16, Adafactor a row and
  a column vector per matrix (a full-size vector for 1-D tensors), SGD nothing. It lives in a
  `ParamState` module beside its weight, so it goes where the weight goes: on the device for a
  resident block, packed into a streamed block's host buffer (each tensor 512-byte aligned, like
  the weights) and brought to the device in that block's slot, then written back with it.
- bitsandbytes' 8-bit AdamW keeps its state on the device for every weight (created by
  bitsandbytes at the first step, not a ParamState, so it never travels): uint8 moments plus one
  fp32 absmax per 256 values each; tensors under 4096 values keep fp32 moments (bitsandbytes'
  `min_8bit_size`). Priced from that layout, not measured (bitsandbytes needs CUDA).
- Gradients: the step runs inside backward, one tensor at a time, and frees the gradient at once
  (in_backward.py), so beyond the activations the device holds one weight's gradient, at most the
  largest trained tensor's, never the model's.
- The step's temporaries (fp32 copies of a bf16 weight and gradient, AdamW's denominator,
  stochastic rounding's noise and bits, per-parameter clipping): measured by running
  `InBackwardStep`'s own update on a small real CPU tensor under a storage tracker, as bytes per
  element of the stepped tensor, for the run's optimizer, dtypes, rounding and clipping. Two terms
  a CPU run cannot show are added: the device copy of an fp32 master (on the CPU the master *is*
  the compute tensor) and, with gradient accumulation, the fp32 conversion of a gradient on its
  way to its host accumulator (4 bytes per element, an upper bound).
- Host RAM: the weights, every trained tensor's state until the plan places the resident part on
  the device, fp32 masters and fp32 accumulators (train/full_host_ram.py's parts).
- Traffic per step (timing.py): a streamed trainable block comes in for forward and again for
  backward (as any streamed block) and goes back once, weights and state, on the write-back
  stream; masters and accumulators cross the bus from pageable memory inside the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .weight_bytes import ModelWeights, ModuleWeights, align
from .workload import Workload

BNB_BLOCK = 256          # values per absmax of bitsandbytes' blockwise 8-bit state
BNB_MIN_8BIT = 4096      # smaller tensors keep fp32 moments (bitsandbytes' min_8bit_size)
_STEP_COEF: dict = {}    # (optimizer, dtype, state dtype, rounding, master, clip) -> bytes per element


def state_tensor_bytes(optimizer: str, shape: tuple[int, ...], state_dtype: str) -> list[int]:
    """Bytes of each ParamState buffer fused_optim creates for a trained tensor of `shape`."""
    from ..train.fused_optim import initial_state

    if optimizer == "adamw8bit":
        return []
    dtype = torch.bfloat16 if state_dtype == "bf16" else torch.float32
    st = initial_state(optimizer, torch.empty(shape, device="meta"), dtype)
    return [v.numel() * v.element_size() for v in st.values()]


def bnb_state_bytes(numel: int) -> int:
    """Device bytes of bitsandbytes' AdamW8bit state for one tensor (see the module docstring)."""
    if numel < BNB_MIN_8BIT:
        return 8 * numel
    return 2 * numel + 2 * 4 * math.ceil(numel / BNB_BLOCK)


class _NoStep:
    """An optimizer that changes nothing: isolates what clipping allocates (8-bit AdamW's own
    step is bitsandbytes' fused in-place kernel)."""

    def step_param(self, p, g) -> None:
        pass


def step_bytes(optimizer: str, dtype: torch.dtype, state_dtype: str, stochastic_rounding: bool,
               master: bool, clip: bool) -> tuple[float, int]:
    """Peak device bytes the in-backward update of one tensor allocates, as (bytes per element of
    the tensor, bytes whatever its size: scalars such as norms), its incoming gradient not
    included: measured on real CPU tensors of two sizes (module docstring)."""
    key = (optimizer, dtype, state_dtype, stochastic_rounding, master, clip)
    if key not in _STEP_COEF:
        small, large = (_measure_step(*key, rows=r) for r in (96, 192))
        per = (large - small) / (96 * 128)
        if master and dtype != torch.float32 and optimizer != "adamw8bit":
            per += 4.0                 # the master's device copy (the master itself on the CPU)
        _STEP_COEF[key] = (per, int(round(small - (large - small))))
    return _STEP_COEF[key]


def _measure_step(optimizer, dtype, state_dtype, sr, master, clip, rows: int) -> int:
    from ..memory.simulated import DeviceMemoryTracker
    from ..train.fused_optim import FusedOptimizer
    from ..train.in_backward import InBackwardStep

    shape = (rows, 128)
    lin = torch.nn.Linear(shape[1], shape[0], bias=False).to(dtype)
    if optimizer == "adamw8bit":
        opt = _NoStep()
    else:
        opt = FusedOptimizer(lin, {"weight": lin.weight}, optimizer, lr=1e-3, state_dtype=state_dtype,
                             stochastic_rounding=sr, master_weights=master)
        opt._generator(lin.weight.device)
    stepper = InBackwardStep(opt, [], max_grad_norm=1.0 if clip else 0.0)
    peak = 0
    for _ in range(2):                 # the second step: state and generator exist, as in a run
        grad = torch.ones(shape, dtype=dtype)
        tracker = DeviceMemoryTracker()
        with tracker:
            stepper._update(lin.weight, grad)
        peak = max(tracker.peak.values(), default=0)
    return peak


@dataclass(frozen=True)
class FullPricing:
    """Per-unit and whole-model numbers of a full fine-tune the memory model adds to its weights."""

    state: list[int]            # per block (execution order): state bytes on the device when resident
    state_packed: list[int]     # per block: state bytes in its packed unit (each tensor aligned)
    nb_state: int
    nb_state_packed: int
    device_always: int          # state that never moves (bitsandbytes 8-bit)
    gradient: int               # the largest trained tensor's gradient
    step: int                   # the update's temporaries for the largest trained tensor
    step_coef: float            # ... per element of the stepped tensor
    trained: int                # trained parameters
    state_total: int
    masters: bool               # fp32 masters in host RAM
    trained_weight_bytes: int   # the trained tensors in their dtype

    @classmethod
    def of(cls, weights: ModelWeights, workload: Workload, dtype_bytes: int) -> FullPricing:
        w = workload
        wide = dtype_bytes < 4

        def unit(m: ModuleWeights) -> tuple[int, int, int]:
            parts = [state_tensor_bytes(w.optimizer, s, w.state_dtype) for s in m.trained]
            bnb = sum(bnb_state_bytes(math.prod(s)) for s in m.trained) if w.optimizer == "adamw8bit" else 0
            return sum(map(sum, parts)), sum(align(b) for p in parts for b in p), bnb

        blocks = [unit(b) for b in weights.blocks]
        nb = unit(weights.non_blocks)
        shapes = [s for m in (*weights.blocks, weights.non_blocks) for s in m.trained]
        largest = max((math.prod(s) for s in shapes), default=0)
        trained = sum(math.prod(s) for s in shapes)
        coef, fixed = step_bytes(w.optimizer, w.dtype, w.state_dtype, w.stochastic_rounding,
                                 w.master_weights and wide, w.clip_per_param) if shapes else (0.0, 0)
        if w.gradient_accumulation > 1:
            coef += 4.0
        device_always = sum(b[2] for b in blocks) + nb[2]
        return cls(state=[b[0] for b in blocks], state_packed=[b[1] for b in blocks], nb_state=nb[0],
                   nb_state_packed=nb[1], device_always=device_always, gradient=largest * dtype_bytes,
                   step=int(math.ceil(coef * largest)) + fixed, step_coef=coef, trained=trained,
                   state_total=sum(b[0] for b in blocks) + nb[0] + device_always,
                   masters=w.master_weights and wide, trained_weight_bytes=trained * dtype_bytes)

    def host_parts(self, loaded: int, accumulation: int) -> dict[str, int]:
        """train/full_host_ram.py's parts, with this model's exact state (8-bit state is on the device)."""
        from ..train.full_host_ram import full_host_parts

        return full_host_parts(loaded, self.trained, self.state_total - self.device_always, masters=self.masters,
                               accumulation=accumulation)
