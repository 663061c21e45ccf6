"""FLUX.2 single files: BFL / ComfyUI transformer files load into diffusers' Flux2Transformer2DModel
bit for bit, with the architecture read from shapes; our BFL names are the ones diffusers' own
converter (convert_flux2_transformer_checkpoint_to_diffusers) reads; fp8 files stay fp8; the three
released variants are told apart from their (meta) shapes; bad files fail naming the file and key.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from diffusers import Flux2Transformer2DModel
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

from leantune.io import load_safetensors, save_safetensors
from leantune.memory.fp8 import SCALE_ATTR, dequantize
from leantune.models.flux2 import keys as flux2_keys
from leantune.models.flux2.single_file import load_single_file_transformer, read_layout, save_single_file
from leantune.models.weights import CheckpointFiles, LoadError, build_empty

COMFY = "model.diffusion_model."


def tiny_config(**over) -> dict:
    cfg = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=3, attention_head_dim=16,
               num_attention_heads=2, joint_attention_dim=24, timestep_guidance_channels=32, mlp_ratio=3.0,
               axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)
    cfg.update(over)
    return cfg


def tiny_model(seed: int = 0, **over) -> Flux2Transformer2DModel:
    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(**tiny_config(**over))
    with torch.no_grad():          # random norm scales too, so a swapped key would show
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.normal_(1.0, 0.2)
    return model.eval()


def _spec():
    from leantune.models.flux2.spec import SPECS

    return SPECS["flux2-dev"]


def _out(model, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    n, length = 6, 5
    x = torch.randn(2, n, model.config.in_channels, generator=g).to(dtype)
    text = torch.randn(2, length, model.config.joint_attention_dim, generator=g).to(dtype)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(2.0), torch.arange(3.0), torch.zeros(1),
                                         indexing="ij"), -1).reshape(-1, 4)
    txt_ids = torch.zeros(length, 4)
    txt_ids[:, 3] = torch.arange(float(length))
    guidance = torch.tensor([3.5, 3.5]) if model.config.guidance_embeds else None
    with torch.no_grad():
        return model(hidden_states=x, encoder_hidden_states=text, timestep=torch.tensor([0.3, 0.8]), img_ids=img_ids,
                     txt_ids=txt_ids, guidance=guidance, return_dict=False)[0]


# -- names: ours are diffusers' converter's --------------------------------------------------------------

@pytest.mark.parametrize("guidance", [True, False])
def test_our_bfl_names_are_what_diffusers_converter_reads(guidance):
    """diffusers_to_bfl writes BFL names that diffusers' own single-file converter turns back into
    the same state dict, bit for bit; and our reader of those names agrees with it."""
    state = tiny_model(guidance_embeds=guidance).state_dict()
    bfl = flux2_keys.diffusers_to_bfl(state)
    assert "double_blocks.0.img_attn.qkv.weight" in bfl and "single_stream_modulation.lin.weight" in bfl
    assert ("guidance_in.in_layer.weight" in bfl) == guidance
    theirs = convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl))
    assert theirs.keys() == state.keys()
    assert all(torch.equal(theirs[k], state[k]) for k in state)
    ours = flux2_keys.convert_bfl_state_dict(bfl)
    assert ours.keys() == state.keys() and all(torch.equal(ours[k], state[k]) for k in state)


def test_final_adaln_halves_are_swapped_in_bfl_names():
    state = tiny_model().state_dict()
    w = state["norm_out.linear.weight"]
    half = w.shape[0] // 2
    bfl = flux2_keys.diffusers_to_bfl(state)["final_layer.adaLN_modulation.1.weight"]
    assert torch.equal(bfl[:half], w[half:]) and torch.equal(bfl[half:], w[:half])


def test_single_file_layout_group_by_group_equals_whole():
    """The spec's SingleFileLayout (full fine-tune export) converts one group at a time (the non-block
    modules, then each block): the union is the whole-model conversion."""
    from leantune.train.full_export import weight_groups

    model = tiny_model()
    layout = _spec().single_file
    assert layout.prefix == "" and layout.name == "BFL"
    state = model.state_dict()
    whole = flux2_keys.diffusers_to_bfl(state)
    joined = {}
    for group in weight_groups(model, _spec()):
        part = layout.to_native({key: state[key] for key, _, _ in group}, model)
        assert not joined.keys() & part.keys()
        joined.update(part)
    assert joined.keys() == whole.keys() and all(torch.equal(joined[k], whole[k]) for k in whole)
    meta = json.loads(layout.metadata(model)["leantune.config"])
    assert meta["axes_dims_rope"] == [4, 4, 4, 4]


def test_diffusers_keys_without_bfl_name_are_refused():
    with pytest.raises(KeyError, match="transformer_blocks.0.attn.to_q.weight"):
        flux2_keys.diffusers_to_bfl({"transformer_blocks.0.attn.to_q.weight": torch.zeros(4, 4)})
    with pytest.raises(KeyError, match="no_such"):
        flux2_keys.diffusers_to_bfl({"no_such.weight": torch.zeros(4, 4)})


# -- files round trip ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["", COMFY])
def test_bfl_file_loads_bit_for_bit(tmp_path, prefix):
    """diffusers -> BFL (or ComfyUI-prefixed) file -> our loader: the same tensors, config and outputs."""
    ref = tiny_model(seed=1)
    path = save_single_file(ref, tmp_path / "flux2.safetensors", prefix=prefix)
    tensors, _ = load_safetensors(path)
    assert f"{prefix}double_blocks.1.txt_attn.qkv.weight" in tensors
    model = load_single_file_transformer(path, dtype=torch.float32, keep_fp8=False)
    for key in ("num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads", "in_channels",
                "joint_attention_dim", "timestep_guidance_channels", "mlp_ratio", "guidance_embeds", "rope_theta"):
        assert model.config[key] == ref.config[key], key
    assert list(model.config.axes_dims_rope) == list(ref.config.axes_dims_rope)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(_out(model), _out(ref))


def test_file_without_metadata_loads_with_flux2_rotary_split(tmp_path):
    """A file as BFL publishes it (no leantune metadata): heads of 128 get FLUX.2's (32, 32, 32, 32)."""
    ref = tiny_model(attention_head_dim=128, num_attention_heads=1, axes_dims_rope=(32, 32, 32, 32),
                     num_layers=1, num_single_layers=1, guidance_embeds=False)
    bfl = flux2_keys.diffusers_to_bfl(ref.state_dict())
    path = save_safetensors(bfl, tmp_path / "bare.safetensors")
    model = load_single_file_transformer(path, dtype=torch.float32, keep_fp8=False)
    assert list(model.config.axes_dims_rope) == [32, 32, 32, 32] and not model.config.guidance_embeds
    assert torch.equal(_out(model), _out(ref))


