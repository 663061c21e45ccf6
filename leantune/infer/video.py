"""Videos out of the sampler: a video family's sampled latents (B, C, T', h, w) decoded to frames and
written as one mp4 with its animated webp preview.

Decoding is the causal VAE's own loop a latent frame at a time (data/video_vae.decode_chunks, equal
to AutoencoderKLWan.decode bit for bit), after the pipeline's de-normalisation (z / (1 / std) +
mean, as WanPipeline writes it), and frames are rounded to uint8 as diffusers' video processor
rounds its PIL output: a sample's frames are WanPipeline's frames. Several prompts' videos are
tiled frame by frame into one grid video, as the image samples are tiled into one grid image
(video i of the grid is prompt i with seed + i).

Why both files: mp4 (H.264) is what players and the page play; the webp is the small preview a
file browser animates without a player (data/video_write.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .images import grid_shape

TENSORBOARD_FRAMES = 16       # frames of a sample video in its TensorBoard contact sheet


@torch.no_grad()
def decode_videos(vae, latents: torch.Tensor, device) -> list[np.ndarray]:
    """Normalised latents (B, C, T', h, w) -> one uint8 (T, H, W, 3) array per video, decoded on
    `device` (where the VAE must be) one latent frame at a time. Non-finite pixels are an error
    (clamping would turn them into black frames that look like a result)."""
    from ..data.video_vae import decode_chunks, denormalize, to_uint8_frames

    if latents.dim() != 5:
        raise ValueError(f"video latents must be (B, C, T', h, w), got {tuple(latents.shape)}")
    dtype = next(vae.parameters()).dtype
    out = []
    for i, z in enumerate(latents.split(1)):
        raw = denormalize(vae, z.to(device=device, dtype=dtype))             # (1, C, T', h, w)
        frames = []
        for chunk in decode_chunks(vae, raw):
            if not bool(torch.isfinite(chunk).all()):
                raise FloatingPointError(f"video {i + 1} decoded to non-finite pixels (NaN or inf): the sampled "
                                         f"latents overflowed; no video was written")
            frames.append(to_uint8_frames(chunk))                             # (t, H, W, 3)
        out.append(torch.cat(frames).numpy())
    return out


def video_grid(videos: list[np.ndarray], cols: int | None = None) -> np.ndarray:
    """Tile equally long, equally sized videos (T, H, W, 3) into one (T, rows * H, cols * W, 3),
    row-major, `cols` per row (default: near square, as infer/images.make_grid)."""
    if not videos:
        raise ValueError("video_grid needs at least one video")
    shape = videos[0].shape
    for i, v in enumerate(videos):
        if v.shape != shape:
            raise ValueError(f"video {i} is {v.shape}, expected {shape} like video 0")
    rows, cols = grid_shape(len(videos), cols)
    t, h, w, c = shape
    grid = np.full((t, rows * h, cols * w, c), 255, np.uint8)
    for i, v in enumerate(videos):
        r, k = divmod(i, cols)
        grid[:, r * h:(r + 1) * h, k * w:(k + 1) * w] = v
    return grid


def save_video(frames: np.ndarray, path: str | Path, fps: float) -> tuple[Path, Path]:
    """Write (T, H, W, 3) uint8 frames as `path` (.mp4) and its animated preview beside it (.webp);
    both atomic. Returns (mp4, webp)."""
    from ..data.video_write import write_mp4, write_webp

    path = Path(path)
    write_mp4(path, frames, fps)
    preview = path.with_suffix(".webp")
    write_webp(preview, frames, fps)
    return path, preview


def save_training_video(frames: np.ndarray, path: str | Path, fps: float, writer=None, step: int = 0) -> Path:
    """A training sample's grid video: the mp4 and its webp preview (save_video), and, given a
    TensorBoard `writer`, its frames as the step's `samples` image: a contact sheet of at most
    TENSORBOARD_FRAMES frames evenly spread over the video, in order, 8 to a row (TensorBoard has no
    video card without extra packages; the sheet shows the motion at a glance). Returns the mp4."""
    import logging

    mp4, preview = save_video(frames, path, fps)
    if writer is not None:
        every = -(-len(frames) // TENSORBOARD_FRAMES)
        sheet = torch.from_numpy(np.ascontiguousarray(frames[::every]))            # (n, H, W, 3) uint8
        writer.add_images("samples", sheet, step, dataformats="NHWC")
    logging.getLogger("leantune").info("samples: %s (%d frames at %g fps; preview %s)", mp4, len(frames), fps,
                                       preview.name)
    return mp4
