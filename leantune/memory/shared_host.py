"""One host copy of the streamed weights for all processes of a machine.

Why. Streaming keeps the frozen weights of the streamed blocks in host RAM, packed one buffer per
block. With N processes on one machine (one per GPU), each process would pack its own copy: N
times the host RAM for identical bytes (12B Flux in bf16 is ~24 GB per copy). Here the buffers
are files in shared memory (/dev/shm): the machine's first process ("leader", local rank 0)
creates and fills them, the others map the same files and point their weights at them without
copying. Each process pins the mapping itself (cudaHostRegister on the shared pages, in
memory/host_buffers.py), so copies to its GPU stay asynchronous.

Order. The leader applies its memory plan first; the followers wait behind a barrier, then map
(`DistContext.local_main_first`). Once every process has mapped them, the files are unlinked:
the mappings stay valid, and nothing is left in /dev/shm when the run ends or crashes later.

Fallback. When /dev/shm lacks room for a buffer (small container defaults), the leader keeps a
private buffer for that block and says so; a follower that finds no file does the same. Nothing
else changes.

Only frozen weights may be shared: LoRA bases and sampling. A full fine-tune writes its weights
back into these buffers and must not share them.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
from pathlib import Path

import torch

log = logging.getLogger("leantune.memory")

SHM = Path("/dev/shm")


class SharedHostBuffers:
    """Hands out host buffers by unit name: the leader creates them, followers map them.

    `buffer(name, nbytes)` returns `(tensor, filled)`: a (nbytes,) uint8 tensor over the shared
    file, and whether it already holds the weights (a follower's). None means "use a private
    buffer" (no room, or no file to map).
    """

    def __init__(self, run_id: str, leader: bool, folder: Path = SHM):
        self.run_id, self.leader, self.folder = run_id, leader, Path(folder)
        self.created: list[Path] = []
        self.mapped_bytes = 0
        self.private: list[str] = []
        if leader:
            atexit.register(self.unlink)

    def path(self, name: str) -> Path:
        return self.folder / f"leantune-{self.run_id}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"

    def buffer(self, name: str, nbytes: int) -> tuple[torch.Tensor, bool] | None:
        path = self.path(name)
        if self.leader:
            free = _free_bytes(self.folder)
            if free < nbytes:
                self.private.append(name)
                log.warning("shared host weights: %s has %.1f MB free, %s needs %.1f MB; this block keeps a "
                            "private copy per process", self.folder, free / 2**20, name, nbytes / 2**20)
                return None
            t = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
            self.created.append(path)
            self.mapped_bytes += nbytes
            return t, False
        if not path.exists():
            self.private.append(name)
            return None
        size = path.stat().st_size
        if size != nbytes:
            raise RuntimeError(f"shared host weights: {path} holds {size} bytes, this process expects {nbytes} for "
                               f"{name}: the processes loaded different models or plans")
        self.mapped_bytes += nbytes
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8), True

    def unlink(self) -> None:
        """Remove the files (mappings stay valid); the leader calls it once every process has mapped."""
        for p in self.created:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        self.created = []

    def describe(self) -> str:
        role = "created" if self.leader else "mapped"
        text = f"shared host weights: {role} {self.mapped_bytes / 2**30:.2f} GiB in {self.folder}"
        if self.private:
            text += f" ({len(self.private)} block(s) private)"
        return text


def _free_bytes(folder: Path) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize
