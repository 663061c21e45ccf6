"""Host RAM of a plan: what the process holds while the model loads, while memory is applied, and
during the steps.

What it trades: nothing at run time; it is what lets the planner refuse a plan before the loader
fills RAM, and pick fp8 when the host is the tighter resource. It follows what the memory engine
really allocates (engine.py, fp8.py, streaming.py, host_buffers.py), phase by phase:
- loading: the transformer in its stored dtypes (block weights of an fp8 checkpoint stay e4m3);
  where the workload's loader quantizes as it reads (`Workload.quantizes_on_load`: the trainer)
  and the plan stores fp8, what the plan stores plus the quantizing workers' buffers
  (models/weights.QUANTIZING_WORK_BYTES), never the file's bf16;
- fp8 conversion (plans with fp8): one Linear at a time, the e4m3 copy and its scales exist beside
  the original until it is freed, so the phase adds the largest converted weight (the arithmetic
  runs on the GPU); nothing where the load quantized already;
- packing: each streamed unit is copied into a host buffer of exactly its packed size (pinned with
  cudaHostRegister on that size: no power-of-two rounding), its original storages freed before the
  next unit is packed. Packing unit i holds the stored model, the buffer of unit i and the
  alignment slack of the units before it: the model plus about one unit, not plus every buffer;
- steps: the streamed units' buffers (resident weights live in VRAM), a staging pool of two
  32 MiB pinned buffers if any unit is pageable, the offloaded block inputs (stacked in 64 MiB
  pinned slabs, memory/host_buffers.HostSlabs: their bytes rounded up to whole slabs once, not
  each input to a power of two) and caches held in RAM.
- previews on another base ([sample] base, infer/preview_base.py): the steps' holdings plus that
  whole transformer as loaded, while a preview runs.
- the disk tier (Plan.disk_blocks, memory/disk_tier.py): a unit on disk holds no host buffer
  through the steps; it is written out as soon as it is packed, its buffer and originals freed
  before the next is packed; its reads go through the staging pool (two 32 MiB pinned buffers).
  A LoRA run's loader reads those blocks straight into the disk tier (memory/disk_load.py: each
  parked in the loading file as soon as it is filled), so the load holds the RAM-tier blocks, the
  non-block weights and one disk-tier block as loaded (the largest: the window), plus the
  quantizing workers' buffers where it quantizes as it reads; packing a disk-tier unit reads its
  parked originals back beside its buffer, both gone before the next (`parked`).
The peak is a process baseline plus the largest phase. Pinning costs no more host RAM than
pageable memory, so a pageable plan only adds the staging pool and slower copies.

A full fine-tune (`full`: train/full_host_ram.py's parts) adds its optimizer state, created beside
every trained weight before the memory plan is applied, and fp32 masters; the set-up phase holds
the loaded weights, all the state and the masters; a streamed unit packs its state with its
weights (so `packed` and `unit_stored` include it); the resident part's state leaves for the
device with its weights; during the steps the host keeps the packed units, the masters and the
fp32 gradient accumulators.

With the optimizer step of streamed blocks on the host (Plan.optimizer_on_host: `host_step`), a
streamed unit packs its weights only: packing copies no state into the buffers (the state stays
in its own tensors, so `packed` and `unit_stored` are weights only) and during the steps the host
keeps, beside the weight-only buffers, the streamed weights' optimizer state (unaligned, pageable:
"optimizer state of streamed blocks (host)"), the transient of one host step (the largest streamed
trained tensor's gradient copy and its update's temporaries, with full_model.host_step_bytes'
CPU-measured coefficients) and, on a CUDA device only, the pinned gradient staging buffers in
flight (at most twice the largest streamed unit's trained-gradient bytes): "gradient staging
(pinned)". A CPU or simulated compute device steps synchronously from the gradient itself and has
no staging, so a comparison with the simulation subtracts that line.
"""

from __future__ import annotations

from .activations import ActivationProfile
from .machine import GiB
from ..memory.plan import Plan
from ..memory.host_buffers import STAGING_CHUNK, offload_host_bytes
from ..memory.pinned_sizes import caching_host_size  # noqa: F401 - re-exported (tests price pinned staging)
from ..models.weights import QUANTIZING_WORK_BYTES
from .workload import Workload

