"""Wan 2.1 I2V's first-frame CLIP image embedding (wan/i2v.py image_embedding, wan/loading.py
load_image_encoder) on a tiny Wan 2.1 I2V built offline from the real classes (leantune.tiny.wan:
a 36-channel WanTransformer3DModel with image_dim and added_kv_proj_dim, transformers'
CLIPVisionModel and CLIPImageProcessor), against WanImageToVideoPipeline with its image_encoder:

- its diffusers folder and its transformer as one file in Wan-AI's names (`img_emb`, `k_img`) load,
  with the CLIP encoder of the folder or of [model] image_encoder (a folder, or one file in
  transformers' names as ComfyUI's clip_vision_h.safetensors, read from its shapes); the embedding is the pipeline's
  `encode_image` (its penultimate hidden state); a missing encoder, an encoder of another width and
  Wan 2.1 FLF2V are refused by name;
- the caching phase stores each clip's first-frame embedding as an entry of its own (a changed clip
  re-encodes) and each training step feeds it as `encoder_hidden_states_image`; without it, or with
  the text at other than 512 rows, the forward refuses;
- a LoRA trained on it (the "all" preset: the cross-attention's add_k_proj / add_v_proj too) loads
  through WanImageToVideoPipeline.load_lora_weights with every key consumed, and `leantune sample
  --reference FIRST.png` writes that pipeline's videos bit for bit (fp32), with and without it;
- the planner's probe prices the 257 image rows of the cross-attention.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from leantune.models.family import get_family
from leantune.tiny.wan import CLIP_VISION_TINY, save_wan21_i2v_folder, wan21_i2v_transformer

FAM = get_family("wan2.2")
SIDE, HEIGHT, FRAMES, SEED, FPS, CLIP_FRAMES = 64, 48, 5, 7, 16, 9
PROMPT = "a square moving right"
ROWS = (CLIP_VISION_TINY["image_size"] // CLIP_VISION_TINY["patch_size"]) ** 2 + 1     # 17 (the released 257)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _prompt_clean_without_ftfy(monkeypatch):
    """pipeline_wan_i2v calls ftfy unguarded; pipeline_wan's prompt_clean is the same cleaning
    (tests/test_wan_i2v.py)."""
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", pipeline_wan.prompt_clean)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_wan21_i2v_folder(tmp_path_factory.mktemp("wan21-i2v") / "folder")


@pytest.fixture(scope="module")
def first_png(tmp_path_factory):
    from PIL import Image

    img = np.full((HEIGHT + 16, SIDE + 8, 3), (30, 60, 200), np.uint8)
    img[10:34, 12:40] = 250
    path = tmp_path_factory.mktemp("first") / "first.png"
    Image.fromarray(img).save(path)
    return path


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    from moving_square_clips import write_media

    return write_media(tmp_path_factory.mktemp("media") / "data", CLIP_FRAMES, FPS, SIDE)


def _sources(path, **keys):
    from leantune.config import ModelConfig

    return FAM.resolve_sources(ModelConfig(path=str(path), family="wan2.2", dtype="fp32", **keys), path.parent)


def _pipe(folder):
    """The folder's WanImageToVideoPipeline, every weight copied to fresh memory (from_pretrained's
    mmap offsets round differently on the CPU; leantune's loader copies: tests/test_wan_i2v.py)."""
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        for name in ("transformer", "vae", "text_encoder", "image_encoder"):
            for p in getattr(pipe, name).parameters():
                p.data = p.data.clone()
    return pipe


# -- loading ---------------------------------------------------------------------------------------

