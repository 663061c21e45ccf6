"""Full fine-tuning in the memory model: what training every weight adds beyond the weights.

What it trades: nothing at planner construction for the step's temporaries (measured once per
code version and shipped: step_bytes.py), and a fraction of a second to time the host optimizer
rate when a plan steps on the host, for prices that follow what the trainer really allocates, read from
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
  (in_backward.py), so beyond the activations the device holds the gradients of the block whose
  backward runs, never the model's. Where each one's update runs, and what is live then, the
  activation probe records (memory_model.py composes `step_of` there); `gradient` and `step`
  below are the largest tensor's, for the levers and the tests.
- The step's temporaries (fp32 copies of a bf16 weight and gradient, AdamW's denominator,
  stochastic rounding's noise and bits, per-parameter clipping): measured by running
  `InBackwardStep`'s own update on a small real CPU tensor under a storage tracker, as bytes per
  element of the stepped tensor, for the run's optimizer, dtypes, rounding and clipping (shipped
  per code and torch version in planner/profiles/step_bytes.json: step_bytes.py). Two terms
  a CPU run cannot show are added: the device copy of an fp32 master (on the CPU the master *is*
  the compute tensor) and, with gradient accumulation, the fp32 conversion of a gradient on its
  way to its host accumulator (4 bytes per element, an upper bound).
- Host RAM: the weights, every trained tensor's state until the plan places the resident part on
  the device, fp32 masters and fp32 accumulators (train/full_host_ram.py's parts).
- Traffic per step (timing.py): a streamed trainable block comes in for forward and again for
  backward (as any streamed block) and goes back once, weights and state, on the write-back
  stream; masters and accumulators cross the bus from pageable memory inside the step.

The host-step variant (Plan.optimizer_on_host, [full] streamed_step = "host", or "auto" when its
best plan is faster than the best device-step plan: search.py): the optimizer step of *streamed* blocks runs on the host CPU. Their state
never crosses PCIe: it stays in host RAM as ordinary tensors, so a streamed unit (its host buffer
and its ring slot) holds the weights alone, and nothing is written back; instead each streamed
trained tensor's gradient (in the weight's dtype) goes device->host once per optimizer step and the
CPU updates the host copy of the weight. That is why it fits budgets the device step cannot (fp32
AdamW moments of Flux-dev at 8 GiB: the slots shrink by the state they no longer carry); its cost
is time: a CPU updates a few hundred million to a billion parameters per second with the host
kernels (two cores), a GPU tens of billions.
Priced here: per block, the trained parameters (gradient bytes, host step time) and the largest
trained tensor (the device runs the updates of the *resident* tensors only, memory_model.py; the
host, one streamed tensor's gradient copy and its update temporaries, with the same measured coefficients
less the master's device copy: on the CPU the master is used in place); and the host optimizer
rate (`host_step_rate`), parameters per second of the fused update measured once per process and
optimizer setting on *this* (the planning) machine's CPU. A plan made on one machine and run on
another with a slower CPU under-predicts the host step, and under "auto" may choose the host step
where that machine's device step would be faster: plan on the machine that trains.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..memory.pinned_sizes import caching_host_size
from .weight_bytes import ModelWeights, ModuleWeights, align
from .workload import Workload

BNB_BLOCK = 256          # values per absmax of bitsandbytes' blockwise 8-bit state
BNB_MIN_8BIT = 4096      # smaller tensors keep fp32 moments (bitsandbytes' min_8bit_size)
_STEP_COEF: dict = {}    # (optimizer, dtype, state dtype, rounding, master, clip) -> bytes per element
_HOST_RATE: dict = {}    # the same key -> parameters per second of the update on this machine's CPU
_HOST_RATE_TENSORS: dict = {}   # dtype -> (weight, gradient) the rate is timed on, drawn once per process
# The tensor the host optimizer rate is timed on: 8.4M elements, past the CPU caches like the
# weights it prices (Flux's are 5-57M). A 1M-element tensor stays cache-resident and stepped 2-3x
# faster per parameter than a 37.7M one (bf16 AdamW, this 2-core machine: 124-207 vs 67 M/s), while
# 8.4M stepped at 59-63 M/s: the same regime as the real tensors, slightly on the safe side.
HOST_RATE_SHAPE = (2048, 4096)


@functools.lru_cache(maxsize=4096)
def state_tensor_bytes(optimizer: str, shape: tuple[int, ...], state_dtype: str) -> tuple[int, ...]:
    """Bytes of each ParamState buffer fused_optim creates for a trained tensor of `shape` (kept per
    shape: a model repeats a few dozen shapes thousands of times)."""
    from ..train.fused_optim import initial_state

    if optimizer == "adamw8bit":
        return ()
    dtype = torch.bfloat16 if state_dtype == "bf16" else torch.float32
    st = initial_state(optimizer, torch.empty(shape, device="meta"), dtype)
    return tuple(v.numel() * v.element_size() for v in st.values())


def bnb_state_bytes(numel: int) -> int:
    """Device bytes of bitsandbytes' AdamW8bit state for one tensor (see the module docstring)."""
    if numel < BNB_MIN_8BIT:
        return 8 * numel
    return 2 * numel + 2 * 4 * math.ceil(numel / BNB_BLOCK)


