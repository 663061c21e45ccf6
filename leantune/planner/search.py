"""The plan search: the fastest plan whose predicted peak fits the budget, monotone in the budget.

Other trainers answer "will it fit?" with fixed tiers (a table of `blocks_to_swap` values per card
size) that users then run out of memory with. Here every candidate is priced by the memory model
(memory_model.py) and the fastest one whose peak plus a safety margin is under the budget wins,
with two rules that keep the answers sensible from one budget to the next:

- fp8 storage costs accuracy, so it is priced: a plan that converts weights to fp8 must be at least
  `FP8_MIN_GAIN` faster than the best plan without it (or be the only kind that fits). Without
  this, at 512 px every budget up to 24 GiB chose fp8 for a few percent: a 512 px block computes in
  a quarter of a 1024 px block's time, so bf16 copies hide less and halving them always looked
  faster. It still wins where it buys real time (a tight budget at 512 px).
- More budget never streams more. Dropping checkpointing saves a third of the compute but needs
  room for activations, which a budget can buy by streaming more blocks: with the fastest plan
  alone, 16 GiB streamed 12 blocks at 512 px and 24 GiB streamed 37. That trades a certain cost
  for the least certain part of the prediction (copies hidden at an assumed PCIe rate), and it asks
  a user who adds VRAM for more pinned host RAM. So the plan for a budget is found by a sweep over
  the fitting plans in the order of the budget they need. For each storage (bf16, fp8) a plan
  replaces the one chosen so far only if it is faster and streams no more parameters and no more
  bytes per step; fp8 is used until the best bf16 plan is at least as good as the best fp8 one
  (fp8 priced as above), and from that budget on it stays off. The answer is a function of the
  budget alone. Along growing budgets fp8 only turns off, and while it stays the same the step
  time, the streamed parameters and the streamed bytes only go down. Where more budget turns fp8
  off, the bf16 plan may stream more than the fp8 plan below it did: that budget buys accuracy
  first.

- fp8 for the modulation Linears (Plan.fp8_modulation) costs more accuracy than the rest of fp8
  (their output scales and shifts every activation of a block), so it is not priced but held back:
  under `Workload.fp8_modulation = None` ("auto") it is used only when no plan without it fits the
  VRAM and host-RAM budgets. Along growing budgets it therefore only turns off, once.

A full fine-tune is searched the same way (memory_model.py prices its streamed units with their
optimizer state and their write-back); fp8 is a candidate there only for the frozen block Linears
of a run that freezes some ([full] exclude).

- The optimizer step of streamed blocks on the host (Plan.optimizer_on_host, full_model.py): their
  state never crosses PCIe, so the slots carry weights only and fp32 AdamW fits budgets the device
  step cannot (Flux-dev at 8 GiB); but the CPU steps slower than the GPU. Under
  `Workload.streamed_step` ([full] streamed_step) "device" no plan steps on the host; under "host"
  every plan that streams does (a plan that streams nothing steps on the device: nothing to move);
  under "auto" every streaming plan is tried both ways, the sweep below runs over the fitting
  device-step plans and over the fitting host-step plans apart, and the faster of the two results
  is the plan (after fp8 modulation's own rule: accuracy before speed); at equal predicted step
  time (to the microsecond) the device step is kept. The host step changes no numerics beyond the
  host kernels' stated tolerances, so speed alone decides: with the host kernels a fast CPU can
  step the streamed blocks sooner than PCIe brings their state in and out. The host step is priced
  at the CPU rate measured on the planning machine (full_model.host_step_rate), so the choice is
  that machine's: plan on the machine that trains (or set "device" / "host"). Along growing
  budgets the step's place changes where the other place's best plan becomes the faster one.
  bitsandbytes' 8-bit AdamW keeps its state on the device: never on the host.

- A LoRA's optimizer step on the host (Plan.optimizer_on_host in a LoRA plan, [lora] optimizer_step,
  train/lora_host_step.py): the adapters' optimizer state and update leave the GPU, and each step
  waits for the gradients' copy down, the CPU's step and the adapters' copy up. Not tied to
  streaming: every candidate, streaming or not, is tried at each place `step_places` gives
  ("auto": both, for adamw and adafactor; "device" / "host": that one), and the faster of the two
  places' sweeps is the plan as for a full fine-tune, so "auto" takes the host only where no
  device-step plan fits or where it is at least LORA_HOST_MIN_GAIN (5 %) faster. The plan's notes say why
  (`lora_step`: the device step's smallest budget, or its step time). A trainer that built its
  optimizer at one place keeps it there for re-plans (`keep_step_place`).

Candidates: every combination of storage (fp8 and fp8 modulation where accuracy allows), checkpointing none/blocks/offload,
the number of streamed blocks (block kinds with the most FLOPs per byte first: for Flux the single
blocks, spread evenly through their list), ring slots 2-4, and streaming the non-block group when
every block streams. Streamed units are always pinned: the engine pins exactly their size, so a
pageable unit would save no host RAM and only add the staging pool and slower copies (the memory
model still prices pageable plans given explicitly in [memory]).

- The disk tier (Machine.disk_read, a LoRA or inference run with [memory] disk_dir): a candidate
  whose host RAM is over the budget gets the streamed blocks beyond it on disk (`to_disk`), the
  engine's own rule (memory/disk_tier.disk_split), and is priced with their reads. Under such a
  budget the step times are no longer smooth in the VRAM budget (a read from disk costs far more
  than a copy from RAM, and how many blocks go there depends on what the rest of the plan holds),
  so the storage sweep above, which turns fp8 off for good at the first budget where bf16 is as
  good, would keep a bf16 plan reading twice the bytes from disk: where any fitting plan reads
  from disk, each storage is swept on its own and the faster result (fp8 priced as above) is the
  plan. A plan reads from disk only where its host RAM is over the budget without it.

- The base format ([memory] base_format = "auto", base_formats.py): a plan that quantizes the
  block Linears (Plan.fp8) stores them in one of the workload's formats (Plan.base_format: fp8
  e4m3, int8 ConvRot, NF4), each priced at its stored bytes, its dequantization and its
  temporaries; every format is one more storage in the candidates. The sweep keeps one current
  plan per format and the fastest of them stands for the quantized storage (so an NF4 base that
  fits resident replaces an fp8 base that streams where it is faster, and fp8 replaces NF4 at a
  budget where it fits as well); FP8_MIN_GAIN prices every format alike. Only formats whose
  measured error against bf16 is within Workload.max_base_error are chosen; the others are priced
  for the report (notes["base_format"]: each format's best plan and time). A pinned format is
  every plan's. Once the trainer has loaded an int8 / NF4 base, its planner keeps that format
  (keep_base_format): a re-plan cannot turn the rows back into bf16.

- Split blocks (Plan.split_blocks, memory/split_parts.py), for a family that has them
  (ModelFamily.split_blocks): each block keeps its parts' inputs only and recomputes each part in
  its own backward, so a step holds less (Qwen-Image-2.1 at 1024² with 3 references: 7.9 -> 4.2 GiB
  of activations, predicted) and computes one more forward of each block. A candidate only with
  checkpointing "blocks" / "offload" (the parts are recomputed inside the block's checkpoint),
  priced from the probe of the split blocks: their activations, and the parts' recompute in the
  backward's FLOPs (timing.py). The fitting plans are swept apart, unsplit and split, and the
  faster of the two results is the plan (the unsplit one at equal predicted time): so a split plan
  is chosen only where no unsplit plan fits or where it is faster (where streaming fewer blocks
  buys more than the extra forward costs). Swept together, the split plans (which fit the
  smallest budgets) would keep every larger budget: "more budget never streams more" stopped the
  faster unsplit plans that stream more (Qwen-Image-2.1, 1 reference, 8 GiB: 9.3 s split against
  7.2 s unsplit, predicted). Along growing budgets a split plan gives way to the unsplit one
  where that becomes the faster.

When nothing fits, `InfeasibleBudget` says the smallest budget that works and which keys of the run
(training config or sample request) to change.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from ..memory.disk_tier import disk_split
from ..memory.engine import even_spread
from .base_formats import FORMATS, ORDER as BASE_ORDER, bound as error_bound, within
from .host_model import HOST_BASELINE
from .memory_model import Estimate, MemoryModel
from ..memory.plan import Plan
from .weight_bytes import ModelWeights, ModuleWeights
from .workload import Budget, InfeasibleBudget, gib

CHECKPOINTING = ("none", "blocks", "offload")
RING_CHOICES = (2, 3, 4)
# fp8 storage must make a step at least this much faster than the best plan without it.
FP8_MIN_GAIN = 0.10
# A LoRA's host step replaces a fitting device-step plan only when at least this much faster (search
# docstring): the CPU step's rate is timed on the planning machine, and noise must not flip the plan.
LORA_HOST_MIN_GAIN = 0.05


class Planner(MemoryModel):
    """The memory model of one (model, workload, machine) and the search over its plans.

    Construction measures the weights and runs the meta probes once per bucket (about a second
    each at full Flux size); `plan(budget)` then searches in well under a second, so re-planning
    after an OOM or a calibration is cheap.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.order = self._streaming_order()
        self._peaks: dict = {}
        self._times: dict = {}
        self._moved: dict = {}
        self._prefs: dict = {}
        self._disk_plans: dict = {}
        # What depends on the model and workload alone, built once (a budget sweep plans hundreds of
        # times), here rather than in the first plan(): a plan's host-RAM limit reads this process's
        # resident set, which building them would grow.
        self._sets: dict[int, tuple[int, ...]] = {}
        self._candidates: dict[tuple[bool, ...], tuple[Plan, ...]] = {}
        self.candidates()

    def forget_estimates(self) -> None:
        """Drop cached peaks and times: the calibration changed, so every plan is priced again."""
        self._peaks.clear()
        self._times.clear()
        self._moved.clear()
        self._prefs.clear()
        self._disk_plans.clear()

    def _streaming_order(self) -> list[str]:
        """Block kinds in the order they start streaming: most forward FLOPs per byte first (their
        copies hide best behind their own compute; for Flux, single blocks move ~2.4x fewer bytes
        per FLOP than double blocks)."""
        prof = self.profiles[(False, False)][self.workload.buckets[0]]
        by_kind: dict[str, list[ModuleWeights]] = {}
        for b in self.weights.blocks:
            by_kind.setdefault(b.kind, []).append(b)

        def intensity(kind: str) -> float:
            nbytes = sum(b.bytes(self.dtype_bytes) for b in by_kind[kind]) / len(by_kind[kind])
            return prof.kinds[kind].fwd_flops / max(nbytes, 1)

        return sorted(by_kind, key=intensity, reverse=True)

    def streamed_set(self, n: int) -> list[int]:
        """Block indices (execution order) of the n blocks to stream: kinds in streaming order, each
        kind's share spread evenly through its list so resident blocks sit between streamed ones."""
        if n not in self._sets:
            chosen: list[int] = []
            for kind in self.order:
                idx = [i for i, k in enumerate(self.kinds) if k == kind]
                take = min(n - len(chosen), len(idx))
                chosen.extend(even_spread(idx, take))
            self._sets[n] = tuple(sorted(chosen))
        return list(self._sets[n])

    # -- the search ---------------------------------------------------------------------------------
    def step_places(self) -> tuple[bool, ...]:
        """Plan.optimizer_on_host values a streaming plan is tried with (module docstring)."""
        w = self.workload
        if w.mode == "lora":
            from ..config import LORA_HOST_STEP_OPTIMIZERS

            if getattr(self, "_step_place", None) is not None:     # keep_step_place
                return (self._step_place,)
            if w.optimizer not in LORA_HOST_STEP_OPTIMIZERS or w.lora_step == "device":
                return (False,)
            return (True,) if w.lora_step == "host" else (False, True)
        if w.mode != "full" or w.optimizer == "adamw8bit" or w.streamed_step == "device":
            return (False,)
        return (True,) if w.streamed_step == "host" else (False, True)

    def keep_step_place(self, plan: Plan) -> None:
        """A LoRA run's optimizer is built where `plan` steps it: later plans (an OOM's or a
        calibration's re-plan) step there too."""
        if self.workload.mode == "lora":
            self._step_place = bool(plan.optimizer_on_host)
            self._candidates.clear()
            self.forget_estimates()

    def candidates(self, places: tuple[bool, ...] | None = None):
        places = tuple(places or self.step_places())
        if places not in self._candidates:           # the same plans every time: built once per planner
            self._candidates[places] = tuple(self._candidate_plans(places))
        return iter(self._candidates[places])

    def _candidate_plans(self, places: tuple[bool, ...]):
        w = self.workload
        n_blocks = len(self.weights.blocks)
        ckpts = ("none",) if w.mode == "inference" else CHECKPOINTING
        counts = range(n_blocks + 1)
        unstreamed = places if w.mode == "lora" else (False,)      # a LoRA's host step needs no streaming
        names_of = [tuple(self.weights.blocks[i].name for i in self.streamed_set(n)) for n in counts]
        storages = [(fp8, mod, fmt) for fp8, mod in self.storages
                    for fmt in (self.formats if fp8 else ("fp8",))]     # the quantized block Linears in each format
        for fp8, mod, fmt in storages:
            for ckpt, split in [(c, sp) for c in ckpts for sp in self._split_choices(c)]:
                for n in counts:
                    names = names_of[n]
                    if n == 0:
                        for on_host in unstreamed:
                            yield Plan(streamed_blocks=(), fp8=fp8, fp8_modulation=mod, checkpointing=ckpt,
                                       base_format=fmt, split_blocks=split, optimizer_on_host=on_host)
                        continue
                    for nb in ((False, True) if n == n_blocks else (False,)):
                        units = n + int(nb)
                        for k in RING_CHOICES:
                            if k > max(2, units):
                                continue
                            for on_host in places:
                                yield Plan(streamed_blocks=names, stream_non_blocks=nb, fp8=fp8, fp8_modulation=mod,
                                           checkpointing=ckpt, ring_slots=k, pin_memory=True,
                                           optimizer_on_host=on_host, base_format=fmt, split_blocks=split)

    def _split_choices(self, checkpointing: str) -> tuple[bool, ...]:
        """Split or not, for candidates of this checkpointing: both where the model has split blocks
        and its blocks are checkpointed, unless the workload pins one ([memory] split_blocks)."""
        pinned = self.workload.split_blocks
        if pinned and not self.splits:
            raise ValueError("[memory] split_blocks = true: this model's family has no split blocks "
                             "(Flux, Wan and Qwen-Image-2.1 have them); remove the key")
        both = (False, True) if self.splits and checkpointing != "none" else (False,)
        return both if pinned is None else tuple(s for s in both if s == pinned)

    def plan(self, budget: Budget) -> Plan:
        """The plan for `budget` (VRAM and host RAM): the sweep described in the module docstring
        over every candidate whose predicted peak plus the margin fits."""
        ram_limit = budget.ram_limit(self.machine)
        usable = budget.usable_vram
        fits: list[tuple[int, Plan]] = []
        smallest_vram = None                       # over plans that fit host RAM
        for plan in self.candidates():
            vram, host = self._cheap_estimate(plan)
            if host > ram_limit:
                plan = self.to_disk(plan, ram_limit)      # the disk tier, where it can bring the host under
                if plan is None:
                    continue
                vram, host = self._cheap_estimate(plan)
            if smallest_vram is None or vram < smallest_vram[0]:
                smallest_vram = (vram, plan)
            if vram <= usable:
                fits.append((vram, plan))
        if not fits:
            raise self._infeasible(budget, ram_limit, smallest_vram)
        fits, priced = self._within_bound(fits, budget)      # base formats: only those within the error bound
        if self.workload.fp8_modulation is None:          # "auto": fp8 modulation only when needed
            # (after the bound: a format over it that fits without fp8 modulation must not rule out
            # the fp8 plans that need it, SD3.5 Medium at 1.2 GiB with NF4 priced cheaper)
            fits = [vp for vp in fits if not vp[1].fp8_modulation] or fits
            priced = [vp for vp in priced if not vp[1].fp8_modulation] or priced
        # split blocks: the faster of the unsplit plans' choice and the split plans' (the unsplit at a tie)
        picks = [self._choose(group) for group in ([vp for vp in fits if vp[1].split_blocks == split]
                                                   for split in (False, True)) if group]
        best = min(picks, key=lambda p: (self._preference(p)[0], p.split_blocks))
        plan = self._annotate(best, self.estimate(best), budget, ram_limit)
        if best.split_blocks:
            plan = replace(plan, notes={**plan.notes, "split_blocks": self._split_note(picks, budget, ram_limit)})
        if self.workload.mode == "lora" and len(self.step_places()) > 1 and best.optimizer_on_host:
            # (only then: a device-step plan's notes do not depend on the CPU rate timed here)
            plan = replace(plan, notes={**plan.notes, "lora_step": self._lora_step_note(best, fits, budget, ram_limit)})
        return self._with_base_choice(plan, priced)

    def _lora_step_note(self, best: Plan, fits: list[tuple[int, Plan]], budget: Budget, ram_limit: int) -> dict:
        """Why "auto" steps a LoRA on the host, for `leantune plan`: the best device-step plan and
        its step time where one fits, else the smallest budget a device-step plan needs."""
        other = not best.optimizer_on_host
        group = [vp for vp in fits if vp[1].optimizer_on_host == other]
        note = {"on_host": bool(best.optimizer_on_host)}
        if group:
            alt = self._choose_place(group)
            note.update(other_step_s=self._timed(alt).step_s, other_plan=alt.describe())
        else:
            peaks = [v for v, h in (self._cheap_estimate(c) for c in self.candidates((other,))) if h <= ram_limit]
            note["other_needs_vram"] = budget.needed_for(min(peaks)) if peaks else None
        return note

    def _choose_place(self, fits: list[tuple[int, Plan]]) -> Plan:
        """The sweep's plan among fits of one step place (split and unsplit as `plan` takes them)."""
        picks = [self._sweep(g) for g in ([vp for vp in fits if vp[1].split_blocks == s] for s in (False, True)) if g]
        picks = [p for p in picks if p is not None]
        return min(picks, key=lambda p: (self._preference(p)[0], p.split_blocks))

    def _split_note(self, picks: list[Plan], budget: Budget, ram_limit: int) -> dict:
        """Why a split plan was chosen, for `leantune plan`: the unsplit plan's step time where one
        fits (the split one is faster), else the smallest VRAM budget an unsplit plan fits."""
        if self.workload.split_blocks:
            return {"pinned": True}
        unsplit = next((p for p in picks if not p.split_blocks), None)
        if unsplit is not None:
            return {"unsplit_step_s": self._timed(unsplit).step_s, "unsplit_plan": unsplit.describe()}
        peaks = [v for v, h in (self._cheap_estimate(c) for c in self.candidates() if not c.split_blocks)
                 if h <= ram_limit]
        return {"unsplit_needs_vram": budget.needed_for(min(peaks)) if peaks else None}

    def _choose(self, fits: list[tuple[int, Plan]]) -> Plan:
        """The plan among `fits` (not empty): the sweep, or with the disk tier or both step places
        the faster of the sweeps apart (module docstring)."""
        if any(p.disk_blocks for _, p in fits):   # the disk tier: the faster of each storage's sweep
            picks = [self._sweep([vp for vp in fits if vp[1].fp8 == fp8]) for fp8 in (False, True)]
            return min((p for p in picks if p is not None), key=self._preference)
        if len(self.step_places()) > 1:       # "auto": the faster of the best plan of each step place
            picks = [self._sweep([vp for vp in fits if vp[1].optimizer_on_host == on_host]) for on_host in (False, True)]
            if self.workload.mode == "lora" and all(p is not None for p in picks):
                # a LoRA's host step must be clearly faster: its CPU time is timed here, and a
                # device plan within the timing's noise is kept (the plan stays a function of the budget)
                device, host = (self._preference(p)[0] for p in picks)
                return picks[1] if host * (1.0 + LORA_HOST_MIN_GAIN) < device else picks[0]
            return min((p for p in picks if p is not None), key=lambda p: (self._preference(p)[0], p.optimizer_on_host))
        return self._sweep(fits)

    def to_disk(self, plan: Plan, ram_limit: int) -> Plan | None:
        """`plan` with the streamed blocks its host RAM cannot hold under `ram_limit` on the disk
        tier, or None: no disk tier (Machine.disk_read), a full fine-tune, nothing streamed, or
        a phase the disk does not lower (the load) over the limit even with every streamed block
        on disk. Which blocks: memory/disk_tier.disk_split over the streamed blocks' packed bytes
        in the engine's order, with the room the steps leave them (the limit less the baseline and
        whatever else the host holds through the steps), the rule the engine applies itself."""
        if self.machine.disk_read is None or self.workload.mode == "full" or not plan.streamed_blocks:
            return None
        key = (_plan_key(plan), ram_limit)
        if key not in self._disk_plans:
            self._disk_plans[key] = self._disk_split(plan, ram_limit)
        return self._disk_plans[key]

    def _disk_split(self, plan: Plan, ram_limit: int) -> Plan | None:
        names = [self.weights.blocks[i].name for i in self.ordered(plan)]
        phases: dict = {}
        if self.host(replace(plan, disk_blocks=tuple(names)), phases)["peak"] > ram_limit:
            return None
        blocks = self.units(plan)[int(plan.stream_non_blocks):]
        room = ram_limit - HOST_BASELINE - phases["steps"]          # the steps' holdings with no block in RAM
        for _ in range(4):        # a load into the tiers can peak above the steps: less room, until it fits
            split = replace(plan, disk_blocks=disk_split(list(zip(names, blocks)), room))
            over = self._cheap_estimate(split)[1] - ram_limit
            if not split.disk_blocks or over <= 0 or len(split.disk_blocks) == len(names):
                break
            room -= over
        return split if split.disk_blocks and over <= 0 else None

    def _sweep(self, fits: list[tuple[int, Plan]]) -> Plan | None:
        """The plan the sweep over `fits` ((peak VRAM, plan) that fit) ends with (module docstring);
        None when nothing fits."""
        fits = sorted(fits, key=lambda vp: (vp[0], _shape(vp[1])))
        # per storage: bf16 (False), and each base format the block Linears are quantized in
        current: dict = {False: None}
        without_fp8 = False        # once the best bf16 plan beats the best fp8 one, fp8 stays off
        quantized = None           # the best of the quantized formats' current plans
        for _, plan in fits:
            key = plan.fp8 and plan.base_format
            cur = current.get(key)
            if cur is None or self._replaces(plan, cur):
                current[key] = plan
                quantized = min((p for k, p in current.items() if k), key=self._preference, default=None)
            if current[False] is not None and (quantized is None or
                                               self._preference(current[False]) <= self._preference(quantized)):
                without_fp8 = True
        return current[False] if without_fp8 else quantized

    def _replaces(self, plan: Plan, current: Plan) -> bool:
        """Whether `plan` (same storage as `current`, fitting a larger budget) is chosen over it
        there: faster, and streaming no more parameters and no more bytes."""
        if any(a > b for a, b in zip(self._streamed(plan), self._streamed(current))):
            return False
        return self._preference(plan) < self._preference(current)

    def _preference(self, plan: Plan) -> tuple:
        """Smaller is better: the step time, fp8 priced at FP8_MIN_GAIN, compared to the
        microsecond (plans whose copies are fully hidden tie), then the simpler plan: no fp8, less
        checkpointing, fewer streamed blocks, the smaller ring."""
        key = _plan_key(plan)
        if key not in self._prefs:
            t = self._timed(plan).step_s * (1.0 + FP8_MIN_GAIN if plan.fp8 else 1.0)
            self._prefs[key] = (round(t, 6), *_shape(plan))
        return self._prefs[key]

    def _streamed(self, plan: Plan) -> tuple[int, int]:
        """(streamed parameters, host->GPU bytes) per step: what more budget must never increase."""
        key = _plan_key(plan)
        if key not in self._moved:
            units = self.unit_weights(plan)
            params = sum(u.numel for u in units)
            self._moved[key] = (params, self._timed(plan).h2d_bytes)
        return self._moved[key]

    def _timed(self, plan: Plan):
        """The plan's step time, simulated once per plan (mean over the buckets)."""
        key = _plan_key(plan)
        if key not in self._times:
            units = self.units(plan)
            per = [self.timing(plan, b, units) for b in self.workload.buckets]
            n = len(per)
            self._times[key] = _Timed(sum(t.step_s for t in per) / n, int(sum(t.h2d_bytes for t in per) / n))
        return self._times[key]

    def _cheap_estimate(self, plan: Plan) -> tuple[int, int]:
        """(peak VRAM, peak host) without the timing simulation: the search filters with it."""
        key = _plan_key(plan)
        if key not in self._peaks:
            vram, host, _ = self.memory(plan)
            self._peaks[key] = (sum(vram.values()), host["peak"])
        return self._peaks[key]

    def _infeasible(self, budget: Budget, ram_limit: int, smallest_vram) -> InfeasibleBudget:
        w = self.workload
        if smallest_vram is None:   # not even the most host-frugal plan fits host RAM
            disk = self.machine.disk_read is not None and w.mode == "lora"
            pool = [replace(c, disk_blocks=c.streamed_blocks) if disk and c.streamed_blocks else c
                    for c in self.candidates()]           # with the disk tier: every streamed block on disk
            frugal = min(pool, key=lambda p: self._cheap_estimate(p)[1])
            need = self._cheap_estimate(frugal)[1]
            est = self.estimate(frugal)
            disk = bool(frugal.disk_blocks)
            loading = est.host["transformer while loading"]
            return InfeasibleBudget(
                f"no memory plan fits host RAM: the smallest needs {gib(need)} (loading the transformer "
                f"alone takes {gib(loading + HOST_BASELINE)}"
                + (" with every streamed block loaded straight to the disk tier" if disk else "")
                + f"), but ram_budget is "
                f"{gib(ram_limit)}. Raise [memory] ram_budget or free host memory; a checkpoint stored in fp8 "
                f"(e4m3) loads its blocks in half the RAM" + _disk_hint(w.mode, self.machine.disk_read is not None)
                + ".", needed_ram=need, best=frugal)
        peak, plan = smallest_vram
        est = self.estimate(plan)
        need = budget.needed_for(peak)
        parts = est.vram
        act = parts["activations"]
        train = parts["adapters"] + parts["gradients"] + parts["optimizer states"]
        levers = []
        if act:
            levers.append(_activation_lever(w, act))
        if train and w.mode == "lora":
            levers.append(f"adapters, gradients and optimizer states take {gib(train)}: lower [lora] rank or "
                          f"narrow [lora] targets, or use [train] optimizer = \"adafactor\"")
            host_need = self._lora_host_need(budget, ram_limit)
            if host_need is not None:
                levers.append(f"[lora] optimizer_step = \"host\" (or \"auto\") keeps the optimizer state in host RAM "
                              f"and steps the adapters on the CPU: its smallest budget is {gib(host_need)}")
        if w.mode == "full":
            levers.extend(_full_levers(w, parts, self._host_step_need(budget, ram_limit), plan.optimizer_on_host))
        if parts["weights resident"]:
            levers.append(f"weights that cannot stream take {gib(parts['weights resident'])}")
        if w.mode == "inference":
            levers.append("or give the sampler a larger budget (--vram, or [memory] vram_budget in the request)")
        message = (f"no memory plan fits a VRAM budget of {gib(budget.vram)} (usable {gib(budget.usable_vram)} after "
                   f"a {gib(budget.margin_bytes)} safety margin) for {w.describe()}. The smallest budget that works "
                   f"is {gib(need)}, with: {plan.describe()} (predicted peak {gib(peak)}). To fit "
                   f"{gib(budget.vram)}: " + "; ".join(levers) + ".")
        return InfeasibleBudget(message, needed_vram=need, best=plan)

    def _lora_host_need(self, budget: Budget, ram_limit: int) -> int | None:
        """The smallest VRAM budget of a LoRA host-step plan, when the search did not try them
        ([lora] optimizer_step = "device"); None otherwise."""
        from ..config import LORA_HOST_STEP_OPTIMIZERS

        w = self.workload
        if w.optimizer not in LORA_HOST_STEP_OPTIMIZERS or self.step_places() != (False,):
            return None
        peaks = [vram for vram, host in map(self._cheap_estimate, self.candidates((True,))) if host <= ram_limit]
        return budget.needed_for(min(peaks)) if peaks else None

    def _host_step_need(self, budget: Budget, ram_limit: int) -> int | None:
        """The smallest VRAM budget a host-step plan fits (within the host-RAM limit), when the
        search did not try them ([full] streamed_step = "device"); None otherwise."""
        w = self.workload
        if w.mode != "full" or w.optimizer == "adamw8bit" or w.streamed_step != "device":
            return None
        peaks = [vram for vram, host in map(self._cheap_estimate, self.candidates((True,))) if host <= ram_limit]
        return budget.needed_for(min(peaks)) if peaks else None

    def _annotate(self, plan: Plan, est: Estimate, budget: Budget, ram_limit: int) -> Plan:
        notes = {
            "predicted_peak_vram": est.peak_vram,
            "predicted_peak_host": est.peak_host,
            "vram_breakdown": dict(est.vram),
            "host_breakdown": dict(est.host),
            "predicted_step_s": est.step_s,
            "compute_s": est.compute_s,
            "exposed_transfer_s": est.exposed_s,
            "host_step_s": est.host_step_s,
            "overhead_s": est.overhead_s,
            "h2d_bytes_per_step": est.h2d_bytes,
            "d2h_bytes_per_step": est.d2h_bytes,
            "per_bucket": est.per_bucket,
            "budget_vram": budget.vram,
            "margin_vram": budget.margin_bytes,
            "budget_ram": ram_limit,
            "machine": self.machine.describe(),
            "machine_measured": self.machine.measured,
            "machine_assumed_from": None if self.machine.measured else self.machine.assumed_from,
            "workload": self.workload.describe(),
            "streamed_by_kind": _count_kinds(plan.streamed_blocks, self.weights),
            "total_blocks": len(self.weights.blocks),
            "total_by_kind": _count_kinds([b.name for b in self.weights.blocks], self.weights),
            "stored_fp8": self.weights.prequantized,
            "stored_fp8_modulation": self.weights.prequantized_modulation,
            "architecture_key": self.key,
        }
        if self.recipe_forwards():     # DOP's base predictions and [validation]'s passes (timing.py)
            notes["recipe_forwards"] = {"dop": self.workload.dop_share,
                                        "validation": self.workload.validation_forwards_per_step}
        if self.machine.disk_read is not None and self.workload.mode != "full":    # the disk tier is on
            in_ram = self._timed(replace(plan, disk_blocks=())).step_s if plan.disk_blocks else est.step_s
            notes.update(tiers=self.tiers(plan), disk_blocks=len(plan.disk_blocks), disk_read_rate=self.machine.disk_read,
                         disk_bytes_per_step=est.disk_bytes, disk_read_s=est.disk_bytes / self.machine.disk_read,
                         disk_exposed_s=max(0.0, est.step_s - in_ram), step_s_in_ram=in_ram)
        if self.host_step(plan):       # the CPU's share of the step (timing.py), at this machine's rate
            notes["host_step_params"] = sum(n for n, _ in self.streamed_trained(plan))
            notes["host_optimizer_rate"] = self.full.host_rate()
        if self.lora_host_step(plan):  # the adapters' step on the CPU (memory_model._lora_host_time)
            notes["host_step_params"] = self.trainable_bytes()[1] // 4
            notes["host_optimizer_rate"] = self.lora_host_rate()
            notes["lora_host_step"] = True
        return replace(plan, notes=notes)


    # -- the base format ([memory] base_format = "auto", base_formats.py) ----------------------------------
    def _within_bound(self, fits: list[tuple[int, Plan]], budget: Budget) -> tuple[list, list]:
        """(the fitting plans "auto" may choose from, every fitting plan): plans whose base format's
        measured error is over the workload's bound are priced for the report but not chosen. None
        within it fits: InfeasibleBudget, naming the bound and the formats that would fit."""
        w = self.workload
        if w.base_pinned or len(self.formats) == 1 and self.formats[0] == "fp8":
            return fits, fits
        allowed = [vp for vp in fits if not _quantized(vp[1]) or within(vp[1].base_format, w.max_base_error)]
        if not allowed:
            over = sorted({vp[1].base_format for vp in fits}, key=BASE_ORDER.index)
            raise InfeasibleBudget(
                f"no memory plan within the base-format error bound ({error_bound(w.max_base_error):.2f} % against "
                f"bf16, [memory] max_base_error) fits a VRAM budget of {gib(budget.vram)} for {w.describe()}; "
                + ", ".join(f"{FORMATS[f].label} ({FORMATS[f].error:.2f} %)" for f in over)
                + " would fit: raise [memory] max_base_error or pin [memory] base_format.",
                best=min(fits, key=lambda vp: vp[0])[1])
        return allowed, fits

    def best_of_format(self, fits: list[tuple[int, Plan]], fmt: str) -> Plan | None:
        """The sweep's plan among `fits` of one base format ("bf16": the unquantized plans)."""
        same = [vp for vp in fits if (not _quantized(vp[1]) if fmt == "bf16" else
                                      _quantized(vp[1]) and vp[1].base_format == fmt)]
        # unsplit and split plans swept apart, the faster taken, as plan() chooses
        # (each through _choose: a LoRA's or full fine-tune's step places swept apart, as plan() does)
        picks = [p for p in (self._choose(g) for g in ([vp for vp in same if vp[1].split_blocks == split]
                                                       for split in (False, True)) if g) if p is not None]
        return min(picks, key=lambda p: (self._preference(p)[0], p.split_blocks)) if picks else None

    def resident_of_format(self, fits: list[tuple[int, Plan]], fmt: str) -> Plan | None:
        """The fastest plan among `fits` of one quantized base format that streams nothing."""
        same = [p for _, p in fits if _quantized(p) and p.base_format == fmt and not p.streamed_blocks
                and not p.stream_non_blocks and not p.disk_blocks]
        return min(same, key=self._preference) if same else None

    def _with_base_choice(self, plan: Plan, fits: list[tuple[int, Plan]]) -> Plan:
        """`plan` with notes["base_format"]: its format with its measured error against bf16, and
        the best plan of each other format that fits (step time, blocks streamed, error; whether the
        bound let "auto" choose it), so `leantune plan` states what the choice bought and cost."""
        w = self.workload
        if len(self.formats) == 1 and not w.base_pinned:
            return plan
        chosen = plan.base_format if _quantized(plan) else "bf16"
        rows = []
        for fmt in ("bf16", *self.formats):
            best = plan if fmt == chosen else self.best_of_format(fits, fmt)
            if best is None:
                continue
            rows.append({"format": fmt, "step_s": self._timed(best).step_s, "streamed": len(best.streamed_blocks),
                         "split": best.split_blocks, "error": 0.0 if fmt == "bf16" else FORMATS[fmt].error,
                         "allowed": fmt == "bf16" or w.base_pinned or within(fmt, w.max_base_error),
                         "chosen": fmt == chosen, "plan": best.describe()})
            resident = self.resident_of_format(fits, fmt) if fmt != "bf16" and best.streamed_blocks else None
            if resident is not None:      # the format held whole on the device, beside its best plan
                rows[-1]["resident"] = {"step_s": self._timed(resident).step_s, "split": resident.split_blocks,
                                        "plan": resident.describe()}
        notes = {**plan.notes, "base_format": {"chosen": chosen, "pinned": w.base_pinned,
                                                "bound": error_bound(w.max_base_error), "formats": rows}}
        return replace(plan, notes=notes)

    def keep_base_format(self, plan: Plan) -> None:
        """The model is now stored as `plan` stores it: later plans (an OOM's or a calibration's
        re-plan) keep an int8 / NF4 base's format, since its rows cannot turn back into bf16."""
        if not _quantized(plan) or plan.base_format == "fp8":
            return
        self.formats = (plan.base_format,)
        self.storages = [s for s in self.storages if s[0]] or self.storages
        self._candidates.clear()
        self.forget_estimates()