def test_the_folder_and_a_native_file_load_with_the_clip_encoder_and_bad_ones_are_named(folder, first_png, tmp_path):
    from PIL import Image
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from leantune.models.wan import loading
    from leantune.models.wan.keys import diffusers_to_native, native_metadata
    from leantune.models.weights import LoadError

    src = _sources(folder)
    assert FAM.references.takes_first_frame(src) and loading.takes_image_embedding(src)
    embedding = FAM.references.frame_embedding(src)
    assert embedding.shape == (ROWS, CLIP_VISION_TINY["hidden_size"])
    pipe = _pipe(folder)
    image = Image.open(first_png).convert("RGB")
    got = embedding.embed(embedding.load(torch.float32, "cpu"), image)
    want = pipe.encode_image(image, "cpu")                       # hidden_states[-2] of the processor's pixels
    assert got.shape == want.shape == (1, ROWS, CLIP_VISION_TINY["hidden_size"]) and torch.equal(got, want)
    assert not torch.equal(got, pipe.image_encoder(**pipe.image_processor(images=image, return_tensors="pt"),
                                                   output_hidden_states=True).hidden_states[-1])

    # the transformer as one file in Wan-AI's names, the encoder from [model] image_encoder / image_processor
    model = FAM.load_transformer(src, torch.float32)
    native = diffusers_to_native(model.state_dict())
    assert {"img_emb.proj.1.weight", "blocks.0.cross_attn.k_img.weight", "blocks.0.cross_attn.norm_k_img.weight"} \
        <= set(native)
    path = tmp_path / "wan2.1_i2v_480p_14B.safetensors"
    save_file(native, str(path), metadata=native_metadata(model))
    one = _sources(path, image_encoder=str(folder / "image_encoder"), image_processor=str(folder / "image_processor"))
    loaded = FAM.load_transformer(one, torch.float32)
    assert loaded.config.image_dim == CLIP_VISION_TINY["hidden_size"] and loaded.config.added_kv_proj_dim == 32
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
    assert FAM.references.frame_embedding(one).shape == embedding.shape

    # the encoder as one file too (ComfyUI's clip_vision_h.safetensors: transformers' names with the
    # projection, the architecture from its shapes; the tiny one's 2 heads and activation in its metadata,
    # which the released one's are not), CLIP's own preprocessing without an image_processor folder
    from transformers import CLIPVisionModelWithProjection

    clip_file = tmp_path / "clip_vision_h.safetensors"
    with_projection = CLIPVisionModelWithProjection(CLIPVisionConfig(**CLIP_VISION_TINY))
    with_projection.vision_model.load_state_dict(pipe.image_encoder.state_dict())    # saved under vision_model.
    save_file({k: v.contiguous() for k, v in with_projection.state_dict().items()}, str(clip_file),
              metadata={"leantune.config": '{"num_attention_heads": 2, "hidden_act": "quick_gelu"}'})
    single = FAM.references.frame_embedding(_sources(path, image_encoder=str(clip_file)))
    assert single.shape == embedding.shape
    assert torch.equal(single.embed(single.load(torch.float32, "cpu"), image), want)
    # without the metadata the file is read as the released ViT-H's 16 heads and GELU: another embedding
    released = tmp_path / "released_like.safetensors"
    save_file({k: v.contiguous() for k, v in with_projection.state_dict().items()}, str(released))
    other_heads = FAM.references.frame_embedding(_sources(path, image_encoder=str(released)))
    assert not torch.equal(other_heads.embed(other_heads.load(torch.float32, "cpu"), image), want)
    stray = tmp_path / "not_clip.safetensors"
    save_file({"visual.conv1.weight": torch.zeros(4, 3, 8, 8)}, str(stray))        # open_clip's names
    with pytest.raises(LoadError, match=r"image_encoder: .*not_clip\.safetensors: not a CLIP vision encoder in "
                                        r"transformers' names"):
        FAM.references.frame_embedding(_sources(path, image_encoder=str(stray)))

    with pytest.raises(LoadError, match=r"no Wan 2\.1 I2V image encoder.*set \[model\] image_encoder"):
        FAM.references.frame_embedding(_sources(path))
    other = tmp_path / "wide_encoder"
    CLIPVisionModel(CLIPVisionConfig(**{**CLIP_VISION_TINY, "hidden_size": 24})).save_pretrained(other)
    with pytest.raises(LoadError, match=r"image_encoder: .*config\.json: hidden_size 24, but the transformer's "
                                        r"image embedder takes image_dim = 16"):
        FAM.references.frame_embedding(_sources(path, image_encoder=str(other),
                                                image_processor=str(folder / "image_processor")))
    with pytest.raises(LoadError, match=r"first-last-frame transformer \(Wan 2\.1 FLF2V"):
        loading.check_text_to_video({"in_channels": 36, "out_channels": 16, "image_dim": 1280,
                                     "pos_embed_seq_len": 514}, path)


# -- training ---------------------------------------------------------------------------------------

def _config(tmp_path, folder, media, name: str, extra: str = "", steps: int = 2):
    from leantune.config import load_config

    from moving_square_clips import wan_run

    path = wan_run(tmp_path / f"{name}.toml", family="wan2.2", folder=folder, media=media, cache=tmp_path / "cache",
                   out=tmp_path / name, name="wan21", target_fps=FPS, steps=steps, lr=2e-2, extra=extra)
    text = path.read_text().replace("max_text_length = 32", "max_text_length = 512")
    path.write_text(text.replace("alpha = 4\n", 'alpha = 4\ntargets = "all"\n'))
    return load_config(path)


