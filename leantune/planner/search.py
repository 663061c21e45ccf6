"""The plan search: the fastest plan whose predicted peak fits the budget.

Other trainers answer "will it fit?" with fixed tiers (a table of `blocks_to_swap` values per card
size) that users then run out of memory with. Here every candidate is priced by the memory model
(memory_model.py) and the fastest one whose peak plus a safety margin is under the budget wins.

Candidates: every combination of fp8 (where accuracy allows), checkpointing none/blocks/offload,
the number of streamed blocks (block kinds with the most FLOPs per byte first: for Flux the single
blocks, spread evenly through their list), ring slots 2-4, and streaming the non-block group when
every block streams. Streamed units are always pinned: the engine pins exactly their size, so a
pageable unit would save no host RAM and only add the staging pool and slower copies (the memory
model still prices pageable plans given explicitly in [memory]).

The fastest feasible plan wins; exact ties go to the simpler plan. Because the feasible set only
grows with the budget, more budget never gives a slower plan. When nothing fits,
`InfeasibleBudget` says the smallest budget that works and which keys of the run (training config
or sample request) to change.
"""

from __future__ import annotations

from dataclasses import replace

from ..memory.engine import even_spread
from .host_model import HOST_BASELINE
from .memory_model import Estimate, MemoryModel
from ..memory.plan import Plan
from .weight_bytes import ModelWeights, ModuleWeights
from .workload import Budget, InfeasibleBudget, gib

