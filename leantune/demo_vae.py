"""A tiny VAE for the demo that really reconstructs its images, built analytically in a second.

A randomly initialised VAE decodes anything to noise, so the demo's samples could show nothing.
This one is the real diffusers `AutoencoderKL` class with the tiny preset's shape (16 latent
channels, 8x compression, like Flux's VAE), its weights set by hand so that

  encode: every latent cell holds the mean colour of its 8x8 pixel block, per colour channel
          divided by that channel's RMS over the image, spread over the 16 latent channels by a
          fixed orthonormal mixing (so every channel carries signal, at about unit scale);
  decode: un-mix, upsample with a smoothing kernel, and map back to colours.

How it survives the architecture: every ResNet block's and the attention's residual branch is
zeroed (the blocks become identities); downsampling convs average 2x2; each colour travels as a
pair of channels (v, -v), which makes the GroupNorm before the output an exact division by the
channel's RMS (the pair's mean is exactly zero) and makes `silu(x) - silu(-x) = x` undo the SiLU
exactly. What is lost is each colour channel's overall gain (the RMS), restored as one typical
value: the demo's saturated colours on white or black come back within a few levels.
"""

from __future__ import annotations

import torch

# Typical RMS of a colour channel of the demo's images in [-1, 1] (saturated shapes on white/black).
PIXEL_RMS = 0.85
COLOURS = 3


def mixing(latent_channels: int = 16, seed: int = 0) -> torch.Tensor:
    """(latent_channels, 3) with orthogonal columns of squared norm latent_channels / 3: unit-RMS latents."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(latent_channels, COLOURS, generator=g, dtype=torch.float64))
    return (q * (latent_channels / COLOURS) ** 0.5).float()


def _center(conv: torch.nn.Conv2d, weights: torch.Tensor) -> None:
    """Set a 3x3 conv to act as the 1x1 matrix `weights` (out, in) through its center tap, no bias."""
    conv.weight.zero_()
    conv.weight[:, :, 1, 1] = weights
    conv.bias.zero_()


def _pairs(out_channels: int, source: torch.Tensor) -> torch.Tensor:
    """(out_channels, n_in): channel 2c = source row c, channel 2c+1 = minus it, the rest zero."""
    w = torch.zeros(out_channels, source.shape[1])
    for c in range(source.shape[0]):
        w[2 * c], w[2 * c + 1] = source[c], -source[c]
    return w


def _identity_blocks(module: torch.nn.Module) -> None:
    """Zero every residual branch: ResNet blocks' second conv and attention output projections."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D

    for m in module.modules():
        if isinstance(m, ResnetBlock2D):
            m.conv2.weight.zero_()
            m.conv2.bias.zero_()
            if m.conv_shortcut is not None:
                raise ValueError("the analytic VAE needs equal channel counts in every block")
        elif isinstance(m, Attention):
            m.to_out[0].weight.zero_()
            m.to_out[0].bias.zero_()


def _per_channel(conv: torch.nn.Conv2d, kernel: torch.Tensor) -> None:
    """A conv that applies `kernel` (kh, kw) to each channel on its own."""
    conv.weight.zero_()
    for c in range(conv.out_channels):
        conv.weight[c, c, : kernel.shape[0], : kernel.shape[1]] = kernel
    conv.bias.zero_()


@torch.no_grad()
def shape_vae(seed: int = 0):
    """The analytic AutoencoderKL (tiny preset's config; scaling 1, shift 0: latents are unit RMS)."""
    from diffusers import AutoencoderKL

    from .tiny import VAE_TINY

    vae = AutoencoderKL(**{**VAE_TINY, "scaling_factor": 1.0, "shift_factor": 0.0}).eval()
    enc, dec = vae.encoder, vae.decoder
    width = enc.conv_in.out_channels
    latent = vae.config.latent_channels
    m = mixing(latent, seed)                                              # (16, 3)
    if 2 * COLOURS > width:
        raise ValueError(f"the analytic VAE needs at least {2 * COLOURS} channels per block, has {width}")
    for part in (enc, dec):
        _identity_blocks(part)
        part.conv_norm_out.weight.fill_(1.0)
        part.conv_norm_out.bias.zero_()

    # Encoder: RGB -> (R, -R, G, -G, B, -B, 0, 0); 2x2 averages down to 1/8; mix into 16 means.
    _center(enc.conv_in, _pairs(width, torch.eye(COLOURS)))
    for block in enc.down_blocks:
        for down in block.downsamplers or ():
            _per_channel(down.conv, torch.full((2, 2), 0.25))      # padding (0,1,0,1): rows/cols 2i, 2i+1
    unpair = torch.zeros(COLOURS, width)                                  # silu(x) - silu(-x) = x
    for c in range(COLOURS):
        unpair[c, 2 * c], unpair[c, 2 * c + 1] = 1.0, -1.0
    out = torch.zeros(2 * latent, width)
    out[:latent] = m @ unpair                                             # posterior means
    _center(enc.conv_out, out)
    enc.conv_out.bias[latent:] = -20.0                                    # log-variance: a point posterior

    # Decoder: un-mix to (u, -u) pairs; smooth 2x upsampling; back to colours at the typical gain.
    _center(dec.conv_in, _pairs(width, m.T / (latent / COLOURS)))
    smooth = torch.tensor([0.25, 0.5, 0.25])
    for block in dec.up_blocks:
        for up in block.upsamplers or ():
            _per_channel(up.conv, torch.outer(smooth, smooth))
    _center(dec.conv_out, PIXEL_RMS * unpair)
    return vae


