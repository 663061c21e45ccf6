"""What weight streaming measured: bytes and copies moved, how long the copies took, how long
compute waited for them, and how many units were held at once.

Why it exists: calibration (planner/feedback) reads `stall_s` and `h2d_GBps` to price the next
plan, so every wait of compute on a copy must be counted, wherever it happens (a CUDA stream
waiting on an event, or a thread waiting on a staged copy's future).

CUDA copies and stalls are timed with pairs of timing events. Reading a pair would synchronize on
its end event, so pairs are kept pending and added up only once they completed (`settle`): a
report never makes the per-block path wait. The staging worker thread adds to the same counters,
hence the lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class StreamStats:
    bytes: int = 0
    copies: int = 0
    demand: int = 0            # fetches that were not prefetched
    copy_s: float = 0.0        # time the copies took (copy stream / worker)
    stall_s: float = 0.0       # time compute waited on copies
    held_max: int = 0          # most units held at once
    pending_copy: list = field(default_factory=list)    # CUDA (start, end) events not yet read
    pending_stall: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, attr: str, start, end) -> None:
        with self.lock:
            getattr(self, attr).append((start, end))
        if len(getattr(self, attr)) > 4096:           # nobody reads reports: fold finished pairs in
            self.settle(wait=False)

    def settle(self, wait: bool) -> None:
        """Add up the CUDA event pairs that have completed (all of them if `wait`)."""
        for attr, key in (("pending_copy", "copy_s"), ("pending_stall", "stall_s")):
            with self.lock:
                pairs, keep = getattr(self, attr), []
                for start, end in pairs:
                    if wait:
                        end.synchronize()
                    if end.query():
                        setattr(self, key, getattr(self, key) + start.elapsed_time(end) / 1000.0)
                    else:
                        keep.append((start, end))
                setattr(self, attr, keep)

    def report(self, units: list, slots: list, held: int, wait: bool = False) -> dict:
        """The counters since the last report (then reset), with the ring's shape and state."""
        self.settle(wait)
        out = {
            "streamed_units": len(units),
            "bytes_h2d": self.bytes,
            "copies": self.copies,
            "demand_fetches": self.demand,
            "copy_s": self.copy_s,
            "stall_s": self.stall_s,
            "h2d_GBps": (self.bytes / self.copy_s / 1e9) if self.copy_s > 0 else None,
            "slots": len(slots),
            "slot_bytes": slots[0].buf.numel() if slots else 0,
            "slots_held_max": self.held_max,
            "slots_valid": sum(1 for sl in slots if sl.valid),
        }
        self.bytes = self.copies = self.demand = 0
        self.copy_s = self.stall_s = 0.0
        self.held_max = held
        return out
