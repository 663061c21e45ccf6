"""The families the conformance suite checks: one declarative entry per family and variant.

Each `Case` says how to build its tiny transformer and tiny diffusers folder (the tiny presets in
leantune/tiny/, seed 0: the folder holds the transformer's weights), which diffusers pipeline
samples it, and the few knobs where families differ (text length, how the pipeline takes the
guidance scale and the negative prompt). Everything else comes from the registered family itself
(`get_family(case.family)`): its spec's single-file layout, LoRA key names, block lists, loaders.

Adding a family: its folder (leantune/models/<family>/), one `FamilyEntry` in
leantune/family_registry.py (2-4 lines: the module, its block lists, its stock architectures for
`leantune plan --model`), a tiny preset in leantune/tiny/, and one `Case` to CASES: 2 lines for a
family like FLUX.2-dev (id and family name, the tiny transformer and folder, the pipeline class, the
text length, the guidance scale), 4 for one with classifier-free guidance (the negative prompt and
the pipeline's keywords for it), 5 with every optional knob (Qwen-Image-Edit: files its loader takes
by design, a pipeline component from_pretrained cannot build, reference images). test_conformance.py
then checks all 13 promises for it (the adapter promises for every `[lora] type`: LoRA, LoKr, LoHa,
DoRA); `test_every_registered_family_has_a_case` fails until the entry exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from leantune import tiny
from leantune.tiny import flux2 as tf
from leantune.tiny import krea2 as tk
from leantune.tiny import qwen_image as tq
from leantune.tiny import qwen_image21 as tq21
from leantune.tiny import wan as tw
from leantune.tiny import z_image as tz


@dataclass(frozen=True)
class Sample:
    """How the case is sampled, ours and the pipeline's alike."""

    guidance: float                     # the scale: a transformer input (distilled) or CFG's (cfg)
    negative: str | None = None         # CFG's negative prompt; None for a distilled family
    negative_arg: str | None = None     # the pipeline's keyword for it (None: the pipeline uses "" itself)
    scale_arg: str = "guidance_scale"   # the pipeline's keyword for the scale
    cfg_batched: bool = True            # the pipeline runs CFG's two halves in one batch
    references: int = 0                 # reference images every sample is conditioned on (an edit model)
    video: bool = False                 # a video pipeline (num_frames, output .frames): our images are its
                                        # one-frame videos


@dataclass(frozen=True)
class Case:
    id: str                                   # test id
    family: str                               # the registered family name ([model] family)
    transformer: Callable[[], torch.nn.Module]   # the tiny transformer (seed 0)
    folder: Callable[[Path], Path]            # writes the tiny diffusers folder (seed 0: the same transformer)
    pipeline: str                             # the diffusers pipeline class of the folder, which samples it
    text_length: int                          # text tokens ([data] max_text_length, max_sequence_length)
    sample: Sample
    pipeline_parts: Callable[[], dict] = dict   # components DiffusionPipeline.from_pretrained cannot build
                                                # (loaded as None, then registered)
    accepts: tuple[str, ...] = ()             # other families whose files its loader takes by design
    file_family: str | None = None            # the family its transformer or file alone is told as, if not `family`


def _klein_4b_folder(path: Path) -> Path:
    tf.flux2_pipeline("klein", seed=0, num_layers=5).save_pretrained(path, safe_serialization=True)
    return path


