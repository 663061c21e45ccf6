"""ComfyUI's LoRA loading, modelled independently of leantune's LoRA code: which keys of a LoRA
file a ComfyUI model loads, and the weight deltas it merges.

Written from reading ComfyUI's source (Comfy-Org/ComfyUI, comfy/lora.py at 17358c8f, comfy/utils.py
at 09708eae, comfy/weight_adapter/lora.py at 6f98b150), not copied from it:

* comfy/sd.py `load_lora_for_models`: key map = `comfy.lora.model_lora_keys_unet(model)`; the file
  goes through `comfy.lora_convert.convert_lora` (special cases only: BFL control LoRAs, Wan-Fun,
  USO, Krea2's fused to_qkv; none is a leantune file, `_check_no_conversion` says so), then
  `comfy.lora.load_lora(file, key_map)`, then `ModelPatcher.add_patches`, which patches only
  weights the model has ("NOT LOADED" otherwise).
* `model_lora_keys_unet`: for every model weight `diffusion_model.W.weight` the names
  `lora_unet_<W with _ for .>` and `diffusion_model.W`; then per model class
  - `Flux` (FLUX.2's `Flux2` subclasses it, so it gets the same map): every diffusers weight name
    `k` of `comfy.utils.flux_to_diffusers` as `transformer.k`, `lycoris_<k_>`,
    `lora_transformer_<k_>` and `k`, plus `diffusion_model.single_blocks.N.linear1_qkv` (rows
    0 .. 3 * hidden of linear1);
  - `SD3`: every name of `comfy.utils.mmdit_to_diffusers` as `transformer.k`,
    `base_model.model.k`, `lora_transformer_<k_>`, `lycoris_<k_>`;
  - `QwenImage`: every model weight W as `W`, `transformer.W`, `lycoris_<W_>` (ComfyUI's Qwen-Image
    model has diffusers' names).
  - `Krea2` (comfy/lora.py at 17358c8f; its model has krea-ai's names, `blocks.N.attn.wq`, `first`): every
    diffusers weight name `k` of `comfy.utils.krea2_to_diffusers` as `diffusion_model.k`,
    `transformer.k`, `lycoris_<k_>` and `k`. That table maps each block's and each text-fusion
    block's `attn.to_q/to_k/to_v/to_gate/to_out.0` (and `attn.to_out`) and `ff.gate/up/down` to
    `attn.wq/wk/wv/gate/wo` and `mlp.gate/up/down` (2 layerwise + 2 refiner fusion blocks, fixed),
    and the top level `img_in` -> `first`, `time_embed.linear_1/2` -> `tmlp.0/2`, `time_mod_proj`
    -> `tproj.1`, `txt_in.linear_1/2` -> `txtmlp.1/3`, `text_fusion.projector` ->
    `txtfusion.projector`, `final_layer.linear` -> `last.linear`; nothing fused, nothing swapped.
  - Qwen-Image-2.1 (`QwenImage21` here): ComfyUI's code for this model could not be read (not in
    the code index; the repository is too large to fetch), so only the generic rule above is
    modelled: `lora_unet_<W_>` and `diffusion_model.W` of its weights (diffusers' names, each
    block's SwiGLU gate and up fused as `img_mlp.gate_up`). A diffusers-layout file's
    `transformer.*` keys are then not loaded (a finding of the conformance suite, not a fact
    about ComfyUI's real loader).
  - `WAN21` (ComfyUI's class for Wan 2.1 and 2.2; its model holds Wan-AI's names,
    `blocks.N.self_attn.q`): no branch of its own is modelled (none was found in the code index's
    copies of comfy/lora.py), so the generic rule above: `lora_unet_<W_>` and `diffusion_model.W`.
    A diffusers-layout file's `transformer.blocks.N.attn1.to_q` keys then do not load (a finding
    of the conformance suite); the native state is checked against diffusers' own
    `convert_wan_transformer_to_diffusers` renames.
  - `Lumina2` (ComfyUI's class for Z-Image): every diffusers weight name `k` of
    `comfy.utils.z_image_to_diffusers` as `diffusion_model.k`, `transformer.k`, `lycoris_<k_>` and
    `k`. That table (`_z_image_to_diffusers` here) maps diffusers' `attention.to_q/to_k/to_v` of
    every `layers.N`, `noise_refiner.N`, `context_refiner.N` to rows 0, dim, 2 dim of the native
    `attention.qkv`, `attention.to_out.0` to `attention.out`, the norms and MLP to themselves, and
    `all_x_embedder.2-1` / `all_final_layer.2-1.*` to `x_embedder` / `final_layer.*`; the refiner
    count is `n_refiner_layers` of the model's unet_config, which comfy/model_detection.py's
    `detect_unet_config` never sets, so the default 2 (Z-Image's) is used. (Read from the code
    search index's copies of comfy/lora.py, comfy/utils.py and comfy/model_detection.py: ComfyUI's
    repository was too large to fetch whole for the Z-Image work.)
* `flux_to_diffusers` (the only diffusers names a Flux or FLUX.2 model gets): Flux.1's diffusers
  names, FLUX.2's in-block ones (`ff.linear_in/out`, `attn.to_qkv_mlp_proj`, single `attn.to_out`)
  and Flux.1's top level (`x_embedder`, `context_embedder`, `time_text_embed.*`, `proj_out`,
  `norm_out.linear` with the halves swapped). It has none for FLUX.2's own top-level names
  (`time_guidance_embed.*`, `double_stream_modulation_img/txt.linear`,
  `single_stream_modulation.linear`): a diffusers-layout file's keys for them are skipped with
  "lora key not loaded".
* `load_lora` / `LoRAAdapter.load`: a mapped name x loads from `x.lora_up.weight` +
  `x.lora_down.weight`, `x.lora_B.weight` + `x.lora_A.weight` (and a few rarer spellings); alpha
  only from an `x.alpha` tensor. `LoRAAdapter.calculate_weight`: delta = strength * (alpha /
  rank if alpha else 1) * up @ down, `rank` = the down matrix's rows, on the mapped rows of the
  weight, through the map's function (`swap_scale_shift`) when it has one.

Where the model is an approximation it says so: `mmdit_to_diffusers` slices q/k/v at 64 * depth
with depth = width // 64 (ComfyUI's model detection), which is the width for every released SD3.x;
the tiny test models are narrower than 64, which ComfyUI could not build at all, so the width is
used. A delta of another shape than its rows is reported skipped (ComfyUI logs an error when the
element counts differ, and would reshape one whose counts agree). ComfyUI's two-names-one-weight
overwrite and Tucker-core LoKr / LoHa are refused, not modelled.

LoHa, LoKr and DoRA (comfy/lora.py `load_lora` reads `x.alpha` and `x.dora_scale`, then lets the
weight_adapter classes load `x`; comfy/weight_adapter/loha.py, lokr.py at e8f3bc5a, lora.py,
base.py `weight_decompose` at 9c0cf36c): `_lora_diff` has each class's delta and scale,
`_weight_decompose` the DoRA step, including stock ComfyUI's output-axis norm of the base weight
rather than of the adapted one (Comfy-Org/ComfyUI#15458, open, fixes it: `dora_fixed`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

COMFYUI_SOURCE = "Comfy-Org/ComfyUI comfy/lora.py 17358c8f, comfy/utils.py 09708eae"

# (up suffix, down suffix) pairs LoRAAdapter.load accepts, in its order of preference.
_PAIRS = ((".lora_up.weight", ".lora_down.weight"), ("_lora.up.weight", "_lora.down.weight"),
          (".lora_B.weight", ".lora_A.weight"), (".lora.up.weight", ".lora.down.weight"),
          (".lora_B", ".lora_A"), (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
          (".lora_B.default.weight", ".lora_A.default.weight"))
_UNMODELLED = re.compile(r"\.(lokr_t|hada_t|lora_mid\.|dora_scale$|diff(_b)?$|w_norm$|b_norm$|set_weight$)")


@dataclass(frozen=True)
class Target:
    """Where ComfyUI adds a LoRA module's delta: a weight of its model (native name, no
    "diffusion_model." prefix), optionally only some of its rows, optionally halves swapped."""

    weight: str
    rows: tuple[int, int] | None = None     # (first row, row count) of a fused weight
    swap_halves: bool = False               # comfy.utils.swap_scale_shift on the delta


@dataclass
class ComfyLoad:
    """What ComfyUI does with a LoRA file on one model."""

    loaded: set[str] = field(default_factory=set)          # file keys that patched a weight
    skipped: dict[str, str] = field(default_factory=dict)  # file key -> why not
    deltas: dict[str, torch.Tensor] = field(default_factory=dict)   # native weight -> summed delta


def comfyui_class(family: str) -> str:
    """ComfyUI's model class (comfy/model_base.py) for a leantune family name."""
    if family.startswith("flux2"):
        return "Flux2"
    classes = {"flux": "Flux", "sd3": "SD3", "qwen-image": "QwenImage", "qwen-image-edit": "QwenImage",
               "krea2": "Krea2", "z-image": "Lumina2", "qwen-image-2.1": "QwenImage21", "wan2.2": "WAN21",
               "wan2.2-ti2v": "WAN22"}     # comfy/model_base.py's WAN22: TI2V-5B, WanModel's names as WAN21
    if family not in classes:
        raise KeyError(f"no ComfyUI key map modelled for family {family!r}")
    return classes[family]


