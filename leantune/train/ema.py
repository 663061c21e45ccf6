"""An exponential moving average of the trained adapter weights, kept in host RAM.

An EMA of a LoRA's factors is the usual way to smooth the last steps' noise out of a run: the EMA
file often samples better than the live one, and costs nothing on the device. The shadow copy lives
on the host in fp32 (the adapter is small: a rank-16 Flux LoRA is ~70 MB in fp32), updated every
`[ema] every` optimizer steps as shadow = decay * shadow + (1 - decay) * weights, starting from
zero and bias-corrected as Adam's moments are (divided by 1 - decay ** updates), so the first
updates are not pulled toward zero nor toward the initial weights.

It is written beside the live LoRA as `<name>_ema_<format>.safetensors` (per-step files as the live
ones, `<name>_ema-step000100_<format>`), in every [output] format, by the mode's own export with the
averaged weights swapped in for the moment; `[ema] sample = true` draws the training samples from it
the same way. Its state (shadow and update count) is saved with the run, so a resume continues it
exactly. Full fine-tunes are refused ([ema] is for adapters: a host copy of a whole model in fp32
would be the largest thing in the run).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch


class AdapterEma:
    def __init__(self, transformer: torch.nn.Module, decay: float, every: int):
        self.decay, self.every = float(decay), int(every)
        self.named = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
        self.shadow = {n: torch.zeros(p.shape, dtype=torch.float32, device="cpu") for n, p in self.named.items()}
        self.updates = 0

    def after_step(self, step: int) -> None:
        """Fold the weights in after optimizer step `step` (1-based) when it is one of every `every`."""
        if step % self.every:
            return
        with torch.no_grad():
            for n, p in self.named.items():
                self.shadow[n].mul_(self.decay).add_(p.detach().to("cpu", torch.float32), alpha=1.0 - self.decay)
        self.updates += 1

    def averaged(self) -> dict[str, torch.Tensor]:
        """The bias-corrected average (fp32, host); the live weights before the first update."""
        if self.updates == 0:
            return {n: p.detach().to("cpu", torch.float32).clone() for n, p in self.named.items()}
        correction = 1.0 - self.decay ** self.updates
        return {n: s / correction for n, s in self.shadow.items()}

    @contextmanager
    def swapped_in(self):
        """The averaged weights in the model for the duration (an export, a sample), the live ones
        restored bit for bit afterwards."""
        live = {n: p.detach().clone() for n, p in self.named.items()}
        averaged = self.averaged()
        try:
            with torch.no_grad():
                for n, p in self.named.items():
                    p.copy_(averaged[n].to(p.device, p.dtype))
            yield
        finally:
            with torch.no_grad():
                for n, p in self.named.items():
                    p.copy_(live[n])

    # -- resumable state ---------------------------------------------------------------------------
    def state(self) -> dict:
        return {"shadow": dict(self.shadow), "updates": self.updates}

    def load_state(self, state: dict, ckpt) -> None:
        from ..errors import CheckpointError

        shadow = state.get("shadow", {})
        if set(shadow) != set(self.shadow):
            raise CheckpointError(f"{ckpt}: its [ema] average holds other weights than this run trains "
                                  f"({len(shadow)} against {len(self.shadow)}); resume with the [lora] settings it "
                                  f"was saved with")
        for n, v in shadow.items():
            self.shadow[n].copy_(v.to(torch.float32))
        self.updates = int(state.get("updates", 0))


def ema_paths(paths):
    """Where the EMA's files go: the live files' names with `_ema` after the run's name."""
    return replace(paths, name=f"{paths.name}_ema")


def export_ema(t, paths, step: int, intermediate: bool) -> list:
    """The EMA's LoRA files, written by the mode's own export with the averaged weights in."""
    with t.ema.swapped_in():
        return t.mode.export(t, ema_paths(paths), step, intermediate)
