"""Activation profiles (what the probe measured per block kind) and their composition over a step.

Kept apart from the probe (activation_probe.py, which traces a model and imports peft and the
engine) so that pricing a plan from stored profiles (the planner's cache, spec_cache.py) imports
nothing heavy.

`compose_activations` turns the per-kind values into the peak of a whole step over the n blocks
in execution order, with N_pre the embedder outputs:
    none:    peak = N_pre + sum_{j<=i} S_j + O_i + Tb_i                 (max over i; i = last usually)
    blocks:  peak = N_pre + sum_{j<=i} O_j + O_i + S_i + max(Tf_i, Tb_i) (only block inputs are kept)
    offload: as blocks, with sum_{j<=i} O_j replaced by 2 * O_i (inputs wait in pinned host memory)
In a LoRA step the first block does not keep its input (the embedder outputs need no grad), which is
then released: N_pre keeps counting it, so "none" is over by one block input (~1 O, on the safe side).
For Flux (width D = 3072, bf16 autocast, LoRA r16) the probe finds S_double ~ 26 and S_single ~ 23
times B*L*D*2 bytes (~31 without autocast) and O = B*L*D*2, where L is the image tokens
(height/16 * width/16) plus the text tokens; the probe, not this summary, is the source. fp8 plans
are probed with the engine's own fp8 storage applied, so its dequantised temporaries are in the
transients.

A full fine-tune updates each weight inside backward when its gradient completes; the update's
temporaries are one more transient of the backward it runs in: `bwd_extra` (step_peak of the
block's step points, each priced by the memory model) is taken into Tb_i's max, so an update is
priced with what is live at its own moment (klein-4B's largest, 2.2 GiB of AdamW temporaries, at
the end of its block's backward when most of the block's activations are gone), not with the peak.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class KindProfile:
    """Per-block activation bytes and FLOPs of one block kind at one bucket (batch included)."""

    saved: int            # S: bytes one more block adds to the live set after its forward (output included)
    out: int              # O: bytes of its output (the next block's input; what checkpointing keeps)
    fwd_transient: int    # Tf: peak above the end state during its forward
    bwd_transient: int    # Tb: peak above the start state during its backward
    nograd_transient: int  # Tn: peak above the start during a no-grad forward (checkpointed/inference)
    fwd_flops: float
    bwd_flops: float
    fwd_traffic: int = 0  # bytes moved by memory-bound ops (casts, fp8 dequantisation, norms)
    bwd_traffic: int = 0
    # Full fine-tuning (the optimizer steps each weight inside backward, train/in_backward.py): the
    # moments the block's trained tensors' gradients complete, as (live bytes above the start of its
    # backward then, its gradient included; elements of the tensor), the points no other beats in
    # both (the update's temporaries grow with the elements): the step is priced there, not at the peak.
    step_points: tuple[tuple[int, int], ...] = ()
    # The same for non-block tensors (embedders, FLUX.2's shared modulation) whose gradient completes
    # in the backward of the *first* block of this kind (they feed every block of the kind).
    nb_first_step_points: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class ActivationProfile:
    """The probe's result for one bucket: per kind, plus the non-block parts."""

    bucket: tuple[int, int]
    tokens: int                              # image + text tokens per sample
    kinds: dict[str, KindProfile]
    pre: int                                 # embedder outputs, temb, rotary tables (live before block 0)
    post: int                                # final norm/projection and loss tensors after the last block
    post_bwd_transient: int
    nb_fwd_flops: float                      # embedders (before the blocks)
    nb_bwd_flops: float
    nograd_pre: int
    nograd_post_transient: int
    nb_post_flops: float = 0.0               # final norm, projection and loss (after the blocks)
    # Full fine-tuning: the step points (KindProfile.step_points) of the tensors whose gradient
    # completes in the backward of the final layers, above that backward's start ...
    post_step_points: tuple[tuple[int, int], ...] = ()
    # ... and the largest tensor whose gradient completes anywhere else (no family has one): priced
    # as before this was measured, its update on top of the whole activation peak.
    loose_step_numel: int = 0
    # A LoRA profile's adapter share per rank unit (activation_probe._Tracker), so another rank is
    # priced without tracing again: {"rank": the rank the fields above are at, "kinds": {kind: {field:
    # per rank, or for a transient its candidate peaks [[bytes, bytes per rank], ...]}}, and the
    # non-block fields likewise}. None: the numbers do not depend on a rank (full, inference).
    per_rank: dict | None = None

    def at_rank(self, rank: int) -> ActivationProfile:
        """The profile at LoRA rank `rank`: every byte and FLOP the adapters add is proportional to
        the rank (their tensors have it as a dimension), and a transient is the largest of its
        candidate peaks at that rank."""
        pr = self.per_rank
        if pr is None or rank == pr["rank"]:
            return self
        d = rank - pr["rank"]

        def top(points) -> int:
            return max(0, max(int(a + rank * b) for a, b in points))

        kinds = {}
        for name, k in self.kinds.items():
            r = pr["kinds"][name]
            kinds[name] = replace(
                k, saved=k.saved + d * r["saved"], fwd_transient=top(r["fwd_transient"]),
                bwd_transient=top(r["bwd_transient"]), nograd_transient=top(r["nograd_transient"]),
                fwd_flops=k.fwd_flops + d * r["fwd_flops"], bwd_flops=k.bwd_flops + d * r["bwd_flops"],
                fwd_traffic=k.fwd_traffic + d * r["fwd_traffic"], bwd_traffic=k.bwd_traffic + d * r["bwd_traffic"])
        return replace(self, kinds=kinds, pre=self.pre + d * pr["pre"], post=self.post + d * pr["post"],
                       post_bwd_transient=top(pr["post_bwd_transient"]),
                       nb_fwd_flops=self.nb_fwd_flops + d * pr["nb_fwd_flops"],
                       nb_bwd_flops=self.nb_bwd_flops + d * pr["nb_bwd_flops"],
                       nograd_pre=self.nograd_pre + d * pr["nograd_pre"],
                       nograd_post_transient=top(pr["nograd_post_transient"]),
                       nb_post_flops=self.nb_post_flops + d * pr["nb_post_flops"], per_rank={**pr, "rank": rank})

    def to_dict(self) -> dict:
        d = asdict(self)
        d["bucket"] = list(self.bucket)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ActivationProfile:
        d = dict(d)
        d["bucket"] = tuple(d["bucket"])
        d["kinds"] = {k: KindProfile(**{f: (_points(x) if f.endswith("step_points") else x) for f, x in v.items()})
                      for k, v in d["kinds"].items()}
        if "post_step_points" in d:
            d["post_step_points"] = _points(d["post_step_points"])
        return cls(**d)


