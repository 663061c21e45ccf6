"""Scaled fp8 storage: quantization math, what is (not) quantized, prequantized checkpoints,
autograd, removal, and the output error of each technique against bf16."""

from __future__ import annotations

import copy

import pytest
import torch
from test_memory_helpers import block_names, lora_flux, make_batch, train
from torch import nn

from leantune.memory.engine import apply_memory
from leantune.memory.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    SCALE_ATTR,
    _Fp8Linear,
    apply_fp8_storage,
    block_linears,
    dequantize,
    quantize,
    remove_fp8_storage,
)
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC, predict

MODULATION = ("norm1.linear", "norm1_context.linear", "norm.linear")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# -- the math ---------------------------------------------------------------------------------------

def test_quantize_block_scales_and_row_fallback():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g)
    w[3] = 0.0                                   # an all-zero row
    w[5, 70] = 40.0                              # an outlier in the second block of row 5
    q, s = quantize(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (48, 4)                   # 256 / 64 blocks per row
    assert q.float().abs().max() <= FP8_MAX
    assert torch.equal(s[3], torch.ones(4)) and torch.equal(dequantize(q, s, torch.float32)[3], torch.zeros(256))
    # the outlier only coarsens its own block: the other blocks of row 5 keep their resolution
    assert s[5, 1] > 10 * s[5, 0]
    back = dequantize(q, s, torch.float32)
    nz = w != 0
    rel = ((back - w).abs()[nz] / w.abs()[nz])
    # e4m3 keeps 3 mantissa bits: round-to-nearest error <= 2^-4 of the value for normal numbers
    normal = (w.abs() / s.repeat_interleave(64, dim=1)) >= 2 ** -6
    assert rel[normal[nz]].max() <= 2 ** -4 + 1e-6
    assert _rel(back, w) < 0.03
    # widths that are not multiples of 64 fall back to one scale per row
    _, s2 = quantize(torch.randn(10, 100, generator=g))
    assert s2.shape == (10, 1)
    with pytest.raises(ValueError, match="2-D Linear weight"):
        quantize(torch.randn(3, 4, 5))


def test_fp8_linear_autograd_matches_dequantized_linear():
    g = torch.Generator().manual_seed(1)
    q, s = quantize(torch.randn(24, 128, generator=g))
    x = torch.randn(2, 5, 128, generator=g, requires_grad=True)
    bias = torch.randn(24, generator=g, requires_grad=True)
    y = _Fp8Linear.apply(x, q, s, bias)
    w = dequantize(q, s, torch.float32)
    x2 = x.detach().clone().requires_grad_(True)
    b2 = bias.detach().clone().requires_grad_(True)
    y2 = nn.functional.linear(x2, w, b2)
    assert torch.equal(y, y2)
    gy = torch.randn(y.shape, generator=g)
    y.backward(gy)
    y2.backward(gy)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bias.grad, b2.grad, rtol=1e-6, atol=1e-6)


# -- applying to a model -----------------------------------------------------------------------------

def test_what_is_quantized():
    model = lora_flux(seed=0)
    handle = apply_fp8_storage(model, FLUX_SPEC)
    for name, p in model.named_parameters():
        rel = name.split(".", 2)[-1] if name.startswith(("transformer_blocks", "single_transformer_blocks")) else ""
        is_block = bool(rel)
        is_weight = name.endswith(".base_layer.weight") or (name.endswith(".weight") and "lora_" not in name)
        if "lora_" in name:
            assert p.dtype == torch.float32 and p.requires_grad, name          # adapters untouched
        elif is_block and is_weight and not any(m in name for m in MODULATION) and "norm" not in rel:
            assert p.dtype == FP8_DTYPE, name
        else:
            assert p.dtype == torch.float32, name                             # biases, norms, modulation, embedders
    assert len(handle.linears) == 34
    assert all(getattr(lin, SCALE_ATTR).dtype == torch.float32 for lin in handle.linears.values())
    assert sorted(n.split(".", 2)[2] for n in handle.kept) == sorted(
        ["norm1.linear", "norm1_context.linear"] * 2 + ["norm.linear"] * 2)
    # LoRA still trains on top of the fp8 base
    rec = train(model, shapes=[(8, 8)])
    assert all(g is not None and torch.isfinite(g).all() for g in rec[0]["grads"].values())
    remove_fp8_storage(handle)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not any(hasattr(m, SCALE_ATTR) or "forward" in m.__dict__ for m in model.modules())