CHECKPOINTING = ("none", "blocks", "offload")
RING_CHOICES = (2, 3, 4)


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

    def forget_estimates(self) -> None:
        """Drop cached peaks: the calibration changed, so every plan is priced again."""
        self._peaks.clear()

    def _streaming_order(self) -> list[str]:
        """Block kinds in the order they start streaming: most forward FLOPs per byte first (their
        copies hide best behind their own compute; for Flux, single blocks move ~2.4x fewer bytes
        per FLOP than double blocks)."""
        prof = self.profiles[False][self.workload.buckets[0]]
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
        chosen: list[int] = []
        for kind in self.order:
            idx = [i for i, k in enumerate(self.kinds) if k == kind]
            take = min(n - len(chosen), len(idx))
            chosen.extend(even_spread(idx, take))
        return sorted(chosen)

    # -- the search ---------------------------------------------------------------------------------
    def candidates(self):
        w = self.workload
        n_blocks = len(self.weights.blocks)
        ckpts = ("none",) if w.mode == "inference" else CHECKPOINTING
        counts = range(n_blocks + 1) if w.mode != "full" else range(1)
        for fp8 in self.fp8_options:
            for ckpt in ckpts:
                for n in counts:
                    names = tuple(self.weights.blocks[i].name for i in self.streamed_set(n))
                    if n == 0:
                        yield Plan(streamed_blocks=(), fp8=fp8, checkpointing=ckpt)
                        continue
                    for nb in ((False, True) if n == n_blocks else (False,)):
                        units = n + int(nb)
                        for k in RING_CHOICES:
                            if k > max(2, units):
                                continue
                            yield Plan(streamed_blocks=names, stream_non_blocks=nb, fp8=fp8, checkpointing=ckpt,
                                       ring_slots=k, pin_memory=True)

    def plan(self, budget: Budget) -> Plan:
        """The fastest plan whose predicted peak plus the margin fits `budget` (VRAM and host RAM).

        Exhaustive over the candidates that fit, so a larger budget (a superset of fitting plans)
        never gives a slower plan. To keep it fast, candidates are grouped by (fp8, checkpointing):
        the group's plan with nothing streamed is a lower bound on every plan of the group (streaming
        only adds copies), and groups whose bound is already slower than the best plan are skipped.
        """
        ram_limit = budget.ram_limit(self.machine)
        groups: dict[tuple[bool, str], list[Plan]] = {}
        smallest_vram = None                       # over plans that fit host RAM
        for plan in self.candidates():
            vram, host = self._cheap_estimate(plan)
            vram_ok, host_ok = vram <= budget.usable_vram, host <= ram_limit
            if host_ok and (smallest_vram is None or vram < smallest_vram[0]):
                smallest_vram = (vram, plan)
            if vram_ok and host_ok:
                groups.setdefault((plan.fp8, plan.checkpointing), []).append(plan)
        if not groups:
            raise self._infeasible(budget, ram_limit, smallest_vram)
        bound = {g: round(self.step_time(Plan(fp8=g[0], checkpointing=g[1])), 6) for g in groups}
        best = best_key = None
        for g in sorted(groups, key=bound.__getitem__):
            if best_key is not None and bound[g] > best_key[0]:
                break
            for plan in groups[g]:
                # Step times are compared to the microsecond: equal-time plans (copies fully hidden)
                # tie, and the tie goes to no fp8, less checkpointing, fewer streamed blocks, the
                # smaller ring.
                key = (round(self.step_time(plan), 6), plan.fp8, CHECKPOINTING.index(plan.checkpointing),
                       len(plan.streamed_blocks), plan.stream_non_blocks, plan.ring_slots)
                if best_key is None or key < best_key:
                    best, best_key = plan, key
        return self._annotate(best, self.estimate(best), budget, ram_limit)

    def _cheap_estimate(self, plan: Plan) -> tuple[int, int]:
        """(peak VRAM, peak host) without the timing simulation: the search prunes with it."""
        key = (plan.streamed_blocks, plan.stream_non_blocks, plan.fp8, plan.checkpointing, plan.ring_slots,
               plan.pin_memory)
        if key not in self._peaks:
            vram, host, _ = self.memory(plan)
            self._peaks[key] = (sum(vram.values()), host["peak"])
        return self._peaks[key]

    def _infeasible(self, budget: Budget, ram_limit: int, smallest_vram) -> InfeasibleBudget:
        w = self.workload
        if smallest_vram is None:   # not even the most host-frugal plan fits host RAM
            frugal = min(self.candidates(), key=lambda p: self._cheap_estimate(p)[1])
            need = self._cheap_estimate(frugal)[1]
            est = self.estimate(frugal)
            return InfeasibleBudget(
                f"no memory plan fits host RAM: the smallest needs {gib(need)} (loading the transformer "
                f"alone takes {gib(est.host['transformer while loading'] + HOST_BASELINE)}), but ram_budget is "
                f"{gib(ram_limit)}. Raise [memory] ram_budget or free host memory; a checkpoint stored in fp8 "
                f"(e4m3) loads its blocks in half the RAM.", needed_ram=need, best=frugal)
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
        if w.mode == "full":
            levers.append(f"a full fine-tune keeps every weight, gradient and optimizer state on the GPU "
                          f"({gib(parts['weights resident'] + train)}); train a LoRA instead")
        if parts["weights resident"] and w.mode != "full":
            levers.append(f"weights that cannot stream take {gib(parts['weights resident'])}")
        if w.mode == "inference":
            levers.append("or give the sampler a larger budget (--vram, or [memory] vram_budget in the request)")
        message = (f"no memory plan fits a VRAM budget of {gib(budget.vram)} (usable {gib(budget.usable_vram)} after "
                   f"a {gib(budget.margin_bytes)} safety margin) for {w.describe()}. The smallest budget that works "
                   f"is {gib(need)}, with: {plan.describe()} (predicted peak {gib(peak)}). To fit "
                   f"{gib(budget.vram)}: " + "; ".join(levers) + ".")
        return InfeasibleBudget(message, needed_vram=need, best=plan)

    def _annotate(self, plan: Plan, est: Estimate, budget: Budget, ram_limit: int) -> Plan:
        notes = {
            "predicted_peak_vram": est.peak_vram,
            "predicted_peak_host": est.peak_host,
            "vram_breakdown": dict(est.vram),
            "host_breakdown": dict(est.host),
            "predicted_step_s": est.step_s,
            "compute_s": est.compute_s,
            "exposed_transfer_s": est.exposed_s,
            "overhead_s": est.overhead_s,
            "h2d_bytes_per_step": est.h2d_bytes,
            "per_bucket": est.per_bucket,
            "budget_vram": budget.vram,
            "margin_vram": budget.margin_bytes,
            "budget_ram": ram_limit,
            "machine": self.machine.describe(),
            "machine_measured": self.machine.measured,
            "workload": self.workload.describe(),
            "streamed_by_kind": _count_kinds(plan.streamed_blocks, self.weights),
            "total_blocks": len(self.weights.blocks),
            "architecture_key": self.key,
        }
        return replace(plan, notes=notes)


def _count_kinds(names, weights: ModelWeights) -> dict[str, int]:
    kinds = {b.name: b.kind for b in weights.blocks}
    out: dict[str, int] = {}
    for n in names:
        out[kinds[n]] = out.get(kinds[n], 0) + 1
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
