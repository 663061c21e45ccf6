"""One variant against the reference: held, or the first way it differs, naming the parameter.

Exact techniques (streaming, checkpointing and its offload, pinned or pageable copies, the host
step) move bytes and recompute the same operations in the same order, so they must give the same
bits: losses, gradients and weights are compared bitwise. fp8 storage rounds the frozen weights,
so it is held to the error `FP8_TOLERANCE` allows (docs/check.md says how it was measured).
Either way, a NaN the reference does not have, or a parameter whose gradient is missing or zero
where the reference's is not (an adapter cut off from the optimizer), is a failure of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .record import Record


@dataclass(frozen=True)
class Tolerance:
    """What fp8 storage may change: the loss's relative difference at every step; over all
    trained parameters together, per step, the gradient's relative error ||g - g_ref|| / ||g_ref||
    and its cosine with the reference's; the trained weights' relative error after the last step."""

    loss_rel: float
    grad_rel: float
    grad_cos: float
    weight_rel: float

    def describe(self) -> str:
        return (f"loss {self.loss_rel:.0e}, gradients {self.grad_rel:g} relative error and cosine >= "
                f"{self.grad_cos:g}, weights {self.weight_rel:g}")


# Measured on the tiny Flux over 2 steps (docs/check.md: LoRA on every block Linear, seeds 1, 3, 7,
# 11, fp32 and bf16, with and without the modulation in fp8; full mode with frozen fp8 blocks): at
# most 8.9e-4 on the loss, 0.043 relative gradient error (cosine >= 0.999), 0.0045 on the weights.
# The bounds leave about 6x on the gradients and 10x on loss and weights; an fp8 fault (a lost
# scale, a stale weight) moves them by orders of magnitude.
FP8_TOLERANCE = Tolerance(loss_rel=1e-2, grad_rel=0.25, grad_cos=0.97, weight_rel=0.05)
# The int8 / NF4 rows of a pinned or planned [memory] base_format are held to the same bounds, measured
# as fp8's were (docs/check.md): on the tiny Flux int8 gives 1.2e-5 on the loss, 0.0086 on the
# gradients, 0.0018 on the weights; NF4, whose error on a real-width block is 3.7x e4m3's, 0.0017,
# 0.054 (cosine 0.9986) and 0.0045: within the bounds with 4.6x left on the gradients.
# A LoRA's optimizer step on the host (train/lora_host_step.py: torch's fused CPU AdamW) against the
# device step: the same update to fp32 rounding (docs/check.md gives what the tiny Flux measured).
HOST_STEP_TOLERANCE = Tolerance(loss_rel=1e-5, grad_rel=1e-4, grad_cos=0.99999, weight_rel=1e-5)
TOLERANCES = {"fp8": FP8_TOLERANCE, "int8": FP8_TOLERANCE, "nf4": FP8_TOLERANCE, "host step": HOST_STEP_TOLERANCE}


@dataclass(frozen=True)
class Verdict:
    held: bool
    text: str                         # after "held — " or "differs: "
    measured: dict                    # the numbers compared (largest over the steps)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _nonfinite(t: torch.Tensor) -> bool:
    return t.is_floating_point() and not bool(torch.isfinite(t).all())


def _missing(ref: Record, rec: Record) -> str | None:
    """A NaN, or a gradient missing or zero, where the reference has a number: the first found,
    step by step (a step's gradients before the next step's loss, which they made)."""
    for i, (got, want) in enumerate(zip(rec.grads, ref.grads)):
        if not math.isfinite(rec.losses[i]) and math.isfinite(ref.losses[i]):
            return f"the loss of step {i + 1} is {rec.losses[i]}"
        for name, g0 in want.items():
            g = got.get(name)
            if g0 is None:
                continue
            if name not in got:
                return f"{name} is not trained in this variant (step {i + 1})"
            if g is None:
                return f"{name} got no gradient at step {i + 1} (it does not reach the optimizer)"
            if _nonfinite(g) and not _nonfinite(g0):
                return f"NaN in the gradient of {name} at step {i + 1}"
            if not bool(g.any()) and bool(g0.any()):
                return f"the gradient of {name} is zero at step {i + 1} where the reference's is not"
    for name, w in rec.weights.items():
        if _nonfinite(w) and name in ref.weights and not _nonfinite(ref.weights[name]):
            return f"NaN in the trained weight {name}"
    return None


def _largest_diff(pairs) -> tuple[float, str]:
    """(max |a - b|, the name where it is) over (name, a, b) triples."""
    worst, where = 0.0, ""
    for name, a, b in pairs:
        d = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        if d > worst or not where:
            worst, where = d, name
    return worst, where


def _step_errors(got: dict, want: dict) -> tuple[float, float, float]:
    """(relative error, cosine, norm ratio) of all the step's gradients together."""
    names = [n for n, g in want.items() if g is not None and got.get(n) is not None]
    if not names:
        return 0.0, 1.0, 1.0
    a = torch.cat([got[n].double().reshape(-1) for n in names])
    b = torch.cat([want[n].double().reshape(-1) for n in names])
    nb = float(b.norm())
    rel = float((a - b).norm()) / nb if nb else float((a - b).norm())
    na = float(a.norm())
    cos = float(a @ b) / (na * nb) if na and nb else (1.0 if na == nb else 0.0)
    return rel, cos, (na / nb if nb else (1.0 if na == nb else math.inf))


