"""End-to-end training on the tiny FLUX.2 (dev-like: Mistral3 text encoder, guidance input), by
`[model] family = "flux2-dev"` alone: the caches (patchified batch-norm latents, the stacked hidden
layers of every padded row), flow matching with the family's resolution-dependent shift, LoRA and
full modes, the full mode's exact resume, the diffusers-layout LoRA file giving Flux2Pipeline the
trained model's outputs, and the default exports (ComfyUI beside diffusers) read back by `leantune
sample --lora`, diffusers' FLUX.2 converter and `leantune convert` (a LoRA run's exact resume:
tests/families/test_conformance.py)."""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from leantune.config import load_config
from leantune.demo import draw_shapes
from leantune.tiny import flux2 as tf
from leantune.models.family import get_family
from leantune.train import flow_matching as fm
from leantune.trainer import train

MAX_LEN = 32
RUN = """
[model]
family = "flux2-dev"
path = "{model}"
dtype = "fp32"

[data]
resolutions = [64]
batch_size = 2
cache_dir = "cache"
max_text_length = 32

[[data.datasets]]
path = "{images}"
trigger_word = "lnt"

[lora]
rank = 4
alpha = 8
targets = "all"

[train]
steps = {steps}
learning_rate = 1e-2
mixed_precision = "no"
save_every = 4
keep_last = 5
seed = 3
guidance = 4.0

[output]
dir = "out"
name = "t"
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tf.save_flux2_folder(tmp_path_factory.mktemp("flux2") / "flux2-tiny", "dev", seed=0)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes") / "images"
    draw_shapes(folder, count=4, size=64, seed=5)
    return folder


def make_config(tmp_path, model, images, extra=(), text=RUN, steps=8):
    tmp_path.mkdir(parents=True, exist_ok=True)
    p = tmp_path / "run.toml"
    p.write_text(text.format(model=model, images=images, steps=steps))
    return load_config(p, list(extra))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, model_dir, images):
    cfg = make_config(tmp_path_factory.mktemp("reference"), model_dir, images)
    return cfg, train(cfg, progress=False)


def _fixed_loss(transformer, data, batches: int = 2) -> float:
    """The flow-matching loss of `transformer` on the run's cached latents and captions (and
    reference latents, when the dataset has them), at fixed noise and noise levels (the same
    numbers for every model measured)."""
    family = get_family("flux2-dev")
    g = torch.Generator().manual_seed(0)
    it = data.batches(seed=0)
    losses = []
    with torch.no_grad():
        for _ in range(batches):
            batch = next(it)
            x0 = batch.latents.float()
            _, _, h, w = x0.shape
            for sigma in (0.3, 0.6, 0.9):
                noise = torch.randn(x0.shape, generator=g)
                s = torch.full((x0.shape[0],), sigma)
                refs = {"references": batch.references} if batch.references else {}
                pred = family.predict(transformer, family.pack_latents(fm.add_noise(x0, noise, s)), s,
                                      batch.embeds, (h, w), 4.0, **refs)
                losses.append(float(fm.flow_matching_loss(pred, family.pack_latents(fm.velocity_target(x0, noise)))))
    return float(np.mean(losses))


def _lora_model(cfg, lora: dict):
    """The run's base transformer with the LoRA of a diffusers-layout state dict applied."""
    from leantune.train.lora import apply_lora

    family = get_family("flux2-dev")
    model = family.load_transformer(family.resolve_sources(cfg.model, Path(cfg.base_dir)), dtype=torch.float32)
    apply_lora(model, _weights({k: v.float() for k, v in lora.items()}), strength=1.0)
    return model.eval()


def _data(cfg):
    from leantune.data.cache import prepare_caches
    from leantune.models.component_loading import dtype_from_name

    return prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", dtype_from_name(cfg.model.dtype))


def test_schedule_default_is_the_resolution_dependent_shift():
    assert fm.sampling_method("auto", get_family("flux2-dev")) == "flux_shift"
    assert fm.sampling_method("auto", get_family("flux2-klein-9b")) == "flux_shift"


