"""The plan a run would use, and one run config per technique of it.

Each variant is the user's config with another [memory] section written as explicit keys
(streamed_blocks as the list of names, no vram_budget), so the trainer builds it as it builds
any run: nothing here applies a technique itself. The reference has none (nothing streamed, no
fp8, no checkpointing); each technique the plan uses gets a variant with that technique alone;
the whole plan is the last. Streaming always runs in poison mode (a slot freed too early, or
reused without its fetch, holds NaN), so a schedule fault shows as NaN instead of as plausible
numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..config import RunConfig, validate
from ..memory.plan import Plan


@dataclass(frozen=True)
class Variant:
    """One run of the check: `memory` / `full` are the [memory] / [full] keys it sets."""

    key: str                      # "reference", "streaming", "fp8", "checkpointing", "host step", "plan"
    label: str                    # what the report line calls it
    memory: dict = field(default_factory=dict)
    full: dict = field(default_factory=dict)
    exact: bool = True            # bitwise equal to `against` expected (False: its storage's error allowed)
    against: str = "reference"    # the variant it is compared with: the whole plan with fp8 against fp8 alone
    storage: str = "fp8"          # with exact False: which storage's tolerance (compare.TOLERANCES)
    data: dict = field(default_factory=dict)   # [data] keys it sets (the N-times batch of processes.py)
    train: dict = field(default_factory=dict)  # [train] keys it sets (processes.py: clipping off in both runs)
    model: dict = field(default_factory=dict)  # [model] keys it sets (processes.py: fp32 weights in both runs)
    lora: dict = field(default_factory=dict)   # [lora] keys it sets (the LoRA optimizer step's place)


def meta_model(cfg: RunConfig):
    """The config's transformer on the meta device, as the trainer builds it before loading."""
    from ..data.cache import model_dtype
    from ..models.family import get_family, loader_options

    family = get_family(cfg.model.family)
    sources = family.resolve_sources(cfg.model, Path(cfg.base_dir))
    return family.load_transformer(sources, dtype=model_dtype(cfg.model), device="meta", **loader_options(cfg.memory))


def run_plan(cfg: RunConfig, meta) -> tuple[Plan, object | None, object | None]:
    """(plan, planner, budget) of the run: the planner's under [memory] vram_budget (as the trainer
    chooses it before loading, on the meta-built model `meta`), else the explicit [memory] keys
    (planner and budget None)."""
    from ..memory.engine import resolve_plan
    from ..models.family import get_family
    from ..trainer import _plan_before_load

    spec = get_family(cfg.model.family).spec
    planned = _plan_before_load(cfg, spec, lambda: meta, None)
    if planned is not None:
        return planned
    try:
        plan = resolve_plan(cfg.memory, spec, meta)
    except ValueError as e:                   # the message names the [memory] key
        from ..config import ConfigError

        raise ConfigError(str(e)) from None
    from dataclasses import replace

    if cfg.train.mode == "full" and cfg.full.streamed_step == "host" and streams(plan):
        plan = replace(plan, optimizer_on_host=True)      # as trainer._apply_memory does
    if cfg.train.mode == "lora" and cfg.lora.optimizer_step == "host":
        plan = replace(plan, optimizer_on_host=True)      # as LoraMode.use_plan takes it
    if cfg.memory.base_format in ("int8", "nf4"):         # a pinned format: the block Linears as its rows
        plan = replace(plan, fp8=True, base_format=cfg.memory.base_format)
    return plan, None, None


def rows(plan: Plan) -> bool:
    """Whether `plan` stores the block Linears as int8 / NF4 rows (Plan.base_format), not e4m3."""
    return plan.base_format != "fp8" and bool(plan.fp8 or plan.fp8_modulation)


def memory_keys(plan: Plan, *, poison: bool, modulation=None) -> dict:
    """`plan` as explicit [memory] keys (no vram_budget: the trainer applies them as they are).
    `modulation`: the config's own [memory] fp8_modulation, kept when the plan does not store the
    modulation in fp8 and it says false (a file's e4m3 modulation is then upcast, as the run does);
    else "auto" (a file's e4m3 modulation stays as stored, a bf16 one is not quantized).
    base_format is always explicit, so a format the user's config pins is a technique of its own:
    the reference and the exact techniques run on the bf16 base; int8 / NF4 rows (a plan's
    base_format) store the block Linears as they are read (the modulation stays as the file has it:
    explicit keys cannot ask for it in rows)."""
    own_modulation = True if plan.fp8_modulation else (False if modulation is False else "auto")
    if rows(plan):
        storage = {"base_format": plan.base_format, "fp8": False, "fp8_modulation": "auto"}
    else:
        storage = {"base_format": "fp8" if plan.fp8 else "bf16", "fp8": plan.fp8, "fp8_modulation": own_modulation}
    return {"streamed_blocks": list(plan.streamed_blocks), "stream_non_blocks": plan.stream_non_blocks,
            **storage,
            "checkpointing": plan.checkpointing, "split_blocks": plan.split_blocks, "ring_slots": plan.ring_slots,
            "pin_memory": plan.pin_memory,
            "debug_poison": poison and bool(plan.streamed_blocks or plan.stream_non_blocks), "vram_budget": None}


def streams(plan: Plan) -> bool:
    return bool(plan.streamed_blocks) or plan.stream_non_blocks


