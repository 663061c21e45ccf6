"""fp8 checkpoints stay fp8: ComfyUI e4m3 BFL files (plain and "scaled fp8") load with their block
Linear weights in e4m3 plus a `weight_scale`, the modulation Linears included unless
[memory] fp8_modulation = false asks for them upcast, are never upcast on the way, compute exactly
what the upcast load computes, and train a LoRA under streaming + checkpointing.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_memory_helpers import assert_records_equal, block_names, train
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from leantune.config import LoraConfig
from leantune.io import load_safetensors
from leantune.memory.engine import apply_memory
from leantune.memory.fp8 import SCALE_ATTR, _Fp8Forward, dequantize
from leantune.memory.plan import Plan
from leantune import tiny
from leantune.models.flux import FLUX_SPEC, PromptEmbeds, predict
from leantune.models.flux.loading import FluxSources, fp8_block_weights, load_transformer, save_bfl_transformer
from leantune.train.lora import add_lora

E4M3 = torch.float8_e4m3fn
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.fixture(scope="module", params=["e4m3", "scaled"])
def fp8_file(request, tmp_path_factory) -> tuple[str, Path]:
    ref = tiny.flux_transformer(seed=2)
    path = tmp_path_factory.mktemp("fp8") / f"flux-{request.param}.safetensors"
    return request.param, save_bfl_transformer(ref, path, fp8=request.param)


def _sources(path: Path) -> FluxSources:
    return FluxSources(path, None, None, None, None, None)


def _out(model, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 64, generator=g).to(dtype)                     # (B, 4x4 tokens, 64)
    embeds = PromptEmbeds(torch.randn(2, 8, 32, generator=g), torch.randn(2, 32, generator=g)).to("cpu", dtype)
    with torch.no_grad():
        return predict(model, x, torch.tensor([0.3, 0.8]), embeds, (8, 8), guidance=3.5)


class _UpcastRecorder(TorchDispatchMode):
    """Counts the values of every op that reads an fp8 tensor and writes a wider float one."""

    def __init__(self):
        super().__init__()
        self.values = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(t.dtype in FP8 for t in ins):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in FP8:
                    self.values += t.numel()
        return out


@pytest.mark.parametrize("modulation", [True, False])
def test_block_linears_load_as_stored_e4m3(fp8_file, modulation):
    """Every block Linear the file stores in e4m3 stays e4m3, modulation included; with
    fp8_modulation=False the modulation Linears alone are upcast."""
    kind, path = fp8_file
    tensors, _ = load_safetensors(path)
    model = load_transformer(_sources(path), dtype=torch.bfloat16, fp8_modulation=modulation)
    eligible = fp8_block_weights(model, modulation)
    # 2 double x 11 + 2 single x 6 Linears, + 2 double x 2 + 2 single x 1 modulation Linears
    assert len(eligible) == (40 if modulation else 34)
    mod_names = {"transformer_blocks.0.norm1.linear.weight", "single_transformer_blocks.1.norm.linear.weight"}
    assert (mod_names <= eligible) == modulation and not (mod_names & eligible) == (not modulation)
    for name, p in model.named_parameters():
        if name in eligible:
            assert p.dtype == E4M3, name
            lin = model.get_submodule(name.removesuffix(".weight"))
            scale = getattr(lin, SCALE_ATTR)
            assert scale.dtype == torch.float32 and scale.shape == (p.shape[0], 1), name
            assert isinstance(lin.__dict__.get("forward"), _Fp8Forward), name
        else:                                                   # norms, biases, embedders (modulation if asked)
            assert p.dtype == torch.bfloat16, name
    # the very bytes of the file: BFL's fused qkv split into to_q / to_k / to_v rows, scale as stored
    qkv = tensors["double_blocks.1.img_attn.qkv.weight"]                      # (96, 32) e4m3
    want_scale = tensors["double_blocks.1.img_attn.qkv.scale_weight"].item() if kind == "scaled" else 1.0
    for i, part in enumerate(("to_q", "to_k", "to_v")):
        lin = getattr(model.transformer_blocks[1].attn, part)
        assert torch.equal(lin.weight.view(torch.uint8), qkv[32 * i:32 * (i + 1)].view(torch.uint8)), part
        assert torch.equal(getattr(lin, SCALE_ATTR), torch.full((32, 1), want_scale)), part
    mod = model.transformer_blocks[0].norm1.linear
    assert mod.weight.dtype == (E4M3 if modulation else torch.bfloat16)             # e4m3 in the file
    if modulation:
        want = tensors["double_blocks.0.img_mod.lin.weight"]
        assert torch.equal(mod.weight.view(torch.uint8), want.view(torch.uint8))


def test_no_fp8_weight_is_upcast_while_loading(fp8_file):
    """The loader's per-tensor path never widens a kept weight: by default no fp8 value of the file is
    converted to a wider float at all; with fp8_modulation=False only those of the modulation
    Linears are. The upcast load converts every fp8 value in the file, once."""
    _, path = fp8_file
    tensors, _ = load_safetensors(path)
    in_file = sum(t.numel() for k, t in tensors.items() if t.dtype == E4M3 and k.endswith(".weight"))
    with _UpcastRecorder() as kept_rec:
        kept = load_transformer(_sources(path), dtype=torch.bfloat16)
    with _UpcastRecorder() as mod_rec:
        mod_upcast = load_transformer(_sources(path), dtype=torch.bfloat16, fp8_modulation=False)
    with _UpcastRecorder() as upcast_rec:
        load_transformer(_sources(path), dtype=torch.bfloat16, keep_fp8=False)
    kept_values = sum(p.numel() for p in kept.parameters() if p.dtype == E4M3)
    modulation = sum(p.numel() for n, p in kept.named_parameters()
                     if n.startswith(("transformer_blocks.", "single_transformer_blocks.")) and ".norm" in n
                     and n.endswith("linear.weight"))
    assert upcast_rec.values == in_file == kept_values
    assert kept_rec.values == 0
    assert mod_rec.values == modulation == in_file - sum(p.numel() for p in mod_upcast.parameters()
                                                         if p.dtype == E4M3) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_match_the_upcast_load(fp8_file, dtype):
    """Both loads dequantize the same e4m3 values with the same fp32 scale and round the product
    once (dequantize no longer rounds the scale to bf16 first): bitwise equal weights and outputs
    in fp32 and in bf16."""
    kind, path = fp8_file
    kept = load_transformer(_sources(path), dtype=dtype)
    upcast = load_transformer(_sources(path), dtype=dtype, keep_fp8=False)
    for name in fp8_block_weights(kept):
        lin = kept.get_submodule(name.removesuffix(".weight"))
        w = dequantize(lin.weight, getattr(lin, SCALE_ATTR), dtype)
        assert torch.equal(w, upcast.get_parameter(name)), name
    got, want = _out(kept, dtype), _out(upcast, dtype)
    assert torch.equal(got, want)
    # the engine takes the e4m3 weights as they are, whatever memory.fp8 says: same output
    for fp8 in (False, True):
        model = copy.deepcopy(kept).requires_grad_(False)
        handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(block_names(model)), fp8=fp8), "cpu")
        assert len(handle.fp8.prequantized) == 40 and len(handle.fp8.modulation) == 6
        assert torch.equal(_out(model, dtype), got)
        handle.remove()
        assert model.transformer_blocks[0].attn.to_q.weight.dtype == E4M3          # remove keeps them e4m3
        assert torch.equal(_out(model, dtype), got)


def _lora_model(path: Path):
    model = load_transformer(_sources(path), dtype=torch.float32)
    model.requires_grad_(False)
    params = add_lora(model, FLUX_SPEC, LoraConfig(rank=4))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)     # nonzero lora_B: every gradient is informative
    return model, params


def test_lora_trains_on_fp8_checkpoint_with_streaming_and_checkpointing(fp8_file):
    """peft wraps the fp8 Linears (LoRA weights fp32); two SGD steps with every block streamed
    (poison mode) and checkpointed match, bitwise, the same fp8 model fully resident without the
    engine: loss, LoRA gradients and LoRA values. The base weights stay the same e4m3 bytes, and
    streaming moves 1-byte weights."""
    _, path = fp8_file
    model, params = _lora_model(path)
    assert params and all(p.dtype == torch.float32 and p.requires_grad for p in params)
    to_q = model.transformer_blocks[0].attn.to_q.base_layer
    assert to_q.weight.dtype == E4M3
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == E4M3}
    want = train(copy.deepcopy(model))
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(block_names(model)), checkpointing="blocks",
                                                 debug_poison=True), "cpu")
    entries = [e for u in handle.streaming.units for e in u.entries]
    assert sum(e.dtype == E4M3 for e in entries) == 40 and "(fp8," in handle.streaming.describe()
    got = train(model)
    assert_records_equal(got, want)
    assert all(torch.isfinite(g).all() for r in got for g in r["grads"].values())
    handle.remove()
    for n, p in model.named_parameters():
        if n in before:
            assert p.dtype == E4M3 and torch.equal(p.view(torch.uint8), before[n].view(torch.uint8)), n


def test_fp8_loaded_model_saves_back_to_bfl(fp8_file, tmp_path):
    """save_bfl_transformer dequantizes e4m3 weights with their scales (BFL fuses Linears whose
    scales differ): the saved fp32 file loads into what the upcast load gives in fp32."""
    _, path = fp8_file
    kept = load_transformer(_sources(path), dtype=torch.float32)
    out = save_bfl_transformer(kept, tmp_path / "back.safetensors")
    again = load_transformer(_sources(out), dtype=torch.float32)
    upcast = load_transformer(_sources(path), dtype=torch.float32, keep_fp8=False)
    sa, sb = again.state_dict(), upcast.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