HOST_BASELINE = int(2.5 * GiB)  # python + torch + CUDA runtime + diffusers, before any weight
STAGING_BUFFERS = 2             # the pinned staging pool of pageable units (host_buffers.py)


def packing_extra(units: list[tuple[int, int]], disk: list[bool] | None = None,
                  parked: list[int] | None = None) -> int:
    """Host bytes above the stored model while the engine packs the streamed units in order.

    `units` holds (packed bytes, stored bytes) per unit. Packing unit i adds its buffer while its
    originals still exist; each unit packed before it holds its packed size instead of its stored
    size (the difference is the 512-byte alignment of every tensor). A unit on disk (`disk`, the
    disk tier) is written out and its buffer freed before the next is packed: it then holds
    nothing, its originals freed too. `parked` (loaded straight to disk): per unit, the bytes of
    its originals that are in the loading file, not in the stored model the caller counts; packing
    reads them back beside the unit's buffer.
    """
    extra = peak = 0
    for i, (packed, stored) in enumerate(units):
        back = parked[i] if parked else 0
        peak = max(peak, extra + packed + back)
        extra += -(stored - back) if disk and disk[i] else packed - stored
    return peak


def offloaded_inputs(workload: Workload, profiles: dict[tuple[int, int], ActivationProfile], kinds: list[str]) -> int:
    """Host bytes of the block inputs activation offload keeps, at the largest bucket.

    Each block's input is two tensors (image and text streams; a stream of no tokens is none),
    stacked in the offloader's host slabs (memory/host_buffers.HostSlabs: each input's bytes
    aligned to 512, the stack rounded up to whole 64 MiB slabs, no power-of-two rounding per input),
    all alive at the end of the forward: `offload_host_bytes` of their sizes. `kinds`: the blocks
    whose inputs move (without the `frozen_lead` ones).
    """
    largest = 0
    for bucket in workload.buckets:
        prof = profiles[bucket]
        img = workload.image_tokens(bucket) / prof.tokens
        sizes = [n for k in kinds for n in (int(prof.kinds[k].out * img), int(prof.kinds[k].out * (1 - img)))]
        largest = max(largest, offload_host_bytes(sizes))
    return largest


def frozen_lead(mode: str, blocks: list[str], adapters: list[str]) -> int:
    """How many blocks, first in execution order, take inputs that need no gradient, so activation
    offload moves none of them (checkpointing.ActivationOffloader.offloads: only inputs that require
    a gradient go to the host): in a LoRA run whose adapters all sit in blocks (`adapters`: their
    base modules' names), every block up to and including the first with an adapter gets the
    frozen embedders' outputs. 0 for a full fine-tune (the embedders train) or an adapter outside
    the blocks (it may be upstream of them)."""
    if mode != "lora" or not adapters:
        return 0
    owner = []
    for a in adapters:
        hit = [i for i, b in enumerate(blocks) if a.startswith(b + ".")]
        if not hit:
            return 0
        owner.append(hit[0])
    return min(owner) + 1