def variants(plan: Plan, total_blocks: int, full_mode: bool, modulation=None) -> list[Variant]:
    """The reference, one variant per technique `plan` uses, and the whole plan (when it combines
    several). `total_blocks`: the model's block count, for the streaming line; `modulation`: the
    config's [memory] fp8_modulation (memory_keys)."""
    from functools import partial

    keys = partial(memory_keys, modulation=modulation)
    none = Plan(ring_slots=plan.ring_slots, pin_memory=plan.pin_memory)
    device_step = {"streamed_step": "device"} if full_mode else {}
    out = [Variant("reference", "reference (nothing streamed, no fp8, no checkpointing)",
                   keys(none, poison=False), device_step)]
    alone = Plan(streamed_blocks=plan.streamed_blocks, stream_non_blocks=plan.stream_non_blocks,
                 ring_slots=plan.ring_slots, pin_memory=plan.pin_memory)
    used = []
    if streams(plan):
        what = f"{len(plan.streamed_blocks)} of {total_blocks} blocks" + (
            " + non-block modules" if plan.stream_non_blocks else "")
        pin = "pinned" if plan.pin_memory else "pageable"
        out.append(Variant("streaming", f"streaming {what} ({pin}, poison mode)", keys(alone, poison=True),
                           device_step))
        used.append("streaming")
        if full_mode and plan.optimizer_on_host:
            out.append(Variant("host step", f"optimizer step of the streamed blocks on the host ({what}, poison "
                               f"mode)", keys(alone, poison=True), {"streamed_step": "host"}))
            used.append("host step")
    if rows(plan):
        fmt = plan.base_format
        stored = Plan(fp8=True, base_format=fmt, ring_slots=plan.ring_slots, pin_memory=plan.pin_memory)
        out.append(Variant(fmt, f"{fmt} storage (block Linears)", keys(stored, poison=False), device_step,
                           exact=False, storage=fmt))
        used.append(fmt)
    elif plan.fp8 or plan.fp8_modulation:
        fp8 = Plan(fp8=plan.fp8, fp8_modulation=plan.fp8_modulation, ring_slots=plan.ring_slots,
                   pin_memory=plan.pin_memory)
        what = " + ".join(w for w, on in (("block Linears", plan.fp8), ("modulation", plan.fp8_modulation)) if on)
        out.append(Variant("fp8", f"fp8 storage ({what})", keys(fp8, poison=False), device_step, exact=False))
        used.append("fp8")
    if plan.checkpointing != "none":
        ckpt = Plan(checkpointing=plan.checkpointing, ring_slots=plan.ring_slots, pin_memory=plan.pin_memory)
        what = "blocks" if plan.checkpointing == "blocks" else "blocks, inputs offloaded to host RAM"
        out.append(Variant("checkpointing", f"checkpointing ({what})", keys(ckpt, poison=False), device_step))
        used.append("checkpointing")
        if plan.split_blocks:               # exact: each part runs the plain block's own lines
            split = replace(ckpt, split_blocks=True)
            out.append(Variant("split blocks", f"split blocks (each block's parts recomputed one at a time; {what})",
                               keys(split, poison=False), device_step))
            used.append("split blocks")
    lora_host = not full_mode and plan.optimizer_on_host
    if lora_host:            # torch's fused CPU AdamW on the host: the device step's to fp32 rounding
        out.append(Variant("host step", "optimizer step of the LoRA on the host (fp32 adapters and optimizer state "
                           "in host RAM)", keys(none, poison=False), device_step, exact=False, storage="host step",
                           lora={"optimizer_step": "host"}))
        used.append("host step")
    same = any(v.memory == keys(plan, poison=True) and v.full == (
        {"streamed_step": "host" if plan.optimizer_on_host else "device"} if full_mode else {})
        and (v.lora.get("optimizer_step") == "host") == lora_host for v in out)
    if len(used) > 1 and not same:         # (streaming with the host step alone is the host step's run)
        step = {"streamed_step": "host" if plan.optimizer_on_host else "device"} if full_mode else {}
        # With a storage the exact techniques on top of it must give that storage alone's bits.
        stored = next((u for u in used if u in ("fp8", "int8", "nf4")), None)
        out.append(Variant("plan", f"the whole plan ({plan.describe(lora=not full_mode)}, poison mode"
                           + (f", against {stored} storage alone)" if stored else ")"),
                           keys(plan, poison=True), step, against=stored or "reference",
                           exact=not lora_host, storage=stored or "host step",
                           lora={"optimizer_step": "host"} if lora_host else {}))
    if not full_mode:        # every other run steps on the device, whatever the config asks
        out = [v if v.lora else replace(v, lora={"optimizer_step": "device"}) for v in out]
    return out


def variant_config(cfg: RunConfig, variant: Variant, out_dir: Path) -> RunConfig:
    """The user's config with `variant`'s [memory] / [full] keys and an output folder in `out_dir`
    (never the user's run folder). Validated again, as a file would be."""
    # Only the keys the file set: several validators refuse a key set to its default where it does
    # not apply ([lora] factor without type = "lokr"), so a dump of every field would not validate.
    data = cfg.model_dump(mode="json", exclude_unset=True)
    data["memory"] = {**data.get("memory", {}), **variant.memory}
    if variant.full:
        data["full"] = {**data.get("full", {}), **variant.full}
    if variant.data:
        data["data"] = {**data.get("data", {}), **variant.data}
    if variant.train:
        data["train"] = {**data.get("train", {}), **variant.train}
    if variant.model:
        data["model"] = {**data.get("model", {}), **variant.model}
    if variant.lora:
        data["lora"] = {**data.get("lora", {}), **variant.lora}
    data["output"] = {**data.get("output", {}), "dir": str(out_dir / variant.key.replace(" ", "_"))}
    return validate(data, source=f"{variant.key} variant of the config", base_dir=cfg.base_dir)
