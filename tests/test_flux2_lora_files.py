"""FLUX.2 LoRA files: kohya / musubi-tuner, ai-toolkit and LyCORIS LoKr layouts read as diffusers'
own FLUX.2 converters read them (same weight deltas), FLUX.2 told apart from Flux.1 whose names it
shares, and our ComfyUI and diffusers exports loaded by diffusers (its converters and peft) giving
the outputs of the LoRA we wrote.
"""

# Checks moved to the conformance suite (issue 33):
# - test_our_comfyui_export_loads_in_diffusers_with_the_same_outputs, trimmed to diffusers' kohya FLUX.2
#   converter: "our reader reads the ComfyUI file back to the written deltas" moved to
#   tests/families/test_conformance.py::test_lora_files_read_back_exactly[flux2-dev] (the family told from
#   the file alone, the deltas bit for bit; here it was with FLUX2_LORA_KEYS given, within 1e-5)

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import Flux2Transformer2DModel
from diffusers.loaders.lora_conversion_utils import (
    _convert_kohya_flux2_lora_to_diffusers,
    _convert_lycoris_flux2_lokr_to_diffusers,
    _convert_non_diffusers_flux2_lokr_to_diffusers,
    _convert_non_diffusers_flux2_lora_to_diffusers,
)
from diffusers.loaders.lora_pipeline import Flux2LoraLoaderMixin
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

from leantune.io import save_safetensors
from leantune.models.flux2 import keys as flux2_keys
from leantune.models.flux2.lora_keys import FLUX2_LORA_KEYS
from leantune.models.flux.lora_keys import FLUX_LORA_KEYS
from leantune.train.lora_formats import (
    LoraFormatError,
    LoraModule,
    LoraWeights,
    lora_from_state_dict,
    read_lora,
    save_lora,
)

D, HIDDEN = 32, 96      # tiny FLUX.2: 2 heads of 16, SwiGLU MLP 3x wide


def tiny_model(seed: int = 0) -> Flux2Transformer2DModel:
    torch.manual_seed(seed)
    return Flux2Transformer2DModel(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=24, timestep_guidance_channels=32,
                                   mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True).eval()


def _r(*shape, seed=[0]):      # noqa: B006  (a counter: every call new values)
    seed[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0]))


