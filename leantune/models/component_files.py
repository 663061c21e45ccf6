"""Single-file CLIP-L, T5-XXL and VAE checkpoints: where a component sits in a file, its key layout
and its architecture config.

ComfyUI users have these as separate files (clip_l.safetensors with transformers CLIP keys,
t5xxl_*.safetensors with T5 encoder keys, ae.safetensors with BFL/LDM VAE keys) or inside one
all-in-one checkpoint under prefixes (text_encoders.clip_l.transformer., text_encoders.t5xxl.
transformer., vae.). Nothing is fetched to build a model: the config is read from the tensor
shapes (layers, widths, vocabulary, heads where the weights show them), completed from the
full-size configs shipped in models/configs/ and overridden by a `leantune.config` JSON entry in
the file's metadata when present (how tiny test files state what shapes cannot: CLIP's head
count, T5's relative attention distance, the VAE's group-norm size).
"""

from __future__ import annotations

import json
import re
from importlib import resources

import torch

from .weights import KeyOp, LoadError

METADATA_CONFIG_KEY = "leantune.config"

# Key prefixes a component may sit under, most specific first; "" = a file of that component alone.
PREFIXES = {
    "transformer": ("model.diffusion_model.", "diffusion_model.", ""),
    "clip": ("text_encoders.clip_l.transformer.", "cond_stage_model.transformer.",
             "conditioner.embedders.0.transformer.", ""),
    "clip_g": ("text_encoders.clip_g.transformer.", ""),      # SD3's CLIP-G (transformers layout)
    "t5": ("text_encoders.t5xxl.transformer.", "text_encoders.t5xxl.", ""),
    "vae": ("vae.", "first_stage_model.", ""),
}
# A key (after the prefix) whose presence identifies the component.
ANCHORS = {
    # Flux (BFL, diffusers), SD3 (Stability, diffusers)
    "transformer": ("img_in.weight", "x_embedder.weight", "x_embedder.proj.weight", "pos_embed.proj.weight"),
    "clip": ("text_model.embeddings.token_embedding.weight", "embeddings.token_embedding.weight"),
    "clip_g": ("text_model.embeddings.token_embedding.weight", "embeddings.token_embedding.weight"),
    "t5": ("encoder.block.0.layer.0.SelfAttention.q.weight",),
    "vae": ("encoder.conv_in.weight",),
}


def packaged_config(name: str) -> dict:
    """A shipped architecture config from models/configs/ ("clip_l", "t5_xxl", "flux_vae", "flux1_dev")."""
    text = resources.files("leantune.models").joinpath("configs", f"{name}.json").read_text()
    return json.loads(text)


def find_prefix(keys, component: str) -> str | None:
    """The prefix under which `component` sits in a file's keys, or None if it is not there."""
    keys = set(keys)
    for prefix in PREFIXES[component]:
        if any(prefix + a in keys for a in ANCHORS[component]):
            return prefix
    return None


def describe(keys) -> str:
    """A guess of what a checkpoint is, for 'this is not a Flux transformer' messages; where a
    registered family claims the keys (models/family.family_of_keys), the sentence ends by naming
    the [model] family to set."""
    keys = list(keys)
    what = _looks_like(keys)
    from .family import families_of_keys

    families = families_of_keys(keys)         # several where only shapes tell them apart (Wan 2.2's two)
    return what if not families else f'{what}; set [model] family = ' + " or ".join(f'"{f}"' for f in families)


