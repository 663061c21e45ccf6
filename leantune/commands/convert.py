"""`leantune convert in.safetensors out.safetensors --to comfyui|diffusers`.

Reads any LoRA layout leantune understands (kohya / ComfyUI, diffusers, ai-toolkit, BFL keys)
and writes it in the chosen one, with the same weight deltas; the source header's training notes
(ss_*) are carried over. Heavy imports wait until the command runs.
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


def run(args) -> int:
    import torch

    from leantune.train.lora_formats import read_lora, save_lora

    dtype = None if _DTYPES[args.dtype] is None else getattr(torch, _DTYPES[args.dtype])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            weights = read_lora(args.input)
        for w in caught:
            print(f"leantune convert: warning: {w.message}", file=sys.stderr)
        path = save_lora(weights, args.output, args.to, dtype=dtype)
    except (ValueError, FileNotFoundError) as e:   # LoraFormatError and unreadable files name the file
        print(f"leantune convert: {e}", file=sys.stderr)
        return 2
    print(f"converted {len(weights.modules)} modules from {weights.format} layout to {args.to}: {path}")
    return 0
