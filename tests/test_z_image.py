"""Z-Image beyond the conformance suite (tests/families): parity with Tongyi-MAI's published forward
(tests/z_image_reference.py, an independent model of it) on a seeded tiny model in the official
single-file layout, read by leantune's loader and by diffusers' own single-file conversion; fp8
files kept e4m3; text encoding equal to ZImagePipeline.encode_prompt, loaded and read from its
files layer by layer; samples with a LoRA at strength 1 and 0.5 equal the pipeline's bit for bit;
a full fine-tune's exports load back to the trained weights."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from z_image_reference import reference_forward

from leantune.config import ModelConfig
from leantune.models.component_files import METADATA_CONFIG_KEY
from leantune.models.family import PromptEmbeds, get_family
from leantune.models.z_image import model_time, predict
from leantune.models.z_image.loading import save_single_file
from leantune.tiny.z_image import Z_IMAGE_TINY, save_z_image_folder, z_image_transformer

FAM = get_family("z-image")
COMFY = "model.diffusion_model."
UNSEEN = {k: Z_IMAGE_TINY[k] for k in ("axes_dims", "axes_lens", "rope_theta", "norm_eps", "t_scale")}


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: tiny models run best on one thread


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_z_image_folder(tmp_path_factory.mktemp("z_image") / "folder")


def _sources(path, root):
    return FAM.resolve_sources(ModelConfig(path=str(path), family="z-image"), root)


def _official_state(seed: int = 5) -> dict:
    """Seeded random tensors in the official source's module names (src/zimage/transformer.py names
    its modules as diffusers does), on the tiny architecture's shapes."""
    g = torch.Generator().manual_seed(seed)
    shapes = {k: v.shape for k, v in z_image_transformer(0).state_dict().items()}
    return {k: torch.randn(s, generator=g) * (0.5 if len(s) > 1 else 0.2) + (1.0 if "norm" in k else 0.0)
            for k, s in sorted(shapes.items())}


def _original_layout(sd: dict) -> dict:
    """The original checkpoint's names, written here by hand (not with leantune's table): fused
    attention.qkv (q, k, v rows), attention.out, q_norm / k_norm, x_embedder, final_layer."""
    out = {}
    for k, v in sd.items():
        if ".attention.to_k." in k or ".attention.to_v." in k:
            continue
        if ".attention.to_q." in k:
            out[k.replace("to_q", "qkv")] = torch.cat([v, sd[k.replace("to_q", "to_k")], sd[k.replace("to_q", "to_v")]])
            continue
        k = (k.replace("attention.to_out.0", "attention.out").replace("attention.norm_q", "attention.q_norm")
             .replace("attention.norm_k", "attention.k_norm").replace("all_x_embedder.2-1", "x_embedder")
             .replace("all_final_layer.2-1", "final_layer"))
        out[k] = v
    return out


