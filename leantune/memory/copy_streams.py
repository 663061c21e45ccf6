"""The device side of weight streaming's copies: the compute device, its dedicated copy stream,
and events, or their absence on CPU.

Why a dedicated copy stream: host->device copies issued there overlap the compute stream's work;
ordering between the two is by events only (compute waits on a copy's event before using a unit, a
slot is refilled only after the event recorded on the compute stream at its last use), never by a
device- or stream-wide synchronize. On CPU the same schedule runs with no streams and no events
(`cuda` is False, `event()` returns None), which lets CI test it.
"""

from __future__ import annotations

import torch


class CopyBackend:
    def __init__(self, device: torch.device | str):
        dev = torch.device(device)
        self.cuda = dev.type == "cuda"
        if self.cuda and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.copy_stream = torch.cuda.Stream(dev) if self.cuda else None
        self.forward_stream = None           # the stream the model's forward runs on (bind_forward)

    def bind_forward(self) -> None:
        """Take the stream the model's forward is called on as the compute stream, until the next
        forward (the engine calls this as each forward begins).

        Why not the current stream at each use: the slots are released and waited for in backward
        too, on autograd's device thread, whose current stream is the forward op's only while
        autograd runs that op; a hook, an engine callback or a caller that ran the forward under
        `torch.cuda.stream(s)` sees another. An event recorded on the wrong stream lets the next
        copy overwrite a slot a kernel still reads."""
        if self.cuda:
            self.forward_stream = torch.cuda.current_stream(self.device)

    def compute_stream(self):
        if not self.cuda:
            return None
        return self.forward_stream if self.forward_stream is not None else torch.cuda.current_stream(self.device)

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing) if self.cuda else None