def _looks_like(keys: list[str]) -> str:

    def has(fragment: str) -> bool:
        return any(fragment in k for k in keys)

    if has(".lora_down.") or has(".lora_A.") or has(".lora_B."):
        return "it looks like a LoRA file, not a model"
    if has("joint_blocks."):
        return "it looks like an SD3/SD3.5 transformer (original layout)"
    if has("pos_embed.proj.weight") and has("transformer_blocks.0.attn.to_q"):
        return "it looks like an SD3/SD3.5 transformer (diffusers layout)"
    if has("stream_modulation.lin.weight") or has("stream_modulation.linear.weight"):
        return "it looks like a FLUX.2 transformer"
    if has("img_mod.1.weight") and has("txt_in.weight"):
        return "it looks like a Qwen-Image transformer"
    if has("conditioner.embedders.1") or has("add_embedding.linear_1"):
        return "it looks like an SDXL checkpoint"
    if has("input_blocks.0.0.weight") or has("down_blocks.0.resnets.0.time_emb_proj"):
        return "it looks like a Stable Diffusion UNet"
    for component, label in (("vae", "a VAE"), ("clip", "a CLIP text encoder"), ("t5", "a T5 text encoder"),
                             ("transformer", "a Flux transformer")):
        if find_prefix(keys, component) is not None:
            return f"it looks like {label}"
    return f"its keys start with {sorted(keys)[:3]}"


def metadata_config(metadata: dict[str, str], where: str, component: str) -> dict:
    """Config overrides a file states in its metadata: `leantune.config.<component>` (all-in-one
    files, one per component) or `leantune.config` (a file of one component)."""
    key = f"{METADATA_CONFIG_KEY}.{component}"
    if key not in metadata:
        key = METADATA_CONFIG_KEY
    raw = metadata.get(key)
    if not raw:
        return {}
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError:
        raise LoadError(f"{where}: metadata {key!r} is not JSON") from None
    if not isinstance(cfg, dict):
        raise LoadError(f"{where}: metadata {key!r} is not a JSON object")
    return cfg


def _count(shapes, prefix: str) -> int:
    return len({k[len(prefix):].split(".", 1)[0] for k in shapes if k.startswith(prefix)})


def _need(shapes, key: str, where: str, what: str):
    if key not in shapes:
        raise LoadError(f"{where}: missing key {key!r} of {what}")
    return shapes[key]


# -- CLIP-L ---------------------------------------------------------------------------------------

def clip_config(shapes: dict, meta: dict, where: str, base: str = "clip_l") -> dict:
    """CLIPTextConfig kwargs from shapes of keys without the `text_model.` prefix, completed from the
    packaged config `base` ("clip_l", or "clip_g" for SD3's second encoder: gelu, not quick_gelu)."""
    cfg = packaged_config(base)
    vocab, hidden = _need(shapes, "embeddings.token_embedding.weight", where, "a CLIP text encoder")
    inferred = dict(
        vocab_size=vocab, hidden_size=hidden,
        max_position_embeddings=_need(shapes, "embeddings.position_embedding.weight", where, "CLIP")[0],
        num_hidden_layers=_count(shapes, "encoder.layers."),
        intermediate_size=_need(shapes, "encoder.layers.0.mlp.fc1.weight", where, "CLIP")[0],
    )
    if "text_projection.weight" in shapes:
        inferred["projection_dim"] = shapes["text_projection.weight"][0]
    if hidden != cfg["hidden_size"]:
        # The head count is invisible in the weights; CLIP uses 64-wide heads at every size.
        if "num_attention_heads" not in meta and hidden % 64:
            raise LoadError(f"{where}: cannot tell the head count of a CLIP text encoder of width {hidden}; "
                            f"state it as num_attention_heads in the file's {METADATA_CONFIG_KEY!r} metadata, "
                            f"or use a diffusers text_encoder folder")
        inferred["num_attention_heads"] = hidden // 64
    cfg.update(inferred)
    cfg.update(meta)
    return cfg


def clip_rename(model_keys) -> callable:
    """File key (prefix removed) -> model key: transformers 5 drops `text_model.`, older versions keep it."""
    wants_prefix = any(k.startswith("text_model.") for k in model_keys)

    def rename(key: str) -> str:
        bare = key.removeprefix("text_model.")
        return ("text_model." + bare) if wants_prefix and not bare.startswith("text_projection") else bare
    return rename


