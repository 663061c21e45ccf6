"""Key layout of the Wan 2.1 VAE's native single file (Wan-AI's Wan2.1_VAE.pth names, which ComfyUI's
repackaged wan_2.1_vae.safetensors keeps), to diffusers' AutoencoderKLWan, and its architecture from
shapes. Wan 2.2 A14B and Wan 2.1 use this VAE; TI2V-5B's 48-channel Wan 2.2 VAE is another
architecture (residual blocks, patchified input), refused here by name.

Wan-AI's modules are flat lists where diffusers nests some of them:

- `conv1` / `conv2` at the top are diffusers' `quant_conv` / `post_quant_conv`; `encoder.conv1` /
  `decoder.conv1` their `conv_in`; `*.head.0` / `*.head.2` the `norm_out` / `conv_out`;
- a residual block's `residual.0 / .2 / .3 / .6` (RMS norm, conv, RMS norm, conv of its
  Sequential) are `norm1 / conv1 / norm2 / conv2`, its `shortcut` is `conv_shortcut`;
- `*.middle.0 / .1 / .2` are the mid block's `resnets.0`, `attentions.0`, `resnets.1`;
- `encoder.downsamples.N` keep their flat index as diffusers' `encoder.down_blocks.N` (each stage's
  num_res_blocks residual blocks, then a resample but after the last stage);
- `decoder.upsamples.N` are flat in Wan-AI's file (per stage num_res_blocks + 1 residual blocks, then
  a resample but after the last stage) and nested in diffusers: stage s's residual block j is
  `decoder.up_blocks.s.resnets.j`, its resample `decoder.up_blocks.s.upsamplers.0`.

The weights show the widths, the stages, the residual blocks per stage and which resamples also
halve time; the latent mean and std are not in the weights: they are the released VAE's
(models/configs/wan_vae.json), or a file's `leantune.config` metadata.
"""

from __future__ import annotations

import re

_RESIDUAL = {"residual.0.": "norm1.", "residual.2.": "conv1.", "residual.3.": "norm2.", "residual.6.": "conv2.",
             "shortcut.": "conv_shortcut."}
_MIDDLE = {"0": "mid_block.resnets.0.", "1": "mid_block.attentions.0.", "2": "mid_block.resnets.1."}
_FLAT_RE = re.compile(r"^(encoder\.downsamples|decoder\.upsamples)\.(\d+)\.(.+)$")
NATIVE_ANCHOR = "encoder.conv1.weight"
UNSEEN = ("latents_mean", "latents_std", "scale_factor_temporal", "scale_factor_spatial")


def _residual(rest: str) -> str:
    for src, dst in _RESIDUAL.items():
        if rest.startswith(src):
            return dst + rest[len(src):]
    return rest


def is_native(keys) -> bool:
    return any(k == NATIVE_ANCHOR or k.startswith("decoder.upsamples.") for k in keys)


def residual_blocks_per_stage(keys) -> int:
    """num_res_blocks: the encoder's residual blocks before its first resample (all of them when
    there is a single stage)."""
    flat = {}
    for k in keys:
        m = _FLAT_RE.match(k)
        if m and m.group(1) == "encoder.downsamples":
            flat.setdefault(int(m.group(2)), set()).add(m.group(3).split(".", 1)[0])
    if not flat:
        raise KeyError("encoder.downsamples.0.residual.0.gamma")
    first = next((i for i in sorted(flat) if "resample" in flat[i]), None)
    return len(flat) if first is None else first


def diffusers_name(native: str, per_stage: int) -> str:
    """The diffusers key of a native key; `per_stage`: num_res_blocks (the decoder has one more per stage)."""
    m = _FLAT_RE.match(native)
    if m:
        part, index, rest = m.group(1), int(m.group(2)), m.group(3)
        if part == "encoder.downsamples":
            return f"encoder.down_blocks.{index}.{_residual(rest)}"
        stage, j = divmod(index, per_stage + 2)
        if j <= per_stage:
            return f"decoder.up_blocks.{stage}.resnets.{j}.{_residual(rest)}"
        return f"decoder.up_blocks.{stage}.upsamplers.0.{rest}"
    for side in ("encoder.", "decoder."):
        if native.startswith(side):
            rest = native[len(side):]
            if rest.startswith("conv1."):
                return f"{side}conv_in.{rest[len('conv1.'):]}"
            if rest.startswith("head.0."):
                return f"{side}norm_out.{rest[len('head.0.'):]}"
            if rest.startswith("head.2."):
                return f"{side}conv_out.{rest[len('head.2.'):]}"
            mid = re.match(r"^middle\.(\d)\.(.+)$", rest)
            if mid and mid.group(1) in _MIDDLE:
                inner = mid.group(2) if mid.group(1) == "1" else _residual(mid.group(2))
                return f"{side}{_MIDDLE[mid.group(1)]}{inner}"
            return native
    if native.startswith("conv1."):
        return "quant_conv." + native[len("conv1."):]
    if native.startswith("conv2."):
        return "post_quant_conv." + native[len("conv2."):]
    return native


def config_from_shapes(shapes: dict[str, tuple[int, ...]], released: dict, meta: dict | None = None) -> dict:
    """An AutoencoderKLWan config from diffusers key shapes (a native file's after renaming).

    Raises KeyError naming a missing anchor key, ValueError for shapes of another architecture."""
    def need(key):
        if key not in shapes:
            raise KeyError(key)
        return shapes[key]

    if any(".avg_shortcut" in k or "clip" in k for k in shapes):
        raise ValueError("a Wan 2.2 (TI2V-5B, 48-channel) VAE: only the Wan 2.1 VAE is read from one file; "
                         "point [model] vae at the vae/ folder of a Wan diffusers repository")
    if any(".attentions." in k and k.startswith("encoder.down_blocks") for k in shapes):
        raise ValueError("attention inside the down blocks (attn_scales): not the Wan 2.1 VAE")
    base = need("encoder.conv_in.weight")[0]
    z_dim = need("post_quant_conv.weight")[0]
    flat = sorted({int(k.split(".")[2]) for k in shapes if k.startswith("encoder.down_blocks.")})
    resamples = [i for i in flat if f"encoder.down_blocks.{i}.resample.1.weight" in shapes]
    per = resamples[0] if resamples else len(flat)
    if len(flat) != (len(resamples) + 1) * per + len(resamples):
        raise ValueError(f"{len(flat)} encoder down blocks do not make stages of {per} residual blocks and a resample")
    widths = [need(f"encoder.down_blocks.{s * (per + 1)}.conv1.weight")[0] for s in range(len(resamples) + 1)]
    if any(w % base for w in widths):
        raise ValueError(f"stage widths {widths} are not multiples of the first convolution's {base}")
    config = dict(base_dim=base, z_dim=z_dim, dim_mult=[w // base for w in widths], num_res_blocks=per,
                  attn_scales=[], temperal_downsample=[f"encoder.down_blocks.{i}.time_conv.weight" in shapes
                                                       for i in resamples])
    config.update({k: released[k] for k in UNSEEN if k in released})
    config.update({k: v for k, v in dict(meta or {}).items() if k in UNSEEN})
    if len(config["latents_mean"]) != z_dim or len(config["latents_std"]) != z_dim:
        raise ValueError(f"{z_dim} latent channels but {len(config['latents_mean'])} latent means: give "
                         f"latents_mean and latents_std in the file's leantune.config metadata")
    return config
