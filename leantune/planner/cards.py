"""Common GPUs by name, for planning a run on a card this machine does not have.

Why: `leantune plan` (and the page) is often asked on a laptop or a server without the GPU the run
will train on. Without a GPU to measure, the planner used one assumed card (RTX 4090 class on PCIe
Gen4 x16), so a user with a 12 GB RTX 3060 or a 4060 Ti on eight PCIe lanes saw another card's step
times. `--gpu NAME` plans for that card: its memory, its host link and its compute, from its spec
sheet (nothing here is measured; the report says "assumed").

How the numbers are derived, the same way for every card, so that cards compare as their spec
sheets do:
- compute: the dense bf16 tensor rate with fp32 accumulation (the rate a training step's matmuls
  run at; GeForce cards run it at half their fp16-accumulate rate) times SUSTAINED, the share of
  that peak a Flux training step sustains (70 of 165 TFLOP/s on an RTX 4090: planner/machine.py's
  assumed rate, which this table reproduces for the 4090's compute and link);
- host link: PCIe Gen4 x16 at machine.py's assumed 25 GB/s pinned, Gen5 x16 twice that, x8 half;
  pageable copies at the assumed machine's 18/25 of pinned, device-to-host as pinned;
- VRAM: the card's memory size; "auto" as the VRAM budget plans for all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..host import host_ram
from .machine import ASSUMED, GiB, Machine

SUSTAINED = ASSUMED["flops"] / 165.2e12          # share of the dense fp32-accumulate peak a step sustains
GEN4_X16 = ASSUMED["h2d_pinned"]                   # bytes/s pinned over PCIe Gen4 x16
PAGEABLE = ASSUMED["h2d_pageable"] / ASSUMED["h2d_pinned"]


@dataclass(frozen=True)
class Card:
    title: str            # as the page and the report name it
    vram_gib: int
    tensor_tflops: float  # dense bf16 (fp32 accumulate) peak, TFLOP/s
    link: float           # host link relative to PCIe Gen4 x16 (x8: 0.5, Gen5 x16: 2)
    memory_tbs: float     # device memory bandwidth, TB/s


CARDS = {
    "rtx3060-12gb": Card("RTX 3060 12 GB", 12, 25.6, 1.0, 0.36),
    "rtx4060ti-16gb": Card("RTX 4060 Ti 16 GB (PCIe x8)", 16, 44.1, 0.5, 0.288),
    "rtx3090": Card("RTX 3090 24 GB", 24, 71.0, 1.0, 0.936),
    "rtx4080": Card("RTX 4080 16 GB", 16, 97.5, 1.0, 0.717),
    "rtx4090": Card("RTX 4090 24 GB", 24, 165.2, 1.0, 1.008),
    "rtx5090": Card("RTX 5090 32 GB", 32, 209.5, 2.0, 1.792),
    "a100-80gb": Card("A100 80 GB", 80, 312.0, 1.0, 2.0),
    "h100-80gb": Card("H100 80 GB (SXM)", 80, 989.0, 2.0, 3.35),
}


def card_machine(name: str) -> Machine:
    """The Machine of card `name` (a CARDS key) with this machine's host RAM; rates assumed."""
    if name not in CARDS:
        raise ValueError(f"no GPU named {name!r}: one of {', '.join(CARDS)}")
    card = CARDS[name]
    total, avail = host_ram()
    pinned = GEN4_X16 * card.link
    vram = card.vram_gib * GiB
    return Machine(name=card.title, vram_total=vram, vram_free=vram,
                   h2d_pinned=pinned, h2d_pageable=pinned * PAGEABLE, d2h=pinned,
                   flops=card.tensor_tflops * 1e12 * SUSTAINED, hbm=card.memory_tbs * 1e12,
                   host_ram_total=total, host_ram_available=avail, measured=False,
                   assumed_from="its spec sheet: --gpu " + name)
