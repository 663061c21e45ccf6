"""GGUF bases (models/gguf_file.py, memory/gguf_storage.py): a tiny Flux written to GGUF files as
ComfyUI-GGUF's converter writes them, loaded with its block Linears kept in their blocks.

The files: the tiny Flux's state dict in BFL / ComfyUI names (no `model.diffusion_model.` prefix),
written by the gguf package's GGUFWriter, the way city96's tools/convert.py does: 1-D tensors and
the embedders / final layer in F32, every other 2-D tensor quantized, a tensor whose rows do not
hold whole blocks in F16 (the converters' fallback). Q8_0 quantizes with gguf.quants.quantize on the
standard tiny Flux (width 32: every row length divides by 32), as IQ4_NL (32-value blocks) does.
The 256-value types need rows of whole 256s, so their files come from a tiny Flux 256 wide (4 heads
of 64); and gguf 0.19 decodes the K and IQ4 types but cannot encode them (llama.cpp's C quantizer
does), so tests/gguf_encoders.py packs their blocks by the format's layout (plain per-sub-block
scales, not llama.cpp's search): the reference the tests compare with is still the package's
decoder, and each encoder is checked against its input.
"""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_encoders import encode
from test_memory_helpers import (assert_adapters_train_as_on_the_decoded_base, assert_quantized_base_streams_exactly,
                                 assert_records_equal, block_names, make_batch, train)

from leantune import tiny
from leantune.memory.engine import apply_memory
from leantune.memory.gguf_storage import TYPE_ATTR, is_gguf, stored_weight
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC, PromptEmbeds, predict
from leantune.models.flux import keys as bfl_keys
from leantune.models.flux.loading import FluxSources, load_transformer
from leantune.models.weights import LoadError

Q = gguf.GGMLQuantizationType
WIDE = dict(attention_head_dim=64, num_attention_heads=4, axes_dims_rope=(8, 28, 28))    # inner width 256
_F32_KEYS = ("time_in.", "txt_in.", "vector_in.", "img_in.", "guidance_in.", "final_layer.")   # convert.py's list


# -- writing GGUF files as the community's converter does ---------------------------------------------

def write_gguf(model, path: Path, qtype: Q) -> dict[str, Q]:
    """`model` (a diffusers Flux) as a ComfyUI-GGUF Flux file; returns each tensor's type."""
    values, _ = gguf.GGML_QUANT_SIZES[qtype]
    writer = gguf.GGUFWriter(str(path), "flux")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    types = {}
    for key, t in bfl_keys.diffusers_to_bfl(model.state_dict()).items():
        a = t.float().numpy()
        if a.ndim == 1 or key.startswith(_F32_KEYS):
            kind, data = Q.F32, a
        elif a.shape[-1] % values:
            kind, data = Q.F16, a.astype(np.float16)
        else:
            kind, data = qtype, encode(a, qtype)
        writer.add_tensor(key, data, raw_dtype=kind)
        types[key] = kind
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


_BASES: dict = {}


def _base(qtype: Q, tmp_path_factory):
    """(bf16-free reference model in fp32, file path, types) for one block type, written once."""
    if qtype not in _BASES:
        ref = tiny.flux_transformer(seed=2, **({} if gguf.GGML_QUANT_SIZES[qtype][0] == 32 else WIDE))
        path = tmp_path_factory.mktemp("gguf") / f"flux-{qtype.name}.gguf"
        _BASES[qtype] = (ref, path, write_gguf(ref, path, qtype))
    return _BASES[qtype]


def _sources(path: Path) -> FluxSources:
    return FluxSources(path, None, None, None, None, None)


TYPES = [Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q4_K, Q.Q3_K, Q.Q2_K, Q.IQ4_NL, Q.IQ4_XS]
# the decoded weight's relative error against the source, bounded per type (the encoders are sane)
SOURCE_ERROR = {Q.Q8_0: 0.01, Q.Q6_K: 0.03, Q.Q5_K: 0.05, Q.Q4_K: 0.1, Q.Q3_K: 0.2, Q.Q2_K: 0.4,
                Q.IQ4_NL: 0.1, Q.IQ4_XS: 0.1}


@pytest.fixture(scope="module", params=TYPES, ids=[t.name for t in TYPES])
def gguf_base(request, tmp_path_factory):
    return (request.param, *_base(request.param, tmp_path_factory))


