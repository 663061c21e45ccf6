"""Split blocks: a block whose backward recomputes its parts one at a time, not the whole block at once.

Why. The engine's checkpointing keeps only each block's input between blocks, but it recomputes a
block whole before that block's backward, so the step's activation peak is one block's full
internals (Flux 1024²: ~26 block outputs' worth; Wan at 81 frames: several GiB). A split block runs
its parts (an attention branch, an MLP's halves, ...) each as a non-reentrant checkpoint nested in
the engine's block checkpoint: the block keeps only each part's inputs, and each part is recomputed
at the start of its own backward. Each part runs the reference block's own lines on the same
tensors, so outputs and gradients are the plain block's bit for bit; the price is one more forward
of each block per step. So it is a plan choice (Plan.split_blocks), taken where it is needed.

The seam (a family that has such a block):
- `ModelFamily.split_blocks(transformer)`: swaps the transformer's blocks' classes in place (the
  module tree, names and weights unchanged) to the family's split class; its loader calls it on
  every load, the meta copy the planner probes included, so the probe runs the class training runs.
- the split class's forward is the reference block's forward unless the block's `split_parts`
  attribute is True (a class attribute, default False), and only splits in a forward that records
  gradients;
- the engine sets `split_parts` from the plan (`set_split_parts`).
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

ATTR = "split_parts"


def same_modes():
    """checkpoint's context_fn: the recompute in backward runs under the torch function modes the
    forward ran under (none in a real run; a meta copy's host layout and the planner probe's GPU
    semantics on tensors without values), as torch itself restores the autocast state."""
    modes = _get_current_function_mode_stack()

    @contextlib.contextmanager
    def recompute():
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            yield

    return contextlib.nullcontext(), recompute()


def part(fn, *tensors):
    """Run `fn(*tensors)` as one part of a split block: kept for backward as its inputs only and
    recomputed at the start of its own backward. Tensors go positionally (checkpoint saves them and
    the engine's offload hooks see them); anything else reaches `fn` by closure."""
    return checkpoint(fn, *tensors, use_reentrant=False, context_fn=same_modes)


def has_split_blocks(model: nn.Module) -> bool:
    """Whether any of `model`'s modules is a split block (has the `split_parts` switch)."""
    return any(hasattr(type(m), ATTR) for m in model.modules())


def set_split_parts(model: nn.Module, on: bool) -> int:
    """Switch every split block of `model` on or off; returns how many blocks were switched."""
    n = 0
    for m in model.modules():
        if hasattr(type(m), ATTR):
            setattr(m, ATTR, bool(on))
            n += 1
    return n