def _shape(v) -> tuple[int, ...]:
    return tuple(v.shape) if hasattr(v, "shape") else tuple(v)


def _count(names, pattern: str) -> int:
    found = [int(m.group(1)) for n in names if (m := re.match(pattern, n))]
    return max(found) + 1 if found else 0


# -- diffusers names -> native weights (comfy.utils) ------------------------------------------------

def _flux_to_diffusers(shapes: Mapping) -> dict[str, Target]:
    """{diffusers weight name (no ".weight"): Target} as comfy.utils.flux_to_diffusers has them
    (weights only: the LoRA map reads no biases)."""
    h = _shape(shapes["img_in.weight"])[0]                 # unet_config["hidden_size"]
    out: dict[str, Target] = {}
    thirds = [(0, h), (h, h), (2 * h, h)]
    for i in range(_count(shapes, r"double_blocks\.(\d+)\.")):
        d, n = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for proj, rows in zip(("to_q", "to_k", "to_v"), thirds):
            out[f"{d}.attn.{proj}"] = Target(f"{n}.img_attn.qkv.weight", rows)
        for proj, rows in zip(("add_q_proj", "add_k_proj", "add_v_proj"), thirds):
            out[f"{d}.attn.{proj}"] = Target(f"{n}.txt_attn.qkv.weight", rows)
        for diff, nat in (("attn.to_out.0", "img_attn.proj"), ("norm1.linear", "img_mod.lin"),
                          ("norm1_context.linear", "txt_mod.lin"), ("attn.to_add_out", "txt_attn.proj"),
                          ("ff.net.0.proj", "img_mlp.0"), ("ff.net.2", "img_mlp.2"),
                          ("ff_context.net.0.proj", "txt_mlp.0"), ("ff_context.net.2", "txt_mlp.2"),
                          ("ff.linear_in", "img_mlp.0"), ("ff.linear_out", "img_mlp.2"),
                          ("ff_context.linear_in", "txt_mlp.0"), ("ff_context.linear_out", "txt_mlp.2")):
            out[f"{d}.{diff}"] = Target(f"{n}.{nat}.weight")
    for i in range(_count(shapes, r"single_blocks\.(\d+)\.")):
        d, n = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        for proj, rows in zip(("to_q", "to_k", "to_v"), thirds):
            out[f"{d}.attn.{proj}"] = Target(f"{n}.linear1.weight", rows)
        out[f"{d}.proj_mlp"] = Target(f"{n}.linear1.weight", (3 * h, 4 * h))
        for diff, nat in (("norm.linear", "modulation.lin"), ("proj_out", "linear2"),
                          ("attn.to_qkv_mlp_proj", "linear1"), ("attn.to_out", "linear2")):
            out[f"{d}.{diff}"] = Target(f"{n}.{nat}.weight")
    for diff, nat in (("proj_out", "final_layer.linear"), ("x_embedder", "img_in"),
                      ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
                      ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
                      ("context_embedder", "txt_in"),
                      ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
                      ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
                      ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
                      ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
                      ("controlnet_x_embedder", "pos_embed_input")):
        out[diff] = Target(f"{nat}.weight")
    out["norm_out.linear"] = Target("final_layer.adaLN_modulation.1.weight", swap_halves=True)
    return out