# -- reading ---------------------------------------------------------------------------------------

def test_block_linears_keep_their_blocks_and_decode_as_the_gguf_package(gguf_base):
    """Every block Linear holds the file's bytes (BFL's fused qkv / linear1 split by rows) with its
    type; gguf.quants.dequantize of the file's own tensor gives, bitwise, the weights the loaded
    Linears compute with; F32 tensors load as written; the encoder for the K types is near its input."""
    qtype, ref, path, types = gguf_base
    model = load_transformer(_sources(path), dtype=torch.float32)
    reader = gguf.GGUFReader(path)
    raw = {t.name: t for t in reader.tensors}
    stored = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear and is_gguf(m)]
    in_blocks = [n for n, _ in stored if n.startswith(("transformer_blocks.", "single_transformer_blocks."))]
    assert len(in_blocks) == len(stored) == 40                   # 2 double x 13 + 2 single x 7 block Linears
    assert all(m.__dict__[TYPE_ATTR] == int(qtype) and m.weight.dtype == torch.uint8 for _, m in stored)
    d = model.x_embedder.out_features                                           # inner width
    qkv = raw["double_blocks.1.img_attn.qkv.weight"]
    assert qkv.tensor_type == qtype
    want = gguf.quants.dequantize(qkv.data, qtype)                              # (3D, D) fp32
    for i, part in enumerate(("to_q", "to_k", "to_v")):
        lin = getattr(model.transformer_blocks[1].attn, part)
        assert torch.equal(lin.weight, torch.from_numpy(np.array(qkv.data[d * i:d * (i + 1)]))), part
        assert torch.equal(stored_weight(lin), torch.from_numpy(want[d * i:d * (i + 1)])), part
    linear2 = raw["single_blocks.0.linear2.weight"]
    assert torch.equal(stored_weight(model.single_transformer_blocks[0].proj_out),
                       torch.from_numpy(gguf.quants.dequantize(linear2.data, qtype)))
    assert torch.equal(model.x_embedder.weight, ref.x_embedder.weight)          # F32 as written
    assert types["img_in.weight"] == Q.F32 and types["double_blocks.0.img_mod.lin.weight"] == qtype
    # the decoded weight is the source's, to the format's precision (the K encoder is sane)
    src = ref.transformer_blocks[1].attn.to_q.weight
    err = (stored_weight(model.transformer_blocks[1].attn.to_q) - src).norm() / src.norm()
    assert err < SOURCE_ERROR[qtype], err


def test_outputs_equal_a_model_holding_the_decoded_weights(gguf_base):
    """The GGUF forward computes exactly what a plain model with gguf.quants.dequantize's weights
    computes (fp32, bitwise); the whole model is the source up to the format's error."""
    qtype, ref, path, _ = gguf_base
    model = load_transformer(_sources(path), dtype=torch.float32)
    plain = copy.deepcopy(ref)
    with torch.no_grad():
        for name, m in model.named_modules():
            if type(m) is torch.nn.Linear and is_gguf(m):
                plain.get_submodule(name).weight.copy_(stored_weight(m))
    g = torch.Generator().manual_seed(0)
    width = ref.config.in_channels
    x = torch.randn(2, 16, width, generator=g)
    embeds = PromptEmbeds(torch.randn(2, 8, 32, generator=g), torch.randn(2, 32, generator=g))
    with torch.no_grad():
        got = predict(model, x, torch.tensor([0.3, 0.8]), embeds, (8, 8), guidance=3.5)
        want = predict(plain, x, torch.tensor([0.3, 0.8]), embeds, (8, 8), guidance=3.5)
        orig = predict(ref, x, torch.tensor([0.3, 0.8]), embeds, (8, 8), guidance=3.5)
    assert torch.equal(got, want)
    assert ((got - orig).norm() / orig.norm()) < SOURCE_ERROR[qtype]


def test_a_gguf_file_is_told_from_its_tensor_names(gguf_base):
    from leantune.models.family import guess_family

    _, _, path, _ = gguf_base
    assert guess_family(path) == "flux"