CASES = [
    Case("flux-dev", "flux", lambda: tiny.flux_transformer(0), lambda p: tiny.save_flux_folder(p),
         "FluxPipeline", tiny.T5_TINY_MAX_LENGTH, Sample(guidance=3.5)),
    Case("flux-schnell", "flux", lambda: tiny.flux_transformer(0, guidance_embeds=False),
         lambda p: tiny.save_flux_folder(p, guidance_embeds=False), "FluxPipeline", tiny.T5_TINY_MAX_LENGTH,
         Sample(guidance=0.0)),
    Case("sd3.5-large", "sd3", lambda: tiny.sd3_transformer("large", 0), lambda p: tiny.save_sd3_folder(p, "large"),
         "StableDiffusion3Pipeline", 16, Sample(guidance=7.0, negative="blurry", negative_arg="negative_prompt")),
    Case("sd3.5-medium", "sd3", lambda: tiny.sd3_transformer("medium", 0), lambda p: tiny.save_sd3_folder(p, "medium"),
         "StableDiffusion3Pipeline", 16, Sample(guidance=7.0, negative="blurry", negative_arg="negative_prompt")),
    Case("qwen-image", "qwen-image", lambda: tq.qwen_image_transformer(0), lambda p: tq.save_qwen_image_folder(p),
         "QwenImagePipeline", 64, Sample(guidance=4.0, negative="a blue square", negative_arg="negative_prompt",
                                         scale_arg="true_cfg_scale", cfg_batched=False),
         accepts=("qwen-image-edit",)),
    Case("qwen-image-edit", "qwen-image-edit", lambda: tq.qwen_image_transformer(0),
         lambda p: tq.save_qwen_image_folder(p, edit=True), "QwenImageEditPlusPipeline", 64,
         Sample(guidance=4.0, negative="a blue square", negative_arg="negative_prompt", scale_arg="true_cfg_scale",
                cfg_batched=False, references=1),
         pipeline_parts=lambda: {"processor": tq.qwen_processor()}, accepts=("qwen-image",), file_family="qwen-image"),
    Case("flux2-dev", "flux2-dev", lambda: tf.flux2_transformer("dev", 0), lambda p: tf.save_flux2_folder(p, "dev"),
         "Flux2Pipeline", 32, Sample(guidance=4.0)),
    # The tiny klein is either size (the loaders take it under both); 5 double blocks say 4B, 2 say 9B.
    Case("flux2-klein-4b", "flux2-klein-4b", lambda: tf.flux2_transformer("klein", 0, num_layers=5), _klein_4b_folder,
         "Flux2KleinPipeline", 32, Sample(guidance=4.0, negative="", cfg_batched=False),
         accepts=("flux2-klein-9b",)),
    Case("flux2-klein-9b", "flux2-klein-9b", lambda: tf.flux2_transformer("klein", 0),
         lambda p: tf.save_flux2_folder(p, "klein"), "Flux2KleinPipeline", 32,
         Sample(guidance=4.0, negative="", cfg_batched=False), accepts=("flux2-klein-4b",)),
    # ZImagePipeline guides for any scale above 0 (v_pos + s (v_pos - v_neg)), the empty negative by default
    Case("z-image", "z-image", lambda: tz.z_image_transformer(0), lambda p: tz.save_z_image_folder(p),
         "ZImagePipeline", 32, Sample(guidance=4.0, negative="")),
    # Krea 2's guidance is on for any scale > 0 (cond + s (cond - uncond)); its pipeline runs the two
    # halves one after the other and defaults the negative prompt to ""
    Case("krea2", "krea2", lambda: tk.krea2_transformer(0), lambda p: tk.save_krea2_folder(p), "Krea2Pipeline", 32,
         Sample(guidance=4.5, negative="", cfg_batched=False)),
    # Qwen-Image-2.1: true CFG (off at its default 1.0), the halves one after the other; its processor
    # needs torchvision in from_pretrained (the tiny preset's subclass stands in)
    Case("qwen-image-2.1", "qwen-image-2.1", lambda: tq21.qwen_image21_transformer(0),
         lambda p: tq21.save_qwen_image21_folder(p), "QwenImage21Pipeline", 32,
         Sample(guidance=4.0, negative="a blue square", negative_arg="negative_prompt", scale_arg="true_cfg_scale",
                cfg_batched=False),
         pipeline_parts=lambda: {"processor": tq21.qwen3_vl_processor()}),
    # Wan: a video family, sampled as one-frame videos; classifier-free guidance above 1, the halves one
    # after the other, "" as the negative by default. The one-transformer folder (Wan 2.1's layout):
    # the two experts of Wan 2.2 A14B are checked in tests/test_wan.py
    Case("wan2.2", "wan2.2", lambda: tw.wan_transformer(0), lambda p: tw.save_wan_folder(p, experts=1), "WanPipeline",
         tw.TEXT_LENGTH, Sample(guidance=5.0, negative="", cfg_batched=False, video=True)),
    # Wan 2.2 TI2V-5B: the same transformer class at 48 channels over the Wan 2.2 VAE, sampled by
    # WanPipeline(expand_timesteps=True) (tests/test_wan_ti2v.py checks its videos)
    Case("wan2.2-ti2v", "wan2.2-ti2v", lambda: tw.wan_ti2v_transformer(0), lambda p: tw.save_wan_ti2v_folder(p),
         "WanPipeline", tw.TEXT_LENGTH, Sample(guidance=5.0, negative="", cfg_batched=False, video=True)),
]