def _mmdit_to_diffusers(shapes: Mapping) -> dict[str, Target]:
    """{diffusers weight name: Target} as comfy.utils.mmdit_to_diffusers has them."""
    width = _shape(shapes["x_embedder.proj.weight"])[0]    # 64 * depth for every released SD3.x
    blocks = _count(shapes, r"joint_blocks\.(\d+)\.")
    thirds = [(0, width), (width, width), (2 * width, width)]
    out: dict[str, Target] = {}
    for i in range(blocks):
        d, n = f"transformer_blocks.{i}", f"joint_blocks.{i}"
        for prefix, fused in (("attn.to_", "x_block.attn.qkv"), ("attn.add_", "context_block.attn.qkv"),
                              ("attn2.to_", "x_block.attn2.qkv")):
            names = ("q", "k", "v") if prefix.endswith("to_") else ("q_proj", "k_proj", "v_proj")
            for name, rows in zip(names, thirds):
                out[f"{d}.{prefix}{name}"] = Target(f"{n}.{fused}.weight", rows)
        for diff, nat in (("norm1_context.linear", "context_block.adaLN_modulation.1"),
                          ("attn.to_add_out", "context_block.attn.proj"),
                          ("ff_context.net.0.proj", "context_block.mlp.fc1"),
                          ("ff_context.net.2", "context_block.mlp.fc2"),
                          ("norm1.linear", "x_block.adaLN_modulation.1"), ("attn.to_out.0", "x_block.attn.proj"),
                          ("attn2.to_out.0", "x_block.attn2.proj"), ("ff.net.0.proj", "x_block.mlp.fc1"),
                          ("ff.net.2", "x_block.mlp.fc2")):
            out[f"{d}.{diff}"] = Target(f"{n}.{nat}.weight")
    for diff, nat in (("context_embedder", "context_embedder"),
                      ("time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
                      ("time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
                      ("pos_embed.proj", "x_embedder.proj"),
                      ("time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0"),
                      ("time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2"),
                      ("proj_out", "final_layer.linear")):
        out[diff] = Target(f"{nat}.weight")
    out["norm_out.linear"] = Target("final_layer.adaLN_modulation.1.weight", swap_halves=True)
    # the last block's text adaLN (context pre-only: shift, scale) is swapped too; it replaces the
    # block entry above (map_basic is applied after the blocks)
    last = blocks - 1
    out[f"transformer_blocks.{last}.norm1_context.linear"] = Target(
        f"joint_blocks.{last}.context_block.adaLN_modulation.1.weight", swap_halves=True)
    return out


def _krea2_to_diffusers(shapes: Mapping) -> dict[str, Target]:
    """{diffusers weight name: Target} as comfy.utils.krea2_to_diffusers has them (its block count
    is the model's `layers`; the text fusion's 2 + 2 blocks are fixed there)."""
    block = (("attn.to_q", "attn.wq"), ("attn.to_k", "attn.wk"), ("attn.to_v", "attn.wv"),
             ("attn.to_gate", "attn.gate"), ("attn.to_out.0", "attn.wo"), ("attn.to_out", "attn.wo"),
             ("ff.gate", "mlp.gate"), ("ff.up", "mlp.up"), ("ff.down", "mlp.down"))
    out: dict[str, Target] = {}
    groups = [(f"transformer_blocks.{i}", f"blocks.{i}") for i in range(_count(shapes, r"blocks\.(\d+)\."))]
    groups += [(f"text_fusion.{kind}.{i}", f"txtfusion.{kind}.{i}")
               for kind in ("layerwise_blocks", "refiner_blocks") for i in range(2)]
    for d, n in groups:
        for diff, nat in block:
            out[f"{d}.{diff}"] = Target(f"{n}.{nat}.weight")
    for diff, nat in (("img_in", "first"), ("time_embed.linear_1", "tmlp.0"), ("time_embed.linear_2", "tmlp.2"),
                      ("time_mod_proj", "tproj.1"), ("txt_in.linear_1", "txtmlp.1"), ("txt_in.linear_2", "txtmlp.3"),
                      ("text_fusion.projector", "txtfusion.projector"), ("final_layer.linear", "last.linear")):
        out[diff] = Target(f"{nat}.weight")
    return out


def _z_image_to_diffusers(shapes: Mapping, n_refiner_layers: int = 2) -> dict[str, Target]:
    """{diffusers weight name: Target} as comfy.utils.z_image_to_diffusers has them (weights only;
    `n_refiner_layers`: the unet_config's, which ComfyUI's detection leaves at the default 2)."""
    dim = _shape(shapes["cap_embedder.1.weight"])[0]          # unet_config["dim"] (detect_unet_config)
    out: dict[str, Target] = {}
    blocks = [f"layers.{i}" for i in range(_count(shapes, r"layers\.(\d+)\."))]
    blocks += [f"{lst}.{i}" for lst in ("context_refiner", "noise_refiner") for i in range(n_refiner_layers)]
    for b in blocks:
        for proj, start in (("to_q", 0), ("to_k", dim), ("to_v", 2 * dim)):
            out[f"{b}.attention.{proj}"] = Target(f"{b}.attention.qkv.weight", (start, dim))
        for diff, nat in (("attention.norm_q", "attention.q_norm"), ("attention.norm_k", "attention.k_norm"),
                          ("attention.to_out.0", "attention.out"), ("attention_norm1", "attention_norm1"),
                          ("attention_norm2", "attention_norm2"), ("feed_forward.w1", "feed_forward.w1"),
                          ("feed_forward.w2", "feed_forward.w2"), ("feed_forward.w3", "feed_forward.w3"),
                          ("ffn_norm1", "ffn_norm1"), ("ffn_norm2", "ffn_norm2"),
                          ("adaLN_modulation.0", "adaLN_modulation.0")):
            out[f"{b}.{diff}"] = Target(f"{b}.{nat}.weight")
    for diff, nat in (("all_final_layer.2-1.linear", "final_layer.linear"),
                      ("all_final_layer.2-1.adaLN_modulation.1", "final_layer.adaLN_modulation.1"),
                      ("all_x_embedder.2-1", "x_embedder"), ("cap_embedder.0", "cap_embedder.0"),
                      ("cap_embedder.1", "cap_embedder.1"), ("t_embedder.mlp.0", "t_embedder.mlp.0"),
                      ("t_embedder.mlp.2", "t_embedder.mlp.2")):
        out[diff] = Target(f"{nat}.weight")
    return out


def diffusers_names(family: str, shapes: Mapping) -> dict[str, Target]:
    """The diffusers module names ComfyUI's model class knows and where they go (for QwenImage the
    model's own names)."""
    cls = comfyui_class(family)
    if cls in ("Flux", "Flux2"):
        return _flux_to_diffusers(shapes)
    if cls == "SD3":
        return _mmdit_to_diffusers(shapes)
    if cls == "Krea2":
        return _krea2_to_diffusers(shapes)
    if cls == "Lumina2":
        return _z_image_to_diffusers(shapes)
    if cls == "QwenImage21":
        return _qwen_image21_to_native(shapes)
    if cls in ("WAN21", "WAN22"):
        return _wan_to_native(shapes)
    return {k[:-len(".weight")]: Target(k) for k in shapes if k.endswith(".weight")}


def _qwen_image21_to_native(shapes: Mapping) -> dict[str, Target]:
    """Where each diffusers weight of Qwen-Image-2.1 sits in ComfyUI's repackaged model (the
    layout diffusers' convert_qwen_image21_transformer_checkpoint_to_diffusers reads: diffusers'
    names, each block's img_mlp.gate_layer and img_mlp.proj the two row halves of img_mlp.gate_up).
    Used only to check the native state; ComfyUI's key map for this class is the generic one
    (comfyui_key_map): its code for the model could not be read here."""
    out: dict[str, Target] = {}
    for k in shapes:
        if not k.endswith(".weight"):
            continue
        if k.endswith("img_mlp.gate_up.weight"):
            stem, half = k[:-len("gate_up.weight")], _shape(shapes[k])[0] // 2
            out[stem + "gate_layer"] = Target(k, (0, half))
            out[stem + "proj"] = Target(k, (half, half))
        else:
            out[k[:-len(".weight")]] = Target(k)
    return out


def _wan_to_native(shapes: Mapping) -> dict[str, Target]:
    """Where each diffusers weight of Wan sits in ComfyUI's model, which holds Wan-AI's own names
    (comfy/ldm/wan/model.py): diffusers' own single-file converter
    (convert_wan_transformer_to_diffusers, renames only) run on the native names. Used only to check
    the native state; ComfyUI's key map for WAN21 is modelled as the generic one (comfyui_key_map)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    natives = {k: k for k in shapes if k.endswith(".weight")}
    return {d[:-len(".weight")]: Target(n) for d, n in convert_wan_transformer_to_diffusers(dict(natives)).items()}


# -- the key map (comfy/lora.py model_lora_keys_unet) --------------------------------------------------

def comfyui_key_map(family: str, model_keys: Mapping) -> dict[str, Target]:
    """LoRA module name -> Target, as `model_lora_keys_unet` builds it for a model whose
    diffusion-model state dict has `model_keys` (native name -> tensor or shape, no prefix)."""
    cls = comfyui_class(family)
    key_map: dict[str, Target] = {}
    weights = [k for k in model_keys if k.endswith(".weight")]
    for k in weights:
        w = k[:-len(".weight")]
        key_map[f"lora_unet_{w.replace('.', '_')}"] = Target(k)
        key_map[f"diffusion_model.{w}"] = Target(k)
    if cls == "SD3":
        for k, t in _mmdit_to_diffusers(model_keys).items():
            flat = k.replace(".", "_")
            for name in (f"transformer.{k}", f"base_model.model.{k}", f"lora_transformer_{flat}", f"lycoris_{flat}"):
                key_map[name] = t
    if cls in ("Flux", "Flux2"):
        for k, t in _flux_to_diffusers(model_keys).items():
            flat = k.replace(".", "_")
            for name in (f"transformer.{k}", f"lycoris_{flat}", f"lora_transformer_{flat}", k):
                key_map[name] = t
        h = _shape(model_keys["img_in.weight"])[0]
        for k in weights:
            if ".linear1." in k:
                key_map[f"diffusion_model.{k.replace('.linear1.weight', '.linear1_qkv')}"] = Target(k, (0, 3 * h))
    if cls == "Krea2":
        for k, t in _krea2_to_diffusers(model_keys).items():
            for name in (f"diffusion_model.{k}", f"transformer.{k}", f"lycoris_{k.replace('.', '_')}", k):
                key_map[name] = t
    if cls == "Lumina2":
        for k, t in _z_image_to_diffusers(model_keys).items():
            for name in (f"diffusion_model.{k}", f"transformer.{k}", f"lycoris_{k.replace('.', '_')}", k):
                key_map[name] = t
    if cls == "QwenImage":
        for k in weights:
            w = k[:-len(".weight")]
            for name in (w, f"transformer.{w}", f"lycoris_{w.replace('.', '_')}"):
                key_map[name] = Target(k)
    return key_map


def _check_no_conversion(lora: Mapping) -> None:
    """comfy.lora_convert.convert_lora rewrites a few foreign layouts before the key map; the
    model here covers files it leaves alone."""
    triggers = ("single_blocks.0.norm.key_norm.scale", "lora_unet__blocks_0_cross_attn_k.lora_down.weight",
                "single_blocks.37.processor.qkv_lora.up.weight")
    if any(t in lora for t in triggers) or any(re.search(r"attn[._]to_qkv(\.|$)", k) for k in lora):
        raise NotImplementedError("a file comfy.lora_convert.convert_lora rewrites first: not modelled")


def _lora_diff(x: str, lora: Mapping[str, torch.Tensor], alpha: float | None):
    """(keys, diff (rows, cols) fp32, scale) of the first adapter the weight_adapter classes load
    for module name `x` (LoRAAdapter, LoHaAdapter, LoKrAdapter, in comfy/weight_adapter/__init__.py's
    order), or None. The scales, as each adapter's calculate_weight has them:
    - LoRA: alpha / rank (rank: the down matrix's rows), 1 without alpha;
    - LoHa: alpha / hada_w1_b's rows, 1 without alpha; diff = (w1_a @ w1_b) * (w2_a @ w2_b);
    - LoKr: alpha / dim, dim the rows of lokr_w2_b when w2 is decomposed, else of lokr_w1_b when w1
      is, and 1 when both are whole or there is no alpha; diff = kron(w1, w2)."""
    pair = next(((x + u, x + d) for u, d in _PAIRS if x + u in lora), None)
    if pair is not None:
        up, down = lora[pair[0]].float(), lora[pair[1]].float()
        return list(pair), up @ down, (alpha / down.shape[0] if alpha is not None else 1.0)
    if x + ".hada_w1_a" in lora:
        if x + ".hada_t1" in lora:
            raise NotImplementedError(f"{x}: LoHa with a Tucker core is not modelled")
        keys = [f"{x}.hada_{r}" for r in ("w1_a", "w1_b", "w2_a", "w2_b")]
        w1a, w1b, w2a, w2b = (lora[k].float() for k in keys)
        return keys, (w1a @ w1b) * (w2a @ w2b), (alpha / w1b.shape[0] if alpha is not None else 1.0)
    names = {r: f"{x}.lokr_{r}" for r in ("w1", "w2", "w1_a", "w1_b", "w2_a", "w2_b", "t2")}
    if any(names[r] in lora for r in ("w1", "w2", "w1_a", "w2_a")):
        if names["t2"] in lora:
            raise NotImplementedError(f"{x}: LoKr with a Tucker core is not modelled")
        dim = None
        if names["w1"] in lora:
            w1 = lora[names["w1"]].float()
        else:
            dim = lora[names["w1_b"]].shape[0]
            w1 = lora[names["w1_a"]].float() @ lora[names["w1_b"]].float()
        if names["w2"] in lora:
            w2 = lora[names["w2"]].float()
        else:
            dim = lora[names["w2_b"]].shape[0]
            w2 = lora[names["w2_a"]].float() @ lora[names["w2_b"]].float()
        keys = [k for k in names.values() if k in lora]
        return keys, torch.kron(w1, w2), (alpha / dim if alpha is not None and dim is not None else 1.0)
    return None


def _weight_decompose(dora_scale: torch.Tensor, weight: torch.Tensor, diff: torch.Tensor, strength: float,
                      fixed: bool) -> torch.Tensor:
    """comfy/weight_adapter/base.py weight_decompose on an fp32 weight (ModelPatcher casts the weight
    to fp32 before calculate_weight), `diff` already scaled and through the map's function. A
    dora_scale with the weight's row count is the output-axis decomposition: stock ComfyUI divides
    it by the row norms of the base weight (`fixed` = False, Comfy-Org/ComfyUI at 9c0cf36c); with
    Comfy-Org/ComfyUI#15458 by those of weight + diff, as the input-axis branch divides a (1, in)
    scale by the column norms of weight + diff. Each norm gets float32's eps added."""
    calc = weight + diff
    if dora_scale.shape[0] == calc.shape[0]:
        norm = (calc if fixed else weight).norm(dim=1, keepdim=True)
    else:
        norm = calc.norm(dim=0, keepdim=True)
    norm = norm + torch.finfo(torch.float32).eps
    calc = calc * (dora_scale.float() / norm)
    return weight + strength * (calc - weight) if strength != 1.0 else calc


def comfyui_load(family: str, model_keys: Mapping, lora: Mapping[str, torch.Tensor],
                 strength: float = 1.0, dora_fixed: bool = False) -> ComfyLoad:
    """Load `lora` (a file's tensors) into a ComfyUI model of `family` whose diffusion-model
    weights are `model_keys` (native name -> tensor or shape; tensors for a DoRA file, whose delta
    depends on them): the keys that patch a weight, the ones skipped and why, and the summed delta
    per native weight (full shape, fp32). `dora_fixed`: ComfyUI with #15458's output-axis norm."""
    _check_no_conversion(lora)
    key_map = comfyui_key_map(family, model_keys)
    out = ComfyLoad()
    consumed: dict[str, str] = {}
    patches: dict[Target, str] = {}
    for x, target in key_map.items():            # load_lora walks the key map
        alpha = lora[x + ".alpha"].item() if x + ".alpha" in lora else None
        found = _lora_diff(x, lora, alpha)
        if found is None:
            continue
        keys, diff, scale = found
        if target in patches:
            raise ValueError(f"{x!r} and {patches[target]!r} patch the same weight: ComfyUI keeps only one")
        patches[target] = x
        keys = keys + [x + k for k in (".alpha", ".dora_scale") if x + k in lora]
        for k in keys:
            consumed[k] = x
        if target.weight not in model_keys:
            out.skipped.update({k: f"NOT LOADED: the model has no {target.weight}" for k in keys})
            continue
        shape = _shape(model_keys[target.weight])
        rows = shape[0] if target.rows is None else target.rows[1]
        if tuple(diff.shape) != (rows, shape[1]):
            out.skipped.update({k: f"shape {tuple(diff.shape)} does not fit {target}" for k in keys})
            continue
        start = 0 if target.rows is None else target.rows[0]
        if x + ".dora_scale" in lora:
            diff = scale * diff
            if target.swap_halves:
                diff = torch.cat(diff.chunk(2, dim=0)[::-1], dim=0)
            weight = model_keys[target.weight].float()[start:start + rows]
            delta = _weight_decompose(lora[x + ".dora_scale"], weight, diff, strength, dora_fixed) - weight
        else:
            delta = strength * scale * diff
            if target.swap_halves:
                delta = torch.cat(delta.chunk(2, dim=0)[::-1], dim=0)
        full = out.deltas.setdefault(target.weight, torch.zeros(shape))
        full[start:start + rows] += delta
        out.loaded.update(keys)
    for k in lora:
        if k not in consumed:
            if _UNMODELLED.search(k):
                raise NotImplementedError(f"{k!r}: a LoRA kind this model of ComfyUI does not cover")
            out.skipped[k] = "lora key not loaded: no key map entry"
    return out


def comfyui_loaded_keys(family: str, model_keys: Mapping, lora: Mapping[str, torch.Tensor]) -> set[str]:
    """The keys of a LoRA file ComfyUI loads into a `family` model with weights `model_keys`."""
    return comfyui_load(family, model_keys, lora).loaded


def comfyui_deltas(family: str, model_keys: Mapping, lora: Mapping[str, torch.Tensor],
                   strength: float = 1.0) -> dict[str, torch.Tensor]:
    """Native weight name -> the delta ComfyUI merges into it at `strength`."""
    return comfyui_load(family, model_keys, lora, strength).deltas


# -- the model as ComfyUI holds it ------------------------------------------------------------------

def comfyui_native_state(family: str, transformer: torch.nn.Module, state: dict | None = None,
                         ) -> dict[str, torch.Tensor]:
    """A diffusers transformer's weights (or `state`, a state dict of it, e.g. with a LoRA merged)
    in ComfyUI's native names, through the family's single-file layout
    (spec.single_file.to_native), checked against ComfyUI's own diffusers -> native table: every
    weight that table names equals the diffusers weight it names (rows, swapped halves)."""
    from leantune.models.family import get_family

    state = dict(transformer.state_dict() if state is None else state)
    native = get_family(family).spec.single_file.to_native(state, transformer)
    native = {k.removeprefix("model.diffusion_model."): v for k, v in native.items()}
    checked = 0
    for name, t in diffusers_names(family, native).items():
        if f"{name}.weight" not in state:
            continue
        got = native[t.weight]
        if t.rows is not None:
            got = got[t.rows[0]:t.rows[0] + t.rows[1]]
        if t.swap_halves:
            got = torch.cat(got.chunk(2, dim=0)[::-1], dim=0)
        assert torch.equal(got, state[f"{name}.weight"]), f"{name} -> {t}: ComfyUI's table disagrees"
        checked += 1
    assert checked, "ComfyUI's table names none of the model's weights"
    return native