def _prepare(cfg, **kw):
    from leantune.data import cache

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cache.prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32, **kw)


def test_each_clip_s_embedding_is_cached_and_fed_every_step(tmp_path, folder, media):
    """Two reference entries per clip, [condition, embedding]; the embedding is the pipeline's
    encode_image of the clip's first frame (as its latent entry decodes it), in bf16; a second pass
    reads them, a changed clip re-encodes its own; the step's forward gets it as
    encoder_hidden_states_image; without it, or with 32 text rows, the forward refuses."""
    import shutil
    from types import SimpleNamespace

    from PIL import Image

    from leantune.data import cache
    from leantune.data.video_vae import iter_clip_frames
    from leantune.trainer import forward_backward
    from moving_square_clips import moving_square

    data_dir = tmp_path / "data"
    shutil.copytree(media, data_dir)
    cfg = _config(tmp_path, folder, data_dir, "cached")
    data = _prepare(cfg)
    clips = sorted(data.samples, key=lambda s: str(s.item.path))
    assert len(clips) == 2 and all(len(s.reference_keys) == 2 for s in clips)
    assert data.stats["first_frame_embeddings"].misses == 2
    pipe = _pipe(folder)
    for s in clips:
        first = next(iter_clip_frames(s.item.path, target_fps=FPS, num_frames=1, size=(SIDE, SIDE)))
        pixels = ((first + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        want = pipe.encode_image(Image.fromarray(pixels), "cpu")[0]
        entry = data.latent_entry(s.reference_keys[1])
        assert entry.shape == (ROWS, 16) and torch.equal(entry, want.to(cache.STORE_DTYPE))
    again = _prepare(cfg)
    assert (again.stats["first_frame_embeddings"].hits, again.stats["first_frame_embeddings"].misses) == (2, 0)
    from leantune.data.video_write import write_mp4

    write_mp4(data_dir / "clip1.mp4", moving_square(1, CLIP_FRAMES, SIDE)[:, ::-1].copy(), FPS)   # a changed clip
    changed = _prepare(cfg)
    assert (changed.stats["first_frame_embeddings"].hits, changed.stats["first_frame_embeddings"].misses) == (1, 1)

    batch = next(data.batches(seed=0))
    assert [tuple(r.shape) for r in batch.references] == [(2, 20, 3, 8, 8), (2, ROWS, 16)]
    transformer = FAM.load_transformer(_sources(folder), torch.float32)
    seen = []
    transformer.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("encoder_hidden_states_image")),
                                          with_kwargs=True)
    t = SimpleNamespace(device=torch.device("cpu"), generator=torch.Generator().manual_seed(0),
                        sources=_sources(folder), transformer=transformer, dtype=torch.float32, mode=None,
                        last_bucket=None)
    assert np.isfinite(forward_backward(t, cfg, batch))
    assert seen[0] is not None and torch.equal(seen[0], batch.references[1].float())

    noisy, sigma = torch.randn(1, 16, 3, 8, 8), torch.tensor([0.5])
    cond = batch.references[0][:1].float()
    text = type("E", (), {"t5": torch.randn(1, 512, 32)})()
    with pytest.raises(ValueError, match=r"reads its first frame's CLIP image embedding .*none given"):
        FAM.predict(transformer, noisy, sigma, text, (8, 8), references=[cond])
    short = type("E", (), {"t5": torch.randn(1, 32, 32)})()
    with pytest.raises(ValueError, match=r"text at 512 rows .*got 32: set \[data\] max_text_length = 512"):
        FAM.predict(transformer, noisy, sigma, short, (8, 8), references=[cond, batch.references[1][:1].float()])


# -- a trained LoRA and sampling ------------------------------------------------------------------------

def _sample(folder, out, *flags) -> int:
    from leantune.cli import main

    return main(["sample", "--model", str(folder), "--family", "wan2.2", "--prompt", PROMPT, "--width", str(SIDE),
                 "--height", str(HEIGHT), "--steps", "3", "--guidance", "5.0", "--seed", str(SEED), "--device", "cpu",
                 "--out", str(out), "--set", "model.dtype=fp32", "--frames", str(FRAMES), *flags])


