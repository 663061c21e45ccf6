"""Wan 2.2 beyond the conformance suite (tests/families): Wan-AI's native single files and ComfyUI's
repackaged ones (bare or under model.diffusion_model., bf16 and fp8) load to what diffusers' own
single-file conversion makes of them; a bad file is refused naming the key; the two experts of a
Wan 2.2 A14B folder load as WanPipeline's transformer and transformer_2; an expert trains on its
share of the noise levels only (boundary_ratio), drawn from the configured distribution restricted to
it; and the staged sampler switches experts at WanPipeline's step, its samples equal to the
pipeline's bit for bit in fp32."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from leantune.config import ModelConfig
from leantune.models.component_files import METADATA_CONFIG_KEY
from leantune.models.family import get_family
from leantune.models.weights import LoadError
from leantune.tiny.wan import BOUNDARY_RATIO, WAN_TINY, save_wan_folder, wan_transformer

FAM = get_family("wan2.2")
COMFY = "model.diffusion_model."
UNSEEN = {"attention_head_dim": WAN_TINY["attention_head_dim"], "eps": WAN_TINY["eps"],
          "rope_max_seq_len": WAN_TINY["rope_max_seq_len"]}
PROMPT, SEED, W, H = "a photo of a cat", 3, 64, 48


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: tiny models run best on one thread


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny Wan 2.2 A14B layout: transformer/ (high noise), transformer_2/ (low noise), boundary_ratio."""
    return save_wan_folder(tmp_path_factory.mktemp("wan") / "folder")


@pytest.fixture(scope="module")
def pipeline(folder):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    for part in pipe.components.values():
        if isinstance(part, torch.nn.Module):
            part.eval().requires_grad_(False)
    return pipe


def _sources(path, root, **model):
    return FAM.resolve_sources(ModelConfig(path=str(path), family="wan2.2", **model), root)


def _native_layout(sd: dict) -> dict:
    """Wan-AI's names, written here by hand (not with leantune's table): self_attn / cross_attn with
    q k v o, ffn.0 / ffn.2, modulation, the cross-attention norm as norm3, the embedders' Sequential
    indices, head.head and head.modulation."""
    out = {}
    for k, v in sd.items():
        n = (k.replace("attn1.to_out.0", "self_attn.o").replace("attn2.to_out.0", "cross_attn.o")
             .replace("attn1.to_", "self_attn.").replace("attn2.to_", "cross_attn.")
             .replace("attn1.norm_", "self_attn.norm_").replace("attn2.norm_", "cross_attn.norm_")
             .replace("ffn.net.0.proj", "ffn.0").replace("ffn.net.2", "ffn.2").replace(".norm2.", ".norm3.")
             .replace("condition_embedder.text_embedder.linear_1", "text_embedding.0")
             .replace("condition_embedder.text_embedder.linear_2", "text_embedding.2")
             .replace("condition_embedder.time_embedder.linear_1", "time_embedding.0")
             .replace("condition_embedder.time_embedder.linear_2", "time_embedding.2")
             .replace("condition_embedder.time_proj", "time_projection.1").replace("proj_out", "head.head"))
        if n.endswith(".scale_shift_table"):
            n = n.replace(".scale_shift_table", ".modulation")
        elif n == "scale_shift_table":
            n = "head.modulation"
        out[n] = v
    return out


def _seeded_state(seed: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {k: v.shape for k, v in wan_transformer(0).state_dict().items()}
    return {k: torch.randn(s, generator=g) * 0.3 for k, s in sorted(shapes.items())}


def _inputs(seed: int = 2, frames: int = 2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 16, frames, 4, 6, generator=g), torch.tensor([700.0, 150.0]),
            torch.randn(2, 9, WAN_TINY["text_dim"], generator=g))


def _forward(model, x, t, text):
    with torch.no_grad():
        return model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]


def _assert_same_weights(got, want):
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:6]
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b)


