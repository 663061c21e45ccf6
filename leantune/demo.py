"""The demo: everything a newcomer needs to see leantune work, built offline on CPU.

It writes a tiny Flux of the real diffusers classes (with tiny CLIP/T5 encoders, tokenizers trained
on the spot, and a tiny VAE built to reconstruct its images: demo_vae.py) as a diffusers folder,
draws a small captioned image set of coloured shapes, and trains a LoRA with the shipped quickstart
config — the same `train()` a real run uses. Then it samples the quickstart's prompts with the base
model and with the trained LoRA (same seeds) and puts them side by side: the picture a newcomer
looks at shows what training changed.

The base model's weights are random (it draws noise), so the LoRA must carry everything: the
recipe (quickstart.toml) is what makes that possible in about a minute of one CPU core. Shapes sit
centred at a fixed size, so what there is to learn is what the words mean; the LoRA covers every
Linear (`all_linear`: a random, frozen input and output projection would cap what the blocks can
learn) at rank 32 on a model 64 wide; timesteps are drawn uniformly, since sampling starts at pure
noise, where the logit-normal draw of real Flux training seldom goes; samples use the guidance the
LoRA was trained with, since the random guidance embedder means nothing at any other value.
Torch runs on one thread: the matrices are too small to share, and on a busy machine extra
threads spin for cores they do not get.
`mode="full"` fine-tunes every weight instead (quickstart_full.toml: step inside backward, two
streamed trainable blocks) and exports the whole model as a BFL / ComfyUI file.
`family="wan"` trains on video: 9-frame clips of the same shapes, each moving its own way
(draw_clips), through a hand-set AutoencoderKLWan; the before/after picture shows the first frame of
each sampled video, and before-after.mp4 beside it the videos.
"""

from __future__ import annotations

import random
import shutil
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

COLOURS = {
    "red": (220, 40, 40), "blue": (40, 80, 220), "green": (40, 170, 60), "yellow": (235, 210, 40),
    "purple": (140, 60, 180), "orange": (240, 140, 30),
}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15)}
SHAPES = ("circle", "square", "triangle")
# The demo's images: three colours far apart, each with its own shape. Six colours were too many
# words for the random base's LoRA to tell apart in a minute; three it learns.
DEMO_PAIRS = (("red", "circle"), ("blue", "square"), ("green", "triangle"))