def test_diffusers_named_single_file_loads(tmp_path):
    ref = tiny_model(seed=3)
    meta = flux2_keys.native_metadata(ref)
    path = save_safetensors(ref.state_dict(), tmp_path / "diffusers_names.safetensors", metadata=meta)
    model = load_single_file_transformer(path, dtype=torch.float32, keep_fp8=False)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


def test_bf16_file_loads_as_bf16(tmp_path):
    ref = tiny_model(seed=4)
    path = save_single_file(ref, tmp_path / "bf16.safetensors", dtype=torch.bfloat16, prefix=COMFY)
    model = load_single_file_transformer(path, dtype=torch.bfloat16)
    want = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}
    got = model.state_dict()
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want)


# -- fp8 -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["e4m3", "scaled"])
def test_fp8_file_block_weights_stay_e4m3(tmp_path, kind):
    """Every block Linear stored in e4m3 stays e4m3 with its fp32 scale; the rest (embedders, the
    shared modulation, norms) is upcast; the outputs are those of the upcast load exactly."""
    ref = tiny_model(seed=5)
    path = save_single_file(ref, tmp_path / f"{kind}.safetensors", fp8=kind, prefix=COMFY)
    stored = CheckpointFiles([path])
    assert stored.tensors[f"{COMFY}single_blocks.0.linear1.weight"].dtype == "F8_E4M3"
    model = load_single_file_transformer(path, dtype=torch.float32)
    kept = {n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    block_linears = {f"{name}.{rel}.weight" for name, block in _spec().blocks(model)
                     for rel, m in block.named_modules() if type(m) is torch.nn.Linear}
    assert kept == block_linears and len(kept) == 2 * 12 + 3 * 2
    for name in kept:
        module = model.get_submodule(name[: -len(".weight")])
        scale = getattr(module, SCALE_ATTR)
        assert scale.dtype == torch.float32 and scale.shape == (module.weight.shape[0], 1)
    raw, _ = load_safetensors(path)                  # the stored e4m3 bytes, kept as they are
    qkv = raw[f"{COMFY}double_blocks.1.img_attn.qkv.weight"]
    width = qkv.shape[0] // 3
    assert torch.equal(model.transformer_blocks[1].attn.to_k.weight.view(torch.uint8),
                       qkv[width:2 * width].view(torch.uint8))
    assert model.double_stream_modulation_img.linear.weight.dtype == torch.float32
    upcast = load_single_file_transformer(path, dtype=torch.float32, keep_fp8=False)
    assert all(p.dtype == torch.float32 for p in upcast.parameters())
    for name in kept:                # the kept bytes dequantize to the upcast load's weights exactly
        lin = model.get_submodule(name[: -len(".weight")])
        assert torch.equal(dequantize(lin.weight, getattr(lin, SCALE_ATTR), torch.float32), upcast.get_parameter(name))
    # and compute the same outputs (one thread: the CPU matmul's split over threads may round otherwise)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(_out(model), _out(upcast))
    finally:
        torch.set_num_threads(threads)


def test_meta_device_reads_nothing(tmp_path, monkeypatch):
    """device="meta" builds the architecture with the loader's dtypes (fp8 kept) from the header alone."""
    path = save_single_file(tiny_model(seed=6), tmp_path / "fp8.safetensors", fp8="e4m3")

    def no_reads(*args, **kwargs):
        raise AssertionError("a meta load read tensor data")

    monkeypatch.setattr(CheckpointFiles, "read_rows_into", no_reads)
    monkeypatch.setattr(CheckpointFiles, "_read_bytes", no_reads)
    model = load_single_file_transformer(path, dtype=torch.bfloat16, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.transformer_blocks[0].attn.to_q.weight.dtype == torch.float8_e4m3fn
    assert model.x_embedder.weight.dtype == torch.bfloat16


# -- the released variants from shapes ---------------------------------------------------------------

_FULL = {   # name -> the released Flux2Transformer2DModel configs (diffusers' transformer/config.json)
    "flux2-dev": dict(num_layers=8, num_single_layers=48, num_attention_heads=48, joint_attention_dim=15360,
                      guidance_embeds=True),
    "flux2-klein-4b": dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                           guidance_embeds=False),
    "flux2-klein-9b": dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
                           guidance_embeds=False),
}