def compare(ref: Record, rec: Record, exact: bool, tolerance: Tolerance = FP8_TOLERANCE) -> Verdict:
    """`rec` (a variant) against `ref` (the reference)."""
    steps = len(ref.losses)
    if rec.error is not None:
        return Verdict(False, f"the run failed: {rec.error}", {})
    if len(rec.losses) != steps:
        return Verdict(False, f"ran {len(rec.losses)} of {steps} steps", {})
    problem = _missing(ref, rec)
    if problem is not None:
        return Verdict(False, problem, {})
    grads = [(n, g, step_ref[n]) for step, step_ref in zip(rec.grads, ref.grads)
             for n, g in step.items() if g is not None and step_ref.get(n) is not None]
    weights = [(n, w, ref.weights[n]) for n, w in rec.weights.items() if n in ref.weights]
    if set(rec.weights) != set(ref.weights):
        other = sorted(set(rec.weights) ^ set(ref.weights))
        return Verdict(False, f"trains other parameters than the reference, e.g. {other[0]}", {})
    if exact:
        for i, (a, b) in enumerate(zip(rec.losses, ref.losses)):
            if a != b:
                return Verdict(False, f"the loss of step {i + 1} is {a!r}, the reference's {b!r} "
                                      f"(|diff| {abs(a - b):.3g}), expected bitwise", {})
        bad = [(n, a, b) for n, a, b in grads if not _bits_equal(a, b)]
        if bad:
            d, where = _largest_diff(bad)
            return Verdict(False, f"max |grad diff| {d:.3g} in {where} ({len(bad)} gradient(s) differ), "
                                  f"expected bitwise", {"grad_max_abs": d})
        bad = [(n, a, b) for n, a, b in weights if not _bits_equal(a, b)]
        if bad:
            d, where = _largest_diff(bad)
            return Verdict(False, f"max |weight diff| {d:.3g} in {where} after step {steps} (the gradients agreed: "
                                  f"the update did not arrive), expected bitwise", {"weight_max_abs": d})
        return Verdict(True, f"losses, gradients and weights bitwise equal over {steps} step(s)", {})
    loss_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(rec.losses, ref.losses))
    errors = [_step_errors(got, want) for got, want in zip(rec.grads, ref.grads)]
    grad_rel = max(e[0] for e in errors)
    grad_cos = min(e[1] for e in errors)
    w_num = math.sqrt(sum(float((a.double() - b.double()).norm()) ** 2 for _, a, b in weights))
    w_den = math.sqrt(sum(float(b.double().norm()) ** 2 for _, _, b in weights))
    weight_rel = w_num / w_den if w_den else w_num
    measured = {"loss_rel": loss_rel, "grad_rel": grad_rel, "grad_cos": grad_cos, "weight_rel": weight_rel}
    said = (f"loss {loss_rel:.2g} relative, gradients {grad_rel:.2g} relative error (cosine {grad_cos:.4f}), "
            f"weights {weight_rel:.2g}")
    tol = tolerance
    over = [k for k, bad in (("loss", loss_rel > tol.loss_rel), ("gradients", grad_rel > tol.grad_rel),
                             ("gradient cosine", grad_cos < tol.grad_cos), ("weights", weight_rel > tol.weight_rel))
            if bad]
    if over:
        return Verdict(False, f"{said}; {', '.join(over)} outside the tolerance ({tol.describe()})", measured)
    return Verdict(True, f"{said} over {steps} step(s), within the tolerance ({tol.describe()})", measured)


