"""int8 ConvRot bases (memory/int8_storage.py): the format of ComfyUI's `*_int8_convrot` layers
(comfy-kitchen's TensorWiseINT8Layout with convrot), a tiny Flux's block Linears stored in it.

The reference here is the format's definition written out independently of the module: the
regular Hadamard matrix entry by entry from its base-4 digits, the rotation as one block-diagonal
matrix. comfy-kitchen itself is not installed, so its code is not run. The model is the tiny Flux
128 wide, whose block Linears' inputs (128, 512, 640) all split into groups of 64.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_memory_helpers import (assert_adapters_train_as_on_the_decoded_base, assert_quantized_base_streams_exactly,
                                 assert_records_equal, block_names, make_batch, train)

from leantune import tiny
from leantune.memory import int8_storage as i8
from leantune.memory.engine import apply_memory
from leantune.memory.fp8 import block_linears
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC, predict

WIDE = dict(attention_head_dim=32, num_attention_heads=4, axes_dims_rope=(8, 12, 12))   # inner width 128
_H4 = [[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]]


def _regular_hadamard(size: int) -> torch.Tensor:
    """Entry (i, j) of the Kronecker power of H4: the product over base-4 digits of H4[i_d][j_d], / sqrt(size)."""
    h = torch.empty(size, size, dtype=torch.float64)
    for i in range(size):
        for j in range(size):
            v, a, b, n = 1, i, j, size
            while n > 1:
                v *= _H4[a % 4][b % 4]
                a, b, n = a // 4, b // 4, n // 4
            h[i, j] = v
    return (h / size ** 0.5).float()


def _reference_rotate(w: torch.Tensor, group: int) -> torch.Tensor:
    """w @ blockdiag(H, ..., H)^T in float64, one matrix for the whole row."""
    h = _regular_hadamard(group).double()
    return (w.double() @ torch.block_diag(*[h] * (w.shape[1] // group)).T).float()


# -- the format ---------------------------------------------------------------------------------------

def test_the_rotation_is_the_regular_hadamard_matrix():
    """Kronecker powers of H4 over sqrt(size): symmetric, orthogonal, no all-ones column; a size
    that is not a power of 4 is refused."""
    for size in (4, 16, 64, 256):
        h = i8.hadamard(size)
        assert torch.equal(h, _regular_hadamard(size)), size
        assert torch.equal(h, h.T)
        torch.testing.assert_close(h @ h.T, torch.eye(size), rtol=0, atol=1e-6)
        assert (h * size ** 0.5).sum(0).abs().max() < size            # every column has both signs
    for bad in (2, 8, 32, 48, 128):
        with pytest.raises(ValueError, match=rf"power of 4 .*got {bad}"):
            i8.hadamard(bad)


def test_codes_and_scales_follow_the_format_and_decode_within_its_rounding():
    """Per row: scale = absmax of the rotated row / 127, codes = round(rotated / scale); the
    decoded weight equals the reference rotation of codes * scale (fp64 reference, fp32 product)
    and is the source to int8's precision; rows are independent."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 256, generator=g) * torch.linspace(0.1, 3, 256)      # uneven input channels
    w[3, 17] = 40.0                                                          # one outlier
    codes, scale = i8.quantize_codes(w, 64)
    rotated = _reference_rotate(w, 64)
    torch.testing.assert_close(scale, rotated.abs().amax(-1, keepdim=True) / 127, rtol=1e-6, atol=0)
    want = (rotated / scale).round().clamp(-128, 127)
    assert (codes.float() - want).abs().max() <= 1 and (codes.float() != want).float().mean() < 1e-3
    assert codes.float().abs().amax(-1).eq(127).all()                        # each row's absmax is +-127
    decoded = i8.dequantize(i8.pack(codes, scale), 256, 64, torch.float32)
    torch.testing.assert_close(decoded, _reference_rotate(codes.float() * scale, 64), rtol=1e-5, atol=1e-6)
    plain_codes = (w / (w.abs().amax(-1, keepdim=True) / 127)).round()          # per row, no rotation
    plain = plain_codes * (w.abs().amax(-1, keepdim=True) / 127)
    err, err_plain = ((decoded - w).norm() / w.norm()).item(), ((plain - w).norm() / w.norm()).item()
    assert err < 0.01 and err < err_plain, (err, err_plain)                   # the rotation spreads the outlier
    assert torch.equal(i8.quantize(w[5:9], 64), i8.quantize(w, 64)[5:9])