@pytest.mark.parametrize("name", sorted(_FULL))
def test_released_variants_from_meta_shapes(name):
    """A full-size model built on meta (no weights), written in BFL names and read back from shapes
    alone, is the same architecture and is named as released."""
    cfg = dict(patch_size=1, in_channels=128, attention_head_dim=128, timestep_guidance_channels=256, mlp_ratio=3.0,
               axes_dims_rope=(32, 32, 32, 32), **_FULL[name])
    model = build_empty(lambda: Flux2Transformer2DModel(**cfg))
    bfl_shapes = {k: tuple(v.shape) for k, v in flux2_keys.diffusers_to_bfl(model.state_dict()).items()}
    ops, unknown = flux2_keys.bfl_to_diffusers_ops(bfl_shapes)
    assert not unknown
    shapes = {t: s for op in ops for t, s in zip(op.targets, op.target_shapes(bfl_shapes[op.source]))}
    got = flux2_keys.config_from_shapes(shapes)
    for key, value in cfg.items():
        assert (list(got[key]) if key == "axes_dims_rope" else got[key]) == (list(value) if key == "axes_dims_rope"
                                                                              else value), key
    assert flux2_keys.variant_of(got) == name
    assert flux2_keys.variant_of(model.config) == name


def test_tiny_and_pruned_configs_are_no_released_variant_but_have_a_family():
    """Not a released architecture, still one family: dev by its guidance embedder, a klein by its
    width where that is a released klein's (pruned), else by its depth (5 double blocks: 4B)."""
    assert not flux2_keys.is_released(tiny_config())
    assert flux2_keys.variant_of(tiny_config()) == "flux2-dev"
    assert flux2_keys.variant_of(tiny_config(guidance_embeds=False)) == "flux2-klein-9b"
    assert flux2_keys.variant_of(tiny_config(guidance_embeds=False, num_layers=5)) == "flux2-klein-4b"
    pruned = dict(num_layers=8, num_single_layers=40, num_attention_heads=48, attention_head_dim=128,
                  joint_attention_dim=15360, guidance_embeds=True)
    assert not flux2_keys.is_released(pruned) and flux2_keys.variant_of(pruned) == "flux2-dev"
    pruned_4b = {**pruned, "num_layers": 4, "num_attention_heads": 24, "joint_attention_dim": 7680,
                 "guidance_embeds": False}
    assert not flux2_keys.is_released(pruned_4b) and flux2_keys.variant_of(pruned_4b) == "flux2-klein-4b"
    for name, over in _FULL.items():
        assert flux2_keys.is_released(dict(attention_head_dim=128, **over))