def _diffusers_deltas(converted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """module -> delta (out, in) of a diffusers/peft LoRA state dict (scales baked in, as the
    FLUX.2 converters leave them)."""
    out = {}
    for key in converted:
        if key.endswith(".lora_A.weight"):
            name = key[len("transformer."):-len(".lora_A.weight")]
            out[name] = converted[key.replace("lora_A", "lora_B")].float() @ converted[key].float()
    return out


def _lokr_deltas(converted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """module -> kron(w1, w2) of diffusers' converted LoKr state dict (alpha baked into w1)."""
    def factor(name, n):
        whole = converted.get(f"transformer.{name}.lokr_w{n}")
        if whole is not None:
            return whole.float()
        return converted[f"transformer.{name}.lokr_w{n}_a"].float() @ converted[f"transformer.{name}.lokr_w{n}_b"].float()
    names = {k[len("transformer."):].rsplit(".lokr_", 1)[0] for k in converted}
    return {n: torch.kron(factor(n, 1), factor(n, 2)) for n in names}


def _ours(weights: LoraWeights) -> dict[str, torch.Tensor]:
    return {n: m.delta() for n, m in weights.modules.items()}


def _close(a: dict, b: dict):
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


# -- kohya / musubi-tuner -----------------------------------------------------------------------------

def _kohya(block_diagonal: bool) -> dict[str, torch.Tensor]:
    r = 4
    sd = {}

    def put(name, down, up, alpha):
        sd[f"lora_unet_{name}.lora_down.weight"] = down
        sd[f"lora_unet_{name}.lora_up.weight"] = up
        sd[f"lora_unet_{name}.alpha"] = torch.tensor(float(alpha))

    up_qkv = torch.block_diag(_r(D, r), _r(D, r), _r(D, r)) if block_diagonal else _r(3 * D, 3 * r)
    put("double_blocks_0_img_attn_qkv", _r(3 * r, D), up_qkv, 6.0)
    put("double_blocks_1_txt_attn_qkv", _r(3 * r, D), _r(3 * D, 3 * r), 12.0)
    put("double_blocks_0_img_attn_proj", _r(r, D), _r(D, r), 2.0)
    put("double_blocks_1_txt_attn_proj", _r(r, D), _r(D, r), 4.0)
    put("double_blocks_0_img_mlp_0", _r(r, D), _r(2 * HIDDEN, r), 8.0)
    put("double_blocks_1_txt_mlp_2", _r(r, HIDDEN), _r(D, r), 1.0)
    put("single_blocks_0_linear1", _r(r, D), _r(3 * D + 2 * HIDDEN, r), 4.0)
    put("single_blocks_1_linear2", _r(r, D + HIDDEN), _r(D, r), 3.0)
    put("img_in", _r(r, 8), _r(D, r), 4.0)
    return sd


@pytest.mark.parametrize("block_diagonal", [True, False])
def test_kohya_file_reads_as_diffusers_converter(block_diagonal):
    sd = _kohya(block_diagonal)
    ours = lora_from_state_dict(dict(sd), keys=FLUX2_LORA_KEYS, source="kohya.safetensors")
    assert ours.format == "comfyui"
    theirs = _diffusers_deltas(_convert_kohya_flux2_lora_to_diffusers(dict(sd)))
    _close(_ours(ours), theirs)
    assert "single_transformer_blocks.0.attn.to_qkv_mlp_proj" in ours.modules           # kept fused


def test_kohya_file_family_is_read_from_shapes():
    """FLUX.2 and Flux.1 kohya names are the same; the shapes (linear1 9:1, SwiGLU MLP) say FLUX.2,
    and a Flux.1 file (linear1 7:1) is not read as FLUX.2."""
    sd = _kohya(True)
    assert lora_from_state_dict(dict(sd)).keys is FLUX2_LORA_KEYS
    with pytest.raises(LoraFormatError, match=r"not a Flux LoRA: .* where a Flux (img_mlp\.0|linear1) has"):
        lora_from_state_dict(dict(sd), keys=FLUX_LORA_KEYS)
    flux1 = {"lora_unet_single_blocks_0_linear1.lora_down.weight": _r(4, D),
             "lora_unet_single_blocks_0_linear1.lora_up.weight": _r(7 * D, 4)}
    with pytest.raises(LoraFormatError, match=r"not a FLUX\.2 LoRA: 224 outputs for 32 inputs.*9:1"):
        lora_from_state_dict(flux1, keys=FLUX2_LORA_KEYS)
    assert lora_from_state_dict(dict(flux1), keys=FLUX_LORA_KEYS).keys is FLUX_LORA_KEYS


# -- ai-toolkit ------------------------------------------------------------------------------------------

def _ai_toolkit() -> dict[str, torch.Tensor]:
    r = 4
    sd = {}

    def put(name, down, up):
        sd[f"diffusion_model.{name}.lora_A.weight"] = down
        sd[f"diffusion_model.{name}.lora_B.weight"] = up

    put("double_blocks.0.img_attn.qkv", _r(r, D), _r(3 * D, r))
    put("double_blocks.1.txt_attn.qkv", _r(r, D), _r(3 * D, r))
    put("double_blocks.0.txt_attn.proj", _r(r, D), _r(D, r))
    put("double_blocks.1.img_mlp.0", _r(r, D), _r(2 * HIDDEN, r))
    put("double_blocks.1.img_mlp.2", _r(r, HIDDEN), _r(D, r))
    put("single_blocks.1.linear1", _r(r, D), _r(3 * D + 2 * HIDDEN, r))
    put("single_blocks.0.linear2", _r(r, D + HIDDEN), _r(D, r))
    put("single_stream_modulation.lin", _r(r, D), _r(3 * D, r))
    put("double_stream_modulation_txt.lin", _r(r, D), _r(6 * D, r))
    put("txt_in", _r(r, 24), _r(D, r))
    put("transformer_blocks.1.attn.to_out.0", _r(r, D), _r(D, r))      # expanded diffusers names
    return sd


def test_ai_toolkit_file_reads_as_diffusers_converter():
    sd = _ai_toolkit()
    ours = lora_from_state_dict(dict(sd), keys=FLUX2_LORA_KEYS)
    theirs = _diffusers_deltas(_convert_non_diffusers_flux2_lora_to_diffusers(dict(sd)))
    _close(_ours(ours), theirs)


def test_native_lora_deltas_are_the_checkpoint_conversion_of_merged_weights():
    """The ground truth under every name: merging a LoRA into BFL weights and converting the
    checkpoint with diffusers' single-file converter gives the diffusers weights plus our deltas.
    This covers the final adaLN, whose halves BFL orders (shift, scale): diffusers' ai-toolkit
    LoRA converter maps it without the swap its checkpoint converter makes."""
    model = tiny_model()
    state = model.state_dict()
    bfl = flux2_keys.diffusers_to_bfl(state)
    sd = _ai_toolkit()
    sd["diffusion_model.final_layer.adaLN_modulation.1.lora_A.weight"] = _r(4, D)
    sd["diffusion_model.final_layer.adaLN_modulation.1.lora_B.weight"] = _r(2 * D, 4)
    sd = {k: v for k, v in sd.items() if ".transformer_blocks." not in k}
    merged = dict(bfl)
    for key in sd:
        if key.endswith(".lora_A.weight"):
            native = key[len("diffusion_model."):-len(".lora_A.weight")]
            merged[native + ".weight"] = bfl[native + ".weight"] + sd[key.replace("lora_A", "lora_B")] @ sd[key]
    truth = convert_flux2_transformer_checkpoint_to_diffusers(merged)
    ours = lora_from_state_dict(sd, keys=FLUX2_LORA_KEYS)
    for name, m in ours.modules.items():
        torch.testing.assert_close(state[name + ".weight"] + m.delta(), truth[name + ".weight"], rtol=1e-5,
                                   atol=1e-6, msg=name)
    untouched = set(state) - {n + ".weight" for n in ours.modules}
    assert untouched and all(torch.equal(truth[k], state[k]) for k in untouched)


# -- LoKr ------------------------------------------------------------------------------------------------

def _lokr_bfl() -> dict[str, torch.Tensor]:
    p = "diffusion_model."
    return {
        # qkv (96, 32): w1 whole (4, 2), w2 = a @ b (24, 3) @ (3, 16), alpha 6 -> scale 2
        f"{p}double_blocks.0.img_attn.qkv.lokr_w1": _r(4, 2),
        f"{p}double_blocks.0.img_attn.qkv.lokr_w2_a": _r(24, 3),
        f"{p}double_blocks.0.img_attn.qkv.lokr_w2_b": _r(3, 16),
        f"{p}double_blocks.0.img_attn.qkv.alpha": torch.tensor(6.0),
        # linear1 (288, 32): w1 = a @ b (4, 2) @ (2, 4), w2 whole (72, 8), alpha 1 -> scale 1/2
        f"{p}single_blocks.1.linear1.lokr_w1_a": _r(4, 2),
        f"{p}single_blocks.1.linear1.lokr_w1_b": _r(2, 4),
        f"{p}single_blocks.1.linear1.lokr_w2": _r(72, 8),
        f"{p}single_blocks.1.linear1.alpha": torch.tensor(1.0),
        # img_mlp.0 (192, 32): both whole: no scaling, the alpha is ignored
        f"{p}double_blocks.1.img_mlp.0.lokr_w1": _r(8, 4),
        f"{p}double_blocks.1.img_mlp.0.lokr_w2": _r(24, 8),
        f"{p}double_blocks.1.img_mlp.0.alpha": torch.tensor(5.0),
        f"{p}double_blocks.1.txt_attn.proj.lokr_w1": _r(2, 4),
        f"{p}double_blocks.1.txt_attn.proj.lokr_w2_a": _r(16, 2),
        f"{p}double_blocks.1.txt_attn.proj.lokr_w2_b": _r(2, 8),
    }


def test_lokr_bfl_file_reads_as_diffusers_converter():
    """ai-toolkit's LoKr on BFL names: the same deltas; diffusers keeps a fused qkv LoKr on the
    fused projection (to_qkv), which is our q, k, v deltas stacked."""
    sd = _lokr_bfl()
    ours = _ours(lora_from_state_dict(dict(sd), keys=FLUX2_LORA_KEYS))
    theirs = _lokr_deltas(_convert_non_diffusers_flux2_lokr_to_diffusers(dict(sd)))
    qkv = theirs.pop("transformer_blocks.0.attn.to_qkv")
    stacked = torch.cat([ours.pop(f"transformer_blocks.0.attn.to_{x}") for x in "qkv"])
    torch.testing.assert_close(stacked, qkv, rtol=1e-5, atol=1e-6)
    _close(ours, theirs)


def _lycoris() -> dict[str, torch.Tensor]:
    return {
        "lycoris_transformer_blocks_0_attn_to_q.lokr_w1": _r(2, 2),
        "lycoris_transformer_blocks_0_attn_to_q.lokr_w2_a": _r(16, 3),
        "lycoris_transformer_blocks_0_attn_to_q.lokr_w2_b": _r(3, 16),
        "lycoris_transformer_blocks_0_attn_to_q.alpha": torch.tensor(1.5),
        "lycoris_transformer_blocks_1_ff_context_linear_out.lokr_w1": _r(4, 4),
        "lycoris_transformer_blocks_1_ff_context_linear_out.lokr_w2": _r(8, 24),
        "lycoris_single_transformer_blocks_0_attn_to_qkv_mlp_proj.lokr_w1_a": _r(4, 1),
        "lycoris_single_transformer_blocks_0_attn_to_qkv_mlp_proj.lokr_w1_b": _r(1, 4),
        "lycoris_single_transformer_blocks_0_attn_to_qkv_mlp_proj.lokr_w2_a": _r(72, 2),
        "lycoris_single_transformer_blocks_0_attn_to_qkv_mlp_proj.lokr_w2_b": _r(2, 8),
        "lycoris_single_transformer_blocks_0_attn_to_qkv_mlp_proj.alpha": torch.tensor(4.0),
        "lycoris_single_transformer_blocks_1_attn_to_out.lokr_w1": _r(2, 4),
        "lycoris_single_transformer_blocks_1_attn_to_out.lokr_w2": _r(16, 32),
    }


def test_lycoris_lokr_file_reads_as_diffusers_converter():
    sd = _lycoris()
    ours = lora_from_state_dict(dict(sd), keys=FLUX2_LORA_KEYS)
    assert ours.format == "lycoris"
    _close(_ours(ours), _lokr_deltas(_convert_lycoris_flux2_lokr_to_diffusers(dict(sd))))


def _lycoris_peft() -> dict[str, torch.Tensor]:
    """LyCORIS LoKr factors as peft lays them out (near-square factors: what diffusers' peft path
    can rebuild), w2 of rank 2 with an alpha."""
    from peft.tuners.lokr.layer import factorization

    shapes = {"transformer_blocks_0_attn_to_q": (D, D), "transformer_blocks_1_attn_add_v_proj": (D, D),
              "transformer_blocks_0_ff_linear_in": (2 * HIDDEN, D),
              "single_transformer_blocks_1_attn_to_qkv_mlp_proj": (3 * D + 2 * HIDDEN, D),
              "single_transformer_blocks_0_attn_to_out": (D, D + HIDDEN)}
    sd = {}
    for name, (out, inp) in shapes.items():
        (lo, ko), (li, ki) = factorization(out, -1), factorization(inp, -1)
        sd[f"lycoris_{name}.lokr_w1"] = _r(lo, li)
        sd[f"lycoris_{name}.lokr_w2_a"] = _r(ko, 2) * 0.3
        sd[f"lycoris_{name}.lokr_w2_b"] = _r(2, ki) * 0.3
        sd[f"lycoris_{name}.alpha"] = torch.tensor(1.0)
    return sd


def test_lycoris_lokr_outputs_match_diffusers_peft_load(tmp_path):
    """The LyCORIS file loaded by diffusers (its converter, then peft's LoKr layers) computes what
    the transformer with our deltas merged computes."""
    path = save_safetensors(_lycoris_peft(), tmp_path / "lycoris.safetensors")
    ours = read_lora(path, keys=FLUX2_LORA_KEYS)
    _check_diffusers_outputs(path, ours)


def test_bad_lokr_is_named():
    sd = _lycoris()
    del sd["lycoris_transformer_blocks_0_attn_to_q.lokr_w2_b"]
    with pytest.raises(LoraFormatError, match=r"x\.safetensors: LoKr module has no lokr_w2"):
        lora_from_state_dict(sd, keys=FLUX2_LORA_KEYS, source="x.safetensors")
    tucker = {"diffusion_model.double_blocks.0.img_attn.proj.lokr_t2": torch.zeros(2, 2, 3, 3)}
    with pytest.raises(LoraFormatError, match=r"'diffusion_model.double_blocks.0.img_attn.proj.lokr_t2'.*Tucker"):
        lora_from_state_dict(tucker, keys=FLUX2_LORA_KEYS)


# -- our exports, read by diffusers -----------------------------------------------------------------------

def _trained() -> LoraWeights:
    """A LoRA like training makes: every preset Linear, one rank and alpha."""
    r, alpha = 4, 8.0
    shapes = {}
    for i in range(2):
        for n in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                  "attn.add_v_proj", "attn.to_add_out"):
            shapes[f"transformer_blocks.{i}.{n}"] = (D, D)
        shapes[f"transformer_blocks.{i}.ff.linear_in"] = (2 * HIDDEN, D)
        shapes[f"transformer_blocks.{i}.ff_context.linear_out"] = (D, HIDDEN)
        shapes[f"single_transformer_blocks.{i}.attn.to_qkv_mlp_proj"] = (3 * D + 2 * HIDDEN, D)
        shapes[f"single_transformer_blocks.{i}.attn.to_out"] = (D, D + HIDDEN)
    return LoraWeights({n: LoraModule(_r(r, i) * 0.1, _r(o, r) * 0.1, alpha) for n, (o, i) in shapes.items()},
                       keys=FLUX2_LORA_KEYS)


def _merged(model, weights: LoraWeights):
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, m in weights.modules.items():
            model.get_submodule(name).weight += m.delta()
    return model


def _out(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(2.0), torch.arange(3.0), torch.zeros(1),
                                         indexing="ij"), -1).reshape(-1, 4)
    txt_ids = torch.zeros(5, 4)
    txt_ids[:, 3] = torch.arange(5.0)
    with torch.no_grad():
        return model(hidden_states=torch.randn(1, 6, 8, generator=g), encoder_hidden_states=torch.randn(1, 5, 24, generator=g),
                     timestep=torch.tensor([0.4]), img_ids=img_ids, txt_ids=txt_ids, guidance=torch.tensor([3.5]),
                     return_dict=False)[0]


