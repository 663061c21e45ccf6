"""Wan's causal video VAE run over time in chunks: a clip is encoded as its frames arrive from the
decoder, and latents are decoded back to frames a chunk at a time.

Why. `AutoencoderKLWan.encode` wants the whole clip as one (B, 3, T, H, W) tensor: 81 frames of
1280x720 are 900 MB of fp32 pixels before the encoder starts, and its `decode` concatenates every
output frame before returning. Yet the network itself is causal and already walks time in chunks
inside `_encode`/`_decode`: the first frame alone, then groups of 4 frames (one latent frame each),
each chunk's convolutions reading the previous chunk's last frames from a per-convolution cache
(`feat_cache`). Driving that same loop from outside, with the VAE's own encoder, decoder and
quant convolutions, lets the pixels stream in (and out) one chunk at a time while the result is
the whole-clip call's: only a chunk's pixels, its activations and the small causal cache live at
once, so the peak no longer grows with the clip's length.

Frames come from `video.py`'s decoding (nearest source frame per output time, resized as they
arrive) as a generator (`iter_clip_frames`), so a long or 4K clip is never decoded whole.

Time only: a chunk is encoded at its full width and height (the VAE's `enable_tiling` spatial
tiles are not applied here), so a chunk's activations grow with the frame size, not the length.

Latents here are raw posterior parameters unless named otherwise; `normalize` / `denormalize` are
the per-channel mean/std the Wan pipelines apply (`(mode - mean) * (1 / std)` when conditioning,
`z / (1 / std) + mean` before decoding), written the same way so the floats match theirs.
"""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Iterable, Iterator

import av
import torch

from leantune.data.reading import load_rgb
from leantune.data.video import (SEQUENCE_FPS, ClipError, _as_fraction, _file_frames, _resize_crop, _to_tensor,
                                 sequence_frames)

FIRST_CHUNK = 1           # frames of the first chunk: Wan's VAE encodes the first frame on its own
CHUNK = 4                 # frames per later chunk: one latent frame (the VAE's 4:1 time compression)


# -- frames in -------------------------------------------------------------------------------------

def _picked(timed, frame_dur: Fraction, target: Fraction, start: Fraction, num_frames: int, to_img, size):
    """Nearest source frame for each output time start + k/target, yielded as chosen (uint8 (3, H, W)).

    The generator form of `video._pick` (same rule, ties to the earlier frame, the last frame held
    for its own duration), so frames leave as soon as they are picked instead of being collected.
    """
    prev = None
    k = 0
    t = start
    for tc, frame in timed:
        while k < num_frames and tc >= t:
            chosen = prev[1] if prev is not None and t - prev[0] <= tc - t else frame
            yield _to_tensor(_resize_crop(to_img(chosen), size))
            k += 1
            t = start + k / target
        if k >= num_frames:
            return
        prev = (tc, frame)
    while prev is not None and k < num_frames and t < prev[0] + frame_dur:
        yield _to_tensor(_resize_crop(to_img(prev[1]), size))
        k += 1
        t = start + k / target


def iter_clip_frames(path, *, target_fps, num_frames: int, start_s: float = 0.0, size=None,
                     sequence_fps=SEQUENCE_FPS) -> Iterator[torch.Tensor]:
    """`video.read_clip_frames` as a stream: each (3, H, W) float32 frame in [-1, 1] as it is decoded.

    The same frames, in the same order and values, but only one decoded frame (and the decoder's own
    buffers) is alive at a time. Raises ClipError naming the file if the clip runs out first (after
    yielding what it had).
    """
    path = Path(path)
    target, start = _as_fraction(target_fps), Fraction(start_s).limit_denominator(1_000_000)
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    count = 0
    if path.is_dir():
        rate = _as_fraction(sequence_fps)
        timed = ((i / rate, p) for i, p in enumerate(sequence_frames(path)))

        def frame_image(p: Path):
            try:
                return load_rgb(p)
            except (OSError, ValueError, SyntaxError) as e:      # PIL's kinds for a damaged frame file
                raise ClipError(f"{path}: frame {p.name} cannot be read ({type(e).__name__}: {e})") from e

        for frame in _picked(timed, 1 / rate, target, start, num_frames, frame_image, size):
            count += 1
            yield frame.float() / 127.5 - 1.0
    else:
        try:
            with av.open(str(path)) as container:
                stream = container.streams.video[0]
                stream.thread_type = "AUTO"
                rate = Fraction(stream.average_rate or stream.guessed_rate or SEQUENCE_FPS)
                for frame in _picked(_file_frames(container, stream, start_s), 1 / rate, target, start,
                                     num_frames, lambda f: f.to_image(), size):
                    count += 1
                    yield frame.float() / 127.5 - 1.0
        except (av.FFmpegError, OSError, IndexError) as e:
            raise ClipError(f"{path}: cannot be decoded ({e})") from e
    if count < num_frames:
        raise ClipError(f"{path}: holds {count} frame(s) at {float(target):g} fps from {start_s:g} s, "
                        f"{num_frames} asked")