class _Timed(NamedTuple):
    step_s: float
    h2d_bytes: int


def _disk_hint(mode: str, disk_on: bool) -> str:
    """What the disk tier does for a load that does not fit host RAM (memory/disk_load.py)."""
    if mode == "full":
        return ""
    if mode != "lora":
        return "; the disk tier ([memory] disk_dir) lowers what the steps hold, not the sampler's load"
    if disk_on:
        return "; the disk tier's blocks already load straight to disk, one at a time"
    return "; the disk tier ([memory] disk_dir) loads the streamed blocks it holds straight to disk, one at a time"


def _plan_key(plan: Plan) -> tuple:
    return (plan.streamed_blocks, plan.stream_non_blocks, plan.fp8, plan.fp8_modulation, plan.checkpointing,
            plan.ring_slots, plan.pin_memory, plan.optimizer_on_host, plan.disk_blocks, plan.base_format,
            plan.split_blocks)


def _quantized(plan: Plan) -> bool:
    """Whether the plan quantizes the block Linears (in its base format; fp8 modulation alone is not a format)."""
    return plan.fp8


def _shape(plan: Plan) -> tuple:
    """The simpler-plan order: no fp8 (modulation first), less checkpointing, blocks not split, fewer
    streamed blocks, the smaller ring, the optimizer step on the device, fewer blocks on disk."""
    return (plan.fp8_modulation, plan.fp8, BASE_ORDER.index(plan.base_format), CHECKPOINTING.index(plan.checkpointing),
            plan.split_blocks, len(plan.streamed_blocks), plan.stream_non_blocks,
            plan.ring_slots, plan.optimizer_on_host, len(plan.disk_blocks))