def _check_diffusers_outputs(path, weights: LoraWeights):
    base = tiny_model(seed=1)
    want = _out(_merged(base, weights))
    model = copy.deepcopy(base)
    state = Flux2LoraLoaderMixin.lora_state_dict(str(path))
    model.load_lora_adapter(state, prefix="transformer", adapter_name="x")
    got = _out(model)
    assert not torch.allclose(want, _out(base), atol=1e-3)       # the LoRA changes the output
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_our_comfyui_export_loads_in_diffusers_with_the_same_outputs(tmp_path):
    """Through diffusers' kohya FLUX.2 converter (our diffusers-layout file: tests/families,
    test_diffusers_load_lora_weights_gives_the_trained_output)."""
    fmt = "comfyui"
    weights = _trained()
    path = save_lora(weights, tmp_path / f"{fmt}.safetensors", fmt)
    _check_diffusers_outputs(path, weights)
    # (Our reader reads it back: tests/families, see the top of this file.)


def test_comfyui_export_names_and_header(tmp_path):
    path = save_lora(_trained(), tmp_path / "c.safetensors", "comfyui")
    from leantune.io import load_safetensors

    tensors, meta = load_safetensors(path)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in tensors
    assert tensors["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"].shape == (3 * D, 12)
    assert tensors["lora_unet_single_blocks_1_linear1.lora_up.weight"].shape == (3 * D + 2 * HIDDEN, 4)
    assert "lora_unet_double_blocks_1_img_mlp_0.lora_down.weight" in tensors
    assert meta["ss_base_model_version"] == "flux2"
    assert lora_from_state_dict(tensors, meta).keys is FLUX2_LORA_KEYS
    assert lora_from_state_dict(tensors).keys is FLUX2_LORA_KEYS        # without the header: its shapes


