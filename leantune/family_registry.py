"""Every family leantune has, in one table that imports nothing (not even torch).

Adding a family is its folder (models/<family>/, whose `__init__` builds and registers the
`ModelFamily`) plus one `FamilyEntry` here. What the rest of leantune needs to know about a family
before its module is imported reads this table: the names `[model] family` accepts (config.py), the
block lists `[lora] blocks` may name, the config keys the planner's probe copy shortens
(planner/meta.py), and the full-size architectures `leantune plan --model`, the simulated GPU and
the shipped plan profiles know (commands/plan.py, simulated_run.py, scripts/make_plan_profiles.py).
`leantune plan --model` answers from a shipped profile without importing torch, so this table stays
free of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StockModel:
    """A full-size architecture shipped as a config in models/configs/ (no weights)."""

    config: str               # models/configs/<config>.json
    text_tokens: int          # the text tokens it runs with (its pipeline's max_sequence_length)


@dataclass(frozen=True)
class FamilyEntry:
    module: str                                   # the module that registers the family on import
    block_counts: dict[str, str]                  # block list attribute -> the config key of its length,
                                                  # in the spec's block-list order ([lora] blocks kinds follow it)
    lora_blocks: tuple[str, ...]                  # the block-list kinds [lora] blocks may name
    stock: dict[str, StockModel] = field(default_factory=dict)   # `leantune plan --model` name -> architecture
    trailing_special: dict[str, int] = field(default_factory=dict)   # blocks at a list's end built unlike the rest
    # The [model] variant values besides "auto": checkpoints of one architecture whose weights alone
    # cannot tell them apart in a single file (Flux dev / schnell, Z-Image Turbo / Base, Krea 2 Raw /
    # Turbo), sampled with each one's published schedule (the family's sampling.schedule)
    variants: tuple[str, ...] = ()
    # A video family (its ModelFamily.video is set): trains on clips, so a plan without a config
    # prices its frames ([data] max_frames as `leantune plan --frames`)
    video: bool = False


_DOUBLE_SINGLE = {"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"}
_JOINT = {"transformer_blocks": "num_layers"}

# Flux dev 512 T5 tokens, schnell 256 (distilled at 256); SD3.5: StableDiffusion3Pipeline's 256 T5
# tokens (after 77 CLIP rows: family.text_rows); Qwen-Image: QwenImagePipeline's max_sequence_length
# (a prompt's rows are at most that many); FLUX.2: both pipelines' max_sequence_length (every prompt
# padded to it).
FAMILIES: dict[str, FamilyEntry] = {
    "flux": FamilyEntry("leantune.models.flux", _DOUBLE_SINGLE, ("double", "single"),
                        {"flux-dev": StockModel("flux1_dev", 512), "flux-schnell": StockModel("flux1_schnell", 256)},
                        variants=("dev", "schnell")),
    "sd3": FamilyEntry("leantune.models.sd3", _JOINT, ("joint",),
                       {"sd3.5-large": StockModel("sd35_large", 256), "sd3.5-medium": StockModel("sd35_medium", 256)},
                       trailing_special={"transformer_blocks": 1}),   # the last joint block is context-pre-only
    "qwen-image": FamilyEntry("leantune.models.qwen_image", _JOINT, ("joint",),
                              {"qwen-image": StockModel("qwen_image", 512)}),
    "qwen-image-edit": FamilyEntry("leantune.models.qwen_image.edit", _JOINT, ("joint",),
                                   {"qwen-image-edit": StockModel("qwen_image", 512)}),
    "flux2-dev": FamilyEntry("leantune.models.flux2", _DOUBLE_SINGLE, ("double", "single"),
                             {"flux2-dev": StockModel("flux2_dev", 512)}),
    "flux2-klein-4b": FamilyEntry("leantune.models.flux2", _DOUBLE_SINGLE, ("double", "single"),
                                  {"flux2-klein-4b": StockModel("flux2_klein_4b", 512)}),
    "flux2-klein-9b": FamilyEntry("leantune.models.flux2", _DOUBLE_SINGLE, ("double", "single"),
                                  {"flux2-klein-9b": StockModel("flux2_klein_9b", 512)}),
    # Z-Image (Turbo and base: one architecture, models/configs/Z_IMAGE_SOURCES.md): ZImagePipeline's
    # max_sequence_length 512 (a prompt's rows are at most that many)
    "z-image": FamilyEntry("leantune.models.z_image",
                           {"noise_refiner": "n_refiner_layers", "context_refiner": "n_refiner_layers",
                            "layers": "n_layers"}, ("noise_refiner", "context_refiner", "main"),
                           {"z-image-turbo": StockModel("z_image_turbo", 512), "z-image": StockModel("z_image", 512)},
                           variants=("turbo", "base")),
    # Krea 2 (Raw and Turbo: one architecture, models/configs/KREA2_SOURCES.md): Krea2Pipeline's
    # max_sequence_length 512 (a prompt's rows, its template suffix included, are at most that many)
    "krea2": FamilyEntry("leantune.models.krea2", _JOINT, ("single",),
                         {"krea2": StockModel("krea2", 512), "krea2-turbo": StockModel("krea2", 512)},
                         variants=("raw", "turbo")),
    # Qwen-Image-2.1 (issue 35): one list of 32 single-stream blocks; QwenImage21Pipeline cuts no
    # prompt, so the planner's text length is the usual 512 tokens
    "qwen-image-2.1": FamilyEntry("leantune.models.qwen_image21", {"transformer_blocks": "num_layers"}, ("single",),
                                  {"qwen-image-2.1": StockModel("qwen_image21", 512)}),
    # Wan 2.2 (issue 36; T2V-A14B's two experts, Wan 2.1 T2V: one class, models/configs/WAN_SOURCES.md):
    # one list of blocks; WanPipeline pads every prompt to its max_sequence_length 512
    "wan2.2": FamilyEntry("leantune.models.wan", {"blocks": "num_layers"}, ("main",),
                          {"wan2.2-a14b": StockModel("wan22_a14b", 512), "wan2.1-i2v-14b": StockModel("wan21_i2v_14b", 512)},
                          video=True),
    # Wan 2.2 TI2V-5B (issue 36): the same transformer class at 48 channels over the Wan 2.2 VAE, one
    # transformer (models/wan/ti2v.py); the released config.json's values (models/configs/wan22_ti2v_5b.json)
    "wan2.2-ti2v": FamilyEntry("leantune.models.wan.ti2v", {"blocks": "num_layers"}, ("main",),
                               {"wan2.2-ti2v-5b": StockModel("wan22_ti2v_5b", 512)}, video=True),
}

FAMILY_NAMES: tuple[str, ...] = tuple(FAMILIES)


def stock_models() -> dict[str, tuple[str, StockModel]]:
    """`leantune plan --model` name -> (its family, its architecture), over every family."""
    return {name: (family, model) for family, entry in FAMILIES.items() for name, model in entry.stock.items()}