def test_f16_fallback_rows_load_as_f16(tmp_path):
    """A K-type file of the 32-wide tiny Flux: no row holds a whole 256-value block, so the
    converter keeps every 2-D tensor in F16, and the load holds plain Linears."""
    ref = tiny.flux_transformer(seed=2)
    path = tmp_path / "f16.gguf"
    types = write_gguf(ref, path, Q.Q4_K)
    assert Q.Q4_K not in types.values() and Q.F16 in types.values()
    model = load_transformer(_sources(path), dtype=torch.float32)
    assert not any(is_gguf(m) for m in model.modules())
    to_q = model.transformer_blocks[0].attn.to_q.weight
    assert torch.equal(to_q, ref.transformer_blocks[0].attn.to_q.weight.half().float())


# -- bad files -------------------------------------------------------------------------------------

def _q8(tmp_path_factory) -> Path:
    return _base(Q.Q8_0, tmp_path_factory)[1]


def test_not_a_gguf_file_is_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(LoadError, match=r"bad\.gguf: not a readable GGUF file \(GGUF magic invalid\)"):
        load_transformer(_sources(bad))


def test_truncated_file_names_the_tensor(tmp_path, tmp_path_factory):
    src = _q8(tmp_path_factory)
    data = src.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 300])
    lost = [t for t in gguf.GGUFReader(src).tensors if t.data_offset + t.n_bytes > len(data) - 300]
    assert len(lost) == 2                                       # single_blocks.1.linear2's weight and bias
    end = lost[0].data_offset + lost[0].n_bytes
    with pytest.raises(LoadError, match=rf"cut\.gguf: tensor '{lost[0].name}': its data ends at byte {end}, past "
                                        rf"the end of the file \({len(data) - 300} bytes\)"):
        load_transformer(_sources(cut))


def test_a_type_leantune_does_not_take_is_named(tmp_path, tmp_path_factory):
    """The header's type of one tensor rewritten to F64 (a type no ComfyUI-GGUF file uses)."""
    src = _q8(tmp_path_factory)
    data = bytearray(src.read_bytes())
    name = b"double_blocks.0.img_attn.norm.key_norm.scale"
    at = data.index(name) + len(name)                                # then n_dims u32, dims u64 x n, type u32
    n_dims = int.from_bytes(data[at:at + 4], "little")
    pos = at + 4 + 8 * n_dims
    assert int.from_bytes(data[pos:pos + 4], "little") == int(Q.F32)
    data[pos:pos + 4] = int(Q.F64).to_bytes(4, "little")
    bad = tmp_path / "f64.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(LoadError, match=rf"f64\.gguf: tensor '{name.decode()}' is stored as F64, which leantune "
                                        r"does not read"):
        load_transformer(_sources(bad))


def test_a_gguf_file_only_as_the_transformer(tmp_path, tmp_path_factory):
    from leantune.models.component_loading import check_file

    check_file(_q8(tmp_path_factory), "transformer")
    with pytest.raises(LoadError, match=r"\[model\] vae: .*only \.safetensors.*a \.gguf file only as"):
        check_file(_q8(tmp_path_factory), "vae")


# -- training over the stored blocks ---------------------------------------------------------------

def _lora_base(path: Path, kind: str = "lora"):
    """The GGUF-loaded tiny Flux with a rank-4 adapter of `kind` (train/lora.add_lora) whose
    trainable factors are all random, so every gradient path is exercised."""
    from leantune.config import LoraConfig
    from leantune.train.lora import add_lora

    model = load_transformer(_sources(path), dtype=torch.float32)
    params = add_lora(model, FLUX_SPEC, LoraConfig(type=kind, rank=4, targets="all"))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_streamed_equals_resident_bitwise_in_poison_mode(gguf_base):
    """Two SGD steps with every block and the non-block group streamed (poison mode: a released
    slot is 0xFF, a NaN fp16 block scale) and checkpointed equal the resident run bitwise: loss,
    adapter gradients and values; the blocks stream as stored uint8 and the base keeps its bytes
    (test_memory_helpers.assert_quantized_base_streams_exactly)."""
    _, _, path, _ = gguf_base
    assert_quantized_base_streams_exactly(_lora_base(path), stored=40)


def test_fp8_storage_leaves_the_blocks_alone(tmp_path_factory):
    """[memory] fp8 on a GGUF base: the blocks stay as stored (not re-quantized to e4m3) and the
    run computes what the plain one does, bitwise."""
    path = _q8(tmp_path_factory)
    model = _lora_base(path)
    want = train(copy.deepcopy(model))
    handle = apply_memory(model, FLUX_SPEC, Plan(fp8=True), "cpu")
    assert not handle.fp8.linears
    assert sum(p.dtype == torch.uint8 for p in model.parameters()) == 40
    assert_records_equal(train(model), want)