def _inputs(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    images = [torch.randn(16, 1, 6, 8, generator=g), torch.randn(16, 1, 6, 8, generator=g)]
    caps = [torch.randn(13, 16, generator=g), torch.randn(40, 16, generator=g)]     # 1 and 2 blocks of 32 rows
    return images, torch.tensor([0.3, 0.85]), caps


# -- parity with the official forward ------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["", COMFY])
def test_official_single_file_loads_to_the_official_forward(prefix, tmp_path):
    """A seeded tiny model in the official single-file layout (bare, as Tongyi-MAI's; under
    ComfyUI's prefix): leantune's loaded model gives the official forward's outputs bit for bit
    (tests/z_image_reference.py), its weights are what diffusers' own single-file conversion makes of
    the file, and predict is the pipeline's convention of it (time 1 - sigma, output negated)."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    sd = _official_state()
    path = tmp_path / "z_image.safetensors"
    save_file({prefix + k: v for k, v in _original_layout(sd).items()}, str(path),
              metadata={METADATA_CONFIG_KEY: json.dumps(UNSEEN)})      # the tiny head size's rotary split
    model = FAM.load_transformer(_sources(path, tmp_path), dtype=torch.float32).eval().requires_grad_(False)
    for k, v in Z_IMAGE_TINY.items():
        assert list(model.config[k]) == list(v) if isinstance(v, (list, tuple)) else model.config[k] == v, k
    converted = convert_z_image_transformer_checkpoint_to_diffusers(load_file(str(path)))
    got = model.state_dict()
    assert converted.keys() == got.keys() == sd.keys()
    assert all(torch.equal(converted[k], got[k]) and torch.equal(sd[k], got[k]) for k in sd)
    images, t, caps = _inputs()
    want = reference_forward(sd, dict(Z_IMAGE_TINY), images, t, caps)
    with torch.no_grad():
        out = model(list(images), t, list(caps), return_dict=False)[0]
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    # predict at sigma feeds time (1000 - 1000 sigma) / 1000 and returns the negated velocity
    sigma = torch.tensor([0.7, 0.15])
    padded = torch.zeros(2, 40, 16)
    padded[0, :13], padded[1] = caps[0], caps[1]
    with torch.no_grad():
        v = predict(model, torch.stack(images).squeeze(2), sigma, PromptEmbeds(padded, torch.zeros(2, 0)), (6, 8))
    want = reference_forward(sd, dict(Z_IMAGE_TINY), images, model_time(sigma), caps)
    assert torch.equal(v, -torch.stack(want).squeeze(2))
    torch.testing.assert_close(model_time(sigma), 1 - sigma)


def test_fp8_files_keep_their_block_weights_e4m3(tmp_path):
    """ComfyUI's fp8 layouts (plain e4m3 and "scaled" with scale_weight) of the original names load
    with every block Linear e4m3 (the adaLN too unless fp8_modulation = false), the rest in the
    compute dtype, and outputs within e4m3's rounding of the bf16 model's."""
    tiny = z_image_transformer(0).requires_grad_(False)
    images, t, caps = _inputs()
    with torch.no_grad():
        want = torch.stack(tiny(list(images), t, list(caps), return_dict=False)[0])
    for fp8 in ("e4m3", "scaled"):
        path = save_single_file(tiny, tmp_path / f"{fp8}.safetensors", dtype=torch.bfloat16, fp8=fp8, prefix=COMFY)
        raw = load_file(str(path))
        assert raw[COMFY + "layers.0.attention.qkv.weight"].dtype == torch.float8_e4m3fn
        src = _sources(path, tmp_path)
        model = FAM.load_transformer(src, dtype=torch.bfloat16)
        state = model.state_dict()
        for name in ("layers.1.attention.to_k", "noise_refiner.0.feed_forward.w2", "context_refiner.0.attention.to_out.0",
                     "layers.0.adaLN_modulation.0"):
            assert state[f"{name}.weight"].dtype == torch.float8_e4m3fn, (fp8, name)
        assert state["all_x_embedder.2-1.weight"].dtype == torch.bfloat16
        assert state["layers.0.attention_norm1.weight"].dtype == torch.bfloat16
        upcast = FAM.load_transformer(src, dtype=torch.bfloat16, fp8_modulation=False).state_dict()
        assert upcast["layers.0.adaLN_modulation.0.weight"].dtype == torch.bfloat16
        assert upcast["layers.0.attention.to_q.weight"].dtype == torch.float8_e4m3fn
        with torch.no_grad():
            got = torch.stack(model([i.bfloat16() for i in images], t, [c.bfloat16() for c in caps],
                                    return_dict=False)[0]).float()
        err = (got - want).norm() / want.norm()
        assert 0 < err < 0.08, (fp8, float(err))


def test_a_file_of_another_architecture_is_refused_naming_the_key(tmp_path):
    sd = _original_layout(_official_state())
    sd["layers.1.attention.qkv.weight"] = sd["layers.1.attention.qkv.weight"][:-1]      # not 3 equal parts
    path = tmp_path / "bad.safetensors"
    save_file(sd, str(path), metadata={METADATA_CONFIG_KEY: json.dumps(UNSEEN)})
    from leantune.models.weights import LoadError

    with pytest.raises(LoadError, match=r"bad\.safetensors.*layers\.1\.attention\.qkv\.weight"):
        FAM.load_transformer(_sources(path, tmp_path), dtype=torch.float32)
    del sd["layers.1.attention.qkv.weight"]
    save_file(sd, str(path), metadata={METADATA_CONFIG_KEY: json.dumps(UNSEEN)})
    with pytest.raises(LoadError, match=r"bad\.safetensors.*layers\.1\.attention\.qkv\.weight"):
        FAM.load_transformer(_sources(path, tmp_path), dtype=torch.float32)


# -- text encoding -------------------------------------------------------------------------------------

PROMPTS = ["a photo of a cat", "a small orange ellipse next to a large purple square, two shapes, a circle and a square",
           ""]


def test_text_encoding_equals_the_pipelines_encode_prompt(folder, tmp_path):
    """Prompts of different lengths, one cut at max_length, the empty one: encode_prompts' rows up to
    `lengths` are ZImagePipeline.encode_prompt's tensors bit for bit and the rest zero, with the
    encoder loaded and with it read from its files layer by layer (a host-RAM budget it does not
    fit); the encoder is whole again after each encode."""
    from diffusers import ZImagePipeline

    from leantune.models.streamed_encoder import is_file_backed, text_encoder_ram_budget

    pipe = ZImagePipeline.from_pretrained(str(folder), local_files_only=True)
    want, _ = pipe.encode_prompt(list(PROMPTS), device="cpu", do_classifier_free_guidance=False, max_sequence_length=24)
    assert max(len(w) for w in want) == 24 and min(len(w) for w in want) < 24        # one truncated
    for budget in (None, 1):
        with text_encoder_ram_budget(budget):
            encoders = FAM.load_text_encoders(_sources(folder, tmp_path), torch.float32, "cpu")
        assert is_file_backed(encoders.text_encoder) == (budget is not None)
        embeds, lengths = FAM.encode_prompts(list(PROMPTS), encoders, 24, "cpu")
        assert lengths.tolist() == [len(w) for w in want]
        for row, n, w in zip(embeds.t5, lengths, want):
            assert torch.equal(row[:n], w), budget
            assert not row[n:].any()
        assert len(encoders.text_encoder.layers) == 3 and not isinstance(encoders.text_encoder.norm, torch.nn.Identity)


def test_text_encoder_single_file_encodes_as_the_pipeline(folder, tmp_path):
    """The tiny Qwen3 as ComfyUI's qwen_3_4b.safetensors holds it (transformers' names under `model.`,
    an lm_head beside; the rope base and norm eps its leantune.config metadata states, Qwen3-4B's
    otherwise): the architecture is read from the shapes, and the encoder, loaded or read from the
    file layer by layer, encodes as ZImagePipeline.encode_prompt; a file without the embedding is
    refused naming the file and the key."""
    from diffusers import ZImagePipeline

    from leantune.models.streamed_encoder import is_file_backed, text_encoder_ram_budget
    from leantune.models.weights import LoadError

    pipe = ZImagePipeline.from_pretrained(str(folder), local_files_only=True)
    cfg = pipe.text_encoder.config
    state = {f"model.{k}": v for k, v in pipe.text_encoder.state_dict().items()}
    state["lm_head.weight"] = torch.zeros(8, 16)
    path = tmp_path / "qwen_3_4b.safetensors"
    save_file(state, str(path), metadata={METADATA_CONFIG_KEY: json.dumps(
        {"rope_parameters": dict(cfg.rope_parameters), "rms_norm_eps": cfg.rms_norm_eps})})
    want, _ = pipe.encode_prompt(list(PROMPTS), device="cpu", do_classifier_free_guidance=False, max_sequence_length=24)
    for budget in (None, 1):
        with text_encoder_ram_budget(budget):
            encoders = FAM.load_text_encoders(FAM.resolve_sources(
                ModelConfig(path=str(folder), family="z-image", text_encoder=str(path)), tmp_path), torch.float32, "cpu")
        assert is_file_backed(encoders.text_encoder) == (budget is not None)
        assert encoders.text_encoder.config.num_hidden_layers == 3 and encoders.text_encoder.config.head_dim == 8
        embeds, lengths = FAM.encode_prompts(list(PROMPTS), encoders, 24, "cpu")
        for row, n, w in zip(embeds.t5, lengths, want):
            assert torch.equal(row[:n], w), budget
    del state["model.embed_tokens.weight"]
    save_file(state, str(path))
    with pytest.raises(LoadError, match=r"qwen_3_4b\.safetensors.*embed_tokens"):
        FAM.load_text_encoders(FAM.resolve_sources(ModelConfig(path=str(folder), family="z-image",
                                                               text_encoder=str(path)), tmp_path), torch.float32)


# -- samples with a LoRA -------------------------------------------------------------------------------

def _trained_lora(model, root: Path):
    from leantune.train.lora import add_lora, lora_weights_from_model, save_lora

    trained = copy.deepcopy(model)
    params = add_lora(trained, FAM.spec, SimpleNamespace(rank=4, effective_alpha=8.0, alpha=8.0, dropout=0.0,
                                                        targets="all_linear", blocks=None))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    weights = lora_weights_from_model(trained)
    return {fmt: save_lora(weights, root / f"lora_{fmt}.safetensors", fmt) for fmt in ("diffusers", "comfyui")}


def test_samples_with_a_lora_at_strength_1_and_half_equal_the_pipelines(folder, tmp_path):
    """fp32, CFG 4 with the empty negative prompt, 2 steps: our staged sampler with a trained LoRA
    (either of its files) applied at strength 1 and 0.5 gives ZImagePipeline's images bit for bit,
    the pipeline loading the diffusers file with its own load_lora_weights / set_adapters."""
    import numpy as np
    from diffusers import ZImagePipeline

    from leantune.infer.decode import decode_latents
    from leantune.infer.encode import encode_prompts_stage
    from leantune.infer.loras import apply_loras
    from leantune.infer.sampler import denoise

    src = _sources(folder, tmp_path)
    encoders = FAM.load_text_encoders(src, torch.float32, "cpu")
    vae = FAM.load_vae(src, torch.float32, "cpu").eval().requires_grad_(False)
    base = FAM.load_transformer(src, torch.float32).eval().requires_grad_(False)
    files = _trained_lora(base, tmp_path)
    embeds, negative = encode_prompts_stage(encoders, ["a photo of a cat"], max_length=32, device="cpu", family=FAM,
                                            negative_prompts=[""])
    schedule = FAM.sampling.schedule("z-image", folder)
    parts = ZImagePipeline.from_pretrained(str(folder), local_files_only=True).components
    images = {}
    for strength in (1.0, 0.5):
        pipe = ZImagePipeline(**{**parts, "transformer": copy.deepcopy(base), "vae": vae})
        pipe.set_progress_bar_config(disable=True)
        pipe.load_lora_weights(str(files["diffusers"]), adapter_name="x")
        pipe.set_adapters(["x"], [strength])
        pipe.transformer.requires_grad_(False)
        want = pipe(prompt="a photo of a cat", height=48, width=64, num_inference_steps=2, guidance_scale=4.0,
                    max_sequence_length=32, generator=torch.Generator().manual_seed(3), output_type="np").images
        for fmt, path in files.items():
            model = copy.deepcopy(base)
            apply_loras(model, [(path, strength)])
            model.requires_grad_(False)
            latents = denoise(model, embeds, [3], width=64, height=48, steps=2, guidance=4.0, schedule=schedule,
                              device="cpu", family=FAM, negative=negative)
            ours = decode_latents(vae, latents, "cpu").permute(0, 2, 3, 1).numpy()
            assert np.abs(ours - want).max() == 0.0, (fmt, strength)
        images[strength] = want
    assert np.abs(images[1.0] - images[0.5]).max() > 1e-4


# -- full fine-tune ------------------------------------------------------------------------------------

FULL = """
[model]
family = "z-image"
path = "{model}"
dtype = "fp32"

