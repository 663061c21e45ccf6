"""The better choice: settings the user left at their default that would make the plan several
times faster or smaller, each with its trade-off and the key that sets it.

Why: the defaults are the safe ones (fp32 AdamW moments, AdamW), and the search keeps them: it
chooses where weights live, not what the run trains with. But a default can cost a great deal:
a full fine-tune of Flux-dev at 8 GiB with fp32 moments fits only if its streamed blocks step on
the CPU (minutes per step), while bf16 moments fit with the step on the GPU (seconds). The plan
stays what was asked; this says what the other choice would give, so the user decides.

Only settings the user did not choose are tried (a flag given, or a key the config sets, is a
choice), one at a time, each with the same measured model (none of them changes what is measured:
spec_cache._workload_shape), budget and machine. A choice is reported when it makes the step
`SEVERAL` times faster, the predicted VRAM peak `SEVERAL` times smaller, or fits where the default
plan does not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .workload import Budget, InfeasibleBudget, Workload

SEVERAL = 3.0


@dataclass(frozen=True)
class Choice:
    """One setting to change: the workload field and value, the config key and flag that set it,
    and what it costs."""

    field: str
    value: object
    key: str            # the TOML key, as a line to paste
    flag: str           # the `leantune plan` flag
    trade_off: str


def candidate_choices(workload: Workload, chosen: set[str]) -> list[Choice]:
    """The settings worth trying for `workload`, less those in `chosen` (workload field names)."""
    out = []
    if workload.mode != "full":
        return out
    if workload.optimizer == "adamw" and workload.state_dtype == "fp32" and "state_dtype" not in chosen:
        out.append(Choice("state_dtype", "bf16", '[full] state_dtype = "bf16"', "--state-dtype bf16",
                          "AdamW's moments in bf16 (stochastically rounded): half the optimizer state; "
                          "a little less precise moments"))
    if workload.optimizer == "adamw" and "optimizer" not in chosen:
        out.append(Choice("optimizer", "adafactor", '[train] optimizer = "adafactor"', "--optimizer adafactor",
                          "Adafactor: factored second moment and no first moment, a fraction of AdamW's state; "
                          "it converges differently (learning rate to retune)"))
    return out


@dataclass(frozen=True)
class Better:
    """A choice and the plan it gives, against the default's."""

    choice: Choice
    plan: object                     # the Plan with notes (search.Planner._annotate)
    step_s: float
    peak_vram: int
    why: str                         # "12x faster", "fits", ...

    def describe(self, default_step_s: float | None) -> str:
        """Two lines: the key, what it gives, the plan; then the trade-off."""
        n, p = self.plan.notes, self.plan
        where = ("; the streamed blocks step on the CPU" if p.optimizer_on_host
                 else "; the streamed blocks step on the GPU" if p.streamed_blocks else "")
        before = f" (instead of {default_step_s:.1f} s)" if default_step_s is not None else ""
        return (f"better choice: {self.choice.key} (leantune plan {self.choice.flag}), {self.why}: "
                f"{self.step_s:.1f} s per step{before}, VRAM peak {self.peak_vram / 2**30:.2f} GiB, host RAM peak "
                f"{n['predicted_peak_host'] / 2**30:.1f} GiB; {p.describe()}{where}\n"
                f"  trade-off: {self.choice.trade_off}")


def better_choices(make_planner, workload: Workload, budget: Budget, default_plan, chosen: set[str]) -> list[Better]:
    """The choices (candidate_choices) whose plan for `budget` is several times better than
    `default_plan` (None: the default did not fit). `make_planner(workload)` builds the planner
    for a changed workload from the same measurement and machine."""
    out = []
    for choice in candidate_choices(workload, chosen):
        try:
            plan = make_planner(replace(workload, **{choice.field: choice.value})).plan(budget)
        except InfeasibleBudget:
            continue
        n = plan.notes
        step, peak = n["predicted_step_s"], n["predicted_peak_vram"]
        if default_plan is None:
            why = "fits this budget (the default does not)"
        else:
            d = default_plan.notes
            faster = d["predicted_step_s"] / max(step, 1e-12)
            smaller = d["predicted_peak_vram"] / max(peak, 1)
            if faster >= SEVERAL:
                why = f"{faster:.0f}x faster"
            elif smaller >= SEVERAL:
                why = f"{smaller:.0f}x smaller VRAM peak"
            else:
                continue
        out.append(Better(choice, plan, step, peak, why))
    return out


def chosen_fields(flags: dict, config_sets: set[str] = frozenset()) -> set[str]:
    """Workload fields the user chose: a `leantune plan` flag given (argparse dest: value or None)
    or a key the config sets (workload field names)."""
    dest_to_field = {"state_dtype": "state_dtype", "optimizer": "optimizer", "streamed_step": "streamed_step",
                     "rank": "rank"}
    return {field for dest, field in dest_to_field.items() if flags.get(dest) is not None} | set(config_sets)