def causal_chunks(frames: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Group (3, H, W) frames into the VAE's time chunks: (1, 3, 1, H, W), then (1, 3, 4, H, W) each.

    A clip must hold 4k+1 frames (video.valid_frame_count); a trailing partial chunk is an error
    rather than frames silently dropped (the whole-clip `encode` would drop them without a word).
    """
    group: list[torch.Tensor] = []
    want = FIRST_CHUNK
    seen = 0
    for frame in frames:
        if frame.dim() != 3 or frame.shape[0] != 3:
            raise ValueError(f"frame {seen}: expected (3, H, W), got {tuple(frame.shape)}")
        group.append(frame)
        seen += 1
        if len(group) == want:
            yield torch.stack(group, dim=1)[None]          # (1, 3, t, H, W)
            group, want = [], CHUNK
    if seen == 0:
        raise ValueError("no frames to encode")
    if group:
        raise ValueError(f"{seen} frames is not 4k+1 (Wan's VAE encodes 1 + 4k frames); "
                         f"the last {len(group)} would be dropped -- pick the length with valid_frame_count")


# -- the VAE's own loop, chunk by chunk ---------------------------------------------------------

def _causal_conv_count(module: torch.nn.Module) -> int:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return sum(isinstance(m, WanCausalConv3d) for m in module.modules())


def _patch_size(vae) -> int | None:
    return vae.config.patch_size


@torch.no_grad()
def encode_chunks(vae, chunks: Iterable[torch.Tensor]) -> torch.Tensor:
    """Encode (1, 3, t, H, W) chunks (first t=1, then t=4) -> posterior parameters (1, 2z, T', h, w).

    `AutoencoderKLWan._encode`'s loop with the VAE's own modules: one causal cache for the whole
    clip, reset per chunk only in its index; `quant_conv` (a 1x1x1 convolution) applied per chunk
    instead of once at the end, which is the same arithmetic per latent frame. Only the latents
    (1/48 of the pixels in Wan 2.1's VAE) accumulate.
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

    cache = [None] * _causal_conv_count(vae.encoder)
    patch = _patch_size(vae)
    out = []
    for chunk in chunks:
        x = chunk.to(device=vae.device, dtype=vae.dtype)
        if patch is not None:
            x = patchify(x, patch_size=patch)
        out.append(vae.quant_conv(vae.encoder(x, feat_cache=cache, feat_idx=[0])))
        del x
    if not out:
        raise ValueError("no chunks to encode")
    return torch.cat(out, dim=2)


def encode_frames(vae, frames: Iterable[torch.Tensor]):
    """(3, H, W) frames in [-1, 1] (4k+1 of them, any iterable) -> the posterior, as `encode` returns it
    (`DiagonalGaussianDistribution`: `.mode()` / `.mean` are the latents the pipelines use)."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    return DiagonalGaussianDistribution(encode_chunks(vae, causal_chunks(frames)))


def encode_clip(vae, path, *, target_fps, num_frames: int, start_s: float = 0.0, size=None,
                sequence_fps=SEQUENCE_FPS) -> torch.Tensor:
    """A clip's window straight from the file to normalised training latents (z, T', h, w), streaming.

    num_frames must be 4k+1 (frame_bucket gives it); the posterior's mode is cached, as the Wan
    pipelines take `argmax` latents of a conditioning image.
    """
    frames = iter_clip_frames(path, target_fps=target_fps, num_frames=num_frames, start_s=start_s, size=size,
                              sequence_fps=sequence_fps)
    return normalize(vae, encode_frames(vae, frames).mode())[0]


@torch.no_grad()
def decode_chunks(vae, z: torch.Tensor) -> Iterator[torch.Tensor]:
    """Raw latents (1, z, T', h, w) -> pixel chunks in [-1, 1]: (1, 3, 1, H, W), then (1, 3, 4, H, W).

    `AutoencoderKLWan._decode`'s loop with its own modules: `post_quant_conv` (1x1x1) per latent
    frame, the decoder's causal cache carried across frames, `first_chunk` on the first; each chunk
    is yielded (unpatchified, clamped) as soon as it is decoded, so the caller writes it out and the
    whole video never sits in memory.
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    if z.dim() != 5 or z.shape[0] != 1:
        raise ValueError(f"expected latents (1, C, T, h, w), got {tuple(z.shape)}")
    cache = [None] * _causal_conv_count(vae.decoder)
    patch = _patch_size(vae)
    for i in range(z.shape[2]):
        x = vae.post_quant_conv(z[:, :, i:i + 1].to(device=vae.device, dtype=vae.dtype))
        out = vae.decoder(x, feat_cache=cache, feat_idx=[0], first_chunk=i == 0)
        if patch is not None:
            out = unpatchify(out, patch_size=patch)
        yield torch.clamp(out, min=-1.0, max=1.0)


def to_uint8_frames(chunk: torch.Tensor) -> torch.Tensor:
    """(1, 3, t, H, W) in [-1, 1] -> (t, H, W, 3) uint8 on the CPU for a video writer, rounded as
    diffusers' image processor rounds its PIL output ((x / 2 + 0.5) clamped to [0, 1], * 255, round)."""
    x = (chunk[0].float() / 2 + 0.5).clamp(0, 1)
    return (x.permute(1, 2, 3, 0) * 255).round().to(torch.uint8).cpu()


def decoded_frames(vae, z: torch.Tensor) -> Iterator[torch.Tensor]:
    """Raw latents (1, z, T', h, w) -> uint8 (H, W, 3) frames one by one, decoded a chunk at a time:
    what `video_write.write_mp4` / `write_webp` take, so a sample video is written as it decodes."""
    for chunk in decode_chunks(vae, z):
        yield from to_uint8_frames(chunk)


# -- the Wan pipelines' latent normalisation ----------------------------------------------------

def _stats(vae, like: torch.Tensor):
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, inv_std


def normalize(vae, latents: torch.Tensor) -> torch.Tensor:
    """Raw (1, z, T, h, w) -> the normalised latents a Wan transformer trains on: (x - mean) * (1 / std)."""
    mean, inv_std = _stats(vae, latents)
    return (latents - mean) * inv_std


def denormalize(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised (1, z, T, h, w) -> raw, as WanPipeline does before decoding: z / (1 / std) + mean."""
    mean, inv_std = _stats(vae, latents)
    return latents / inv_std + mean