def save_shape_vae(folder, seed: int = 0):
    """Write the analytic VAE as a diffusers `vae/` folder (safetensors), replacing what is there."""
    vae = shape_vae(seed)
    vae.save_pretrained(folder, safe_serialization=True)
    return folder


# -- Qwen-Image's VAE (AutoencoderKLQwenImage, the Wan 2.1 design) ----------------------------------------
#
# The same idea in Qwen-Image's causal 3-D VAE, built for one frame. Its norms are RMS norms over the
# channels of each pixel (not GroupNorm), which would keep only each pixel's colour direction; so one
# channel carries a large constant K beside the colour pairs: the per-pixel norm is then K within
# 1e-6, the normalisation a division by a known number, and the decoder's output gain is exact (no
# typical RMS assumed). Residual branches are zeroed as above; the 3x3x3 causal convs act through
# their current-frame centre tap (temporal index 2: the causal padding puts the two earlier frames
# first); the decoder's upsampling convs halve the channels (16 -> 8), which still hold the three
# pairs and the constant; its time convs, like the encoder's, are skipped for a first frame.

QWEN_DEMO_VAE = dict(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                     temperal_downsample=[False, True, True], latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
_CONSTANT = 1000.0
_K = 2 * COLOURS             # the channel holding the constant, after the three (v, -v) pairs


def _tap3d(conv, weights: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """A causal 3-D conv acting as the matrix `weights` (out, in) on the current frame, centre pixel."""
    conv.weight.zero_()
    k = conv.weight.shape[2:]
    conv.weight[:, :, k[0] - 1, k[1] // 2, k[2] // 2] = weights
    conv.bias.zero_()
    if bias is not None:
        conv.bias.copy_(bias)


def _qwen_identity_blocks(module: torch.nn.Module, residual=None, attention=None) -> None:
    """Zero the residual branches (second conv of every residual block, attention output projection);
    a channel-changing shortcut becomes the embedding of the first channels. `residual` and
    `attention` are the VAE's block classes (default: AutoencoderKLQwenImage's)."""
    if residual is None:
        from diffusers.models.autoencoders.autoencoder_kl_qwenimage import (QwenImageAttentionBlock,
                                                                            QwenImageResidualBlock)

        residual, attention = QwenImageResidualBlock, QwenImageAttentionBlock
    for m in module.modules():
        if isinstance(m, residual):
            m.conv2.weight.zero_()
            m.conv2.bias.zero_()
            if isinstance(m.conv_shortcut, torch.nn.Module) and hasattr(m.conv_shortcut, "weight"):
                _tap3d(m.conv_shortcut, torch.eye(m.conv_shortcut.out_channels, m.conv_shortcut.in_channels))
        elif isinstance(m, attention):
            m.proj.weight.zero_()
            m.proj.bias.zero_()


def _with_constant(weights: torch.Tensor) -> torch.Tensor:
    """`weights` (out, in) with the constant channel passed through."""
    w = weights.clone()
    w[_K, _K] = 1.0
    return w


@torch.no_grad()
def qwen_shape_vae(seed: int = 0):
    """The analytic AutoencoderKLQwenImage (QWEN_DEMO_VAE; latents_mean 0, latents_std 1): encode
    gives each 8x8 block's mean colour mixed into 16 channels, decode gives it back, smoothed."""
    from diffusers import AutoencoderKLQwenImage

    return _set_causal_shape_vae(AutoencoderKLQwenImage(**QWEN_DEMO_VAE).eval(), seed)


def _set_causal_shape_vae(vae, seed: int, residual=None, attention=None):
    """Set the weights of a Wan-2.1-style causal VAE (AutoencoderKLQwenImage, AutoencoderKLWan) by hand."""
    enc, dec = vae.encoder, vae.decoder
    width, latent = enc.conv_in.out_channels, vae.config.z_dim
    m = mixing(latent, seed)                                              # (16, 3)
    for part in (enc, dec):
        _qwen_identity_blocks(part, residual, attention)
        part.norm_out.gamma.fill_(1.0)
    unpair = torch.zeros(COLOURS, width)                                  # silu(x) - silu(-x) = x
    for c in range(COLOURS):
        unpair[c, 2 * c], unpair[c, 2 * c + 1] = 1.0, -1.0
    constant = torch.zeros(width)
    constant[_K] = _CONSTANT

    # Encoder: RGB -> pairs and the constant; 2x2 averages down to 1/8 (time convs unused for one
    # frame); the RMS norm divides by K / sqrt(width); mix the colours into the 16 means.
    _tap3d(enc.conv_in, _pairs(width, torch.eye(COLOURS)), constant)
    for block in enc.down_blocks:
        resample = getattr(block, "resample", None)
        if resample is not None:
            _per_channel(resample[1], torch.full((2, 2), 0.25))   # after ZeroPad2d (0, 1, 0, 1): rows 2i, 2i+1
    gain = _CONSTANT / enc.norm_out.scale
    out = torch.zeros(2 * latent, width)
    out[:latent] = gain * (m @ unpair)
    _tap3d(enc.conv_out, out, torch.cat([torch.zeros(latent), torch.full((latent,), -20.0)]))  # point posterior
    _tap3d(vae.quant_conv, torch.eye(2 * latent))

    # Decoder: un-mix to pairs beside the constant; smoothing 2x upsampling (the constant by the
    # centre tap alone); the RMS norm's division undone exactly at the output.
    _tap3d(vae.post_quant_conv, torch.eye(latent))
    _tap3d(dec.conv_in, _pairs(width, m.T / (latent / COLOURS)), constant)
    smooth = torch.outer(*(torch.tensor([0.25, 0.5, 0.25]),) * 2)
    for block in dec.up_blocks:
        for up in block.upsamplers or ():
            conv = up.resample[1]
            conv.weight.zero_()
            conv.bias.zero_()
            for c in range(2 * COLOURS):
                conv.weight[c, c] = smooth
            conv.weight[_K, _K, 1, 1] = 1.0
    out_width = dec.norm_out.gamma.shape[0]
    _tap3d(dec.conv_out, (_CONSTANT / dec.norm_out.scale) * unpair[:, :out_width])
    _time_convs(vae)
    return vae


def _time_convs(vae) -> None:
    """The time convs, which a clip's later chunks pass (a first frame skips them). The encoder's two
    stride-2 ones each average the two newest frames of their window (taps 1 and 2 of [earlier,
    newer, newest]), so a latent frame after the first holds the mean of its 4 frames; the decoder's
    (dim -> 2 dim: two output frames per input frame) copy the frame into both, so each of the 4
    frames a latent frame decodes to shows that mean. Every channel is passed, the constant too."""
    for conv in (getattr(m, "time_conv", None) for m in vae.encoder.modules()):
        if conv is not None:
            conv.weight.zero_()
            conv.bias.zero_()
            for c in range(conv.out_channels):
                conv.weight[c, c, 1:] = 0.5
    for conv in (getattr(m, "time_conv", None) for m in vae.decoder.modules()):
        if conv is not None:
            conv.weight.zero_()
            conv.bias.zero_()
            dim = conv.in_channels
            for c in range(dim):
                conv.weight[c, c, -1] = conv.weight[dim + c, c, -1] = 1.0


def save_qwen_shape_vae(folder, seed: int = 0):
    """Write the analytic Qwen-Image VAE as a diffusers `vae/` folder (safetensors)."""
    vae = qwen_shape_vae(seed)
    vae.save_pretrained(folder, safe_serialization=True)
    return folder


# -- Wan's VAE (AutoencoderKLWan, Wan 2.1's design: 16 channels, 8x spatial and 4x temporal) ---------------
#
# AutoencoderKLQwenImage is Wan 2.1's VAE under another name, so the construction above sets its
# weights module for module; what a clip adds is the time convs (`_time_convs`). A clip of 4k+1
# frames encodes to 1 + k latent frames: the first frame alone, then the mean of each 4 frames;
# decoded, the first frame comes back as an image would and each later 4 frames as their mean
# (a shape moving 2 px a frame smears by 6 px).

WAN_DEMO_VAE = dict(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                    temperal_downsample=[False, True, True], latents_mean=[0.0] * 16, latents_std=[1.0] * 16)


@torch.no_grad()
def wan_shape_vae(seed: int = 0):
    """The analytic AutoencoderKLWan (WAN_DEMO_VAE; latents_mean 0, latents_std 1)."""
    from diffusers import AutoencoderKLWan
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock, WanResidualBlock

    return _set_causal_shape_vae(AutoencoderKLWan(**WAN_DEMO_VAE).eval(), seed, WanResidualBlock, WanAttentionBlock)


def save_wan_shape_vae(folder, seed: int = 0):
    """Write the analytic Wan VAE as a diffusers `vae/` folder (safetensors)."""
    vae = wan_shape_vae(seed)
    vae.save_pretrained(folder, safe_serialization=True)
    return folder
