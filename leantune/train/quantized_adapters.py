"""LoKr, LoHa and DoRA on a quantized frozen base (GGUF blocks, NF4 rows, int8 ConvRot rows).

Why: a quantized base Linear keeps its stored bytes in `weight` (uint8, of another shape than the
Linear's (out, in)) and computes through its own forward (memory/gguf_storage.py, nf4_storage.py,
int8_storage.py). peft's LoRA reads nothing of that weight but its device, so it trains on such a
base as is; the other adapter types read more of it:
- LoKr and LoHa shape their update as `base_layer.weight.shape`: LoHa's factors when they are made,
  and both types' delta at every forward (`get_delta_weight` reshapes the product to it). Here they
  see the Linear's (out, in) for the length of those calls (`logical_weight`; the stored Parameter
  is put back before anything else runs), which is the shape the product already has.
- DoRA reads the base weight's values (its rows' norms, when it is made and at every forward)
  through peft's `dequantize_module_weight`, which dequantizes a module that has `W_q` by calling
  its `dequantize()`: the hook peft keeps for quantized bases it does not know (HQQ's). A
  quantized base here gets those two names (`expose_decoder`), `dequantize()` decoding its rows
  with the format's own decoder, exactly the weight its forward computes with.

Nothing is copied: the update is peft's own, on the same rows the base computes with, so a LoKr,
LoHa or DoRA trained here is the one the bf16 base would train on the decoded weights.
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch

from ..memory.gguf_storage import is_gguf, stored_weight as gguf_weight
from ..memory.int8_storage import is_int8, stored_weight as int8_weight
from ..memory.nf4_storage import is_nf4, stored_weight as nf4_weight


def is_quantized(linear: torch.nn.Module) -> bool:
    """Whether `linear` holds stored GGUF / NF4 / int8 rows rather than its weight."""
    return is_gguf(linear) or is_nf4(linear) or is_int8(linear)


def decoded_weight(linear: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (out, in) weight a quantized Linear computes with, in `dtype`."""
    decode = gguf_weight if is_gguf(linear) else nf4_weight if is_nf4(linear) else int8_weight
    return decode(linear, dtype)


STUB_ATTR = "_leantune_logical_weight"     # a quantized Linear's cached shape-only weight (forward time)


@contextmanager
def logical_weight(linears, shape_only: bool = False):
    """While inside, each quantized Linear of `linears` shows a weight of its (out, in) shape; after,
    its stored Parameter again. Made on the weight's device (a zero-stride uint8 view, no memory;
    an integer dtype, so peft casts nothing to it: what peft reads while it makes the adapter), or
    with `shape_only` on the meta device, made once per Linear (all a delta's reshape reads, at every
    forward). Only shapes, and the device while the adapter is made, may be read inside."""
    kept = []
    try:
        for lin in linears:
            if is_quantized(lin):
                kept.append((lin, lin._parameters["weight"]))
                lin._parameters["weight"] = _shape_stub(lin) if shape_only else torch.nn.Parameter(
                    torch.zeros((), dtype=torch.uint8, device=lin.weight.device).expand(lin.out_features,
                                                                                       lin.in_features),
                    requires_grad=False)
        yield
    finally:
        for lin, weight in kept:
            lin._parameters["weight"] = weight


def _shape_stub(lin: torch.nn.Module) -> torch.nn.Parameter:
    stub = lin.__dict__.get(STUB_ATTR)
    if stub is None:
        stub = torch.nn.Parameter(torch.empty(lin.out_features, lin.in_features, dtype=torch.uint8, device="meta"),
                                  requires_grad=False)
        object.__setattr__(lin, STUB_ATTR, stub)       # not a registered parameter: state_dict never sees it
    return stub


def expose_decoder(linear: torch.nn.Module) -> None:
    """Give a quantized Linear the two names peft's `dequantize_module_weight` decodes through:
    `W_q` (set without registering anything: the stored Parameter stays the only one; peft reads
    its device when it places the DoRA) and `dequantize()`, the format's decoder in fp32 (a bound
    method: a deep copy of the model decodes its own rows)."""
    if not is_quantized(linear):
        return
    object.__setattr__(linear, "W_q", linear.weight)
    object.__setattr__(linear, "dequantize", types.MethodType(decoded_weight, linear))


class _LogicalShapeDelta:
    """Mixed into a peft LoKr / LoHa layer over a quantized base: its delta is shaped as the
    Linear, not as the stored bytes."""

    def get_delta_weight(self, adapter_name, *args, **kwargs):
        with logical_weight([self.get_base_layer()], shape_only=True):
            return super().get_delta_weight(adapter_name, *args, **kwargs)


_CLASSES: dict[type, type] = {}


def shape_deltas_as_the_linear(layer: torch.nn.Module) -> None:
    """Make a peft LoKr / LoHa layer whose base is quantized shape its delta as the Linear (its
    class becomes a subclass with `_LogicalShapeDelta`; peft's isinstance checks still hold)."""
    if not is_quantized(layer.get_base_layer()) or isinstance(layer, _LogicalShapeDelta):
        return
    cls = type(layer)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"QuantizedBase{cls.__name__}", (_LogicalShapeDelta, cls), {})
    layer.__class__ = _CLASSES[cls]