def step_bytes(optimizer: str, dtype: torch.dtype, state_dtype: str, stochastic_rounding: bool,
               master: bool, clip: bool) -> tuple[float, int]:
    """Peak device bytes the in-backward update of one tensor allocates, as (bytes per element of
    the tensor, bytes whatever its size: scalars such as norms), its incoming gradient not
    included: measured on real CPU tensors of two sizes (module docstring)."""
    key = (optimizer, dtype, state_dtype, stochastic_rounding, master, clip)
    if key not in _STEP_COEF:
        per, fixed = _measured_coef(key, host=False)
        if master and dtype != torch.float32 and optimizer != "adamw8bit":
            per += 4.0                 # the master's device copy (the master itself on the CPU)
        _STEP_COEF[key] = (per, fixed)
    return _STEP_COEF[key]


def host_step_bytes(optimizer: str, dtype: torch.dtype, state_dtype: str, stochastic_rounding: bool,
                    master: bool, clip: bool) -> tuple[float, int]:
    """Peak bytes the update of one tensor allocates *on the CPU*, as step_bytes gives them (per
    element, fixed), without the master's device copy: what a host step (Plan.optimizer_on_host)
    allocates beside the gradient it steps with, since it runs exactly where this is measured
    (with the host kernels, train/host_kernels.py, where they apply)."""
    return _measured_coef((optimizer, dtype, state_dtype, stochastic_rounding, master, clip), host=True)


def _measured_coef(key: tuple, host: bool) -> tuple[float, int]:
    """(bytes per element, fixed bytes) of one update: with the host kernels (`host`), or with the
    torch-op path a device step runs (step_bytes.py: shipped for this code, else measured)."""
    from .step_bytes import coefficients

    return coefficients(*key, host)