def host_breakdown(plan: Plan, packed: list[int], unit_stored: list[int], loaded: int, stored: int,
                   largest_conversion: int, offload: int, cache_bytes: int,
                   full: dict[str, int] | None = None, host_step: dict[str, int] | None = None,
                   quantizing_load: bool = False, preview_base: int = 0, ema: int = 0,
                   disk: list[bool] | None = None, phases: dict | None = None,
                   parked: list[tuple[int, int]] | None = None) -> dict[str, int]:
    """Host RAM components of a plan (bytes) and their "peak".

    `packed` and `unit_stored` are the streamed units' packed and stored bytes in the engine's
    packing order; `loaded` the transformer as loaded, `stored` as the plan stores it (fp8 or not),
    `largest_conversion` the largest weight fp8 storage converts (0 without fp8), `offload` the
    offloaded inputs' pinned bytes. The phase totals (loading, converting, packing) and the steady
    components are listed; "peak" is the baseline plus the largest phase. `host_step` (a full
    fine-tune whose streamed blocks step on the host) gives their optimizer "state", the host
    step's transient ("step") and the CUDA gradient "staging" (module docstring). `quantizing_load`:
    the loader stores fp8 as it reads (module docstring), so a plan with fp8 loads `stored` plus
    the workers' buffers and converts nothing afterwards. `preview_base`: the bytes of another base
    loaded beside the steps' holdings for each preview (0: none). `ema`: [ema]'s fp32 shadow of the
    trained adapter (train/ema.py), held on the host through the steps. `disk` (the disk tier):
    per unit, whether its bytes live on disk (Plan.disk_blocks): no host buffer through the steps,
    freed as soon as it is written while packing, and the staging pool the engine reads them
    through. `phases`, if given, receives the phase totals ("steps": what the host holds through
    the steps), which the planner's disk split reads. `parked` (the disk-tier blocks loaded straight
    to disk, memory/disk_load.py): per streamed unit, its bytes (as loaded, as stored) when it is
    parked, (0, 0) when not: the load holds the rest and the largest parked block (module docstring).
    """
    quantized_as_read = quantizing_load and plan.fp8 and stored < loaded
    parked = parked if parked and any(l for l, _ in parked) else None
    if parked:
        # what the loader holds of the parked blocks: none, beside the one being filled
        out_ld, out_st = sum(l for l, _ in parked), sum(s for _, s in parked)
        window = max(s for _, s in parked) if quantized_as_read else max(l for l, _ in parked)
        converting_parked = out_st            # fp8 storage converting them after the load: the copies in RAM
    if quantized_as_read:
        loaded = stored + QUANTIZING_WORK_BYTES
        if parked:
            loaded += window - out_st
            stored -= out_st                  # packing finds them in the loading file
    elif parked:
        loaded += window - out_ld
        if not (plan.fp8 or plan.fp8_modulation):
            stored -= out_st
    state = full["optimizer state"] if full else 0
    masters = full["master weights"] if full else 0
    accumulators = full["gradient accumulators"] if full else 0
    setup = loaded + state + masters if full else 0
    converting = (loaded + state + masters + largest_conversion
                  + (converting_parked - window if parked else 0)
                  if (plan.fp8 or plan.fp8_modulation) and not quantized_as_read else 0)
    reads_back = parked and (quantized_as_read or not (plan.fp8 or plan.fp8_modulation))
    packing = stored + state + masters + packing_extra(list(zip(packed, unit_stored)), disk,
                                                       [s for _, s in parked] if reads_back else None)
    on_disk = disk is not None and any(disk)
    streamed = sum(n for i, n in enumerate(packed) if not (on_disk and disk[i]))
    staging = STAGING_BUFFERS * STAGING_CHUNK if packed and (not plan.pin_memory or on_disk) else 0
    steady = streamed + staging + offload + cache_bytes + masters + accumulators + ema
    if host_step:
        steady += host_step["state"] + host_step["step"] + host_step["staging"]
    out = {"process baseline": HOST_BASELINE, "transformer while loading": loaded}
    if full:
        out["transformer + optimizer state + masters at set-up"] = setup
    out.update({"transformer while converting to fp8": converting,
                "stored transformer + one unit while packing": packing,
                f"streamed blocks ({'pinned' if plan.pin_memory else 'pageable'})": streamed,
                "staging buffers": staging, "offloaded activations": offload, "caches": cache_bytes})
    if ema:
        out["EMA of the adapter (fp32)"] = ema
    if full:
        out["fp32 master weights"] = masters
        out["fp32 gradient accumulators"] = accumulators
    if host_step:
        out["optimizer state of streamed blocks (host)"] = host_step["state"]
        out["optimizer step on the host (one tensor)"] = host_step["step"]
        out["gradient staging (pinned)"] = host_step["staging"]
    previewing = steady + preview_base if preview_base else 0
    if preview_base:
        out["another base for previews"] = preview_base
        out["steps + another base while previewing"] = previewing
    out["peak"] = HOST_BASELINE + max(loaded, setup, converting, packing, steady, previewing)
    if phases is not None:
        phases.update(loading=loaded, setup=setup, converting=converting, packing=packing, steps=steady,
                      previewing=previewing, streamed=streamed)
    return out