def test_a_linear_computes_with_the_decoded_weight_forward_and_backward():
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(128, 16)
    i8.set_int8_weight(lin, i8.quantize(torch.randn(16, 128, generator=g), 64), 64)
    assert lin.weight.shape == (16, 132) and lin.weight.dtype == torch.uint8
    want = i8.stored_weight(lin)
    x = torch.randn(5, 128, generator=g, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = lin(x), torch.nn.functional.linear(x2, want, lin.bias)
    assert torch.equal(y, y2)
    y.square().sum().backward()
    y2.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"128 inputs do not split into ConvRot groups of 256"):
        i8.use_int8_weight(torch.nn.Linear(128, 4), 256)


# -- ComfyUI's files ----------------------------------------------------------------------------------

def _comfy_file(path: Path, layers: dict[str, torch.Tensor], prefix: str = "model.diffusion_model.",
                group: int = 64, tamper=None) -> Path:
    """A safetensors file laid out as ComfyUI's int8 ConvRot files: per layer weight int8,
    weight_scale fp32 (out, 1), comfy_quant JSON bytes; a bias beside each."""
    tensors = {}
    for name, w in layers.items():
        codes, scale = i8.quantize_codes(w, group)
        tensors[f"{prefix}{name}.weight"] = codes
        tensors[f"{prefix}{name}.weight_scale"] = scale
        tensors[f"{prefix}{name}.comfy_quant"] = i8.comfy_quant_bytes(group)
        tensors[f"{prefix}{name}.bias"] = torch.zeros(w.shape[0])
    if tamper:
        tamper(tensors)
    save_file(tensors, str(path))
    return path


def test_a_comfyui_int8_convrot_file_reads_as_stored_rows(tmp_path):
    """Each layer's three tensors become its stored rows, which decode as ComfyUI decodes them
    (codes * scale, rotated back); the comfy_quant bytes are the JSON ComfyUI reads."""
    g = torch.Generator().manual_seed(2)
    layers = {"blocks.0.attn.qkv": torch.randn(48, 128, generator=g), "blocks.0.mlp.fc2": torch.randn(16, 256, generator=g)}
    path = _comfy_file(tmp_path / "m_int8_convrot.safetensors", layers)
    assert json.loads(bytes(i8.comfy_quant_bytes(64).tolist())) == {"format": "int8_tensorwise", "convrot": True,
                                                                    "convrot_groupsize": 64}
    got = i8.read_comfy_int8(path, prefix="model.diffusion_model.")
    assert set(got) == set(layers)
    for name, w in layers.items():
        raw, group = got[name]
        assert group == 64 and torch.equal(raw, i8.quantize(w, 64)), name
        codes, scale = i8.quantize_codes(w, 64)
        assert torch.equal(i8.dequantize(raw, w.shape[1], 64, torch.float32), i8.dequantize_codes(codes, scale, 64))


@pytest.mark.parametrize("tamper, message", [
    (lambda t: t.pop("p.a.weight_scale"), r"p\.a\.weight_scale is missing"),
    (lambda t: t.__setitem__("p.a.comfy_quant", torch.tensor(list(b"{oops"), dtype=torch.uint8)), r"p\.a\.comfy_quant: not readable JSON"),
    (lambda t: t.__setitem__("p.a.comfy_quant", torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)),
     r"p\.a\.comfy_quant: format 'float8_e4m3fn' .*is not an int8 ConvRot layer"),
    (lambda t: t.__setitem__("p.a.comfy_quant", torch.tensor(list(
        b'{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 48}'), dtype=torch.uint8)),
     r"p\.a\.comfy_quant: convrot_groupsize: .*power of 4"),
    (lambda t: t.__setitem__("p.a.weight", t["p.a.weight"].float()), r"p\.a\.weight is torch\.float32 .*not a 2-D int8"),
    (lambda t: t.__setitem__("p.a.weight_scale", torch.ones(3)), r"p\.a\.weight_scale has shape \(3,\)"),
])
def test_a_bad_layer_is_named_with_its_file(tmp_path, tamper, message):
    path = _comfy_file(tmp_path / "bad.safetensors", {"a": torch.randn(8, 64)}, prefix="p.", tamper=tamper)
    with pytest.raises(ValueError, match=rf"bad\.safetensors: {message}"):
        i8.read_comfy_int8(path, prefix="p.")