def host_step_rate(optimizer: str, dtype: torch.dtype, state_dtype: str, stochastic_rounding: bool,
                   master: bool, clip: bool, norm_from_device: bool = False) -> float:
    """Parameters per second the host step (InBackwardStep's update: clipping, then the fused
    optimizer's step) runs at on this machine's CPU: timed on a HOST_RATE_SHAPE tensor of the run's
    dtype, best of 3 after a first step that creates the state, once per process and setting
    (a tenth of a second or two; only plans stepping on the host are timed with it).
    It is the planning machine's CPU: a run on another machine steps at that machine's rate.
    `norm_from_device`: the clipping norm comes with the gradient (a run without gradient
    accumulation: the device takes it, trainable_streaming.step_on_host), so the host's step is
    timed without a norm pass of its own."""
    import time

    from ..train.fused_optim import FusedOptimizer
    from ..train.in_backward import InBackwardStep

    key = (optimizer, dtype, state_dtype, stochastic_rounding, master, clip, norm_from_device)
    if key not in _HOST_RATE:
        rows, cols = HOST_RATE_SHAPE
        # Filled in place in the run's dtype (a Linear's init and randn in fp32 took twice as long
        # as the timed steps); the values only need to be finite and of a weight's and a gradient's size.
        # Drawn once per dtype and copied for each setting: the random fill cost more than a
        # setting's timed steps, and a plan times several settings.
        # From a generator of their own: a plan made inside a run (under a vram_budget) must leave the
        # run's global RNG (adapter init, noise, data order) as it was.
        if dtype not in _HOST_RATE_TENSORS:
            g = torch.Generator().manual_seed(0)
            _HOST_RATE_TENSORS[dtype] = (torch.empty(HOST_RATE_SHAPE, dtype=dtype).uniform_(-0.02, 0.02, generator=g),
                                         torch.empty(HOST_RATE_SHAPE, dtype=dtype).uniform_(-1e-3, 1e-3, generator=g))
        weight, grad = _HOST_RATE_TENSORS[dtype]
        grad = grad.clone()          # clipping may scale it in place
        lin = torch.nn.Linear(cols, rows, bias=False, device="meta", dtype=dtype)
        lin.weight = torch.nn.Parameter(weight.clone())
        opt = FusedOptimizer(lin, {"weight": lin.weight}, optimizer, lr=1e-4, state_dtype=state_dtype,
                             stochastic_rounding=stochastic_rounding, master_weights=master, scheduled=False)
        stepper = InBackwardStep(opt, [], max_grad_norm=1.0 if clip else 0.0)
        norm = float(torch.linalg.vector_norm(grad, dtype=torch.float32)) if clip and norm_from_device else None

        def update() -> None:
            stepper._step(lin.weight, grad, grad_norm=norm)

        with torch.no_grad():
            update()                               # state and generator created, as after a run's first step
            best = math.inf
            for _ in range(3):
                t0 = time.perf_counter()
                update()
                best = min(best, time.perf_counter() - t0)
        _HOST_RATE[key] = rows * cols / max(best, 1e-9)
    return _HOST_RATE[key]


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
    # The host-step variant (module docstring): per block, then the non-block group.
    trained_numel: tuple[int, ...] = ()   # per block: trained parameters
    largest: tuple[int, ...] = ()         # per block: elements of its largest trained tensor
    nb_trained_numel: int = 0
    nb_largest: int = 0
    # Per block, then the non-block group: the pinned bytes its gradients' host copies reserve
    # (each tensor rounded up by the caching host allocator: memory/pinned_sizes.py).
    pinned_grads: tuple[int, ...] = ()
    nb_pinned_grads: int = 0
    step_fixed: int = 0         # the update's bytes whatever the tensor's size (norms, scalars)
    host_coef: float = 0.0      # the update's temporaries on the CPU, per element (no master copy)
    host_fixed: int = 0
    dtype_bytes: int = 2        # the trained weights' (and so their gradients') element size
    accumulation: int = 1
    rate_key: tuple = ()        # host_step_rate's arguments

    def step_of(self, numel: int) -> int:
        """The device update's temporaries for a trained tensor of `numel` elements (0: none)."""
        return int(math.ceil(self.step_coef * numel)) + self.step_fixed if numel else 0

    def host_step_of(self, numel: int) -> int:
        """Host bytes one host step of a tensor of `numel` elements holds: its gradient's copy and
        the update's temporaries on the CPU (0: none)."""
        return numel * self.dtype_bytes + int(math.ceil(self.host_coef * numel)) + self.host_fixed if numel else 0

    def host_rate(self) -> float:
        """Parameters per second of the host step on this machine's CPU (host_step_rate)."""
        return host_step_rate(*self.rate_key) if self.trained else math.inf

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
        key = (w.optimizer, w.dtype, w.state_dtype, w.stochastic_rounding, w.master_weights and wide,
               w.clip_per_param)
        coef, fixed = step_bytes(*key) if shapes else (0.0, 0)
        host_coef, host_fixed = host_step_bytes(*key) if shapes else (0.0, 0)
        if w.gradient_accumulation > 1:
            coef += 4.0
            host_coef += 4.0           # the last micro-batch's gradient added to its fp32 accumulator

        def sizes(m: ModuleWeights) -> tuple[int, int]:
            n = [math.prod(s) for s in m.trained]
            return sum(n), max(n, default=0)

        def pinned(m: ModuleWeights) -> int:
            return sum(caching_host_size(math.prod(s) * dtype_bytes) for s in m.trained)

        per_block = [sizes(b) for b in weights.blocks]
        nb_sizes = sizes(weights.non_blocks)
        device_always = sum(b[2] for b in blocks) + nb[2]
        return cls(state=[b[0] for b in blocks], state_packed=[b[1] for b in blocks], nb_state=nb[0],
                   nb_state_packed=nb[1], device_always=device_always, gradient=largest * dtype_bytes,
                   step=int(math.ceil(coef * largest)) + fixed, step_coef=coef, trained=trained,
                   state_total=sum(b[0] for b in blocks) + nb[0] + device_always,
                   masters=w.master_weights and wide, trained_weight_bytes=trained * dtype_bytes,
                   trained_numel=tuple(b[0] for b in per_block), largest=tuple(b[1] for b in per_block),
                   nb_trained_numel=nb_sizes[0], nb_largest=nb_sizes[1], step_fixed=fixed,
                   pinned_grads=tuple(pinned(b) for b in weights.blocks), nb_pinned_grads=pinned(weights.non_blocks),
                   host_coef=host_coef, host_fixed=host_fixed, dtype_bytes=dtype_bytes,
                   accumulation=w.gradient_accumulation,
                   rate_key=key + (w.clip_per_param and w.gradient_accumulation == 1,))

    def host_parts(self, loaded: int, accumulation: int) -> dict[str, int]:
        """train/full_host_ram.py's parts, with this model's exact state (8-bit state is on the device)."""
        from ..train.full_host_ram import full_host_parts

        return full_host_parts(loaded, self.trained, self.state_total - self.device_always, masters=self.masters,
                               accumulation=accumulation)
