"""Reference images for sampling an edit family (`leantune sample --reference`, [sample] references).

An edit model (docs/reference-images.md) is conditioned on reference images twice: its text
encoder may read them with the prompt (`ReferenceConditioning.text_sees_images`), and their VAE
latents join the transformer's image sequence. This module turns the paths a user gives into what
the two stages need: the images (PIL, RGB, as the dataset reads them) for the text encoder, and
their latents, encoded as the family's pipeline encodes them when it samples
(`ReferenceConditioning.sampling_latents`), for the transformer.

Every check happens before any model is loaded, and every error names the key and the file: a
family without reference conditioning, more references than the family takes, a missing or
unreadable image.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import ConfigError
from ..models.family import ModelFamily


def load_reference_images(paths: Sequence[Path], family: ModelFamily, key: str = "references") -> list:
    """The images at `paths` (RGB PIL; RGBA with their alpha for a family that encodes it,
    ModelFamily.rgba) for `family`; [] for none. `key` names the setting in errors."""
    if not paths:
        return []
    refs = family.references
    if refs is None:
        raise ConfigError(f"{key}: family = \"{family.name}\" takes no reference images (an edit family does, "
                          f"e.g. qwen-image-edit); remove them")
    if refs.sampling_latents is None:
        raise ConfigError(f"{key}: family = \"{family.name}\" cannot sample with reference images yet (its "
                          f"ReferenceConditioning has no sampling_latents); remove them")
    if len(paths) > refs.most:
        raise ConfigError(f"{key}: {len(paths)} reference images, but {family.name} takes at most {refs.most}")
    from PIL import UnidentifiedImageError

    from ..data.reading import load_image

    images = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{key}: {path}: no such image file")
        try:
            images.append(load_image(path, family.rgba))
        except (UnidentifiedImageError, OSError) as e:
            raise ConfigError(f"{key}: {path}: not a readable image ({e})") from None
    return images


def text_images(images: list, family: ModelFamily) -> list | None:
    """What the family's text encoder is handed with each prompt: the images when it reads them,
    else None (the caption alone)."""
    if not images or family.references is None or not family.references.text_sees_images:
        return None
    return images


def check_first_frame(family: ModelFamily, sources, images: list, key: str = "references") -> None:
    """For a family whose reference is a video's first frame (ReferenceConditioning.first_frame): a
    model that takes one samples only with it, a model that does not refuses one; ConfigErrors
    naming `key` and the model. Reads the model's configs only."""
    if family.references is None or family.references.first_frame is None or sources is None:
        return
    model = getattr(sources, "transformer", None)
    takes = family.references.takes_first_frame(sources)
    if takes and not images:
        raise ConfigError(f"{key}: {model} is an image-to-video model: every video starts from a first-frame "
                          f"image; give it (--reference IMAGE, or references = [\"first.png\"])")
    if images and not takes and not family.references.first_frame_optional:
        raise ConfigError(f"{key}: {model} is a text-to-video model; it takes no first-frame image; remove "
                          f"{key} (or sample an image-to-video model)")


@torch.no_grad()
def reference_latents(vae, images: list, family: ModelFamily, *, width: int | None = None,
                      height: int | None = None, frames: int = 1) -> list[torch.Tensor]:
    """One (1, C, h, w) latent tensor per reference, on the host, encoded as the family's pipeline
    encodes references when it samples; a first-frame reference (a video family's image-to-video
    model) as the condition of a `frames`-frame sample of width x height."""
    if not images:
        return []
    sized = {} if family.references.first_frame is None else {"width": width, "height": height, "frames": frames}
    return [lat.to("cpu") for lat in family.references.sampling_latents(vae, images, **sized)]


@torch.no_grad()
def frame_embeddings(family: ModelFamily, sources, images: list, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """[(1, L, D)] on the host: the first-frame image's embedding for a model that reads one beside
    its condition (ReferenceConditioning.frame_embedding: Wan 2.1 I2V's CLIP), its image encoder
    loaded for it alone; [] for any other model. The sampler passes it after the condition."""
    refs = family.references
    if not images or refs is None or refs.frame_embedding is None or sources is None \
            or not refs.takes_first_frame(sources):
        return []
    embedding = refs.frame_embedding(sources)
    if embedding is None:
        return []
    encoder = embedding.load(dtype, device)
    try:
        return [embedding.embed(encoder, images[0]).to("cpu")]
    finally:
        del encoder


__all__ = ["check_first_frame", "frame_embeddings", "load_reference_images", "reference_latents", "text_images"]