[data]
resolutions = [64]
batch_size = 1
cache_dir = "{cache}"
max_text_length = 32

[[data.datasets]]
path = "{images}"

[train]
mode = "full"
steps = 2
learning_rate = 1e-3
mixed_precision = "no"
seed = 3

[full]
save_dtype = "fp32"

[memory]
streamed_blocks = 2
stream_non_blocks = true
debug_poison = true
checkpointing = "blocks"

[output]
dir = "out"
name = "t"
formats = ["comfyui", "diffusers"]
"""


def test_full_fine_tune_exports_files_that_load_to_the_trained_weights(folder, tmp_path):
    """Two full fine-tune steps with blocks and the non-block modules streamed (poison mode): the
    original-layout single file and the diffusers folder it exports load, through leantune's loader,
    diffusers' own single-file conversion and from_pretrained, to the same weights, which moved from
    the base."""
    from diffusers import ZImageTransformer2DModel

    from leantune.config import load_config
    from leantune.demo import draw_shapes
    from leantune.trainer import train

    draw_shapes(tmp_path / "images", count=2, size=64, seed=5)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.toml").write_text(FULL.format(model=folder, cache=tmp_path / "cache",
                                                           images=tmp_path / "images"))
    result = train(load_config(tmp_path / "run" / "run.toml", []), progress=False)
    assert result.final_step == 2 and all(torch.isfinite(torch.tensor(result.losses)))
    single, diffusers_dir = result.lora_files
    assert set(load_file(str(single))) >= {"layers.0.attention.qkv.weight", "x_embedder.weight"}
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    from_file = FAM.load_transformer(_sources(single, tmp_path), torch.float32).state_dict()
    from_folder = ZImageTransformer2DModel.from_pretrained(str(diffusers_dir)).state_dict()
    by_diffusers = convert_z_image_transformer_checkpoint_to_diffusers(load_file(str(single)))   # diffusers' own reading
    base = FAM.load_transformer(_sources(folder, tmp_path), torch.float32).state_dict()
    assert from_file.keys() == from_folder.keys() == by_diffusers.keys() == base.keys()
    assert all(torch.equal(from_file[k], from_folder[k]) and torch.equal(by_diffusers[k], from_folder[k]) for k in base)
    assert sum(not torch.equal(from_file[k], base[k]) for k in base) > len(base) // 2


# -- leantune convert from other trainers' layouts ---------------------------------------------------------

def _random_lora(names, shapes, rank, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(rank, shapes[n][1], generator=g) * 0.1, torch.randn(shapes[n][0], rank, generator=g) * 0.1)
            for n in names}


def _musubi_file(shapes, path):
    """musubi-tuner's networks/lora_zimage.py: kohya names (lora_unet_ + the module path, '.' -> '_') of
    its model, which keeps diffusers' module names; the main layers only (refiners and modulation
    excluded by its default patterns); alpha tensors (here 2 for rank 4: scale 0.5)."""
    names = [n for n in shapes if n.startswith("layers.") and "adaLN" not in n]
    lora = _random_lora(names, shapes, 4, 21)
    tensors = {}
    for n, (down, up) in lora.items():
        k = "lora_unet_" + n.replace(".", "_")
        tensors.update({f"{k}.lora_down.weight": down, f"{k}.lora_up.weight": up, f"{k}.alpha": torch.tensor(2.0)})
    save_file(tensors, str(path), metadata={"ss_network_module": "networks.lora_zimage"})
    return {n: 0.5 * up @ down for n, (down, up) in lora.items()}


def _ai_toolkit_file(shapes, path):
    """ai-toolkit (extensions_built_in/diffusion_models/z_image): peft-format names of the diffusers
    model's every Linear with `diffusion_model.` for `transformer.` (convert_lora_weights_before_save),
    no alpha (scale 1)."""
    lora = _random_lora(list(shapes), shapes, 4, 22)
    tensors = {}
    for n, (down, up) in lora.items():
        tensors.update({f"diffusion_model.{n}.lora_A.weight": down, f"diffusion_model.{n}.lora_B.weight": up})
    save_file(tensors, str(path), metadata={"format": "pt"})
    return {n: up @ down for n, (down, up) in lora.items()}


def _diffusion_pipe_file(shapes, path):
    """diffusion-pipe (models/z_image.py, ComfyUI's Lumina model; models/base.py save_adapter): peft
    over ComfyUI's native module names of every JointTransformerBlock (refiners included), a fused
    attention.qkv LoRA among them, `diffusion_model.` prefix, no alpha."""
    from leantune.models.z_image.keys import native_name

    native_shapes = {}
    for n, s in shapes.items():
        if not n.startswith(("layers.", "noise_refiner.", "context_refiner.")):
            continue
        nat = native_name(n + ".weight")[: -len(".weight")]
        rows = native_shapes.get(nat, (0, s[1]))[0]
        native_shapes[nat] = (rows + s[0], s[1])
    lora = _random_lora(list(native_shapes), native_shapes, 4, 23)
    tensors = {}
    for n, (down, up) in lora.items():
        tensors.update({f"diffusion_model.{n}.lora_A.weight": down, f"diffusion_model.{n}.lora_B.weight": up})
    save_file(tensors, str(path), metadata={"format": "pt"})
    deltas = {}
    for n, (down, up) in lora.items():
        if n.endswith("attention.qkv"):
            for i, part in enumerate(up.chunk(3)):
                deltas[n.replace("qkv", "to_" + "qkv"[i])] = part @ down
        else:
            deltas[n.replace("attention.out", "attention.to_out.0")] = up @ down
    return deltas


@pytest.mark.parametrize("layout", ["musubi-tuner", "ai-toolkit", "diffusion-pipe"])
def test_convert_reads_other_trainers_z_image_loras(layout, tmp_path):
    """`leantune convert` reads a Z-Image LoRA in musubi-tuner's, ai-toolkit's and diffusion-pipe's
    layouts (each written here as that tool writes it), tells the family from the names alone, and
    writes comfyui and diffusers files whose deltas are the source's; the comfyui file loads whole in
    ComfyUI's key map (tests/comfyui_keymap.py) to the same merged weights."""
    from comfyui_keymap import comfyui_load, comfyui_native_state

    from leantune.cli import main
    from leantune.train.lora import read_lora

    tiny = z_image_transformer(0)
    shapes = {n: (m.out_features, m.in_features) for n, m in tiny.named_modules() if isinstance(m, torch.nn.Linear)}
    writer = {"musubi-tuner": _musubi_file, "ai-toolkit": _ai_toolkit_file, "diffusion-pipe": _diffusion_pipe_file}
    src = tmp_path / "in.safetensors"
    deltas = writer[layout](shapes, src)
    for fmt in ("comfyui", "diffusers"):
        out = tmp_path / f"{fmt}.safetensors"
        assert main(["convert", str(src), str(out), "--to", fmt]) == 0
        back = read_lora(out)
        assert back.keys is FAM.spec.lora_keys and set(back.modules) == set(deltas), fmt
        for n, d in deltas.items():
            torch.testing.assert_close(back.modules[n].delta(), d, rtol=1e-5, atol=1e-7, msg=f"{fmt} {n}")
    native = comfyui_native_state("z-image", tiny)
    merged = {k: v.clone() for k, v in tiny.state_dict().items()}
    for n, d in deltas.items():
        merged[f"{n}.weight"] += d
    want = comfyui_native_state("z-image", tiny, merged)
    load = comfyui_load("z-image", native, load_file(str(tmp_path / "comfyui.safetensors")))
    assert not load.skipped
    for k in native:
        torch.testing.assert_close(native[k] + load.deltas.get(k, 0), want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_leantune_sample_guides_at_scale_1_as_the_pipeline(folder, tmp_path):
    """`leantune sample` (run_sampling: loaders, plan, engine, PNGs) on the tiny folder at guidance 1
    and 0: ZImagePipeline guides for any scale above 0, so 1 runs classifier-free guidance there
    (v_pos + (v_pos - v_neg)) and here; the PNGs equal the pipeline's images, and 0 (the Turbo's
    default, no guidance) gives another image."""
    import numpy as np
    from diffusers import ZImagePipeline
    from PIL import Image

    from leantune.infer.images import read_png_metadata
    from leantune.infer.request import validate_request
    from leantune.infer.run import run_sampling

    pipe = ZImagePipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    got = {}
    for guidance in (1.0, 0.0):
        request = validate_request({"model": {"path": str(folder), "family": "z-image", "dtype": "fp32"},
                                    "prompts": ["a photo of a cat"], "seed": 3, "steps": 2, "width": 64, "height": 48,
                                    "max_text_length": 32, "guidance": guidance, "out": str(tmp_path / "out")}, "test")
        result = run_sampling(request)
        assert (result.cfg_batched is not None) == (guidance > 0)
        assert read_png_metadata(result.files[0])["guidance"] == f"{guidance:g}"
        ours = np.asarray(Image.open(result.files[0]))
        want = pipe(prompt="a photo of a cat", height=48, width=64, num_inference_steps=2, guidance_scale=guidance,
                    max_sequence_length=32, generator=torch.Generator().manual_seed(3), output_type="np").images[0]
        assert np.array_equal(ours, (want * 255).round().astype(np.uint8)), guidance
        got[guidance] = ours
    assert not np.array_equal(got[1.0], got[0.0])


# -- the Turbo recipe: training through a training adapter ---------------------------------------------

RECIPE = """
[model]
family = "z-image"
path = "{model}"
dtype = "fp32"
{adapters}

[data]
resolutions = [64]
batch_size = 1
cache_dir = "{cache}"
max_text_length = 32

[[data.datasets]]
path = "{images}"

[lora]
rank = 2
alpha = 2
targets = "attention_mlp"

[train]
steps = 3
learning_rate = 1e-3
mixed_precision = "no"
seed = 3

[output]
dir = "out"
name = "t"
formats = ["comfyui", "diffusers"]
"""


def test_turbo_recipe_trains_through_an_ai_toolkit_training_adapter(folder, tmp_path):
    """README's Z-Image Turbo recipe on the tiny model: a de-distilling training adapter as ai-toolkit
    writes it (its `diffusion_model.` peft names over every Linear, no alpha: how ostris'
    zimage_turbo_training_adapter is made) as [model] base_adapters trains the LoRA as training on
    the base with the adapter merged in by hand does (losses, trained weights), unlike training on
    the plain base, and the exports hold the trained LoRA alone."""
    import shutil

    from leantune.config import load_config
    from leantune.demo import draw_shapes
    from leantune.train.lora import read_lora
    from leantune.trainer import train

    draw_shapes(tmp_path / "images", count=2, size=64, seed=5)
    tiny = FAM.load_transformer(_sources(folder, tmp_path), torch.float32)
    shapes = {n: (m.out_features, m.in_features) for n, m in tiny.named_modules() if isinstance(m, torch.nn.Linear)}
    deltas = _ai_toolkit_file(shapes, tmp_path / "adapter.safetensors")
    merged = tmp_path / "merged"
    shutil.copytree(folder, merged)
    with torch.no_grad():
        for name, delta in deltas.items():
            tiny.get_submodule(name).weight += delta
    shutil.rmtree(merged / "transformer")
    tiny.save_pretrained(merged / "transformer", safe_serialization=True)

    def run(name, model, adapters=""):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.toml").write_text(RECIPE.format(model=model, adapters=adapters, cache=tmp_path / name / "c",
                                                                images=tmp_path / "images"))
        return train(load_config(tmp_path / name / "run.toml", []), progress=False)

    through = run("through", folder, f'base_adapters = [{{ path = "{tmp_path / "adapter.safetensors"}", strength = 1.0 }}]')
    on_merged = run("on_merged", merged)
    plain = run("plain", folder)
    assert through.losses == pytest.approx(on_merged.losses, rel=1e-5, abs=1e-7)
    assert through.losses != pytest.approx(plain.losses, rel=1e-3)
    for fmt in ("comfyui", "diffusers"):
        got, want, bare = (read_lora(next(f for f in r.lora_files if f.name.endswith(f"_{fmt}.safetensors"))).modules
                           for r in (through, on_merged, plain))
        assert got.keys() == want.keys() == bare.keys()
        for name, m in want.items():
            torch.testing.assert_close(got[name].delta(), m.delta(), rtol=1e-4, atol=1e-6, msg=f"{fmt} {name}")