@dataclass(frozen=True)
class UpdateTolerance:
    """What several processes may change in a sharded full fine-tune, where no rank holds a whole
    gradient: the loss's relative difference at every step; the update of all trained weights
    together over the steps, ||u - u_ref|| / ||u_ref|| with u = weights after - weights before;
    the trained weights' relative error after the last step."""

    loss_rel: float
    update_rel: float
    weight_rel: float

    def describe(self) -> str:
        return f"loss {self.loss_rel:.0e}, updates {self.update_rel:g} relative error, weights {self.weight_rel:g}"


def compare_updates(ref: Record, rec: Record, before: dict[str, torch.Tensor], tolerance: UpdateTolerance) -> Verdict:
    """`rec` (a sharded full fine-tune on several processes) against `ref` (one process), both
    started from the weights `before`: losses per step, and the weights' update over the steps.

    Why the update and not only the weights: an AdamW update is about the learning rate per
    element, a small part of the weight, so a wrong update on one rank's shard moves the weights'
    relative error by (update / weight) x the fault, which a float tolerance on the weights could
    hide; the update's own relative error shows it whole."""
    steps = len(ref.losses)
    if rec.error is not None:
        return Verdict(False, f"the run failed: {rec.error}", {})
    if len(rec.losses) != steps:
        return Verdict(False, f"ran {len(rec.losses)} of {steps} steps", {})
    for i, (a, b) in enumerate(zip(rec.losses, ref.losses)):
        if not math.isfinite(a) and math.isfinite(b):
            return Verdict(False, f"the loss of step {i + 1} is {a}", {})
    if set(rec.weights) != set(ref.weights):
        other = sorted(set(rec.weights) ^ set(ref.weights))
        return Verdict(False, f"trains other parameters than the one-process run, e.g. {other[0]}", {})
    for name, w in rec.weights.items():
        if _nonfinite(w) and not _nonfinite(ref.weights[name]):
            return Verdict(False, f"NaN in the trained weight {name}", {})
    names = sorted(ref.weights)
    missing = [n for n in names if n not in before]
    if missing:
        return Verdict(False, f"no weight before the first step for {missing[0]}", {})
    got = torch.cat([rec.weights[n].double().reshape(-1) for n in names])
    want = torch.cat([ref.weights[n].double().reshape(-1) for n in names])
    start = torch.cat([before[n].double().reshape(-1) for n in names])
    u, u_ref = got - start, want - start
    moved = [n for n in names if not torch.equal(rec.weights[n], before[n])]
    if not moved and bool(u_ref.any()):
        return Verdict(False, f"no trained weight moved in {steps} step(s) where the one-process run's did "
                              f"(e.g. {names[0]})", {})
    loss_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(rec.losses, ref.losses))
    nu = float(u_ref.norm())
    update_rel = float((u - u_ref).norm()) / nu if nu else float((u - u_ref).norm())
    nw = float(want.norm())
    weight_rel = float((got - want).norm()) / nw if nw else float((got - want).norm())
    # where the update differs most, by tensor: what a fault confined to one rank's shard names
    worst, where = 0.0, names[0]
    for n in names:
        du = (rec.weights[n].double() - ref.weights[n].double()).norm()
        d0 = (ref.weights[n].double() - before[n].double()).norm()
        r = float(du / d0) if float(d0) else float(du)
        if r > worst:
            worst, where = r, n
    measured = {"loss_rel": loss_rel, "update_rel": update_rel, "weight_rel": weight_rel, "worst_update_rel": worst,
                "worst_update_in": where}
    said = (f"loss {loss_rel:.2g} relative, updates {update_rel:.2g} relative error (largest {worst:.2g} in "
            f"{where}), weights {weight_rel:.2g}")
    tol = tolerance
    over = [k for k, bad in (("loss", loss_rel > tol.loss_rel), ("updates", update_rel > tol.update_rel),
                             ("weights", weight_rel > tol.weight_rel)) if bad]
    if over:
        return Verdict(False, f"{said}; {', '.join(over)} outside the tolerance ({tol.describe()})", measured)
    return Verdict(True, f"{said} over {steps} step(s), within the tolerance ({tol.describe()})", measured)