def test_prequantized_checkpoint_is_kept_as_is():
    """An e4m3 weight from a checkpoint is not requantized; a scalar (ComfyUI) or per-row scale is
    used as given; a modulation Linear that arrived in fp8 stays e4m3 too (only the loader upcasts
    it, when [memory] fp8_modulation = false)."""
    model = lora_flux(seed=0)
    to_q = model.transformer_blocks[0].attn.to_q.base_layer
    mod = model.single_transformer_blocks[0].norm.linear
    g = torch.Generator().manual_seed(3)
    q_data = (torch.randn(to_q.weight.shape, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE)
    mod_q = torch.randn(mod.weight.shape, generator=g).to(FP8_DTYPE)
    to_q.weight.data = q_data
    mod.weight.data = mod_q
    to_k = model.transformer_blocks[0].attn.to_k.base_layer
    to_k.weight.data = q_data.clone()
    to_k.register_buffer(SCALE_ATTR, torch.full((32,), 0.5))                 # loader-attached per-row scale
    handle = apply_fp8_storage(model, FLUX_SPEC, scales={"transformer_blocks.0.attn.to_q": torch.tensor(0.01),
                                                          "single_transformer_blocks.0.norm.linear": torch.tensor(2.0)})
    assert to_q.weight.data_ptr() == q_data.data_ptr()                         # the very same bytes
    assert torch.equal(getattr(to_q, SCALE_ATTR), torch.full((32, 1), 0.01))
    assert torch.equal(getattr(to_k, SCALE_ATTR), torch.full((32, 1), 0.5))
    assert mod.weight.data_ptr() == mod_q.data_ptr() and torch.equal(getattr(mod, SCALE_ATTR), torch.full((96, 1), 2.0))
    assert handle.modulation == {"single_transformer_blocks.0.norm.linear"} <= handle.prequantized
    assert len(handle.kept) == 5                                               # the other modulation Linears
    x = torch.randn(3, 32, generator=g)
    assert torch.equal(mod(x), nn.functional.linear(x, mod_q.float() * 2.0, mod.bias))
    assert torch.equal(to_q(x), nn.functional.linear(x, q_data.float() * 0.01, to_q.bias))
    with pytest.raises(ValueError, match=r"scale of transformer_blocks\.1\.attn\.to_v has shape \(7,\), which does not fit weight"):
        other = lora_flux(seed=0)
        other.transformer_blocks[1].attn.to_v.base_layer.weight.data = q_data.clone()
        apply_fp8_storage(other, FLUX_SPEC, scales={"transformer_blocks.1.attn.to_v": torch.ones(7)})
    assert handle.linears


def test_fp8_modulation_stores_the_modulation_linears_too():
    """modulation=True (Plan.fp8_modulation) takes the spec's modulation Linears as well, and only
    them with quantize_rest=False; remove restores every one of them."""
    model = lora_flux(seed=0)
    handle = apply_fp8_storage(model, FLUX_SPEC, modulation=True)
    assert len(handle.linears) == 40 and not handle.kept
    assert sorted(n.split(".", 2)[2] for n in handle.modulation) == sorted(
        ["norm1.linear", "norm1_context.linear"] * 2 + ["norm.linear"] * 2)
    for _, rel, lin in block_linears(FLUX_SPEC, model):
        assert lin.weight.dtype == FP8_DTYPE, rel
    rec = train(model, shapes=[(8, 8)])
    assert all(g is not None and torch.isfinite(g).all() for g in rec[0]["grads"].values())
    remove_fp8_storage(handle)
    assert all(p.dtype == torch.float32 for p in model.parameters())

    only = lora_flux(seed=0)
    handle = apply_fp8_storage(only, FLUX_SPEC, quantize_rest=False, modulation=True)
    assert set(handle.linears) == handle.modulation and len(handle.modulation) == 6
    assert only.transformer_blocks[0].attn.to_q.base_layer.weight.dtype == torch.float32


@pytest.mark.parametrize("breakage,match", [
    ("trainable", r"memory\.fp8: transformer_blocks\.0\.ff\.net\.2\.weight is trainable"),
    ("fp8_lora", r"memory\.fp8: adapter weight .*lora_A.* has dtype torch\.float8_e4m3fn"),
    ("e5m2", r"memory\.fp8: .* is float8_e5m2"),
    ("stray_scale", r"memory\.fp8: scales given for modules that are not fp8 block Linears"),
])
def test_fp8_errors_name_the_key(breakage, match):
    model = lora_flux(seed=0)
    scales = None
    if breakage == "trainable":
        model.transformer_blocks[0].ff.net[2].base_layer.weight.requires_grad_(True)
    elif breakage == "fp8_lora":
        p = model.transformer_blocks[0].attn.to_q.lora_A["default"].weight
        p.data = p.data.to(FP8_DTYPE)
    elif breakage == "e5m2":
        w = model.transformer_blocks[0].attn.to_q.base_layer.weight
        w.data = w.data.to(torch.float8_e5m2)
    else:
        scales = {"proj_out": torch.ones(1)}
    with pytest.raises(ValueError, match=match):
        apply_fp8_storage(model, FLUX_SPEC, scales=scales)


# -- error of each technique against bf16 ------------------------------------------------------------

def test_output_error_per_technique_tiny_bf16(capsys):
    """Tiny Flux in bf16: streaming and checkpointing reproduce the bf16 output exactly; fp8
    storage stays within a few percent."""
    base = lora_flux(seed=0, dtype=torch.bfloat16)
    names = block_names(base)
    x, sigma, embeds, hw, _ = make_batch(8, 12, seed=5, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = predict(copy.deepcopy(base), x, sigma, embeds, hw, guidance=3.5)
    plans = {
        "streaming (all + non-blocks, poison)": Plan(streamed_blocks=tuple(names), stream_non_blocks=True,
                                                     debug_poison=True),
        "checkpointing (offload)": Plan(checkpointing="offload"),
        "fp8 storage": Plan(fp8=True),
        "fp8 + streaming + offload": Plan(fp8=True, streamed_blocks=tuple(names), checkpointing="offload",
                                          debug_poison=True),
        "fp8 storage + modulation": Plan(fp8=True, fp8_modulation=True),
        "fp8 + modulation + streaming + offload": Plan(fp8=True, fp8_modulation=True, streamed_blocks=tuple(names),
                                                       checkpointing="offload", debug_poison=True),
    }
    errors = {}
    for label, plan in plans.items():
        model = copy.deepcopy(base)
        handle = apply_memory(model, FLUX_SPEC, plan, "cpu")
        with torch.no_grad():
            errors[label] = _rel(predict(model, x, sigma, embeds, hw, guidance=3.5), ref)
        handle.remove()
    with capsys.disabled():
        print("\nrelative output error against bf16, tiny Flux:")
        for label, err in errors.items():
            print(f"  {label:40s} {err:.2e}")
    assert errors["streaming (all + non-blocks, poison)"] == 0.0
    assert errors["checkpointing (offload)"] == 0.0
    assert 0.0 < errors["fp8 storage"] < 0.05
    assert errors["fp8 + streaming + offload"] == errors["fp8 storage"]
    assert 0.0 < errors["fp8 storage + modulation"] < 0.05
    assert errors["fp8 + modulation + streaming + offload"] == errors["fp8 storage + modulation"]
    assert errors["fp8 storage + modulation"] != errors["fp8 storage"]


def test_fp8_error_on_a_real_width_block(capsys):
    """One Flux single block at its real width (3072 hidden, 24 heads of 128), 64 image + 16 text
    tokens: fp8 storage against bf16, with bf16 against fp32 for scale."""
    from diffusers.models.transformers.transformer_flux import (
        FluxPosEmbed,
        FluxSingleTransformerBlock,
    )

    torch.manual_seed(0)
    block = FluxSingleTransformerBlock(dim=3072, num_attention_heads=24, attention_head_dim=128)
    block.requires_grad_(False)
    n_img, n_txt = 64, 16
    ids = torch.zeros(n_txt + n_img, 3)
    ids[n_txt:, 1] = torch.arange(n_img) // 8
    ids[n_txt:, 2] = torch.arange(n_img) % 8
    rotary = FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(ids)
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, n_img, 3072, generator=g),
                  encoder_hidden_states=torch.randn(1, n_txt, 3072, generator=g),
                  temb=torch.randn(1, 3072, generator=g), image_rotary_emb=rotary)

    def run(dtype):
        with torch.no_grad():
            out = block(**{k: (v.to(dtype) if torch.is_tensor(v) else v) for k, v in inputs.items()})
        return out[1].float(), out[1].float() - inputs["hidden_states"].to(dtype).float()   # output, update

    _, fp32_upd = run(torch.float32)
    block.to(torch.bfloat16)
    bf16_out, bf16_upd = run(torch.bfloat16)
    bf16_state = {k: v.clone() for k, v in block.state_dict().items()}
    holder = nn.Module()
    holder.transformer_blocks, holder.single_transformer_blocks = nn.ModuleList(), nn.ModuleList([block])
    errs = {}
    for label, modulation in (("fp8", False), ("fp8 + modulation", True)):
        handle = apply_fp8_storage(holder, FLUX_SPEC, modulation=modulation)
        fp8_out, fp8_upd = run(torch.bfloat16)
        assert len(handle.linears) == 5 + modulation and handle.bytes_after < 0.55 * handle.bytes_before
        errs[f"{label} vs bf16, block output"] = _rel(fp8_out, bf16_out)
        errs[f"{label} vs bf16, block update (output - input)"] = _rel(fp8_upd, bf16_upd)
        errs[f"{label} vs fp32, block update"] = _rel(fp8_upd, fp32_upd)
        remove_fp8_storage(handle)
        block.load_state_dict(bf16_state)                               # the same bf16 weights again
    errs["bf16 vs fp32, block update"] = _rel(bf16_upd, fp32_upd)
    with capsys.disabled():
        print("\nrelative error, one real-width Flux single block (3072):")
        for label, err in errs.items():
            print(f"  {label:45s} {err:.2e}")
    assert errs["fp8 vs bf16, block output"] < 0.01
    assert errs["fp8 vs bf16, block update (output - input)"] < 0.08
    assert errs["fp8 vs fp32, block update"] < 0.08
    assert errs["fp8 + modulation vs bf16, block output"] < 0.01
    assert errs["fp8 + modulation vs bf16, block update (output - input)"] < 0.08
    assert errs["fp8 + modulation vs fp32, block update"] < 0.08


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_multiplies_by_the_fp32_scale_and_rounds_once(dtype):
    """Rounding the scale to the weight's dtype before multiplying put a systematic gain error on
    every value of a block (up to 2^-8 for bf16); the product in fp32, rounded once, has none."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 256, generator=g) * 0.02
    q, s = quantize(w)
    want = (q.float().view(64, s.shape[1], -1) * s[..., None]).view(64, 256).to(dtype)
    assert torch.equal(dequantize(q, s, dtype), want)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_in_output_has_the_fp32_products_bits(dtype):
    """Issue 40, finding 5: CUDA forms the product in the bf16/fp16 output (e4m3 -> bf16 is exact
    and bf16 x fp32 rounds once), without the fp32 temporary. Its bits must be the fp32 product's,
    over weights spanning ten decades (subnormal e4m3 values and scales included)."""
    from leantune.memory.fp8 import _dequantize_in_output

    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 384, generator=g) * torch.logspace(-8, 2, 96)[:, None]
    q, s = quantize(w)
    s = s * torch.logspace(-3, 3, s.numel()).view_as(s)          # scales far from the data's own
    want = (q.float().view(96, s.shape[1], -1) * s[..., None]).view(96, 384).to(dtype)
    got = _dequantize_in_output(q, s.float(), torch.empty(96, 384, dtype=dtype))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(dequantize(q, s, dtype).view(torch.int16), want.view(torch.int16))