def clip_ignorable(key: str) -> bool:
    """Keys of a CLIP file that CLIPTextModel does not have: the projection, logit scale, old position ids."""
    return bool(re.search(r"(^|\.)(text_projection(\.weight)?|logit_scale|embeddings\.position_ids)$", key))


def clip_ignorable_with_projection(key: str) -> bool:
    """As clip_ignorable, for CLIPTextModelWithProjection, which has the projection."""
    return bool(re.search(r"(^|\.)(logit_scale|embeddings\.position_ids)$", key))


# -- T5-XXL ---------------------------------------------------------------------------------------

def t5_config(shapes: dict, meta: dict, where: str) -> dict:
    """T5Config kwargs (encoder only) from shapes."""
    cfg = packaged_config("t5_xxl")
    emb = shapes.get("shared.weight") or shapes.get("encoder.embed_tokens.weight")
    if emb is None:
        raise LoadError(f"{where}: missing key 'shared.weight' (or 'encoder.embed_tokens.weight') of a T5 encoder")
    vocab, d_model = emb
    attn = "encoder.block.0.layer.0.SelfAttention."
    inner = _need(shapes, attn + "q.weight", where, "a T5 encoder")[0]
    buckets, heads = _need(shapes, attn + "relative_attention_bias.weight", where, "a T5 encoder")
    gated = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" in shapes
    wi = "encoder.block.0.layer.1.DenseReluDense." + ("wi_0.weight" if gated else "wi.weight")
    inferred = dict(
        vocab_size=vocab, d_model=d_model, num_layers=_count(shapes, "encoder.block."), num_heads=heads,
        d_kv=inner // heads, relative_attention_num_buckets=buckets,
        d_ff=_need(shapes, wi, where, "a T5 encoder")[0],
        feed_forward_proj="gated-gelu" if gated else "relu",
    )
    inferred["num_decoder_layers"] = inferred["num_layers"]
    if not gated:
        cfg.pop("dense_act_fn", None)
        cfg.pop("is_gated_act", None)
    cfg.update(inferred)
    cfg.update(meta)
    return cfg


def t5_ignorable(key: str) -> bool:
    """A full T5 file's decoder and LM head are not part of the encoder."""
    return bool(re.match(r"^(.*\.)?(decoder\.|lm_head\.)", key))


# -- VAE ------------------------------------------------------------------------------------------

_LDM = {"block": "encoder.down.{i}.block.0.conv1.weight", "layer": "encoder.down.0.block.",
        "attn": "encoder.mid.attn_1.q.weight", "count": "encoder.down."}
_DIFFUSERS = {"block": "encoder.down_blocks.{i}.resnets.0.conv1.weight", "layer": "encoder.down_blocks.0.resnets.",
              "attn": "encoder.mid_block.attentions.0.to_q.weight", "count": "encoder.down_blocks."}


def vae_layout(shapes) -> str:
    if "encoder.down.0.block.0.conv1.weight" in shapes:
        return "ldm"
    if "encoder.down_blocks.0.resnets.0.conv1.weight" in shapes:
        return "diffusers"
    return "unknown"


