"""`leantune sample`: generate images on a VRAM budget, optionally with LoRAs.

    leantune sample --model /models/FLUX.1-dev --prompt "a photo of sks dog" \\
        --lora output/dog.safetensors:0.8 --vram 6GiB --out samples
    leantune sample --model /models/stable-diffusion-3.5-large --prompt "a photo of sks dog" \
        --negative-prompt "blurry" --guidance 4.5 --vram 8GiB
    leantune sample --model /models/Qwen-Image-Edit-2509 --prompt "make the cat red" --reference cat.png
    leantune sample --model /models/krea-2-raw --base-adapter krea2-turbo-lora.safetensors \
        --prompt "a photo of sks dog" --lora output/dog.safetensors --steps 8 --guidance 0   # a LoRA under --lora's
    leantune sample --model /models/krea-2-raw --base /models/krea-2-turbo --prompt "a photo of sks dog" \
        --lora output/dog.safetensors --steps 8 --guidance 0     # another checkpoint of the family
    leantune sample --model /models/Wan2.2-T2V-A14B-Diffusers --prompt "a dog running on a beach" \
        --frames 81 --width 832 --height 480 --vram 12GiB    # NNNNN-SEED.mp4 + .webp preview + .json
    leantune sample request.toml [--seed 7] [--set steps=20]

Flags override the request file's values; both go through one strict schema (infer/request.py).
"""

from __future__ import annotations

import argparse
import logging
import sys

from leantune.config import FAMILY_NAMES


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("request", nargs="?", help="a sample request TOML: prompts, seed, steps, guidance, width, height, out, "
                             "[model], [[lora]], [memory]; flags override its values")
    parser.add_argument("--model", help="a diffusers folder (Flux.1, SD3.5, Qwen-Image, FLUX.2) or a single "
                                        ".safetensors transformer file")
    parser.add_argument("--family", choices=FAMILY_NAMES,
                        help="the model family (default: the request's [model] family, else what --model's "
                             "folder or file says it is, else flux)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    parser.add_argument("--negative-prompt", metavar="TEXT",
                        help="what the image should not show (SD3.5's classifier-free guidance; default empty)")
    parser.add_argument("--reference", action="append", metavar="IMAGE",
                        help="a reference image every prompt is conditioned on, for an edit model such as "
                             "qwen-image-edit (repeat for several, up to the model's limit)")
    parser.add_argument("--lora", action="append", metavar="FILE[:STRENGTH]",
                        help="a LoRA file and its strength, default 1.0 (repeat for several)")
    parser.add_argument("--base-adapter", action="append", metavar="FILE[:STRENGTH]",
                        help="a frozen LoRA under the --lora ones, as [model] base_adapters in training (e.g. a "
                             "turbo LoRA over a Raw base); strength default 1.0 (repeat for several)")
    parser.add_argument("--base", metavar="PATH",
                        help="another transformer checkpoint of the model's family to sample on (a diffusers "
                             "folder or a single file), with --model's text encoders and VAE; as [sample] base")
    parser.add_argument("--variant", choices=("dev", "schnell", "turbo", "base", "raw"),
                        help="which checkpoint the sampled transformer is (--base's when given), where a single "
                             "file cannot say: dev / schnell (Flux), turbo / base (Z-Image), raw / turbo (Krea 2); "
                             "its published schedule and default steps and guidance are used (a diffusers folder's "
                             "scheduler config still decides the shift)")
    parser.add_argument("--vram", metavar="SIZE", help="VRAM budget such as 6GiB, or 'auto' for the free memory")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--guidance", type=float,
                        help="Flux dev: distilled guidance (default 3.5); SD3.5: CFG scale (default 7.0)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--height", type=int)
    parser.add_argument("--images-per-prompt", type=int)
    parser.add_argument("--frames", type=int, metavar="N",
                        help="a video family (wan2.2): N frames per sample, a length its VAE decodes (4k+1: 5, "
                             "..., 81), written as .mp4 with an animated .webp preview and a .json of the "
                             "parameters; default 1 (PNG images)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--out", help="output folder (default: samples)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any request key, e.g. --set vae_tiling=on")


def request_data(args: argparse.Namespace) -> tuple[dict, str]:
    """The raw request data (file, then flags) and a name for it in error messages."""
    from pathlib import Path

    from leantune.config import apply_overrides
    from leantune.infer.request import parse_lora_arg, read_request_file

    data: dict = read_request_file(args.request) if args.request else {}
    source = args.request or "command line"
    # Paths typed on the command line are relative to the working directory, not the request file.
    def here(p: str) -> str:
        return str(Path(p).expanduser().absolute())

    if args.model is not None:
        data.setdefault("model", {})["path"] = here(args.model)
    if args.family is not None:
        data.setdefault("model", {})["family"] = args.family
    elif args.model is not None and "family" not in data.get("model", {}):
        from leantune.models.family import guess_family

        family = guess_family(data["model"]["path"])       # a folder's or file's own metadata
        if family is not None:
            data["model"]["family"] = family
    if args.variant is not None:
        data.setdefault("model", {})["variant"] = args.variant
    if args.prompt:
        data["prompts"] = list(args.prompt)
    if args.lora:
        data["lora"] = [{**d, "path": here(d["path"])} for d in map(parse_lora_arg, args.lora)]
    if args.base_adapter:
        data.setdefault("model", {})["base_adapters"] = [{**d, "path": here(d["path"])}
                                                         for d in map(parse_lora_arg, args.base_adapter)]
    if args.base is not None:
        data["base"] = here(args.base)
    if args.reference:
        data["references"] = [here(p) for p in args.reference]
    if args.out is not None:
        data["out"] = here(args.out)
    if args.vram is not None:
        data.setdefault("memory", {})["vram_budget"] = args.vram
    for flag, key in (("steps", "steps"), ("guidance", "guidance"), ("negative_prompt", "negative_prompt"),
                      ("seed", "seed"), ("width", "width"),
                      ("height", "height"), ("images_per_prompt", "images_per_prompt"), ("device", "device"),
                      ("frames", "frames")):
        value = getattr(args, flag)
        if value is not None:
            data[key] = value
    return apply_overrides(data, args.set), source


class _ProgressBar:
    """Denoising progress on stderr (tqdm), created at the first step so loading logs stay readable."""

    def __init__(self):
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="denoising", unit="step", file=sys.stderr, leave=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from leantune.infer.request import validate_request
    from leantune.infer.run import run_sampling

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    data, source = request_data(args)
    base = Path(args.request).parent.resolve() if args.request else Path.cwd()
    request = validate_request(data, source, base)
    bar = _ProgressBar()
    try:
        result = run_sampling(request, progress=bar)
    except (ValueError, FileNotFoundError) as e:   # bad model / LoRA files: the message names the file
        print(f"leantune sample: {e}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    for f in result.files:
        print(f)
    times = ", ".join(f"{k} {v:.1f}s" for k, v in result.timings.items())
    peaks = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in result.stage_peaks.items())
    kind = "videos" if request.frames > 1 else "images"
    print(f"{len(result.files)} {kind}; {times}" + (f"; peak VRAM {peaks}" if peaks else ""), file=sys.stderr)
    return 0