# -- the planner ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_plan_model_z_image_prices_the_stock_architecture_without_weights(capsys, tmp_path, monkeypatch):
    """`leantune plan --model z-image-turbo`: the packaged architecture (30 main + 2 + 2 refiner
    blocks of 3840, counted here by hand from the block's shapes: 6.15B; the planner over the meta
    model, ~10 s: marked slow), a LoRA plan within 12 GiB over the three block lists, and the caching
    phase's Qwen3-4B priced from the packaged config (35 of 36 layers run: hidden_states[-2]).
    `z-image` (the base) is the same architecture."""
    from test_planner import _run_plan

    from leantune.family_registry import FAMILIES
    from leantune.models.component_files import packaged_config
    from leantune.planner.meta import build_meta_packaged

    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))
    stock = FAMILIES["z-image"].stock
    assert packaged_config(stock["z-image"].config) == packaged_config(stock["z-image-turbo"].config)
    meta = build_meta_packaged("z-image", "z_image_turbo")
    d, f, a = 3840, int(3840 / 3 * 8), 256
    plain = 4 * d * d + 2 * 128 + 3 * d * f + 4 * d                 # q, k, v, out; q/k norms; SwiGLU; 4 RMSNorms
    modulated = plain + a * 4 * d + 4 * d                            # + adaLN Linear
    assert (len(meta.layers), len(meta.noise_refiner), len(meta.context_refiner)) == (30, 2, 2)
    assert sum(p.numel() for p in meta.layers[0].parameters()) == modulated
    assert sum(p.numel() for p in meta.context_refiner[0].parameters()) == plain
    top = (a * 1024 + 1024 + 1024 * a + a) + (2560 + 2560 * d + d) + (64 * d + d) + (d * 64 + 64) + (a * d + d) + 2 * d
    assert sum(p.numel() for p in meta.parameters()) == 32 * modulated + 2 * plain + top == 6_154_908_736
    rc, out, err = _run_plan(capsys, "--model", "z-image-turbo", "--resolution", "1024", "--vram", "12GiB",
                             "--ram", "64GiB", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    entry = doc["plans"][0]
    notes = entry["plan"]["notes"]
    assert notes["predicted_peak_vram"] <= entry["budget_bytes"] - notes["margin_vram"]
    names = {f"{lst}.{i}" for lst, n in (("noise_refiner", 2), ("context_refiner", 2), ("layers", 30)) for i in range(n)}
    assert set(entry["plan"]["streamed_blocks"]) <= names
    phase = doc["text_encoding"]
    t = packaged_config("qwen3_4b")
    h, i, hd = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    layer = (h * t["num_attention_heads"] * hd * 2 + h * t["num_key_value_heads"] * hd * 2 + 3 * h * i + 2 * hd + 2 * h) * 2
    assert phase["resident"] == t["vocab_size"] * h * 2                      # the embedding (the final norm is not run)
    assert phase["layer"] == layer and (phase["layers"], phase["layers_run"]) == (36, 35)
    assert phase["tokens"] == 8 * 512


# -- quantizing while loading ---------------------------------------------------------------------------

@pytest.mark.parametrize("modulation", [False, True])
def test_quantizing_load_equals_bf16_load_then_quantize(modulation, tmp_path):
    """[memory] fp8 on an fp32 original-layout file (fused qkv split as it is read): every block Linear
    quantized as it is read equals loading in bf16 and quantizing after (tests/test_load_into_fp8.py's
    check: fp8 values and scales bitwise), the adaLN Linears only with fp8 modulation."""
    from test_load_into_fp8 import _assert_fp8_load_equals_bf16_then_quantize

    from leantune.models.z_image import loading
    from leantune.models.z_image.spec import Z_IMAGE_SPEC

    model = z_image_transformer(seed=7, dim=128, n_heads=4, n_kv_heads=4, axes_dims=[8, 12, 12])    # 64-wide scale blocks
    path = save_single_file(model, tmp_path / "z.safetensors", dtype=torch.float32)
    _assert_fp8_load_equals_bf16_then_quantize(loading.load_transformer, loading.ZImageSources(path, None, None, None),
                                               Z_IMAGE_SPEC, modulation=modulation)


@pytest.mark.slow
def test_the_released_architecture_is_read_from_the_original_names_alone():
    """At full size (Z-Image-Turbo's packaged architecture on meta, its tensors renamed to the
    original single file's and fused as that file stores them): the config read from the shapes,
    with no metadata, is the released one, and the original names map back to every model key.
    (Building the 6B model on meta takes ~7 s here: marked slow.)"""
    from leantune.models.component_files import packaged_config
    from leantune.models.z_image import keys
    from leantune.planner.meta import build_meta_packaged

    meta = build_meta_packaged("z-image", "z_image_turbo")
    native = keys.diffusers_to_native({k: v for k, v in meta.state_dict().items()})
    assert native["layers.29.attention.qkv.weight"].shape == (3 * 3840, 3840) and "x_embedder.weight" in native
    ops = keys.to_diffusers_ops({k: tuple(v.shape) for k, v in native.items()})
    shapes = {t: s for op in ops for t, s in zip(op.targets, op.target_shapes(tuple(native[op.source].shape)))}
    assert shapes == {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    released = packaged_config("z_image_turbo")
    got = keys.config_from_shapes(shapes, released)
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in got.items()} == \
        {k: v for k, v in released.items() if not k.startswith("_")}
