"""`leantune convert in.safetensors out.safetensors --to comfyui|diffusers [--family NAME]`.

Reads any LoRA layout leantune understands (kohya / ComfyUI / musubi-tuner, diffusers, ai-toolkit,
native BFL / Stability keys, LyCORIS names, and LoKr files, which become the LoRA of the same delta)
for any family (Flux, SD3.5, Qwen-Image, FLUX.2, Z-Image: musubi-tuner's, ai-toolkit's and
diffusion-pipe's files too) and writes it in the chosen one, with the same weight deltas; the source
header's training notes (ss_*) are carried over. The family comes from the keys (Flux
`double_blocks` vs SD3 `joint_blocks`, ...), their shapes (FLUX.2 shares Flux.1's names, not its
proportions), the header or the LoRA's width (3072: Flux.1); `--family` says it for files whose
names fit several and that nothing else tells apart (diffusers names without a header, at another
width, converted to kohya names: the first family's names are written then, with a warning). Heavy
imports wait until the command runs.
"""

from __future__ import annotations

import sys
import warnings

_DTYPES = {"keep": None, "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def configure(parser) -> None:
    parser.add_argument("input", help="LoRA file to read (.safetensors)")
    parser.add_argument("output", help="LoRA file to write (.safetensors)")
    parser.add_argument("--to", required=True, choices=("comfyui", "diffusers"),
                        help="comfyui: kohya/ComfyUI lora_unet_* keys; diffusers: transformer.* peft keys")
    parser.add_argument("--dtype", default="keep", choices=tuple(_DTYPES),
                        help="tensor dtype of the output (default: as in the input)")
    parser.add_argument("--family", default=None, metavar="NAME",
                        help="model family the LoRA is for (flux, sd3, qwen-image, flux2-dev, ...); default: read from "
                             "its keys, shapes and header")
    parser.add_argument("--overwrite", action="store_true", help="replace the output file if it exists")


def output_problem(source: str, target: str, overwrite: bool = False) -> str | None:
    """Why `target` cannot be written, or None: its folder must exist (a typo must not create
    folders at /), it must be a .safetensors file, never the input itself, and an existing file is
    replaced only with `overwrite`."""
    from pathlib import Path

    src, out = Path(source).expanduser(), Path(target).expanduser()
    if out.suffix.lower() != ".safetensors":
        return f"{target}: the output must be a .safetensors file (got {out.suffix or 'no extension'})"
    if not out.parent.is_dir():
        return f"{target}: the folder {out.parent} does not exist; create it first (nothing was written)"
    if out.is_dir():
        return f"{target}: is a folder; give a file name ending in .safetensors"
    same = out.exists() and src.exists() and out.samefile(src)
    if same or out.resolve() == src.resolve():
        return f"{target}: is the input file; write the converted LoRA to another file (the input stays as it is)"
    if out.exists() and not overwrite:
        return f"{target}: already exists; pass --overwrite to replace it, or give another name (nothing was written)"
    return None


def run(args) -> int:
    problem = output_problem(args.input, args.output, getattr(args, "overwrite", False))
    if problem:
        print(f"leantune convert: {problem}", file=sys.stderr)
        return 2

    import torch

    from leantune.train.lora_formats import families_in_doubt, read_lora, save_lora

    dtype = None if _DTYPES[args.dtype] is None else getattr(torch, _DTYPES[args.dtype])
    keys = None
    if args.family is not None:
        from leantune.models.family import known_families
        from leantune.train.lora_keys import key_map

        if args.family not in known_families():
            print(f"leantune convert: --family {args.family!r} is not a model family; choose one of "
                  f"{known_families()}", file=sys.stderr)
            return 2
        keys = key_map(args.family)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            weights = read_lora(args.input, keys)
        for w in caught:
            print(f"leantune convert: warning: {w.message}", file=sys.stderr)
        if args.to == "comfyui" and keys is None and weights.keys is None:
            doubt = families_in_doubt(weights)
            if doubt:          # written with the first family's names, as save_lora does; say so
                others = " or ".join(k.family for k in doubt[1:])
                print(f"leantune convert: warning: {args.input}: its module names (e.g. {sorted(weights.modules)[0]!r}) "
                      f"fit {doubt[0].display} and {' and '.join(k.display for k in doubt[1:])} LoRAs, which kohya/ComfyUI "
                      f"name differently, and neither its header nor its width says which; writing "
                      f"{doubt[0].display} names (give --family {others} for another)", file=sys.stderr)
        with warnings.catch_warnings(record=True) as caught:     # e.g. modules ComfyUI has no name for
            warnings.simplefilter("always")
            path = save_lora(weights, args.output, args.to, dtype=dtype, keys=keys)
        for w in caught:
            print(f"leantune convert: warning: {w.message}", file=sys.stderr)
    except (ValueError, FileNotFoundError) as e:   # LoraFormatError and unreadable files name the file
        print(f"leantune convert: {e}", file=sys.stderr)
        return 2
    family = f" of a {weights.keys.display} LoRA" if weights.keys is not None else ""
    print(f"converted {len(weights.modules)} modules{family} from {weights.format} layout to {args.to}: {path}")
    return 0