def _points(pairs) -> tuple[tuple[int, int], ...]:
    """Step points read back from JSON (lists) as the tuples the probe makes."""
    return tuple((int(a), int(b)) for a, b in pairs)


def frontier(points) -> tuple[tuple[int, int], ...]:
    """The (bytes, elements) points no other point matches or beats in both, sorted: what a step
    priced as bytes + f(elements), f increasing, can peak at."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(set(points), key=lambda p: (-p[0], -p[1])):
        if not out or b > out[-1][1]:
            out.append((a, b))
    return tuple(sorted(out))


def step_peak(points, price) -> int:
    """The largest bytes above the reference of a set of step points, each point's update priced
    by `price(elements)` (0 for no point)."""
    return max((a + price(n) for a, n in points), default=0)


def compose_activations(prof: ActivationProfile, seq: list[KindProfile], checkpointing: str, mode: str,
                        bwd_extra: list[int] | None = None, post_extra: int = 0) -> int:
    """Peak activation bytes of a whole step from per-kind probe values (formulas in the module docstring).

    `bwd_extra[i]` (full fine-tuning): the largest bytes above the start of block i's backward at
    the moment one of its updates runs (step_peak of its points), a transient of that backward
    like Tb_i: Tb_i becomes max(Tb_i, bwd_extra[i]); `post_extra` likewise for the final layers'
    backward. So each update is priced with the activations live when its gradient completes."""
    if mode == "inference":
        top = max(k.nograd_transient + k.out for k in seq)
        return prof.nograd_pre + max(top, prof.nograd_post_transient + seq[-1].out)
    extra = bwd_extra or [0] * len(seq)
    pre = prof.pre
    peak = pre
    post_bwd = max(prof.post_bwd_transient, post_extra)
    if checkpointing == "none":
        live = pre
        for k in seq:
            live += k.saved
            peak = max(peak, live + k.fwd_transient)
        peak = max(peak, live + prof.post + post_bwd)
        for k, x in zip(reversed(seq), reversed(extra)):
            peak = max(peak, live + k.out + max(k.bwd_transient, x))
            live -= k.saved
        return peak
    kept = pre
    for k in seq:                                    # no-grad forward, keeping each block's input
        peak = max(peak, kept + k.nograd_transient)
        kept = kept + k.out if checkpointing == "blocks" else pre + 2 * k.out
    peak = max(peak, kept + prof.post + post_bwd)
    for k, x in zip(reversed(seq), reversed(extra)):  # recompute, then backward, block by block
        peak = max(peak, kept + k.out + k.saved + max(k.fwd_transient, k.bwd_transient, x))
        if checkpointing == "blocks":
            kept -= k.out
    return peak