def draw_shapes(folder: Path, count: int = 24, size: int = 128, seed: int = 0, cycle: bool = False,
                centred: bool = False) -> list[Path]:
    """`count` PNGs of one coloured shape each, with a same-stem .txt caption describing it.

    Colours and backgrounds are drawn at random, or with `cycle` in the demo's fixed round: image i
    is the (colour, shape) pair i % 3 of DEMO_PAIRS, and the background switches every 3 images, so
    24 images hold each of the 6 combinations 4 times (the demo's prompts name two of them). Shapes
    sit at a random place and size, or with `centred` in the middle at a fixed size (`shape_box`):
    the demo's small model then learns what the words mean, not where shapes may lie."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        colour, shape, bg = rng.choice(list(COLOURS)), SHAPES[i % len(SHAPES)], rng.choice(list(BACKGROUNDS))
        if cycle:
            (colour, shape), bg = DEMO_PAIRS[i % len(DEMO_PAIRS)], list(BACKGROUNDS)[(i // len(DEMO_PAIRS)) % 2]
        img = Image.new("RGB", (size, size), BACKGROUNDS[bg])
        d = ImageDraw.Draw(img)
        r = rng.randint(size // 5, size // 3)
        cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
        if centred:
            draw_one(d, shape, *shape_box(size), COLOURS[colour])
        elif shape == "circle":
            d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=COLOURS[colour])
        elif shape == "square":
            d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=COLOURS[colour])
        else:
            d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[colour])
        path = folder / f"shape_{i:03d}.png"
        img.save(path)
        path.with_suffix(".txt").write_text(f"a {colour} {shape} on a {bg} background")
        paths.append(path)
    return paths


def shape_box(size: int) -> tuple[int, int]:
    """(centre, half side) of a centred shape in a `size` x `size` image: it spans 60% of the side."""
    return size // 2, size * 3 // 10


def colour_match(image, prompt: str, tolerance: float = 60.0) -> tuple[float, float]:
    """(share of pixels near the prompt's shape colour, share near its background colour) of a PIL
    image: how well a sample draws "a red circle on a white background". `tolerance` is a
    Euclidean RGB distance in 0..255 levels."""
    import numpy as np

    words = prompt.replace(",", " ").split()
    colour = next(w for w in words if w in COLOURS)
    background = next(w for w in words if w in BACKGROUNDS)
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32).reshape(-1, 3)
    return (float(_near(pixels, COLOURS[colour], tolerance).mean()),
            float(_near(pixels, BACKGROUNDS[background], tolerance).mean()))


def prompt_words(prompt: str) -> tuple[str, str, str]:
    """(colour, shape, background) named by a demo prompt such as "lnt, a red circle on a white background"."""
    words = prompt.replace(",", " ").split()
    try:
        return (next(w for w in words if w in COLOURS), next(w for w in words if w in SHAPES),
                next(w for w in words if w in BACKGROUNDS))
    except StopIteration:
        raise ValueError(f"{prompt!r} does not name a colour, a shape and a background of the demo") from None


def _near(pixels, rgb, tolerance: float):
    import numpy as np

    return np.linalg.norm(pixels - np.asarray(rgb, dtype=np.float32), axis=-1) < tolerance


def shape_mask(shape: str, size: int):
    """(size, size) bool mask of the centred `shape` as `draw_shapes(centred=True)` draws it."""
    import numpy as np
    from PIL import Image, ImageDraw

    img = Image.new("L", (size, size), 0)
    draw_one(ImageDraw.Draw(img), shape, *shape_box(size), 255)
    return np.asarray(img) > 0


def draw_one(d, shape: str, c: int, r: int, fill, dx: int = 0, dy: int = 0) -> None:
    """`shape` of half side `r` centred at (c + dx, c + dy)."""
    x, y = c + dx, c + dy
    if shape == "circle":
        d.ellipse([x - r, y - r, x + r, y + r], fill=fill)
    elif shape == "square":
        d.rectangle([x - r, y - r, x + r, y + r], fill=fill)
    else:
        d.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)


# The demo's clips: each shape moves its own way, from the centre, a few pixels a frame.
MOTIONS = {"circle": ("right", (1, 0)), "square": ("down", (0, 1)), "triangle": ("left", (-1, 0))}
CLIP_STEP = 2                # pixels a frame at 16 fps: 16 px over a 9-frame clip
CLIP_FPS = 16


def draw_clips(folder: Path, count: int = 12, size: int = 128, frames: int = 9, fps: int = CLIP_FPS) -> list[Path]:
    """`count` mp4 clips of one moving shape each, with same-stem .txt captions ("a red circle moving
    right on a white background"), in the fixed round of `draw_shapes(cycle=True, centred=True)`:
    clip i is DEMO_PAIRS[i % 3], its background switching every 3 clips. The first frame is that
    round's centred image; the shape then moves CLIP_STEP pixels a frame its own way (MOTIONS)."""
    import numpy as np
    from PIL import Image, ImageDraw

    from .data.video_write import write_mp4

    folder.mkdir(parents=True, exist_ok=True)
    c, r = shape_box(size)
    paths = []
    for i in range(count):
        (colour, shape), bg = DEMO_PAIRS[i % len(DEMO_PAIRS)], list(BACKGROUNDS)[(i // len(DEMO_PAIRS)) % 2]
        direction, (ux, uy) = MOTIONS[shape]
        video = np.empty((frames, size, size, 3), np.uint8)
        for t in range(frames):
            img = Image.new("RGB", (size, size), BACKGROUNDS[bg])
            draw_one(ImageDraw.Draw(img), shape, c, r, COLOURS[colour], ux * CLIP_STEP * t, uy * CLIP_STEP * t)
            video[t] = np.asarray(img)
        path = folder / f"clip_{i:03d}.mp4"
        write_mp4(path, video, fps)
        path.with_suffix(".txt").write_text(f"a {colour} {shape} moving {direction} on a {bg} background")
        paths.append(path)
    return paths


def motion_match(frames, prompt: str, tolerance: float = 80.0) -> float:
    """How far (pixels) the prompted colour's centre moves from the first to the last of `frames`
    ((T, H, W, 3) uint8) along the way the prompted shape moves in the demo's clips (MOTIONS):
    about CLIP_STEP * (T - 1) for a sample that draws the clips' motion, near 0 for a still one,
    and 0 where the colour is absent from either frame."""
    import numpy as np

    colour, shape, _ = prompt_words(prompt)
    ux, uy = MOTIONS[shape][1]
    centres = []
    for frame in (frames[0], frames[-1]):
        ys, xs = np.nonzero(_near(np.asarray(frame, dtype=np.float32), COLOURS[colour], tolerance))
        if len(xs) == 0:
            return 0.0
        centres.append((xs.mean(), ys.mean()))
    (x0, y0), (x1, y1) = centres
    return float((x1 - x0) * ux + (y1 - y0) * uy)


def prompt_match(image, prompt: str, tolerance: float = 80.0) -> dict[str, float | str]:
    """How well a sample draws its demo prompt, where the demo's images put it (centred):

    - `shape`: share of the prompted shape's pixels (eroded 4 px: edges blur) near the prompted colour;
    - `background`: share of the pixels away from the shape (outside its box grown by 8 px) near the
      prompted background colour;
    - `best_shape`: which of the three centred shapes the pixels of the prompted colour overlap best
      (intersection over union), and `iou`, that overlap: the shape check.
    `tolerance` is a Euclidean RGB distance in 0..255 levels."""
    import numpy as np
    from PIL import ImageFilter

    colour, _, background = prompt_words(prompt)
    rgb = image.convert("RGB")
    size = rgb.size[0]
    pixels = np.asarray(rgb, dtype=np.float32)                          # (H, W, 3)
    coloured = _near(pixels, COLOURS[colour], tolerance)               # (H, W)
    masks = {s: shape_mask(s, size) for s in SHAPES}
    c, r = shape_box(size)
    inner = {s: np.asarray(_pil_mask(m).filter(ImageFilter.MinFilter(9))) > 0 for s, m in masks.items()}
    away = np.ones_like(coloured)
    away[max(0, c - r - 8):c + r + 9, max(0, c - r - 8):c + r + 9] = False
    iou = {s: float((coloured & m).sum() / max(1, (coloured | m).sum())) for s, m in masks.items()}
    best = max(iou, key=iou.get)
    shape = prompt_words(prompt)[1]
    return {"shape": float(coloured[inner[shape]].mean()),
            "background": float(_near(pixels, BACKGROUNDS[background], tolerance)[away].mean()),
            "best_shape": best, "iou": iou[shape]}


def _pil_mask(mask):
    from PIL import Image

    return Image.fromarray(mask.astype("uint8") * 255)


def before_after_match(samples: Path, prompts: list[str]) -> dict[str, list[dict]]:
    """prompt_match of each prompt's image in samples/before and samples/after (prompt order). A
    video's (an .mp4 there) is its first frame's, with `motion` (motion_match) beside it."""
    from PIL import Image

    out = {}
    for which in ("before", "after"):
        videos = sorted((samples / which).glob("*.mp4"))
        if videos:
            out[which] = []
            for f, prompt in zip(videos, prompts):
                frames = read_video(f)
                out[which].append({**prompt_match(Image.fromarray(frames[0]), prompt),
                                   "motion": motion_match(frames, prompt)})
            continue
        files = sorted((samples / which).glob("*.png"))
        out[which] = [prompt_match(Image.open(f), prompt) for f, prompt in zip(files, prompts)]
    return out


def read_video(path: Path):
    """(T, H, W, 3) uint8 frames of a video file."""
    import av
    import numpy as np

    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])


# The demo's base: the tiny preset at width 64 (4 heads of 16) instead of 32, its weights random.
# A random base draws noise, so the LoRA carries everything the "after" samples show; at width 64
# the blocks can carry each of the 64 packed latent channels (at 32 they could not), and the
# LoRA also covers the embedders and the final layer (quickstart.toml: targets = "all_linear").
DEMO_FLUX = {"num_attention_heads": 4}
# The same for SD3.5 (Large-style): 8 heads of 8, the text projection as wide as the blocks, and
# position embeddings one unit apart per patch. The tiny preset's (sample_size 32, a 96-patch table)
# are 1/6 apart, so the 8 patches across a 128-pixel image span barely a radian of the fastest
# sine: the model could not tell the centre from the edge, and drew the colours where the noise had
# them (SD3.5 Large is 1/3 apart at 64 patches across).
DEMO_SD3 = {"num_attention_heads": 8, "caption_projection_dim": 64, "sample_size": 64, "pos_embed_max_size": 32}

# The same for Qwen-Image: 4 heads of 16 (the tiny preset has 2), so the blocks are 64 wide like the
# Flux demo's; the VAE is demo_vae.qwen_shape_vae.
DEMO_QWEN = {"num_attention_heads": 4}

# The same for Z-Image: 64 wide in 4 heads of 16 (the tiny preset is 32 wide in 2), the rotary axes
# (4 + 6 + 6) unchanged; its VAE is the Flux demo's (demo_vae.shape_vae: Z-Image uses the Flux.1
# AutoencoderKL, 16 channels, and reads the folder's scaling 1 and shift 0 as the Flux loader does).
DEMO_Z_IMAGE = {"dim": 64, "n_heads": 4, "n_kv_heads": 4}

# The same for Wan: one transformer (Wan 2.1's layout: it denoises every level), 64 wide in 4 heads
# of 16 (the tiny preset has 2); its VAE is demo_vae.wan_shape_vae, its data moving-shape clips.
DEMO_WAN = {"num_attention_heads": 2, "attention_head_dim": 32, "ffn_dim": 256}

# (mode, family) -> the shipped config the demo trains with
CONFIGS = {("lora", "flux"): "quickstart.toml", ("full", "flux"): "quickstart_full.toml",
           ("lora", "sd3"): "quickstart_sd3.toml", ("lora", "qwen-image"): "quickstart_qwen.toml",
           ("lora", "z-image"): "quickstart_zimage.toml", ("lora", "wan"): "quickstart_wan.toml"}
FAMILIES = ("flux", "sd3", "qwen-image", "z-image", "wan")
# Each family's model folder (the config's [model] path)
MODEL_FOLDERS = {"flux": "model", "sd3": "model-sd3", "qwen-image": "model-qwen", "z-image": "model-zimage", "wan": "model-wan"}
# Each family's training data folder: images, or for a video family clips
DATA_FOLDERS = {"wan": "clips"}


def quickstart_text(mode: str = "lora", family: str = "flux") -> str:
    if (mode, family) not in CONFIGS:
        raise ValueError(f"the demo has no {mode} run for family {family!r}; it has "
                         f"{', '.join(f'{f} {m}' for m, f in CONFIGS)}")
    return resources.files("leantune.resources").joinpath(CONFIGS[mode, family]).read_text()


MARKER = ".leantune-demo"
DEMO_ENTRIES = ("model", "model-sd3", "model-qwen", "model-zimage", "model-wan", "images", "clips", "cache",
                "cache-sd3", "cache-qwen", "cache-zimage", "cache-wan", "run", "quickstart.toml",
                "quickstart_full.toml", "quickstart_sd3.toml", "quickstart_qwen.toml", "quickstart_zimage.toml",
                "quickstart_wan.toml")


class DemoFolderError(ValueError):
    """The demo was pointed at a folder it did not make; it never deletes a user's files."""


def _check_ours(out: Path) -> None:
    """`out` must be new, empty, or a folder an earlier demo made (it carries the marker). Anything
    else is refused before a file is written or removed: `--out .` or `--out ~/data` must never
    cost the user their files, nor train on their images."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DemoFolderError(f"--out {out}: exists and is not a folder")
    if any(out.iterdir()) and not (out / MARKER).exists() and not _unmarked_earlier_demo(out):
        raise DemoFolderError(f"--out {out}: the folder is not empty and was not made by `leantune demo` (it has "
                              f"no {MARKER} file); give a new or empty folder (nothing was changed)")


def _unmarked_earlier_demo(out: Path) -> bool:
    """A demo folder from before the marker existed: the shipped quickstart config, unchanged, beside
    a model folder. No folder of the user's own matches that."""
    try:
        same_config = (out / "quickstart.toml").read_text() == quickstart_text()
    except OSError:
        return False
    return same_config and (out / "model" / "model_index.json").is_file()


def _clear(out: Path) -> None:
    """Remove what an earlier demo wrote into `out` (checked by `_check_ours` first), nothing else."""
    for name in DEMO_ENTRIES:
        entry = out / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry.exists() or entry.is_symlink():
            entry.unlink()


def prepare(out: Path, fresh: bool = False, mode: str = "lora", family: str = "flux") -> Path:
    """Write model, images and config into `out`; returns the config path. Reuses what exists.

    `fresh` first removes what an earlier demo wrote into `out` (see `_clear`).
    """
    from .demo_vae import save_qwen_shape_vae, save_shape_vae, save_wan_shape_vae

    text = quickstart_text(mode, family)          # an unknown (mode, family) fails before any write
    _check_ours(out)
    if fresh and out.exists():
        _clear(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by `leantune demo`; `leantune demo` may clear this folder's demo files\n")
    model = out / MODEL_FOLDERS[family]
    if not (model / "model_index.json").exists():
        _save_model(model, family)
        # a VAE that reconstructs the shapes
        {"qwen-image": save_qwen_shape_vae, "wan": save_wan_shape_vae}.get(family, save_shape_vae)(model / "vae")
    if family in DATA_FOLDERS:
        if not any((out / DATA_FOLDERS[family]).glob("*.mp4")):
            draw_clips(out / DATA_FOLDERS[family])
    elif not any((out / "images").glob("*.png")):
        draw_shapes(out / "images", cycle=True, centred=True)
    config = out / CONFIGS[mode, family]
    config.write_text(text)
    return config


def _save_model(folder: Path, family: str) -> None:
    """The demo's random base as a diffusers folder: tiny/__init__.py's preset of the family, widened."""
    from . import tiny

    if family == "flux":
        tiny.save_flux_folder(folder, seed=0, **DEMO_FLUX)
        return
    if family == "qwen-image":
        from diffusers import QwenImagePipeline

        from .tiny import qwen_image as tq

        parts = tq.qwen_image_components(seed=0, **DEMO_QWEN)
        QwenImagePipeline(**parts).save_pretrained(folder, safe_serialization=True)
        return
    if family == "z-image":
        from diffusers import ZImagePipeline

        from .tiny import z_image as tz

        ZImagePipeline(**tz.z_image_components(seed=0, **DEMO_Z_IMAGE)).save_pretrained(folder, safe_serialization=True)
        return
    if family == "wan":
        from diffusers import WanPipeline

        from .tiny import wan as tw

        transformer = tw.wan_transformer(seed=0, **DEMO_WAN)
        _orthogonal_patch_embedding(transformer.patch_embedding)
        parts = {**tw.wan_components(seed=0, experts=1), "transformer": transformer}
        WanPipeline(**parts).save_pretrained(folder, safe_serialization=True)
        return
    from diffusers import StableDiffusion3Pipeline

    parts = tiny.sd3_components("large", seed=0)
    parts["transformer"] = tiny.sd3_transformer("large", seed=0, **DEMO_SD3)
    StableDiffusion3Pipeline(**parts).save_pretrained(folder, safe_serialization=True)


def _orthogonal_patch_embedding(conv, seed: int = 0) -> None:
    """Wan's patch embedding is a Conv3d, which a LoRA of Linears does not cover: frozen at its
    random init (singular values from 1.1 down to 0.005 in the demo's 64 x 64) it would all but drop
    some directions of each patch's latents before the blocks see them. An orthogonal one keeps all."""
    import torch

    out, fan_in = conv.weight.shape[0], conv.weight[0].numel()
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(max(out, fan_in), min(out, fan_in), generator=g))
    with torch.no_grad():
        conv.weight.copy_((q if out >= fan_in else q.T).reshape(conv.weight.shape))
        conv.bias.zero_()


@contextmanager
def one_thread():
    """Run torch on one intra-op thread, then restore the count.

    The demo's matrices are tens of columns wide: splitting them over threads costs more in
    hand-offs than it gains, and on a busy machine each extra thread spin-waits for a core the
    others hold (measured on 2 shared cores under load 7: 66 CPU-s for 100 steps on two threads,
    8 CPU-s on one)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_demo(out: Path, steps: int | None = None, fresh: bool = True, progress: bool = True, mode: str = "lora",
             family: str = "flux"):
    from .config import load_config
    from .trainer import train

    with one_thread():
        config = prepare(out, fresh=fresh, mode=mode, family=family)
        overrides = [] if steps is None else [f"train.steps={steps}"]
        cfg = load_config(config, overrides)
        result = train(cfg, progress=progress, overwrite=True)     # the demo owns its run folder
        if mode == "lora" and not result.interrupted and result.lora_files and cfg.sample.prompts:
            result.sample_files.append(before_after(cfg, result.lora_files[0], result.paths.samples))
    return config, result


def before_after(cfg, lora_file: Path, folder: Path, device: str = "cpu") -> Path:
    """Sample the run's prompts with the base model and with `lora_file` (same seeds, same
    settings as the training samples) and write them as one picture: before on top, after below.
    The single images stay in folder/before and folder/after, each with its PNG metadata."""
    from PIL import Image

    from .infer.images import make_grid, save_png
    from .infer.request import validate_request
    from .infer.run import run_sampling

    s = cfg.sample
    frames = s.frames if s.frames is not None else cfg.data.max_frames
    video = cfg.model.family in VIDEO_FAMILIES and frames > 1
    rows, clips = {}, {}
    for name, loras in (("before", []), ("after", [{"path": str(lora_file), "strength": 1.0}])):
        out = folder / name
        for old in out.glob("*"):               # numbered per run: keep only this run's
            if old.suffix in (".png", ".mp4", ".webp", ".json"):
                old.unlink()
        request = validate_request({"model": {"path": str(cfg.resolve(cfg.model.path)), "dtype": cfg.model.dtype,
                                              "family": cfg.model.family},
                                    "prompts": list(s.prompts), "seed": s.seed, "steps": s.steps,
                                    "guidance": s.guidance, "negative_prompt": s.negative_prompt,
                                    "width": s.width, "height": s.height,
                                    "max_text_length": cfg.data.max_text_length, "lora": loras, "out": str(out),
                                    "device": device, **({"frames": frames} if video else {})}, "demo")
        files = run_sampling(request).files
        if video:
            clips[name] = [read_video(f) for f in files]
            rows[name] = [Image.fromarray(c[0]) for c in clips[name]]
        else:
            rows[name] = [Image.open(f).convert("RGB") for f in files]
    meta = {"prompt": list(s.prompts), "seed": s.seed, "steps": s.steps,
            "rows": "top: base model (before training); bottom: with the trained LoRA", "loras": f"{lora_file}:1"}
    if video:
        _before_after_video(clips["before"] + clips["after"], len(s.prompts), folder / "before-after.mp4")
        meta["frames"] = f"first frame of each video; before-after.mp4 beside it plays all {frames}"
    grid = make_grid(rows["before"] + rows["after"], cols=len(s.prompts), pad=4)
    return save_png(grid, folder / "before-after.png", meta)


# The demo's families that train on clips and sample videos (their [model] family names)
VIDEO_FAMILIES = ("wan2.2",)


def _before_after_video(clips: list, cols: int, path: Path) -> None:
    """The before/after grid frame by frame (the PNG's layout) as an mp4 and its webp preview."""
    import numpy as np
    from PIL import Image

    from .infer.images import make_grid
    from .infer.video import save_video

    frames = [np.asarray(make_grid([Image.fromarray(c[t]) for c in clips], cols=cols, pad=4))
              for t in range(min(len(c) for c in clips))]
    save_video(np.stack(frames), path, CLIP_FPS)