# -- single files --------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["", COMFY])
def test_native_single_file_loads_as_diffusers_converts_it(prefix, tmp_path):
    """A seeded tiny model in Wan-AI's names (bare, as Wan-AI's files; under ComfyUI's prefix):
    leantune's weights are what diffusers' convert_wan_transformer_to_diffusers makes of the file,
    its config is the tiny architecture read from the shapes (and the head size from the metadata),
    and its video output equals the diffusers model holding the same weights, bit for bit."""
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    sd = _seeded_state()
    path = tmp_path / "wan.safetensors"
    save_file({prefix + k: v for k, v in _native_layout(sd).items()}, str(path),
              metadata={METADATA_CONFIG_KEY: json.dumps(UNSEEN)})
    model = FAM.load_transformer(_sources(path, tmp_path), dtype=torch.float32).eval().requires_grad_(False)
    for k, v in WAN_TINY.items():
        assert (list(model.config[k]) == list(v)) if isinstance(v, (list, tuple)) else model.config[k] == v, k
    converted = convert_wan_transformer_to_diffusers(load_file(str(path)))
    got = model.state_dict()
    assert converted.keys() == got.keys() == sd.keys()
    assert all(torch.equal(converted[k], got[k]) and torch.equal(sd[k], got[k]) for k in sd)
    reference = WanTransformer3DModel(**WAN_TINY).eval().requires_grad_(False)
    reference.load_state_dict(sd)
    x, t, text = _inputs()
    assert torch.equal(_forward(model, x, t, text), _forward(reference, x, t, text))
    assert FAM.recognizes_keys(load_file(str(path)).keys())


def test_fp8_files_keep_their_block_weights_e4m3(tmp_path):
    """ComfyUI's fp8 layouts (plain e4m3 and "scaled" with a per-tensor scale_weight) of Wan-AI's
    names load with every block Linear e4m3, the rest (embedders, head, norms, modulation tables) in
    the compute dtype, and outputs within e4m3's rounding of the bf16 model's."""
    from leantune.io import save_safetensors
    from leantune.models import component_loading as cl
    from leantune.models.wan import keys

    tiny = wan_transformer(0).requires_grad_(False)
    x, t, text = _inputs()
    want = _forward(tiny, x, t, text)
    for fp8 in ("e4m3", "scaled"):
        tensors = cl.file_tensors(keys.diffusers_to_native(tiny.state_dict()), dtype=torch.bfloat16, fp8=fp8,
                                  prefix=COMFY, in_block=lambda k: k.startswith("blocks."))
        path = save_safetensors(tensors, tmp_path / f"{fp8}.safetensors", metadata=keys.native_metadata(tiny))
        raw = load_file(str(path))
        assert raw[COMFY + "blocks.0.self_attn.q.weight"].dtype == torch.float8_e4m3fn
        assert (COMFY + "blocks.0.self_attn.q.scale_weight" in raw) == (fp8 == "scaled")
        state = FAM.load_transformer(_sources(path, tmp_path), dtype=torch.bfloat16).state_dict()
        for name in ("blocks.0.attn1.to_q", "blocks.1.attn2.to_v", "blocks.0.attn2.to_out.0", "blocks.1.ffn.net.2"):
            assert state[f"{name}.weight"].dtype == torch.float8_e4m3fn, (fp8, name)
        for name in ("patch_embedding.weight", "condition_embedder.time_proj.weight", "proj_out.weight",
                     "blocks.0.norm2.weight", "blocks.0.scale_shift_table"):
            assert state[name].dtype != torch.float8_e4m3fn, (fp8, name)
        model = FAM.load_transformer(_sources(path, tmp_path), dtype=torch.bfloat16).requires_grad_(False)
        got = _forward(model, x.bfloat16(), t, text.bfloat16()).float()
        err = (got - want).norm() / want.norm()
        assert 0 < err < 0.08, (fp8, float(err))


def test_quantizing_load_equals_bf16_load_then_quantize(tmp_path):
    """[memory] fp8 on an fp32 native file (renamed as it is read): every block Linear quantized as it
    is read equals loading in bf16 and quantizing after (tests/test_load_into_fp8.py's check: fp8
    values and scales bitwise); the rest is the bf16 load."""
    from test_load_into_fp8 import _assert_fp8_load_equals_bf16_then_quantize

    from leantune.models.wan import loading
    from leantune.models.wan.spec import WAN_SPEC

    model = wan_transformer(7, num_attention_heads=4, ffn_dim=256)        # 64-wide rows: whole scale blocks
    path = tmp_path / "wan.safetensors"
    save_file(_native_layout(model.state_dict()), str(path), metadata={METADATA_CONFIG_KEY: json.dumps(UNSEEN)})
    _assert_fp8_load_equals_bf16_then_quantize(loading.load_transformer, _sources(path, tmp_path), WAN_SPEC)