def _count_kinds(names, weights: ModelWeights) -> dict[str, int]:
    kinds = {b.name: b.kind for b in weights.blocks}
    out: dict[str, int] = {}
    for n in names:
        out[kinds[n]] = out.get(kinds[n], 0) + 1
    return out


def _full_levers(w, parts: dict[str, int], host_need: int | None = None, on_host: bool = False) -> list[str]:
    """What shrinks a full fine-tune's own terms, in the config's keys. `host_need`: the smallest
    budget of a plan whose streamed blocks step on the host, when the search did not try them;
    `on_host`: the smallest plan's streamed blocks step on the host (its slots carry no state)."""
    out = []
    slots, states = parts["stream slots"], parts["optimizer states"]
    if host_need is not None:
        out.append(f"[full] streamed_step = \"host\" (or \"auto\") keeps the streamed blocks' optimizer state in host "
                   f"RAM and steps them on the CPU (much slower per step): its smallest budget is {gib(host_need)}")
    if slots and on_host:
        out.append(f"the ring slots take {gib(slots)}, each a streamed block's weights (their optimizer state "
                   f"stays in host RAM)")
    elif slots:
        out.append(f"the ring slots take {gib(slots)}, each a streamed block with its optimizer state: "
                   f"[train] optimizer = \"adafactor\" or [full] state_dtype = \"bf16\" makes them smaller")
    if states:
        out.append(f"optimizer state on the GPU takes {gib(states)}" +
                   (" (bitsandbytes keeps 8-bit AdamW state on the GPU for every weight: use \"adamw\" with "
                    "streaming)" if w.optimizer == "adamw8bit" else ""))
    step = parts["gradients"] + parts["optimizer step"]
    if step:
        out.append(f"stepping the weights inside backward adds {gib(step)} to the activations (the gradient and "
                   f"update temporaries of the weight that rises highest, at the moment its gradient completes)")
    out.append("freeze a part with [full] exclude, or train a LoRA instead")
    return out


def _activation_lever(w, act: int) -> str:
    """What shrinks the activations, in the keys of whoever asked: a sample request for inference
    (its TOML keys and `leantune sample` flags), the training config otherwise."""
    sizes = ", ".join(f"{b[1]}x{b[0]}" for b in w.buckets)
    if w.mode == "inference":
        return (f"activations take {gib(act)} at {sizes}, {w.batch_size} image(s) per forward: lower width/height "
                f"(--width/--height), images_per_prompt (--images-per-prompt) or batch_size (images per "
                f"transformer forward), or max_text_length")
    return (f"activations take {gib(act)} at {sizes}, batch {w.batch_size}: lower [data] resolutions or batch_size, "
            f"or max_text_length")