# -- a tiny Flux on an int8 base ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def source():
    return tiny.flux_transformer(seed=3, **WIDE)


def _int8_base(source):
    model = copy.deepcopy(source).requires_grad_(False)
    assert len(i8.apply_int8_storage(model, FLUX_SPEC)) == 34     # 2 x 12 + 2 x 5 block Linears, modulation kept
    return model


def _lora_base(source, kind: str = "lora"):
    from leantune.config import LoraConfig
    from leantune.train.lora import add_lora

    model = _int8_base(source)
    params = add_lora(model, FLUX_SPEC, LoraConfig(type=kind, rank=4, targets="all"))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_the_stored_linears_decode_to_the_source_and_the_planner_prices_their_bytes(source):
    """Every taken Linear decodes to its source weight to int8's precision; the planner's bytes
    per block equal the stored bytes (in + 4 per row), in every plan, and the streamed units'
    packed sizes equal unit_bytes."""
    from leantune.planner.weight_bytes import measure_weights

    model = _int8_base(source)
    src = {q: lin for q, _, lin in block_linears(FLUX_SPEC, source)}
    for qname, _, lin in block_linears(FLUX_SPEC, model):
        if i8.is_int8(lin):
            w = src[qname].weight
            assert lin.weight.numel() == lin.out_features * (lin.in_features + 4)
            assert (i8.stored_weight(lin) - w).norm() / w.norm() < 0.01, qname
    weights = measure_weights(FLUX_SPEC, model)
    for (name, block), w in zip(FLUX_SPEC.blocks(model), weights.blocks):
        actual = sum(t.numel() * t.element_size() for t in list(block.parameters()) + list(block.buffers()))
        assert w.bytes(4) == w.bytes(4, fp8=True) == actual, name
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(block_names(model))), "cpu")
    try:
        packed = {u.name: u.nbytes for u in handle.streaming.units}
        for w in weights.blocks:
            assert packed[w.name] == w.unit_bytes(4), w.name
    finally:
        handle.remove()


def test_streamed_equals_resident_bitwise_in_poison_mode(source):
    """Streamed and checkpointed in poison mode equals resident bitwise, the int8 rows streamed as
    uint8 (test_memory_helpers.assert_quantized_base_streams_exactly)."""
    assert_quantized_base_streams_exactly(_lora_base(source), stored=34)


def test_fp8_storage_leaves_the_int8_rows_alone(source):
    model = _lora_base(source)
    want = train(copy.deepcopy(model))
    handle = apply_memory(model, FLUX_SPEC, Plan(fp8=True), "cpu")
    assert not handle.fp8.linears
    assert_records_equal(train(model), want)


def test_lokr_loha_and_dora_train_on_an_int8_base_as_on_its_decoded_weights(source):
    """train/quantized_adapters.py: each type reads the Linear's shape and decoded rows, not the bytes."""
    assert_adapters_train_as_on_the_decoded_base(_int8_base(source), stored=34)