def _full_meta(name: str) -> Flux2Transformer2DModel:
    cfg = dict(patch_size=1, in_channels=128, attention_head_dim=128, timestep_guidance_channels=256, mlp_ratio=3.0,
               axes_dims_rope=(32, 32, 32, 32), **_FULL[name])
    return build_empty(lambda: Flux2Transformer2DModel(**cfg))


def test_family_for_model_tells_the_three_flux2_families_apart():
    """They share Flux2Transformer2DModel: the class alone said flux2-dev for every klein. The
    config says: the released architectures (built on meta) by name, the tiny ones by layout, and
    the sampler's variant follows (a klein samples with classifier-free guidance)."""
    from leantune.infer.sampler import variant_of
    from leantune.models.family import family_for_model

    for name in _FULL:
        model = _full_meta(name)
        assert family_for_model(model).name == name
        assert variant_of(model) == ("dev" if name == "flux2-dev" else "klein")
    assert family_for_model(tiny_model()).name == "flux2-dev"
    assert family_for_model(tiny_model(guidance_embeds=False)).name == "flux2-klein-9b"
    assert family_for_model(tiny_model(guidance_embeds=False, num_layers=5)).name == "flux2-klein-4b"
    assert variant_of(tiny_model(guidance_embeds=False)) == "klein"


def _write_folder(path, config: dict | None, pipeline: str, encoder: str):
    """A diffusers folder's metadata alone (model_index.json, transformer/config.json): what
    guess_family reads."""
    path.mkdir(parents=True)
    index = {"_class_name": pipeline, "transformer": ["diffusers", "Flux2Transformer2DModel"],
             "text_encoder": ["transformers", encoder], "vae": ["diffusers", "AutoencoderKLFlux2"]}
    (path / "model_index.json").write_text(json.dumps(index))
    if config is not None:
        (path / "transformer").mkdir()
        (path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "Flux2Transformer2DModel",
                                                                      **config}))
    return path