def _own_storage(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter of `module` copied into a fresh allocation (same values, same dtype).

    Why the pipeline's images need it to equal ours bit for bit: diffusers' from_pretrained and
    load_lora_weights leave fp32 tensors where safetensors read them, at addresses that are not
    64-byte aligned (56 mod 64 for every transformer weight here, 48 for the LoRA's), while
    leantune's loader allocates each tensor anew (aligned). The CPU GEMM kernels sum a row in
    another order for an unaligned operand, so the same weights give matmuls about one ulp apart
    (the first one the timestep embedder's linear_1, 1.2e-7), which three sampling steps and the
    decoder grew to 2.35e-6 in the images. It was neither the LoRA (lora_A/lora_B equal the
    file's, the same scale 1.0 after the alpha fold, unfused in both: peft's layer gives equal
    outputs) nor the file's dtype (fp32): the base model alone, loaded both ways, differs the same.
    With both sides' weights freshly allocated the images are equal."""
    with torch.no_grad():
        for p in module.parameters():
            p.data = p.data.clone()
    return module


def test_lora_run_trains_and_the_diffusers_file_loads_in_flux2pipeline(reference_run, model_dir, tmp_path):
    """The run's losses are finite, the adapter on every preset target moved, the cached text equals
    Flux2Pipeline.encode_prompt, and Flux2Pipeline.load_lora_weights of the written file samples
    exactly what our sampler samples with the trained adapter (the weights' storage made alike:
    _own_storage says why)."""
    from diffusers import Flux2Pipeline

    from leantune.infer.decode import decode_latents
    from leantune.infer.sampler import denoise
    from leantune.models.flux2 import Flux2VAE

    cfg, result = reference_run
    assert len(result.losses) == 8 and all(np.isfinite(result.losses))
    path = result.paths.lora_file("diffusers")
    lora = load_file(str(path))
    assert any(k.endswith("single_transformer_blocks.1.attn.to_qkv_mlp_proj.lora_B.weight") for k in lora)
    moved = [k for k, v in lora.items() if k.endswith("lora_B.weight") and torch.count_nonzero(v)]
    assert len(moved) > 0.8 * sum(k.endswith("lora_B.weight") for k in lora)

    data = _data(cfg)
    assert data.stats["text"].hits > 0 and data.stats["text"].misses == 0
    pipe = Flux2Pipeline.from_pretrained(str(model_dir), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    _own_storage(pipe.transformer)
    t5, pooled = data.text_entry("")
    ref, _ = pipe.encode_prompt("", device="cpu", max_sequence_length=MAX_LEN)
    assert pooled.numel() == 0 and torch.equal(t5.float(), ref[0].to(t5.dtype).float())

    # ours: the base transformer with the trained adapter, sampled by leantune's sampler
    family = get_family("flux2-dev")
    model = _lora_model(cfg, lora)
    sources = family.resolve_sources(cfg.model, Path(cfg.base_dir))
    prompt, seed = "lnt a red circle", 3
    embeds, _ = family.encode_prompts([prompt], family.load_text_encoders(sources, torch.float32), MAX_LEN, "cpu")
    vae = Flux2VAE(pipe.vae)
    lat = denoise(model, embeds, [seed], width=64, height=64, steps=3, guidance=4.0,
                  schedule=family.sampling.schedule("dev", model_dir), device="cpu", family=family)
    ours = decode_latents(vae, lat, "cpu").permute(0, 2, 3, 1).numpy()
    base = pipe(prompt=prompt, height=64, width=64, num_inference_steps=3, guidance_scale=4.0,
                max_sequence_length=MAX_LEN, generator=torch.Generator().manual_seed(seed), output_type="np").images
    pipe.load_lora_weights(str(path))
    _own_storage(pipe.transformer)
    trained = pipe(prompt=prompt, height=64, width=64, num_inference_steps=3, guidance_scale=4.0,
                   max_sequence_length=MAX_LEN, generator=torch.Generator().manual_seed(seed), output_type="np").images
    assert np.abs(ours - trained).max() == 0.0
    assert np.abs(trained - base).max() > 1e-4
    # the loss went down: the trained model fits the training data better than the base
    base_model = family.load_transformer(sources, dtype=torch.float32).eval()
    assert _fixed_loss(model, data) < 0.99 * _fixed_loss(base_model, data)


def _weights(tensors):
    """LoraWeights of a diffusers-layout state dict (module -> down, up), alpha = rank."""
    from leantune.train.lora_formats import LoraModule, LoraWeights

    names = sorted({k[len("transformer."):-len(".lora_A.weight")] for k in tensors if k.endswith(".lora_A.weight")})
    modules = {}
    for n in names:
        down, up = tensors[f"transformer.{n}.lora_A.weight"], tensors[f"transformer.{n}.lora_B.weight"]
        modules[n] = LoraModule(down=down, up=up, alpha=float(down.shape[0]))
    return LoraWeights(modules=modules, source="test")


FULL = RUN.split("[lora]")[0] + """
[train]
mode = "full"
steps = {steps}
learning_rate = 3e-4
mixed_precision = "no"
seed = 3
guidance = 4.0
save_every = 2

[output]
dir = "out"
name = "f"
formats = ["diffusers"]
"""


@pytest.mark.slow
def test_full_fine_tune_trains_resumes_and_exports_a_loadable_folder(tmp_path, model_dir, images):
    """[train] mode = "full": every block weight and the shared modulation train, the loss on the
    training data goes down, a resumed run equals the uninterrupted one, and the exported diffusers
    folder loads back through the FLUX.2 loader with the trained weights."""
    from leantune.config import ModelConfig

    cfg = make_config(tmp_path / "a", model_dir, images, text=FULL, steps=4)
    result = train(cfg, progress=False)
    assert len(result.losses) == 4 and all(np.isfinite(result.losses))
    fam = get_family("flux2-dev")
    before = fam.load_transformer(fam.resolve_sources(cfg.model, Path(cfg.base_dir)), dtype=torch.float32).eval()
    folder = next(p for p in result.paths.root.iterdir() if p.name.endswith("_diffusers") and p.is_dir())
    after = fam.load_transformer(fam.resolve_sources(ModelConfig(path=str(folder), family="flux2-dev"), Path("/")),
                                 dtype=torch.float32).eval()
    a, b = before.state_dict(), after.state_dict()
    assert a.keys() == b.keys()
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    for k in ("transformer_blocks.0.attn.to_q.weight", "transformer_blocks.1.ff_context.linear_out.weight",
              "single_transformer_blocks.1.attn.to_qkv_mlp_proj.weight", "double_stream_modulation_img.linear.weight",
              "single_stream_modulation.linear.weight", "x_embedder.weight"):
        assert k in changed
    data = _data(cfg)
    assert _fixed_loss(after, data) < 0.99 * _fixed_loss(before, data)
    # exact resume in full mode
    cfg2 = make_config(tmp_path / "b", model_dir, images, text=FULL, steps=4)
    assert train(cfg2, stop_after=2, progress=False).final_step == 2
    resumed = train(cfg2, resume=True, progress=False)
    assert resumed.losses == result.losses


def _cli(command, *args) -> int:
    import argparse
    import importlib

    module = importlib.import_module(f"leantune.commands.{command}")
    parser = argparse.ArgumentParser()
    module.configure(parser)
    return module.run(parser.parse_args([str(a) for a in args]))


def _deltas(weights) -> dict:
    return {n: m.delta() for n, m in weights.modules.items()}


def test_default_exports_read_back_in_sample_convert_and_diffusers(reference_run, model_dir, tmp_path, monkeypatch):
    """The trainer's default formats write the ComfyUI layout (fused BFL modules, lora_down /
    lora_up / alpha) beside the diffusers one. Both read back (read_lora) to the same deltas;
    diffusers' own FLUX.2 kohya converter reads the ComfyUI file to those deltas; `leantune
    convert` turns each into the other (diffusers -> ComfyUI gives the trainer's ComfyUI tensors);
    `leantune sample --lora` draws the same image with either file (the family guessed from the
    folder, or given by --family), and another image without it."""
    from diffusers.loaders.lora_pipeline import Flux2LoraLoaderMixin
    from PIL import Image

    from leantune.io import load_safetensors
    from leantune.models.flux2.lora_keys import FLUX2_LORA_KEYS
    from leantune.train.lora_formats import read_lora

    _, result = reference_run
    comfy, diff = result.paths.lora_file("comfyui"), result.paths.lora_file("diffusers")
    tensors, meta = load_safetensors(comfy)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in tensors
    assert "lora_unet_single_blocks_1_linear1.alpha" in tensors and meta["ss_base_model_version"] == "flux2"
    a, b = read_lora(comfy), read_lora(diff)
    assert a.keys is FLUX2_LORA_KEYS and b.keys is FLUX2_LORA_KEYS
    ours, want = _deltas(a), _deltas(b)
    assert ours.keys() == want.keys() and len(want) > 20
    for n in want:
        assert torch.equal(ours[n], want[n]), n

    # diffusers' converter (Flux2LoraLoaderMixin.lora_state_dict -> _convert_kohya_flux2_lora_to_diffusers)
    # bakes alpha / rank into the factors: 8 / 4 = 2 here (the fused qkv's 24 / 12), a power
    # of two, so its deltas are ours exactly
    theirs = Flux2LoraLoaderMixin.lora_state_dict(str(comfy))
    theirs = {k[len("transformer."):-len(".lora_A.weight")]: theirs[k.replace("lora_A", "lora_B")].float() @ theirs[k].float()
              for k in theirs if k.endswith(".lora_A.weight")}
    assert theirs.keys() == want.keys()
    for n in want:
        assert torch.equal(theirs[n], want[n]), n

    # leantune convert, both ways, on the trained files
    assert _cli("convert", comfy, tmp_path / "c2d.safetensors", "--to", "diffusers") == 0
    assert _cli("convert", diff, tmp_path / "d2c.safetensors", "--to", "comfyui") == 0
    c2d = read_lora(tmp_path / "c2d.safetensors")
    assert c2d.keys is FLUX2_LORA_KEYS and all(torch.equal(d, want[n]) for n, d in _deltas(c2d).items())
    d2c, d2c_meta = load_safetensors(tmp_path / "d2c.safetensors")
    assert d2c.keys() == tensors.keys() and all(torch.equal(d2c[k], tensors[k]) for k in tensors)
    assert d2c_meta["ss_base_model_version"] == "flux2" and d2c_meta["ss_steps"] == meta["ss_steps"]

    # leantune sample --lora
    monkeypatch.chdir(tmp_path)
    images = {}
    for name, lora in (("comfy", comfy), ("diffusers", diff), ("none", None)):
        family = ["--family", "flux2-dev"] if name == "diffusers" else []       # or said: any family name
        args = [*family, "--model", model_dir, "--prompt", "lnt a red circle", "--steps", "2", "--width", "64", "--height", "64",
                "--seed", "3", "--guidance", "4", "--device", "cpu", "--out", name, "--set", "max_text_length=32",
                "--set", "model.dtype=fp32"]
        assert _cli("sample", *args, *(["--lora", lora] if lora else [])) == 0
        (png,) = sorted((tmp_path / name).glob("*.png"))
        images[name] = np.asarray(Image.open(png))
    assert np.array_equal(images["comfy"], images["diffusers"])
    assert not np.array_equal(images["comfy"], images["none"])


REFERENCES = RUN.replace('trigger_word = "lnt"', 'trigger_word = "lnt"\nreference_path = "{refs}"').replace(
    'formats = ["diffusers"]\n', "").replace('name = "t"', 'name = "t"\nformats = ["diffusers"]')


def _reference_dataset(root: Path) -> tuple[Path, Path]:
    """Targets with captions, and one reference image per target (refs/<target stem>.png, no captions)."""
    images, refs = root / "images", root / "refs"
    draw_shapes(images, count=4, size=64, seed=5)
    draw_shapes(refs, count=4, size=64, seed=9)
    for p in refs.glob("*.txt"):
        p.unlink()
    for a, b in zip(sorted(refs.glob("*.png")), sorted(images.glob("*.png"))):
        a.rename(refs / f"{b.stem}.png")
    return images, refs


def test_reference_images_train_and_sample_as_flux2pipeline_with_image(tmp_path, model_dir):
    """FLUX.2's multi-reference conditioning through the dataset ([[data.datasets]] reference_path):
    the references are cached as the pipeline encodes `image=` (to the cache's bf16), the trainer's
    call `predict(references=...)` on a batch equals Flux2Pipeline's transformer call on the tokens
    it assembles (its _pack_latents, _prepare_latent_ids, _prepare_image_ids) with the trained LoRA
    loaded, the loss at fixed noise goes down, and a sample drawn with a reference equals
    Flux2Pipeline(image=...) with the trained LoRA, bit for bit (fp32)."""
    from diffusers import Flux2Pipeline
    from PIL import Image

    from leantune.data.cache import image_pixels
    from leantune.infer.decode import decode_latents
    from leantune.infer.sampler import denoise
    from leantune.models.flux2 import Flux2VAE, encode_reference_latents

    images, refs = _reference_dataset(tmp_path)
    cfg = load_config(_write(tmp_path, REFERENCES.format(model=model_dir, images=images, refs=refs, steps=8)), [])
    result = train(cfg, progress=False)
    assert len(result.losses) == 8 and all(np.isfinite(result.losses))
    path = result.paths.lora_file("diffusers")
    family = get_family("flux2-dev")
    data = _data(cfg)
    assert data.stats["latents"].misses == 0 and data.stats["latents"].hits == 8      # 4 targets + 4 references
    batch = next(data.batches(seed=0))
    assert batch.references is not None and len(batch.references) == 1
    assert batch.references[0].shape == batch.latents.shape == (2, 128, 4, 4)

    pipe = Flux2Pipeline.from_pretrained(str(model_dir), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    # The cache holds each reference as the pipeline encodes `image=`: the same pixels (its
    # preprocess), then its VAE path (_encode_vae_image: the mode, 2x2 patches, batch-norm), in the
    # cache's bf16. The pipeline's preprocess hands the VAE a channels-last-strided tensor (made from
    # numpy), on which the CPU convolutions sum in another order than on the cache's contiguous one
    # (3.3e-5 apart in fp32 here, a bf16 ulp on some entries), so its VAE is given the same pixels
    # contiguous.
    for sample in data.samples[:4]:
        (ref,) = sample.item.references
        img = Image.open(ref.path).convert("RGB")
        pixels = pipe.image_processor.preprocess(img, height=img.height, width=img.width, resize_mode="crop")
        assert torch.equal(image_pixels(ref, family.references.size(ref.width, ref.height, sample.bucket)), pixels[0])
        with torch.no_grad():
            want = pipe._encode_vae_image(pixels.contiguous(), generator=None)[0]
        assert torch.equal(data.latent_entry(sample.reference_keys[0]), want.to(torch.bfloat16)), ref.path

    model = _lora_model(cfg, load_file(str(path)))
    pipe.load_lora_weights(str(path))
    _own_storage(pipe.transformer)
    x0 = batch.latents.float()
    b, _, h, w = x0.shape
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.35, 0.8])
    noisy = fm.add_noise(x0, noise, sigma)
    with torch.no_grad():
        ours = family.predict(model, family.pack_latents(noisy), sigma, batch.embeds, (h, w), 4.0,
                              references=batch.references)
        reference = batch.references[0].float()
        tokens = torch.cat([pipe._pack_latents(noisy), pipe._pack_latents(reference)], dim=1)
        ids = torch.cat([pipe._prepare_latent_ids(noisy), pipe._prepare_image_ids([reference[:1]]).expand(b, -1, -1)],
                        dim=1)
        text = batch.embeds.t5.float()
        theirs = pipe.transformer(hidden_states=tokens, timestep=sigma, guidance=torch.full([b], 4.0),
                                  encoder_hidden_states=text, txt_ids=pipe._prepare_text_ids(text), img_ids=ids,
                                  return_dict=False)[0][:, : h * w]
    assert torch.equal(ours, theirs)
    base = family.load_transformer(family.resolve_sources(cfg.model, Path(cfg.base_dir)), dtype=torch.float32).eval()
    assert _fixed_loss(model, data) < 0.99 * _fixed_loss(base, data)

    # sampling with a reference image, as Flux2Pipeline(image=...) with the trained LoRA
    prompt, seed = "lnt a red circle", 3
    ref_img = Image.open(sorted(refs.glob("*.png"))[0]).convert("RGB")
    sources = family.resolve_sources(cfg.model, Path(cfg.base_dir))
    embeds, _ = family.encode_prompts([prompt], family.load_text_encoders(sources, torch.float32), MAX_LEN, "cpu")
    vae = Flux2VAE(pipe.vae)
    lat = denoise(model, embeds, [seed], width=64, height=64, steps=3, guidance=4.0,
                  schedule=family.sampling.schedule("dev", model_dir), device="cpu", family=family,
                  references=encode_reference_latents(vae, [ref_img]))
    mine = decode_latents(vae, lat, "cpu").permute(0, 2, 3, 1).numpy()
    kw = dict(prompt=prompt, height=64, width=64, num_inference_steps=3, guidance_scale=4.0, max_sequence_length=MAX_LEN,
              output_type="np")
    want = pipe(image=[ref_img], generator=torch.Generator().manual_seed(seed), **kw).images
    assert np.array_equal(mine, want)
    unconditioned = pipe(generator=torch.Generator().manual_seed(seed), **kw).images
    assert np.abs(want - unconditioned).max() > 1e-4          # the reference changes the image


def _write(root: Path, text: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "run.toml").write_text(text)
    return root / "run.toml"


def test_klein_lora_run_samples_as_flux2kleinpipeline(tmp_path, images, monkeypatch, caplog):
    """A klein LoRA run (Qwen3 text encoder, no guidance embedder; a tiny klein is either size, so
    [model] family = "flux2-klein-4b" takes it). Its diffusers file in Flux2KleinPipeline
    (classifier-free guidance against the empty prompt) gives exactly the images leantune's sampler
    gives with the trained adapter, the CFG halves one after the other as the pipeline runs them.
    `leantune sample --lora` on the folder with no --family (guess_family reads its config: a klein,
    not flux2-dev) draws that image too, to one level of 255: it batches the two CFG halves in one
    forward when the memory plan allows (here it does), and a batched matmul rounds otherwise than
    two single ones (float noise that moves some pixels by one level after rounding to 8 bits)."""
    from diffusers import Flux2KleinPipeline
    from PIL import Image

    from leantune.infer.decode import decode_latents
    from leantune.infer.sampler import denoise
    from leantune.models.family import guess_family
    from leantune.models.flux2 import Flux2VAE
    from leantune.train.lora import apply_lora
    from leantune.train.lora_formats import read_lora

    klein_dir = tf.save_flux2_folder(tmp_path / "klein-tiny", "klein", seed=1)
    text = RUN.replace('family = "flux2-dev"', 'family = "flux2-klein-4b"').replace("guidance = 4.0\n", "").replace(
        'name = "t"', 'name = "t"\nformats = ["diffusers"]')
    cfg = make_config(tmp_path / "run", klein_dir, images, text=text, steps=4)
    result = train(cfg, progress=False)
    assert len(result.losses) == 4 and all(np.isfinite(result.losses))
    path = result.paths.lora_file("diffusers")
    assert guess_family(klein_dir) == "flux2-klein-9b"          # a tiny klein: the depth rule (not 5 double blocks)

    prompt, seed = "lnt a red circle", 3
    pipe = Flux2KleinPipeline.from_pretrained(str(klein_dir), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(path))
    _own_storage(pipe.transformer)
    kw = dict(prompt=prompt, height=64, width=64, num_inference_steps=2, guidance_scale=4.0, max_sequence_length=MAX_LEN)
    want = pipe(generator=torch.Generator().manual_seed(seed), output_type="np", **kw).images

    family = get_family("flux2-klein-4b")
    sources = family.resolve_sources(cfg.model, Path(cfg.base_dir))
    model = family.load_transformer(sources, dtype=torch.float32).eval()
    apply_lora(model, read_lora(path))
    encoders = family.load_text_encoders(sources, torch.float32)
    cond, _ = family.encode_prompts([prompt], encoders, MAX_LEN, "cpu")
    neg, _ = family.encode_prompts([""], encoders, MAX_LEN, "cpu")
    vae = Flux2VAE(pipe.vae)
    lat = denoise(model, cond, [seed], width=64, height=64, steps=2, guidance=4.0,
                  schedule=family.sampling.schedule("klein", klein_dir), device="cpu", family=family, negative=neg,
                  cfg_batched=False)
    assert np.array_equal(decode_latents(vae, lat, "cpu").permute(0, 2, 3, 1).numpy(), want)

    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO")
    assert _cli("sample", "--model", klein_dir, "--lora", path, "--prompt", prompt, "--steps", "2", "--width", "64",
                "--height", "64", "--seed", seed, "--guidance", "4", "--device", "cpu", "--out", "klein",
                "--set", "max_text_length=32", "--set", "model.dtype=fp32") == 0
    assert "CFG 4, halves batched" in caplog.text
    (png,) = sorted((tmp_path / "klein").glob("*.png"))
    ours = np.asarray(Image.open(png)).astype(int)
    pixels = (want[0] * 255).round().astype(int)
    assert np.abs(ours - pixels).max() <= 1
    plain = pipe(generator=torch.Generator().manual_seed(seed), output_type="np", **{**kw, "guidance_scale": 1.0}).images
    assert np.abs((plain[0] * 255).round() - pixels).max() > 2          # the guidance shows