def test_a_bad_file_is_refused_naming_the_file_and_key(tmp_path):
    sd = _native_layout(_seeded_state())
    meta = {METADATA_CONFIG_KEY: json.dumps(UNSEEN)}
    path = tmp_path / "bad.safetensors"
    wrong = dict(sd, **{"blocks.1.cross_attn.k.weight": sd["blocks.1.cross_attn.k.weight"][:-1]})
    save_file(wrong, str(path), metadata=meta)
    with pytest.raises(LoadError, match=r"bad\.safetensors.*blocks\.1\.cross_attn\.k\.weight"):
        FAM.load_transformer(_sources(path, tmp_path), dtype=torch.float32)
    missing = {k: v for k, v in sd.items() if k != "blocks.1.ffn.2.weight"}
    save_file(missing, str(path), metadata=meta)
    with pytest.raises(LoadError, match=r"bad\.safetensors.*blocks\.1\.ffn\.2\.weight"):
        FAM.load_transformer(_sources(path, tmp_path), dtype=torch.float32)
    save_file(dict(sd, **{"blocks.0.self_attn.extra.weight": torch.zeros(2, 2)}), str(path), metadata=meta)
    with pytest.raises(LoadError, match=r"bad\.safetensors.*blocks\.0\.self_attn\.extra\.weight"):
        FAM.load_transformer(_sources(path, tmp_path), dtype=torch.float32)
    # a TI2V-5B (48 channels) transformer: refused by name (an image-to-video one of 36 input channels
    # loads: tests/test_wan_i2v.py)
    for channels, said in ((48, "TI2V-5B"),):
        other = wan_transformer(0, in_channels=channels, out_channels=48)
        save_file(_native_layout(other.state_dict()), str(path), metadata=meta)
        with pytest.raises(LoadError, match=rf"bad\.safetensors.*{said}"):
            FAM.load_transformer(_sources(path, tmp_path), dtype=torch.float32)


# -- the VAE as one file --------------------------------------------------------------------------------------

def _native_vae(sd: dict, per_stage: int) -> dict:
    """Wan-AI's VAE names, by hand: flat encoder.downsamples / decoder.upsamples (the decoder's stage s
    block j at s * (per_stage + 2) + j, its resample after them), residual.0 / 2 / 3 / 6 and
    shortcut, middle.0 / 1 / 2, conv1 / head.0 / head.2, conv1 / conv2 for the quant convolutions."""
    import re

    def res(rest):
        for d, n in (("norm1.", "residual.0."), ("conv1.", "residual.2."), ("norm2.", "residual.3."),
                     ("conv2.", "residual.6."), ("conv_shortcut.", "shortcut.")):
            if rest.startswith(d):
                return n + rest[len(d):]
        return rest

    out = {}
    for k, v in sd.items():
        side, _, rest = k.partition(".")
        if k.startswith("quant_conv."):
            n = "conv1." + k[len("quant_conv."):]
        elif k.startswith("post_quant_conv."):
            n = "conv2." + k[len("post_quant_conv."):]
        elif m := re.match(r"^encoder\.down_blocks\.(\d+)\.(.+)$", k):
            n = f"encoder.downsamples.{m.group(1)}.{res(m.group(2))}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$", k):
            n = f"decoder.upsamples.{int(m.group(1)) * (per_stage + 2) + int(m.group(2))}.{res(m.group(3))}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)$", k):
            n = f"decoder.upsamples.{int(m.group(1)) * (per_stage + 2) + per_stage + 1}.{m.group(2)}"
        elif m := re.match(r"^(encoder|decoder)\.mid_block\.(resnets|attentions)\.(\d)\.(.+)$", k):
            index = {"resnets0": 0, "attentions0": 1, "resnets1": 2}[m.group(2) + m.group(3)]
            n = f"{side}.middle.{index}.{m.group(4) if m.group(2) == 'attentions' else res(m.group(4))}"
        else:
            n = f"{side}." + {"conv_in": "conv1", "norm_out": "head.0", "conv_out": "head.2"}[rest.split(".")[0]] \
                + "." + rest.split(".", 1)[1]
        out[n] = v
    return out