def test_guess_family_reads_a_flux2_folders_config(tmp_path):
    """A folder's transformer class is the same for the three: its transformer/config.json names
    the family; without one, model_index.json's pipeline and text encoder tell dev from klein, and
    a klein's size is left unsaid (None) rather than guessed."""
    from leantune.models.family import guess_family

    for name, over in _FULL.items():
        dev = name == "flux2-dev"
        cfg = dict(patch_size=1, in_channels=128, attention_head_dim=128, **over)
        folder = _write_folder(tmp_path / name, cfg, "Flux2Pipeline" if dev else "Flux2KleinPipeline",
                               "Mistral3ForConditionalGeneration" if dev else "Qwen3ForCausalLM")
        assert guess_family(folder) == name
    tiny_klein = tiny_config(guidance_embeds=False)
    assert guess_family(_write_folder(tmp_path / "tiny", tiny_klein, "Flux2KleinPipeline", "Qwen3ForCausalLM")) \
        == "flux2-klein-9b"
    assert guess_family(_write_folder(tmp_path / "d", None, "Flux2Pipeline", "Mistral3ForConditionalGeneration")) \
        == "flux2-dev"
    assert guess_family(_write_folder(tmp_path / "k", None, "Flux2KleinPipeline", "Qwen3ForCausalLM")) is None


def test_the_family_loader_refuses_another_flux2s_file_or_folder(tmp_path):
    """[model] family = "flux2-dev" with a klein transformer file (or folder) is refused before a
    tensor is read, naming the file and the family to set; the klein families load it (a tiny klein
    is either size); released klein 4B weights under klein 9B are refused too."""
    from types import SimpleNamespace

    from leantune.tiny import flux2 as tf
    from leantune.models.family import get_family
    from leantune.models.flux2.single_file import check_variant

    klein_file = save_single_file(tf.flux2_transformer("klein", seed=2), tmp_path / "klein.safetensors", prefix=COMFY)
    dev = get_family("flux2-dev")

    def sources(transformer):
        return SimpleNamespace(transformer=transformer, text_encoder=None, tokenizer=None, vae=None)

    with pytest.raises(LoadError, match=r"klein\.safetensors: the weights are flux2-klein-9b \(.*no guidance embedder\), "
                                        r"not flux2-dev; set \[model\] family = \"flux2-klein-4b\" or \"flux2-klein-9b\""):
        dev.load_transformer(sources(klein_file), dtype=torch.float32)
    for name in ("flux2-klein-4b", "flux2-klein-9b"):
        model = get_family(name).load_transformer(sources(klein_file), dtype=torch.float32)
        assert not model.config.guidance_embeds
    dev_file = save_single_file(tiny_model(seed=3), tmp_path / "dev.safetensors")
    with pytest.raises(LoadError, match=r"dev\.safetensors: the weights are flux2-dev .* not flux2-klein-4b; "
                                        r"set \[model\] family = \"flux2-dev\""):
        get_family("flux2-klein-4b").load_transformer(sources(dev_file), dtype=torch.float32)

    folder = tf.save_flux2_folder(tmp_path / "kfolder", "klein", seed=2)
    with pytest.raises(LoadError, match=r"kfolder/transformer/config\.json: the weights are flux2-klein-9b .*not flux2-dev"):
        dev.load_transformer(dev.resolve_sources(SimpleNamespace(path=str(folder), family="flux2-dev", transformer=None,
                                                                 text_encoder=None, tokenizer=None, vae=None), tmp_path),
                             dtype=torch.float32)
    four_b = dict(_full_meta("flux2-klein-4b").config)
    with pytest.raises(LoadError, match=r"w: the weights are flux2-klein-4b \(width 3072, 5 double \+ 20 single.*"
                                        r"not flux2-klein-9b; set \[model\] family = \"flux2-klein-4b\""):
        check_variant(four_b, "flux2-klein-9b", "w")
    assert check_variant(four_b, "auto", "w") == "flux2-klein-4b"