def vae_config(shapes: dict, meta: dict, where: str, base: str = "flux_vae") -> dict:
    """AutoencoderKL config from the shapes of an LDM (ae.safetensors) or diffusers-keyed VAE,
    completed from the packaged config `base` ("flux_vae", "sd3_vae"): the latent scaling and shift
    factors are the family's and invisible in the weights."""
    cfg = packaged_config(base)
    cfg.pop("_class_name", None)
    layout = vae_layout(shapes)
    if layout == "unknown":
        raise LoadError(f"{where}: not a VAE with encoder.down.* (BFL/LDM) or encoder.down_blocks.* (diffusers) keys")
    k = _LDM if layout == "ldm" else _DIFFUSERS
    n = _count(shapes, k["count"])
    channels = [_need(shapes, k["block"].format(i=i), where, "a VAE")[0] for i in range(n)]
    conv_in = _need(shapes, "encoder.conv_in.weight", where, "a VAE")
    inferred = dict(
        in_channels=conv_in[1], out_channels=_need(shapes, "decoder.conv_out.weight", where, "a VAE")[0],
        block_out_channels=channels, layers_per_block=_count(shapes, k["layer"]),
        latent_channels=_need(shapes, "encoder.conv_out.weight", where, "a VAE")[0] // 2,
        down_block_types=["DownEncoderBlock2D"] * n, up_block_types=["UpDecoderBlock2D"] * n,
        use_quant_conv="quant_conv.weight" in shapes, use_post_quant_conv="post_quant_conv.weight" in shapes,
        mid_block_add_attention=k["attn"] in shapes,
    )
    cfg.update(inferred)
    cfg.update(meta)
    groups = cfg["norm_num_groups"]
    if any(c % groups for c in cfg["block_out_channels"]):
        raise LoadError(f"{where}: VAE channels {cfg['block_out_channels']} are not divisible by "
                        f"norm_num_groups={groups}; state norm_num_groups in the file's "
                        f"{METADATA_CONFIG_KEY!r} metadata")
    return cfg


def vae_ldm_ops(shapes: dict, prefix: str, config: dict) -> tuple[list[KeyOp], list[str]]:
    """Ops from LDM VAE keys to diffusers keys, using diffusers' own converter without reading data.

    The converter is run on meta tensors of the file's shapes: each converted value is either one
    of those tensors or a view of one (conv-shaped attention weights become linear), so its origin
    names the file key and its shape the reshape. Returns (ops, file keys the converter left unused).
    """
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    metas = {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}
    origin = {id(t): key for key, t in metas.items()}
    converted = convert_ldm_vae_checkpoint(dict(metas), config)
    ops, used = [], set()
    for target, t in converted.items():
        src = origin.get(id(t))
        if src is None and t._base is not None:
            src = origin.get(id(t._base))
        if src is None:
            raise LoadError(f"VAE key conversion produced {target!r} from no file key")
        reshape = tuple(t.shape) if tuple(t.shape) != tuple(shapes[src]) else None
        ops.append(KeyOp(prefix + src, (target,), reshape=reshape))
        used.add(src)
    return ops, [prefix + k for k in shapes if k not in used]


_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def vae_diffusers_to_ldm(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL state dict in BFL/LDM keys (ae.safetensors layout); attention
    weights become 1x1 conv weights as LDM stores them."""
    n_up = len({k.split(".")[2] for k in state_dict if k.startswith("decoder.up_blocks.")})
    out = {}
    for key, t in state_dict.items():
        new = key.replace("conv_norm_out", "norm_out")
        m = re.match(r"^(encoder|decoder)\.mid_block\.(resnets|attentions)\.(\d+)\.(.+)$", new)
        if m:
            part, kind, idx, rest = m.groups()
            if kind == "resnets":
                new = f"{part}.mid.block_{int(idx) + 1}.{rest.replace('conv_shortcut', 'nin_shortcut')}"
            else:
                module, _, param = rest.rpartition(".")
                new = f"{part}.mid.attn_1.{_VAE_ATTN[module]}.{param}"
                if param == "weight" and module != "group_norm":
                    t = t.reshape(*t.shape, 1, 1)
        m = re.match(r"^encoder\.down_blocks\.(\d+)\.(resnets\.(\d+)|downsamplers\.0)\.(.+)$", new)
        if m:
            i, _, j, rest = m.groups()
            new = (f"encoder.down.{i}.block.{j}.{rest.replace('conv_shortcut', 'nin_shortcut')}" if j is not None
                   else f"encoder.down.{i}.downsample.{rest}")
        m = re.match(r"^decoder\.up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0)\.(.+)$", new)
        if m:
            i, _, j, rest = m.groups()
            b = n_up - 1 - int(i)
            new = (f"decoder.up.{b}.block.{j}.{rest.replace('conv_shortcut', 'nin_shortcut')}" if j is not None
                   else f"decoder.up.{b}.upsample.{rest}")
        out[new] = t
    return out