# -- leantune convert --------------------------------------------------------------------------------------

def _convert(*args) -> int:
    import argparse

    from leantune.commands import convert

    parser = argparse.ArgumentParser()
    convert.configure(parser)
    return convert.run(parser.parse_args([str(a) for a in args]))


@pytest.mark.parametrize("source", ["lycoris", "lokr_bfl", "kohya", "ai_toolkit"])
def test_convert_foreign_files_keeps_the_deltas(tmp_path, capsys, source):
    """`leantune convert` reads each foreign FLUX.2 layout (family from its names and shapes) and
    writes diffusers and ComfyUI files with the same deltas."""
    sd = {"lycoris": _lycoris, "lokr_bfl": _lokr_bfl, "kohya": lambda: _kohya(False), "ai_toolkit": _ai_toolkit}[source]()
    src = save_safetensors(sd, tmp_path / "in.safetensors")
    want = _ours(read_lora(src, keys=FLUX2_LORA_KEYS))
    for fmt in ("diffusers", "comfyui"):
        assert _convert(src, tmp_path / f"{fmt}.safetensors", "--to", fmt) == 0
        assert "of a FLUX.2 LoRA" in capsys.readouterr().out
        got = read_lora(tmp_path / f"{fmt}.safetensors")
        assert got.keys is FLUX2_LORA_KEYS
        _close(_ours(got), want)


def test_convert_family_flag_for_flux2(tmp_path, capsys):
    src = save_safetensors(_ai_toolkit(), tmp_path / "in.safetensors")
    assert _convert(src, tmp_path / "out.safetensors", "--to", "comfyui", "--family", "flux2-klein-9b") == 0
    assert _convert(src, tmp_path / "bad.safetensors", "--to", "comfyui", "--family", "flux") == 2
    assert "double_stream_modulation_txt.lin.lora_A.weight' is not a Flux transformer LoRA key" in capsys.readouterr().err