def test_a_lora_learns_on_an_int8_base_and_its_file_applies_to_the_bf16_base(source, tmp_path):
    """The same fit (rank 4, Adam, one batch) on the int8 base and on its source learns as fast
    (loss ratios within 0.02); its ComfyUI file applies to the bf16 base as trained."""
    from leantune.config import LoraConfig
    from leantune.train.lora import add_lora, apply_lora, lora_weights_from_model
    from leantune.train.lora_formats import read_lora, save_lora

    def fit(model, steps=40):
        params = add_lora(model, FLUX_SPEC, LoraConfig(rank=4, targets="all"))
        opt = torch.optim.Adam(params, lr=1e-2)
        x, sigma, embeds, hw, target = make_batch(8, 8, seed=0)
        losses = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(predict(model, x, sigma, embeds, hw, guidance=1.0), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    model, plain = _int8_base(source), copy.deepcopy(source)
    on_int8, on_source = fit(model), fit(plain)
    ratio, want = on_int8[-1] / on_int8[0], on_source[-1] / on_source[0]
    assert ratio < 0.6 and abs(ratio - want) < 0.02, (ratio, want)
    path = save_lora(lora_weights_from_model(model), tmp_path / "int8.safetensors", "comfyui")
    bf16 = copy.deepcopy(source).to(torch.bfloat16).requires_grad_(False)
    x, sigma, embeds, hw, _ = make_batch(8, 8, seed=0, dtype=torch.bfloat16)
    with torch.no_grad():
        before = predict(bf16, x, sigma, embeds, hw, guidance=1.0)
    weights = read_lora(path)
    assert len(apply_lora(bf16, weights)) == len(weights.modules) == 40
    with torch.no_grad():
        assert not torch.equal(predict(bf16, x, sigma, embeds, hw, guidance=1.0), before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch._int_mm)")
def test_the_int_mm_forward_is_the_w8a8_product_on_cuda(monkeypatch):
    """GPU-only: with INT_MM on, the CUDA forward (input rotated and quantized per row,
    torch._int_mm) is the dequantizing product to the activations' int8 rounding."""
    g = torch.Generator().manual_seed(4)
    lin = torch.nn.Linear(256, 64)
    i8.set_int8_weight(lin, i8.quantize(torch.randn(64, 256, generator=g), 64), 64)
    lin = lin.cuda()
    x = torch.randn(32, 256, generator=g).cuda().bfloat16()
    want = lin(x)
    monkeypatch.setattr(i8, "INT_MM", True)
    got = lin(x)
    assert got.dtype == want.dtype and ((got.float() - want.float()).norm() / want.float().norm()) < 0.02


# -- [model] transformer = a ComfyUI int8 ConvRot file ------------------------------------------------

def _comfy_int8_flux(source, path: Path) -> dict[str, torch.Tensor]:
    """`source` as ComfyUI's int8 ConvRot Flux files are laid out: the BFL single file's names under
    model.diffusion_model., every 2-D block weight (modulation included) as int8 ConvRot (groups
    of 64), the rest and the file's metadata as written; returns each quantized weight's decoded fp32 value by file key."""
    from leantune.io import load_safetensors
    from leantune.models.flux import loading as flux_loading

    plain = flux_loading.save_bfl_transformer(source, path.with_name("plain.safetensors"), dtype=torch.float32)
    tensors, metadata = load_safetensors(plain)
    out, decoded = {}, {}
    for key, t in tensors.items():
        name = f"model.diffusion_model.{key}"
        if key.startswith(("double_blocks.", "single_blocks.")) and key.endswith(".weight") and t.dim() == 2:
            codes, scale = i8.quantize_codes(t, 64)
            stem = name[: -len("weight")]
            out[name], out[stem + "weight_scale"], out[stem + "comfy_quant"] = codes, scale, i8.comfy_quant_bytes(64)
            decoded[key] = i8.dequantize_codes(codes, scale, 64)
        else:
            out[name] = t
    save_file(out, str(path), metadata=metadata)          # leantune's config (the tiny widths' rotary axes)
    return decoded


def test_a_comfyui_int8_convrot_flux_file_loads_with_its_linears_kept_int8(source, tmp_path):
    """[model] transformer = a ComfyUI int8 ConvRot Flux file: every block Linear (BFL's fused qkv
    and linear1 split by rows) holds the file's codes and scale as stored rows and computes with
    ComfyUI's dequantization of them, bitwise: the loaded model equals a plain one holding those
    weights, and the source to int8's precision."""
    from leantune.models.flux import PromptEmbeds
    from leantune.models.flux import loading as flux_loading

    path = tmp_path / "flux_int8_convrot.safetensors"
    decoded = _comfy_int8_flux(source, path)
    model = flux_loading.load_transformer(flux_loading.FluxSources(path, None, None, None, None, None),
                                          dtype=torch.float32)
    stored = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and i8.is_int8(m)]
    assert len(stored) == 40                                      # every block Linear, modulation included
    d = model.x_embedder.out_features
    qkv = decoded["double_blocks.1.img_attn.qkv.weight"]
    for i, part in enumerate(("to_q", "to_k", "to_v")):
        lin = getattr(model.transformer_blocks[1].attn, part)
        assert torch.equal(i8.stored_weight(lin), qkv[d * i:d * (i + 1)]), part
    assert torch.equal(i8.stored_weight(model.single_transformer_blocks[0].proj_out),
                       decoded["single_blocks.0.linear2.weight"])
    plain = copy.deepcopy(source)
    with torch.no_grad():
        for name in stored:
            plain.get_submodule(name).weight.copy_(i8.stored_weight(model.get_submodule(name)))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, source.config.in_channels, generator=g)
    embeds = PromptEmbeds(torch.randn(2, 8, 32, generator=g), torch.randn(2, 32, generator=g))
    with torch.no_grad():
        got = predict(model, x, torch.tensor([0.3, 0.8]), embeds, (8, 8), guidance=3.5)
        want = predict(plain, x, torch.tensor([0.3, 0.8]), embeds, (8, 8), guidance=3.5)
        orig = predict(source, x, torch.tensor([0.3, 0.8]), embeds, (8, 8), guidance=3.5)
    assert torch.equal(got, want)
    assert (got - orig).norm() / orig.norm() < 0.01


