"""Small facts about failures that several layers need, kept at the bottom so that none of them has
to import a bigger package to ask: is this exception an out-of-memory, is this saved state usable.

`is_out_of_memory` is asked by the distributed glue (a rank's vote), the OOM guard (planner/feedback)
and the commands; `CheckpointError` is raised by the checkpoint reader (train/state.py) and by the
distributed glue when a saved world size cannot continue.
"""

from __future__ import annotations

import torch


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA allocator failure (torch.OutOfMemoryError) or an out-of-memory from cuBLAS/cuDNN."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text)


class CheckpointError(ValueError):
    """A saved training state that cannot be resumed (unreadable, or made with other settings)."""