def test_wrong_variant_is_named(tmp_path, monkeypatch):
    from leantune.models.flux2 import single_file as flux2_single_file

    path = save_single_file(tiny_model(seed=7), tmp_path / "t.safetensors")
    monkeypatch.setattr(flux2_keys, "variant_of", lambda config: "flux2-klein-4b")
    with pytest.raises(LoadError, match=r"t\.safetensors.*flux2-klein-4b.*not flux2-dev"):
        flux2_single_file.load_single_file_transformer(path, expected="flux2-dev", keep_fp8=False)
    model = flux2_single_file.load_single_file_transformer(path, expected="flux2-klein-4b", keep_fp8=False)
    assert model.config.num_layers == 2


# -- bad files -------------------------------------------------------------------------------------------

def test_flux1_file_is_refused_naming_it(tmp_path):
    from leantune import tiny
    from leantune.models.flux.loading import save_bfl_transformer

    path = save_bfl_transformer(tiny.flux_transformer(seed=0), tmp_path / "flux1.safetensors")
    with pytest.raises(LoadError, match=r"flux1\.safetensors: not a FLUX\.2 transformer.*single_stream_modulation"):
        load_single_file_transformer(path)


def test_truncated_file_is_refused(tmp_path):
    path = save_single_file(tiny_model(), tmp_path / "cut.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(LoadError, match=r"cut\.safetensors: key '.*': data does not fit its header \(truncated"):
        load_single_file_transformer(path)


def test_corrupt_header_is_refused(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(struct.pack("<Q", 12) + b"{not json!!}" + b"\0" * 16)
    with pytest.raises(LoadError, match=r"junk\.safetensors: not a safetensors file"):
        load_single_file_transformer(path)


def test_missing_tensor_is_named_by_its_bfl_key(tmp_path):
    bfl = flux2_keys.diffusers_to_bfl(tiny_model().state_dict())
    del bfl["double_blocks.1.txt_mlp.2.weight"]
    path = save_safetensors({COMFY + k: v for k, v in bfl.items()}, tmp_path / "holes.safetensors")
    with pytest.raises(LoadError, match=r"holes\.safetensors: missing key\(s\) "
                                        r"'model\.diffusion_model\.double_blocks\.1\.txt_mlp\.2\.weight'"):
        load_single_file_transformer(path)


def test_missing_anchor_is_named(tmp_path):
    bfl = flux2_keys.diffusers_to_bfl(tiny_model().state_dict())
    del bfl["txt_in.weight"]
    path = save_safetensors(bfl, tmp_path / "no_txt.safetensors")
    with pytest.raises(LoadError, match=r"no_txt\.safetensors: missing key 'txt_in\.weight'"):
        load_single_file_transformer(path)


def test_wrong_shape_is_named(tmp_path):
    bfl = flux2_keys.diffusers_to_bfl(tiny_model().state_dict())
    bfl["double_blocks.0.img_attn.proj.weight"] = torch.zeros(32, 31)
    path = save_safetensors(bfl, tmp_path / "bent.safetensors")
    with pytest.raises(LoadError, match=r"bent\.safetensors: key 'double_blocks\.0\.img_attn\.proj\.weight' has "
                                        r"shape \(32, 31\)"):
        load_single_file_transformer(path)


def test_unknown_key_is_named(tmp_path):
    bfl = flux2_keys.diffusers_to_bfl(tiny_model().state_dict())
    bfl["double_blocks.0.img_mod.lin.weight"] = torch.zeros(4, 4)        # Flux.1's per-block modulation
    path = save_safetensors(bfl, tmp_path / "mixed.safetensors")
    with pytest.raises(LoadError, match=r"mixed\.safetensors: unexpected key\(s\) \['double_blocks\.0\.img_mod"):
        read_layout(path)


def test_pickle_is_refused(tmp_path):
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(LoadError, match="model.ckpt"):
        load_single_file_transformer(path)


# -- the family ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["", COMFY])
def test_guess_family_names_flux2_files_not_flux1(tmp_path, prefix):
    """A FLUX.2 file uses Flux.1's block names (double_blocks, single_blocks): guess_family must
    still say FLUX.2 (dev: guidance embedder), and a Flux.1 file stays Flux.1."""
    from leantune import tiny
    from leantune.models.family import guess_family
    from leantune.models.flux.loading import save_bfl_transformer

    dev = save_single_file(tiny_model(), tmp_path / "dev.safetensors", prefix=prefix)
    assert guess_family(dev) == "flux2-dev"
    klein = save_single_file(tiny_model(guidance_embeds=False, num_layers=5), tmp_path / "klein.safetensors",
                             prefix=prefix)
    assert guess_family(klein) == "flux2-klein-4b"
    flux1 = save_bfl_transformer(tiny.flux_transformer(seed=0), tmp_path / "flux1.safetensors", prefix=prefix)
    assert guess_family(flux1) == "flux"


def test_family_loads_a_single_file_and_keeps_fp8(tmp_path):
    """The registered family's load_transformer reads a ComfyUI fp8 file through this module:
    fp8 kept (the family spec's block Linears), and keep_fp8=False upcasts."""
    from leantune.models.family import get_family

    family = get_family("flux2-dev")
    assert family.spec.single_file is not None and family.spec.lora_keys is not None
    path = save_single_file(tiny_model(seed=8), tmp_path / "fp8.safetensors", fp8="e4m3", prefix=COMFY)
    sources = family.resolve_sources(type("M", (), {"path": str(path), "family": "flux2-dev"})(), tmp_path)
    kept = family.load_transformer(sources, torch.float32)
    assert kept.transformer_blocks[0].ff.linear_in.weight.dtype == torch.float8_e4m3fn
    upcast = family.load_transformer(sources, torch.float32, keep_fp8=False)
    assert all(p.dtype == torch.float32 for p in upcast.parameters())


def test_full_finetune_comfyui_export_of_a_streamed_model_loads_back(tmp_path):
    """train/full_export writes a FLUX.2 model (its blocks streamed from host buffers) group by group
    in the spec's BFL layout; our loader reads it back bit for bit, and diffusers' converter reads
    the same names."""
    from leantune.memory.engine import apply_memory
    from leantune.memory.plan import Plan
    from leantune.memory.trainable_streaming import TrainableStreamingEngine, WeightAccess
    from leantune.train.full_export import single_file_metadata, write_model_file

    model = tiny_model(seed=9)
    want_state = {k: v.clone() for k, v in model.state_dict().items()}
    want = _out(model)
    spec = _spec()
    model.requires_grad_(True)
    handle = apply_memory(model, spec, Plan(streamed_blocks=tuple(n for n, _ in spec.blocks(model))), "cpu",
                          streaming_engine=TrainableStreamingEngine)
    path = write_model_file(model, spec, WeightAccess(handle), tmp_path / "ft_comfyui.safetensors", "comfyui",
                            torch.float32, single_file_metadata(model, spec, 7))
    handle.remove()
    loaded = load_single_file_transformer(path, dtype=torch.float32)
    got_state = loaded.state_dict()
    assert got_state.keys() == want_state.keys() and all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    assert torch.equal(_out(loaded), want)
    tensors, meta = load_safetensors(path)
    assert meta["leantune.step"] == "7"
    theirs = convert_flux2_transformer_checkpoint_to_diffusers(dict(tensors))
    assert all(torch.equal(theirs[k], want_state[k]) for k in want_state)


def test_flux1_loader_names_a_flux2_file(tmp_path):
    """[model] family = "flux" given a FLUX.2 file: the error says what the file is and which
    family to set, rather than listing FLUX.2's keys as unexpected."""
    from leantune.models.flux.loading import FluxSources, load_transformer

    path = save_single_file(tiny_model(), tmp_path / "f2.safetensors", prefix=COMFY)
    with pytest.raises(LoadError, match=r"f2\.safetensors: a FLUX\.2 transformer, not a Flux\.1 one; set "
                                        r"\[model\] family = \"flux2-dev\""):
        load_transformer(FluxSources(path, None, None, None, None, None))