def test_a_trained_lora_loads_in_the_pipeline_and_samples_equal_its_videos(tmp_path, folder, media, first_png,
                                                                          monkeypatch, capsys):
    """Two steps of a LoRA on every Linear of the blocks (add_k_proj / add_v_proj included) with a
    preview from [sample] references' first frame; its diffusers file loads through
    WanImageToVideoPipeline.load_lora_weights with every key in the model; `leantune sample
    --reference` writes the pipeline's frames bit for bit without and with it."""
    from peft.utils import get_peft_model_state_dict
    from PIL import Image
    from safetensors import safe_open

    from leantune.infer import video
    from leantune.trainer import train

    extra = (f'\n[sample]\nevery = 2\nsteps = 2\nguidance = 4.0\nwidth = {SIDE}\nheight = {HEIGHT}\nframes = {FRAMES}\n'
             f'prompts = ["a square"]\nreferences = ["{first_png}"]\n')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(_config(tmp_path, folder, media, "trained", extra), progress=False)
    (mp4,) = result.sample_files
    assert mp4.is_file()
    lora = result.paths.lora_file("diffusers")
    with safe_open(str(lora), "pt") as f:
        keys = set(f.keys())
    assert any(".attn2.add_k_proj.lora_A" in k for k in keys) and any(".attn2.add_v_proj.lora_B" in k for k in keys)

    written = []
    save_video = video.save_video
    monkeypatch.setattr(video, "save_video", lambda frames, path, fps: written.append(frames.copy()) or
                        save_video(frames, path, fps))
    assert _sample(folder, tmp_path / "out", "--reference", str(first_png)) == 0
    assert _sample(folder, tmp_path / "out", "--reference", str(first_png), "--lora", str(lora)) == 0
    capsys.readouterr()
    pipe = _pipe(folder)
    image = Image.open(first_png).convert("RGB")
    wants = []
    for with_lora in (False, True):
        if with_lora:
            pipe.load_lora_weights(str(lora))
            (name,) = pipe.transformer.peft_config
            loaded = {"transformer." + k for k in get_peft_model_state_dict(pipe.transformer, adapter_name=name)}
            assert loaded == {k for k in keys if ".lora_" in k}, sorted(loaded ^ keys)[:4]   # every key consumed
        out = pipe(image=image, prompt=PROMPT, negative_prompt="", height=HEIGHT, width=SIDE, num_frames=FRAMES,
                   num_inference_steps=3, guidance_scale=5.0, generator=torch.Generator().manual_seed(SEED),
                   output_type="np").frames[0]
        wants.append((out * 255).round().astype(np.uint8))
    assert len(written) == 2
    for got, want in zip(written, wants):
        assert got.shape == want.shape == (FRAMES, HEIGHT, SIDE, 3)
        assert np.array_equal(got, want), np.abs(got.astype(int) - want.astype(int)).max()
    assert not np.array_equal(wants[0], wants[1])


# -- the planner -------------------------------------------------------------------------------------

def test_the_probe_prices_the_image_rows_of_the_cross_attention():
    """probe_inputs gives a model with an image embedder the released 257 rows of the embedding; the
    activation probe's blocks save more with them than the same model without the image branch, by
    more than one (257, width) tensor (without the rows fed, the image branch adds far less)."""
    from leantune.models.wan import IMAGE_EMBEDDING_ROWS
    from leantune.models.wan.spec import WAN_SPEC
    from leantune.planner.activation_probe import probe_activations
    from leantune.planner.workload import Workload

    with_image = wan21_i2v_transformer(0).requires_grad_(False)
    plain = wan21_i2v_transformer(0, image_dim=None, added_kv_proj_dim=None).requires_grad_(False)
    inputs = FAM.probe_inputs(with_image.config, 1, (8, 8), 512, torch.float32)
    assert tuple(inputs["encoder_hidden_states_image"].shape) == (1, IMAGE_EMBEDDING_ROWS, 16) == (1, 257, 16)
    assert "encoder_hidden_states_image" not in FAM.probe_inputs(plain.config, 1, (8, 8), 512, torch.float32)
    w = Workload(rank=4, targets="all", buckets=((64, 64),), text_length=512, dtype=torch.float32, autocast=False,
                 allow_fp8=False)
    a, b = (probe_activations(WAN_SPEC, m, w, (64, 64)).kinds["main"].saved for m in (with_image, plain))
    # a block saves at least one (257, width) fp32 tensor more: the image rows' keys, values, LoRA inputs
    assert a - b > IMAGE_EMBEDDING_ROWS * 32 * 4, (a, b)