@pytest.mark.parametrize("per_stage", [1, 2])
def test_a_wan_ai_vae_file_loads_as_diffusers_converts_it(per_stage, tmp_path):
    """A seeded tiny Wan 2.1 VAE in Wan-AI's names (ComfyUI's wan_2.1_vae.safetensors layout): the
    architecture read from the shapes (the latent statistics from the metadata) is the model's, the
    weights are the model's and, with the released 2 residual blocks per stage, what diffusers'
    convert_wan_vae_to_diffusers makes of the file; its decode of a video latent is bit for bit the
    model's. A 48-channel (Wan 2.2) file is refused naming the folder to use."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from leantune.tiny.wan import WAN_VAE_TINY

    arch = dict(WAN_VAE_TINY, num_res_blocks=per_stage, dim_mult=[1, 2, 4, 4])      # the released pattern
    torch.manual_seed(4)
    vae = AutoencoderKLWan(**arch).eval().requires_grad_(False)
    sd = vae.state_dict()
    stats = {"latents_mean": list(vae.config.latents_mean), "latents_std": list(vae.config.latents_std)}
    path = tmp_path / "wan_vae.safetensors"
    save_file(_native_vae(sd, per_stage), str(path), metadata={METADATA_CONFIG_KEY: json.dumps(stats)})
    src = _sources(save_wan_folder(tmp_path / "f", experts=1), tmp_path, vae=str(path))
    got = FAM.load_vae(src, torch.float32, "cpu").vae
    for k, v in arch.items():
        assert (list(got.config[k]) == list(v)) if isinstance(v, list) else got.config[k] == v, k
    _assert_same_weights(got, vae)
    if per_stage == 2:
        converted = convert_wan_vae_to_diffusers(load_file(str(path)))
        assert converted.keys() == sd.keys() and all(torch.equal(converted[k], sd[k]) for k in sd)
    z = torch.randn(1, 16, 2, 3, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(got.decode(z).sample, vae.decode(z).sample)
    bad = dict(_native_vae(sd, per_stage), **{"encoder.downsamples.0.avg_shortcut.weight": torch.zeros(1)})
    save_file(bad, str(path))
    with pytest.raises(LoadError, match=r"wan_vae\.safetensors.*Wan 2\.2.*vae/ folder"):
        FAM.load_vae(src, torch.float32, "cpu")


# -- the text encoder as one file --------------------------------------------------------------------------

def test_a_umt5_single_file_encodes_as_the_pipeline(folder, pipeline, tmp_path):
    """The folder's umT5 as one file in transformers' names (ComfyUI's umt5_xxl_*.safetensors), bf16
    and scaled fp8: the architecture read from the shapes is the folder's, the bf16 file's encoder
    gives WanPipeline.encode_prompt's embeddings bit for bit (fp32 load), the fp8 one within e4m3's
    rounding; a T5 file (one relative attention bias) is refused by name."""
    from leantune.io import save_safetensors
    from leantune.models import component_loading as cl

    state = {k: v.clone() for k, v in pipeline.text_encoder.state_dict().items()
             if k != "encoder.embed_tokens.weight"}       # tied to shared.weight, stored once
    path = save_safetensors(state, tmp_path / "umt5.safetensors")
    src = _sources(folder, tmp_path, text_encoder=str(path))
    encoders = FAM.load_text_encoders(src, torch.float32, "cpu")
    for k in ("d_model", "d_ff", "num_layers", "num_heads", "d_kv", "vocab_size", "relative_attention_num_buckets"):
        assert encoders.text_encoder.config.to_dict()[k] == pipeline.text_encoder.config.to_dict()[k], k
    want, _ = pipeline.encode_prompt([PROMPT, "a red circle"], do_classifier_free_guidance=False,
                                     max_sequence_length=32, device="cpu")
    got, lengths = FAM.encode_prompts([PROMPT, "a red circle"], encoders, 32, "cpu")
    assert torch.equal(got.t5, want) and lengths.tolist() == [32, 32]
    scaled = cl.file_tensors(dict(state), dtype=torch.bfloat16, fp8="scaled", prefix="",
                             in_block=lambda k: k.startswith("encoder.block.") and k.endswith(".weight")
                             and "relative_attention_bias" not in k and "layer_norm" not in k)
    fp8 = save_safetensors(scaled, tmp_path / "umt5_fp8.safetensors")
    assert load_file(str(fp8))["encoder.block.0.layer.0.SelfAttention.q.weight"].dtype == torch.float8_e4m3fn
    approx, _ = FAM.encode_prompts([PROMPT], FAM.load_text_encoders(_sources(folder, tmp_path, text_encoder=str(fp8)),
                                                                    torch.float32, "cpu"), 32, "cpu")
    err = (approx.t5 - want[:1]).norm() / want[:1].norm()
    assert 0 < err < 0.1, float(err)
    t5 = {k: v for k, v in state.items() if not k.startswith("encoder.block.1.layer.0.SelfAttention.relative")}
    bad = save_safetensors(t5, tmp_path / "t5.safetensors")
    with pytest.raises(LoadError, match=r"t5\.safetensors.*not Wan's umT5"):
        FAM.load_text_encoders(_sources(folder, tmp_path, text_encoder=str(bad)), torch.float32, "cpu")


# -- LoRA files in ComfyUI ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["lora", "lokr", "loha", "dora"])
def test_the_comfyui_layout_file_of_every_adapter_type_loads_whole_in_comfyui(kind, tmp_path):
    """The conformance suite's adapter on every Linear (its Built, tests/families/conftest.py), each
    [lora] type: the comfyui-layout file (kohya names, lora_unet_blocks_0_self_attn_q) loads whole
    through ComfyUI's key map for WAN21 (tests/comfyui_keymap.py) to the trained weights at strength 1
    (DoRA under the output-axis norm, dora_fixed); the diffusers-layout file loads nothing there (the
    conformance suite's finding)."""
    from comfyui_keymap import comfyui_load, comfyui_native_state
    from families.cases import CASES
    from families.conftest import Built

    b = Built(next(c for c in CASES if c.family == "wan2.2"), tmp_path)
    lora = b.adapter(kind)
    native = comfyui_native_state("wan2.2", b.tiny)
    merged = dict(b.tiny.state_dict())
    merged.update({f"{name}.weight": w for name, w in lora.merged.items()})
    want = comfyui_native_state("wan2.2", b.tiny, merged)
    changed = {k for k in native if not torch.equal(want[k], native[k])}
    tensors = load_file(str(lora.files["comfyui"]))
    assert changed and tensors and all(k.startswith("lora_unet_") for k in tensors)
    load = comfyui_load("wan2.2", native, tensors, dora_fixed=True)
    assert not load.skipped and load.loaded == set(tensors)
    assert set(load.deltas) == changed
    for k in load.deltas:
        torch.testing.assert_close(native[k] + load.deltas[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    diffusers = comfyui_load("wan2.2", native, load_file(str(lora.files["diffusers"])))
    assert diffusers.skipped and not diffusers.loaded


def _native_module(diffusers: str) -> str:
    """A diffusers module name in Wan-AI's names, by hand (as _native_layout names the weights)."""
    return next(iter(_native_layout({diffusers + ".weight": None}))).removesuffix(".weight")


@pytest.mark.parametrize("style", ["diffusion_model", "kohya"])
def test_lora_files_in_wan_ais_names_read_as_leantunes_own(style, tmp_path):
    """A trained LoRA written by hand in the layouts other Wan trainers use: diffusion-pipe's /
    ComfyUI's `diffusion_model.blocks.0.self_attn.q.lora_A.weight` (alpha folded, no alpha key) and
    musubi-tuner's kohya `lora_unet_blocks_0_self_attn_q.lora_down.weight` with its alpha: read back,
    every module's update (alpha / rank * up @ down) is the trained one."""
    from families.cases import CASES
    from families.conftest import RANK, Built

    from leantune.io import save_safetensors
    from leantune.train.lora_formats import read_lora

    b = Built(next(c for c in CASES if c.family == "wan2.2"), tmp_path)
    lora = b.lora
    trained = read_lora(lora.files["diffusers"], FAM.spec.lora_keys).modules
    tensors = {}
    for name, m in trained.items():
        native = _native_module(name)
        assert native != name, name
        if style == "diffusion_model":
            tensors[f"diffusion_model.{native}.lora_A.weight"] = m.down.contiguous()
            tensors[f"diffusion_model.{native}.lora_B.weight"] = (m.up * (m.alpha / m.down.shape[0])).contiguous()
        else:
            stem = "lora_unet_" + native.replace(".", "_")
            tensors[f"{stem}.lora_down.weight"] = m.down.contiguous()
            tensors[f"{stem}.lora_up.weight"] = m.up.contiguous()
            tensors[f"{stem}.alpha"] = torch.tensor(float(m.alpha))
    path = save_safetensors(tensors, tmp_path / f"{style}.safetensors")
    got = read_lora(path, FAM.spec.lora_keys).modules
    assert got.keys() == trained.keys() == lora.deltas.keys() and trained[next(iter(trained))].down.shape[0] == RANK
    for name, delta in lora.deltas.items():
        torch.testing.assert_close(got[name].delta(), delta, rtol=1e-5, atol=1e-6, msg=name)
    assert read_lora(path).family == "wan2.2"            # told from the names alone


# -- video latents through the memory engine -------------------------------------------------------------------

def test_a_video_latent_streams_and_trains_as_the_plain_model(tmp_path):
    """Latents of 3 frames (B, 16, F, h, w), which `pack_latents` passes as they are: the family's
    predict is the transformer's own call on them (timestep sigma * 1000), and a LoRA trained two
    SGD steps with every block and the non-block group streamed in poison mode (checkpointed blocks)
    gives the plain model's outputs, losses, gradients and updated values bit for bit."""
    from families.conftest import lora_config

    from leantune.memory.engine import apply_memory
    from leantune.memory.plan import Plan
    from leantune.models.family import PromptEmbeds
    from leantune.models.wan import pack_latents, predict, unpack_latents
    from leantune.train.lora import add_lora

    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 16, 3, 4, 6, generator=g)
    assert pack_latents(x) is x and unpack_latents(x, 4, 6) is x
    image = x[:, :, 0]
    assert pack_latents(image).shape == (2, 16, 1, 4, 6)
    assert torch.equal(unpack_latents(pack_latents(image), 4, 6), image)
    embeds = PromptEmbeds(torch.randn(2, 9, WAN_TINY["text_dim"], generator=g), torch.zeros(2, 0))
    sigma = torch.tensor([0.9, 0.3])
    tiny = wan_transformer(0).requires_grad_(False)
    assert torch.equal(predict(tiny, x, sigma, embeds, (4, 6)), _forward(tiny, x, sigma * 1000, embeds.t5))
    base = copy.deepcopy(tiny)
    add_lora(base, FAM.spec, lora_config())
    with torch.no_grad():
        for n, p in base.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)

    def two_steps(model):
        params = {n: p for n, p in model.named_parameters() if "default" in n.split(".")}
        for p in params.values():
            p.requires_grad_(True)
        opt = torch.optim.SGD(list(params.values()), lr=0.1)
        out = []
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            v = FAM.predict(model, x, sigma, embeds, (4, 6))
            loss = torch.nn.functional.mse_loss(v, torch.ones_like(v) * step)
            loss.backward()
            out.append((v.detach().clone(), loss.detach().clone(), {n: p.grad.clone() for n, p in params.items()}))
            opt.step()
        return out, {n: p.detach().clone() for n, p in params.items()}

    plain, plain_values = two_steps(copy.deepcopy(base))
    model = copy.deepcopy(base)
    plan = Plan(streamed_blocks=tuple(n for n, _ in FAM.spec.blocks(model)), stream_non_blocks=True, debug_poison=True,
                checkpointing="blocks", ring_slots=2)
    handle = apply_memory(model, FAM.spec, plan, "cpu", offload_min_bytes=0)
    streamed, streamed_values = two_steps(model)
    assert handle.step_report()["bytes_h2d"] > 0
    handle.remove()
    for (v1, l1, g1), (v2, l2, g2) in zip(streamed, plain, strict=True):
        assert torch.equal(v1, v2) and torch.equal(l1, l2)
        assert g1.keys() == g2.keys() and all(torch.equal(g1[n], g2[n]) for n in g2)
    assert all(torch.equal(streamed_values[n], plain_values[n]) for n in plain_values)


def test_a_diffusion_pipe_lora_converts_to_a_file_wanpipeline_loads(tmp_path):
    """`leantune convert --to diffusers` on a LoRA in diffusion-pipe's / ComfyUI's
    `diffusion_model.blocks.N.self_attn.q.lora_A` names: WanPipeline.load_lora_weights takes the
    result, and its peft deltas are the trained ones."""
    from families.cases import CASES
    from families.conftest import Built

    from leantune.cli import main
    from leantune.io import save_safetensors
    from leantune.train.lora import lora_layers
    from leantune.train.lora_formats import read_lora

    b = Built(next(c for c in CASES if c.family == "wan2.2"), tmp_path)
    lora = b.lora
    tensors = {}
    for name, m in read_lora(lora.files["diffusers"], FAM.spec.lora_keys).modules.items():
        tensors[f"diffusion_model.{_native_module(name)}.lora_A.weight"] = m.down.contiguous()
        up = m.up * (m.alpha / m.down.shape[0])                 # alpha folded, as those files carry none
        tensors[f"diffusion_model.{_native_module(name)}.lora_B.weight"] = up.contiguous()
    src = save_safetensors(tensors, tmp_path / "diffusion_pipe.safetensors")
    out = tmp_path / "converted.safetensors"
    assert main(["convert", str(src), str(out), "--to", "diffusers"]) == 0
    pipe = b.pipeline_with(transformer=copy.deepcopy(b.tiny))
    pipe.load_lora_weights(str(out), adapter_name="x")
    layers = lora_layers(pipe.transformer, "x")
    assert set(layers) == set(lora.deltas)
    for name, layer in layers.items():
        torch.testing.assert_close(layer.get_delta_weight("x").detach(), lora.deltas[name], rtol=1e-5, atol=1e-6,
                                   msg=name)


# -- the two experts -----------------------------------------------------------------------------------------

def test_the_two_experts_load_as_the_pipelines_transformer_and_transformer_2(folder, pipeline, tmp_path, caplog):
    """[model] expert "high" / "auto" is the folder's transformer/, "low" its transformer_2/, as
    WanPipeline.from_pretrained reads them ("auto" warning that it is one expert of two); the folder's
    boundary_ratio is read; "low" on a
    one-transformer folder and the key on another family are refused, naming what to change."""
    from leantune.models.wan import trained_expert

    cases = (("auto", pipeline.transformer), ("high", pipeline.transformer), ("low", pipeline.transformer_2))
    for expert, want in cases:
        src = _sources(folder, tmp_path, expert=expert)
        assert src.boundary_ratio == BOUNDARY_RATIO == pipeline.config.boundary_ratio
        caplog.clear()
        _assert_same_weights(FAM.load_transformer(src, dtype=torch.float32), want)
        # "auto" says that it loads one expert of two, and what that means for samples
        assert any("high-noise expert" in r.getMessage() and "expert = \"high\" or \"low\"" in r.getMessage()
                   for r in caplog.records) == (expert == "auto")
        assert trained_expert(src) == ("low" if expert == "low" else "high", BOUNDARY_RATIO)
    assert not torch.equal(pipeline.transformer.proj_out.weight, pipeline.transformer_2.proj_out.weight)
    one = save_wan_folder(tmp_path / "one", experts=1)
    assert trained_expert(_sources(one, tmp_path)) is None
    for expert in ("low", "high"):       # "high" used to pass here and fail later (no boundary: a TypeError)
        with pytest.raises(LoadError, match=rf'\[model\] expert = "{expert}".*transformer_2'):
            _sources(one, tmp_path, expert=expert)
    with pytest.raises(ValueError, match=r'\[model\] expert.*"wan2.2"'):
        ModelConfig(path=str(folder), family="z-image", expert="high")


@pytest.mark.parametrize("method", ["uniform", "sigmoid", "shift"])
@pytest.mark.parametrize("expert", ["high", "low"])
def test_an_expert_trains_on_its_share_of_the_drawn_noise_levels(method, expert):
    """restrict_sigmas moves the trainer's draws into the expert's range [0.875, 1) / (0, 0.875)
    (WanPipeline: timestep >= boundary_ratio * 1000 is the high-noise expert's), keeps their
    order, and follows the configured distribution conditioned on the range: its quantiles are those
    of rejection-sampling the same distribution (Kolmogorov-Smirnov distance < 0.02 on 40000 draws)."""
    from leantune.models.wan.experts import boundary_timestep, owns, restrict_sigmas
    from leantune.train.flow_matching import sample_sigmas

    g = torch.Generator().manual_seed(0)
    drawn = sample_sigmas(40000, method, g, shift=3.0)
    got = restrict_sigmas(drawn, expert, BOUNDARY_RATIO, method, shift=3.0)
    assert owns(expert, got * 1000, BOUNDARY_RATIO).all()
    assert bool((got >= BOUNDARY_RATIO).all()) == (expert == "high")
    assert (torch.diff(got[torch.argsort(drawn)]) >= 0).all()          # monotone in the draw
    pool = sample_sigmas(200000, method, torch.Generator().manual_seed(1), shift=3.0)
    inside = pool[owns(expert, pool * 1000, BOUNDARY_RATIO)]
    grid = torch.linspace(float(got.min()), float(got.max()), 64)
    cdf = lambda s: (s[None, :] <= grid[:, None]).float().mean(dim=1)     # noqa: E731
    assert float((cdf(got) - cdf(inside)).abs().max()) < 0.02
    assert boundary_timestep(BOUNDARY_RATIO) == 875.0


def test_sampling_switches_experts_where_wanpipeline_does(folder, pipeline, tmp_path):
    """The staged sampler (infer/sampler.denoise) on both experts (wan.load_experts) equals
    WanPipeline on the two-expert folder bit for bit (fp32, one-frame videos, classifier-free
    guidance), over steps that cross the boundary: each step runs the expert the pipeline runs, and
    sampling with the high-noise expert alone differs."""
    from leantune.infer.decode import decode_latents
    from leantune.infer.encode import encode_prompts_stage
    from leantune.infer.sampler import denoise
    from leantune.models.wan import load_experts
    from leantune.models.wan.experts import WanExperts

    src = _sources(folder, tmp_path)
    experts = load_experts(src, torch.float32).requires_grad_(False)
    assert isinstance(experts, WanExperts) and experts.boundary_ratio == BOUNDARY_RATIO
    vae = FAM.load_vae(src, torch.float32, "cpu").requires_grad_(False)
    encoders = FAM.load_text_encoders(src, torch.float32, "cpu")
    schedule = FAM.sampling.schedule(FAM.sampling.variant(experts), folder)
    steps, guidance = 4, 5.0
    calls = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, kw, name=name: calls.append(name), with_kwargs=True)
             for name, m in (("high", experts.high), ("low", experts.low))]
    pipe = type(pipeline)(**{**pipeline.components, "transformer": experts.high, "transformer_2": experts.low,
                             "vae": vae.vae}, boundary_ratio=pipeline.config.boundary_ratio)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(prompt=PROMPT, negative_prompt="", height=H, width=W, num_frames=1, num_inference_steps=steps,
                guidance_scale=guidance, max_sequence_length=32, generator=torch.Generator().manual_seed(SEED),
                output_type="np").frames[:, 0]
    pipe_calls, calls[:] = list(calls), []
    assert "high" in pipe_calls and "low" in pipe_calls
    cond, uncond = encode_prompts_stage(encoders, [PROMPT], max_length=32, device="cpu", family=FAM,
                                        negative_prompts=[""])

    def ours(model):
        latents = denoise(model, cond, [SEED], width=W, height=H, steps=steps, guidance=guidance, schedule=schedule,
                          device="cpu", family=FAM, negative=uncond, cfg_batched=False)
        return decode_latents(vae, latents, "cpu").permute(0, 2, 3, 1).numpy()

    got = ours(experts)
    for h in hooks:
        h.remove()
    assert calls == pipe_calls            # per step, the same expert for both halves, in the same order
    assert got.shape == (1, H, W, 3) and np.abs(got - want).max() == 0.0
    assert np.abs(ours(experts.high) - want).max() > 1e-4