def test_a_bad_int8_layer_in_a_flux_file_is_named(source, tmp_path):
    from leantune.models.flux import loading as flux_loading
    from leantune.models.weights import LoadError

    path = tmp_path / "flux_int8_convrot.safetensors"
    _comfy_int8_flux(source, path)
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    key = "model.diffusion_model.double_blocks.0.img_attn.qkv.weight_scale"
    tensors.pop(key)
    save_file(tensors, str(path))                         # no metadata: the error comes before the config
    with pytest.raises(LoadError, match=r"flux_int8_convrot\.safetensors: " + re.escape(key) + " is missing"):
        flux_loading.load_transformer(flux_loading.FluxSources(path, None, None, None, None, None))


# -- [memory] base_format = "int8": quantized as a bf16 file is read ----------------------------------

def test_base_format_int8_quantizes_each_weight_as_read_in_bounded_chunks(source, tmp_path, monkeypatch):
    """[memory] base_format = "int8" (the trainer's load option quantize_fp8="int8"): every block
    Linear apply_int8_storage takes holds int8 ConvRot rows equal, byte for byte, to quantizing the
    bf16 load's weight, a few rows at a time (QUANT_CHUNK, here 640 fp32 values: no call saw more,
    and the 640-wide inputs went one row at a time); everything else is the bf16 load's; the meta load (what the planner prices) has the
    stored shapes; and the config's key names the option."""
    from leantune.config import MemoryConfig, RunConfig
    from leantune.models.flux import loading as flux_loading
    from leantune.trainer import _fp8_load_options

    path = flux_loading.save_bfl_transformer(source, tmp_path / "flux.safetensors", dtype=torch.bfloat16)
    sources = flux_loading.FluxSources(path, None, None, None, None, None)
    calls = []
    real = i8.quantize
    monkeypatch.setattr(i8, "QUANT_CHUNK", 4 * 640)
    monkeypatch.setattr(i8, "quantize", lambda w, g: (calls.append(w.shape), real(w, g))[1])
    got = flux_loading.load_transformer(sources, dtype=torch.bfloat16, quantize_fp8="int8")
    monkeypatch.setattr(i8, "quantize", real)
    ref = flux_loading.load_transformer(sources, dtype=torch.bfloat16).requires_grad_(False)
    assert calls and max(r * c for r, c in calls) <= 640 and (1, 640) in calls
    in_place = copy.deepcopy(ref)
    assert len(i8.apply_int8_storage(in_place, FLUX_SPEC)) == 34
    taken = {f"{q}.weight" for q, _, lin in block_linears(FLUX_SPEC, got) if i8.is_int8(lin)}
    assert len(taken) == 34 and not any(p.requires_grad for n, p in got.named_parameters() if n in taken)
    want = in_place.state_dict()
    for name, t in got.state_dict().items():
        assert torch.equal(t, want[name]), name                      # int8 rows and every other tensor
    meta = flux_loading.load_transformer(sources, dtype=torch.bfloat16, device="meta", quantize_fp8="int8")
    for name, t in meta.state_dict().items():
        assert (t.shape, t.dtype) == (want[name].shape, want[name].dtype), name
    run = dict(model={"path": "x"}, data={"datasets": [{"path": "d"}]})
    assert _fp8_load_options(RunConfig(**run, memory={"base_format": "int8"})) == {"quantize_fp8": "int8"}
    with pytest.raises(ValueError, match=r'base_format = "int8" and fp8 = true'):
        MemoryConfig(base_format="int8", fp8=True)