def test_lokr_loha_and_dora_train_on_a_gguf_base_as_on_its_decoded_weights(tmp_path_factory):
    """train/quantized_adapters.py: DoRA reads the decoded rows, LoKr / LoHa the Linear's shape,
    not the stored blocks'."""
    assert_adapters_train_as_on_the_decoded_base(load_transformer(_sources(_q8(tmp_path_factory)), dtype=torch.float32),
                                                 stored=40)


def _fit(model, steps: int = 40) -> list[float]:
    """A rank-4 LoRA (B = 0 at init, as a real run's) fitted by Adam to one fixed batch."""
    from leantune.config import LoraConfig
    from leantune.train.lora import add_lora

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


def test_a_lora_learns_on_a_q8_0_base_and_its_file_applies_to_the_bf16_base(tmp_path_factory, tmp_path):
    """The loss ratio (last / first) of the same fit on the Q8_0 base and on the fp32 model it was
    quantized from: it learns, and as fast (within 0.02). Its ComfyUI file has the keys and shapes
    of the one trained on the source, and applies to the bf16 base as trained (peft's A / B are
    the file's), changing its output."""
    from leantune.io import load_safetensors
    from leantune.train.lora import apply_lora, lora_weights_from_model
    from leantune.train.lora_formats import read_lora, save_lora

    ref, path, _ = _base(Q.Q8_0, tmp_path_factory)
    model, source = load_transformer(_sources(path), dtype=torch.float32), copy.deepcopy(ref)
    on_gguf, on_source = _fit(model), _fit(source)
    ratio, want = on_gguf[-1] / on_gguf[0], on_source[-1] / on_source[0]
    assert ratio < 0.6 and abs(ratio - want) < 0.02, (ratio, want)
    files = {name: save_lora(lora_weights_from_model(m), tmp_path / f"{name}.safetensors", "comfyui")
             for name, m in (("gguf", model), ("source", source))}
    tensors = {name: load_safetensors(f)[0] for name, f in files.items()}
    assert {k: t.shape for k, t in tensors["gguf"].items()} == {k: t.shape for k, t in tensors["source"].items()}
    bf16 = copy.deepcopy(ref).to(torch.bfloat16).requires_grad_(False)
    x, sigma, embeds, hw, _ = make_batch(8, 8, seed=0, dtype=torch.bfloat16)
    with torch.no_grad():
        plain = predict(bf16, x, sigma, embeds, hw, guidance=1.0)
    weights = read_lora(files["gguf"])
    wrapped = apply_lora(bf16, weights)
    assert len(wrapped) == len(weights.modules) == 40               # "all": every block Linear
    for name in wrapped:
        layer = bf16.get_submodule(name)
        assert torch.equal(layer.lora_A["lora"].weight, weights.modules[name].down.to(layer.lora_A["lora"].weight.dtype))
    with torch.no_grad():
        assert not torch.equal(predict(bf16, x, sigma, embeds, hw, guidance=1.0), plain)


# -- the planner prices the stored bytes -----------------------------------------------------------