def test_a_low_noise_expert_run_trains_below_the_boundary(folder, tmp_path, monkeypatch):
    """A LoRA run with [model] expert = "low" on the two-expert folder: every noise level its steps
    train on is below boundary_ratio (the trainer's draws go through wan's training_sigmas), and the
    adapter it saves is on transformer_2's architecture."""
    from leantune.config import load_config
    from leantune.demo import draw_shapes
    from leantune.models.wan import experts as wan_experts
    from leantune.trainer import train

    seen = []
    restrict = wan_experts.restrict_sigmas

    def recording(sigma, expert, ratio, method, **kw):
        out = restrict(sigma, expert, ratio, method, **kw)
        seen.append((expert, ratio, method, out.clone()))
        return out

    monkeypatch.setattr(wan_experts, "restrict_sigmas", recording)
    images = tmp_path / "images"
    draw_shapes(images, count=2, size=64, seed=5)
    (tmp_path / "run.toml").write_text(f"""
[model]
family = "wan2.2"
path = "{folder}"
dtype = "fp32"
expert = "low"

[data]
resolutions = [64]
batch_size = 2
cache_dir = "{tmp_path / 'cache'}"
max_text_length = 32

[[data.datasets]]
path = "{images}"

[lora]
rank = 4
alpha = 4

[train]
steps = 2
learning_rate = 1e-3
mixed_precision = "no"
seed = 3

[output]
dir = "out"
name = "low"
formats = ["diffusers"]
""")
    result = train(load_config(tmp_path / "run.toml", []), progress=False)
    assert result.final_step == 2 and len(seen) == 2
    for expert, ratio, method, sigma in seen:
        assert (expert, ratio, method) == ("low", BOUNDARY_RATIO, "shift")
        assert sigma.shape == (2,) and bool((sigma < BOUNDARY_RATIO).all()) and bool((sigma > 0).all())
    lora = load_file(str(result.paths.lora_file("diffusers")))
    assert lora and all(k.startswith("transformer.blocks.") for k in lora)