def test_planner_weight_bytes_equal_the_stored_bytes(gguf_base):
    """A meta load (what the planner prices) reports, per block and in total, the bytes the real
    load holds: 34 per 32 values for Q8_0, 210 / 176 / 144 / 136 / 110 / 84 per 256 for Q6_K / Q5_K /
    Q4_K / IQ4_XS / Q3_K / Q2_K, 18 per 32 for IQ4_NL, in every plan;
    the streamed units' packed size equals unit_bytes."""
    from leantune.planner.weight_bytes import measure_weights

    qtype, _, path, _ = gguf_base
    real = load_transformer(_sources(path), dtype=torch.float32)
    meta = load_transformer(_sources(path), dtype=torch.float32, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    weights = measure_weights(FLUX_SPEC, meta)
    per = {Q.Q8_0: 34 / 32, Q.Q6_K: 210 / 256, Q.Q5_K: 176 / 256, Q.Q4_K: 144 / 256, Q.Q3_K: 110 / 256,
           Q.Q2_K: 84 / 256, Q.IQ4_NL: 18 / 32, Q.IQ4_XS: 136 / 256}[qtype]
    to_q = real.transformer_blocks[0].attn.to_q
    assert to_q.weight.numel() == to_q.in_features * to_q.out_features * per
    for (name, block), w in zip(FLUX_SPEC.blocks(real), weights.blocks):
        actual = sum(t.numel() * t.element_size() for t in list(block.parameters()) + list(block.buffers()))
        assert w.bytes(4) == w.bytes(4, fp8=True, modulation=True) == actual, name
    total = sum(t.numel() * t.element_size() for t in list(real.parameters()) + list(real.buffers()))
    assert weights.total(4) == weights.total(4, fp8=True) == total
    assert not weights.prequantized and not weights.fp8_convertible()
    handle = apply_memory(real.requires_grad_(False), FLUX_SPEC, Plan(streamed_blocks=tuple(block_names(real))), "cpu")
    try:
        packed = {u.name: u.nbytes for u in handle.streaming.units}
        for w in weights.blocks:
            assert packed[w.name] == w.unit_bytes(4), w.name
    finally:
        handle.remove()


def test_model_path_and_transformer_keys_take_a_gguf_file(tmp_path_factory, tmp_path):
    """[model] path = a .gguf file is the transformer (no other component in it); [model]
    transformer = a .gguf file overrides a folder's transformer/."""
    from leantune.config import ModelConfig
    from leantune.models.flux.loading import resolve_sources

    path = _q8(tmp_path_factory)
    alone = resolve_sources(ModelConfig(path=str(path)), tmp_path)
    assert alone.transformer == path and alone.vae is None and alone.text_encoder is None
    folder = tmp_path / "flux"
    (folder / "vae").mkdir(parents=True)
    (folder / "vae" / "config.json").write_text("{}")
    both = resolve_sources(ModelConfig(path=str(folder), transformer=str(path)), tmp_path)
    assert both.transformer == path and both.vae == folder / "vae"


# -- the other families whose GGUF names are their single files' -----------------------------------

def _to_gguf(safetensors_path: Path, path: Path) -> Path:
    """A single-file safetensors transformer rewritten as GGUF by the converter's rule: 1-D and
    rows that hold no whole Q8_0 block in F32, every other 2-D tensor Q8_0; names unchanged, and
    the file's string metadata as GGUF string fields (the tiny widths' rotary axes, which the
    released models' head widths do not need)."""
    from leantune.io import load_safetensors

    tensors, metadata = load_safetensors(safetensors_path)
    writer = gguf.GGUFWriter(str(path), "unknown")
    for key, value in (metadata or {}).items():        # leantune's config (the tiny widths' rotary axes)
        writer.add_string(key, value)
    for key, t in tensors.items():
        a = t.float().numpy()
        if a.ndim == 2 and a.shape[-1] % 32 == 0:
            writer.add_tensor(key, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(key, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _family(name: str):
    """(tiny model, save_single_file, load(path), spec) of a family with single-file GGUF reading."""
    if name == "flux2":
        from leantune.models.flux2.single_file import load_single_file_transformer, save_single_file
        from leantune.models.flux2.spec import FLUX2_DEV_SPEC as spec
        from leantune.tiny.flux2 import flux2_transformer as build

        return build(seed=2), save_single_file, lambda p: load_single_file_transformer(p, torch.float32), spec
    if name == "z-image":
        from leantune.models.z_image.loading import ZImageSources, load_transformer as load, save_single_file
        from leantune.models.z_image.spec import Z_IMAGE_SPEC as spec
        from leantune.tiny.z_image import z_image_transformer as build

        return build(seed=2), save_single_file, lambda p: load(ZImageSources(p, None, None, None), torch.float32), spec
    if name == "qwen-image":
        from leantune.models.qwen_image.loading import QwenImageSources, load_transformer as load
        from leantune.models.qwen_image.loading import save_comfy_transformer as save
        from leantune.models.qwen_image.spec import QWEN_IMAGE_SPEC as spec
        from leantune.tiny.qwen_image import qwen_image_transformer as build

        return build(seed=2), save, lambda p: load(QwenImageSources(p, None, None, None), torch.float32), spec
    from leantune.models.krea2.loading import Krea2Sources, load_transformer as load, save_single_file
    from leantune.models.krea2.spec import KREA2_SPEC as spec
    from leantune.tiny.krea2 import krea2_transformer as build

    return build(seed=2), save_single_file, lambda p: load(Krea2Sources(p, None, None, None), torch.float32), spec


@pytest.mark.parametrize("family", ["flux2", "qwen-image", "z-image", "krea2"])
def test_other_families_read_a_gguf_single_file(family, tmp_path):
    """The family's own single file, rewritten as GGUF, loads through its single-file reader: every
    block Linear whose rows hold whole blocks keeps its Q8_0 blocks (the key conversion's splits by rows included), each decodes
    to the safetensors load's weight to Q8_0's precision; a quantized tensor of no Linear is decoded
    as read, the others are as written."""
    from leantune.memory.fp8 import block_linears

    model, save, load, spec = _family(family)
    src = save(model, tmp_path / "t.safetensors", dtype=torch.float32)
    plain, kept = load(src), load(_to_gguf(src, tmp_path / "t.gguf"))
    linears = block_linears(spec, kept)
    assert any(is_gguf(lin) for _, _, lin in linears)
    assert all(is_gguf(lin) == (lin.in_features % 32 == 0) for _, _, lin in linears)   # else F32, as written
    want = dict(plain.named_parameters())
    for name, m in kept.named_modules():
        if type(m) is torch.nn.Linear and is_gguf(m):
            ref = want[f"{name}.weight"]
            assert (stored_weight(m) - ref).norm() / ref.norm() < 0.01, name
    for name, p in kept.named_parameters():
        if p.dtype == torch.uint8:
            continue
        if p.dim() == 2 and p.shape[-1] % 32 == 0:     # a quantized tensor of no Linear (pad tokens): decoded
            assert (p - want[name]).norm() / want[name].norm() < 0.01, name
        else:
            assert torch.equal(p, want[name]), name


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda t: t.name)
def test_legacy_32_value_types_decode_as_the_gguf_package(qtype):
    """The other block types leantune keeps (ComfyUI-GGUF also publishes Q4_0 / Q4_1 / Q5_0 / Q5_1):
    a Linear holding their blocks computes with gguf.quants.dequantize's weight, bitwise, forward
    and backward."""
    from leantune.memory.gguf_storage import use_gguf_weight

    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 64, generator=g)
    blocks = gguf.quants.quantize(w.numpy(), qtype)
    lin = torch.nn.Linear(64, 24)
    lin.weight = torch.nn.Parameter(torch.from_numpy(blocks), requires_grad=False)
    use_gguf_weight(lin, int(qtype))
    want = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    assert torch.equal(stored_weight(lin), want)
    x = torch.randn(3, 64, generator=g, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = lin(x), torch.nn.functional.linear(x2, want, lin.bias)
    assert torch.equal(y, y2)
    y.sum().backward()
    y2.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)


def test_a_full_fine_tune_of_a_gguf_base_is_refused(tmp_path_factory):
    """Stored blocks are bytes, not weights an optimizer could step: named, before any step."""
    from leantune.config import FullConfig, TrainConfig
    from leantune.train.full_mode import FullMode

    model = load_transformer(_sources(_q8(tmp_path_factory)), dtype=torch.float32)
    with pytest.raises(ValueError, match=r'mode = "full": transformer_blocks\.0\..*weight \(and 39 more\) is stored '
                                         r"as quantized GGUF blocks"):
        FullMode(TrainConfig(), FullConfig(), ["comfyui"]).prepare(model, FLUX_SPEC)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_streamed_equals_resident_on_cuda(tmp_path_factory):
    """GPU-only: on CUDA the blocks stream through real ring slots and decode on the device
    (memory/gguf_decode.py); every block streamed in poison mode equals the resident run on the
    device, bitwise."""
    from test_memory_helpers import run_plan

    model = _lora_base(_q8(tmp_path_factory))
    want, ref, _ = run_plan(model, Plan(), device="cuda")
    ref.remove()
    got, handle, _ = run_plan(model, Plan(streamed_blocks=tuple(block_names(model)), debug_poison=True,
                                          checkpointing="blocks"), device="cuda")
    assert handle.step_report()["bytes_h2d"] > 0
    assert_records_equal(got, want)
    handle.remove()
