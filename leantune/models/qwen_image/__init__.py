"""Qwen-Image (20B MMDiT, 60 dual-stream blocks, Qwen2.5-VL-7B text encoder): latents, text encoding,
the transformer call and the family's registration (the spec is in qwen_image/spec.py, loading in
qwen_image/loading.py; this module imports both, neither imports it).

We use diffusers' `QwenImageTransformer2DModel` and `AutoencoderKLQwenImage` and transformers'
`Qwen2_5_VLForConditionalGeneration` as they are. What differs from Flux and SD3.5:

- Latents: the VAE is a video VAE (B, C, T, H, W) with per-channel mean/std instead of one scale and
  shift. `QwenVAE` wraps it so the cache and the decoder see what they see for the other families:
  `encode` gives normalised (B, 16, h, w) latents ((mean - latents_mean) / latents_std, as the Edit
  pipelines encode images), `decode` undoes it as QwenImagePipeline does (z / (1 / std) + mean) and
  drops the frame axis; its config says scaling 1, shift 0, so the shared code's own scaling is
  the identity. Packing is Flux's 2x2 patches (B, h/2 * w/2, 64).
- Text: the prompt goes into a chat template; the last hidden state of Qwen2.5-VL is kept from
  token 34 on (the template's system part dropped, `prompt_template_encode_start_idx`), at most
  `max_length` rows. No pooled vector (PromptEmbeds.pooled is (B, 0)).
- The text mask: Qwen-Image masks padded text tokens in attention. The cache trims each prompt
  to its own rows and batches pad with zero rows, exactly as QwenImagePipeline pads a batch, and
  a hidden state row of Qwen2.5-VL is never all zeros, so `predict` reads the mask back from the
  rows: the batch is cut to its longest prompt and the mask passed only when some row is padding
  (the pipeline's `None` when all tokens are real). Images then equal the pipeline's for any mix
  of prompt lengths in a batch.
- The timestep is sigma (FluxPipeline's rounding: t = sigma * 1000 in the latent dtype, / 1000);
  no guidance input: real classifier-free guidance with a negative prompt, whose combined
  velocity is rescaled to the conditional one's norm per token (QwenImagePipeline's true CFG).
- The 7B text encoder never sits on the device whole: `encode_prompts` streams its decoder layers
  one at a time onto the device (memory/blockwise.py) when the encoder is on the host, which is
  how the caching phase stays within the VRAM budget; cache hits never load it.
"""

from __future__ import annotations

import torch

from . import loading as qwen_image_loading
from ..family import PromptEmbeds
from ..qwen_vae import QwenVAE  # noqa: F401  (its VAE; tests and the Edit family use the name here)
from .spec import QWEN_IMAGE_SPEC
from ..schedule import FlowSchedule, model_timestep

VAE_SCALE_FACTOR = 8
LATENT_CHANNELS = 16
DEFAULT_TEXT_LENGTH = 512      # QwenImagePipeline's max_sequence_length
TOKENIZER_MAX_LENGTH = 1024    # the pipeline's tokenizer_max_length (before the template is dropped)
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
TEMPLATE_DROP = 34             # the pipeline's prompt_template_encode_start_idx


# -- latents -------------------------------------------------------------------------------------------


def load_vae(sources, dtype: torch.dtype = torch.bfloat16, device="cpu") -> QwenVAE:
    return QwenVAE(qwen_image_loading.load_raw_vae(sources, dtype, device))


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, C*4), as QwenImagePipeline._pack_latents."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h/2 * w/2, C*4) -> (B, C, h, w)."""
    b, _, d = packed.shape
    x = packed.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


def image_tokens(h: int, w: int) -> int:
    return (h // 2) * (w // 2)


# -- text ------------------------------------------------------------------------------------------------

def _placement(encoders, device: torch.device):
    """Where Qwen2.5-VL's language model runs: as it is when already on `device` (or on the host for
    a host encode), else streamed layer by layer (the caching phase), from its files when it was
    left there (streamed_encoder.py)."""
    from ..streamed_encoder import placement

    lm = encoders.text_encoder.model.language_model
    return placement(lm, lm.layers, device)


@torch.no_grad()
def encode_prompts(prompts: list[str], encoders, max_length: int = DEFAULT_TEXT_LENGTH,
                   device=None) -> tuple[PromptEmbeds, torch.Tensor]:
    """Encode prompts as QwenImagePipeline.encode_prompt does: template, last hidden state, the
    first 34 rows dropped, each prompt's real rows kept and zero-padded to the batch's longest, cut
    to `max_length` rows. Returns PromptEmbeds(t5=(B, L, D), pooled=(B, 0)) and the row counts (B,)."""
    device = torch.device(device or encoders.device)
    tokens = encoders.tokenizer([PROMPT_TEMPLATE.format(p) for p in prompts],
                                max_length=TOKENIZER_MAX_LENGTH + TEMPLATE_DROP, padding=True, truncation=True,
                                return_tensors="pt")
    encoder = encoders.text_encoder
    with _placement(encoders, device):
        # the last hidden state (the pipeline's hidden_states[-1]), without keeping every layer's
        # states or a KV cache
        out = encoder.model(input_ids=tokens.input_ids.to(device), attention_mask=tokens.attention_mask.to(device),
                            use_cache=False)
    hidden = out.last_hidden_state                                             # (B, L_tok, D)
    mask = tokens.attention_mask.to(hidden.device).bool()
    rows = [h[m][TEMPLATE_DROP:][:max_length] for h, m in zip(hidden, mask)]  # (n_i, D)
    longest = max(r.shape[0] for r in rows)
    seq = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
    seq = seq.to(dtype=encoder.dtype)
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long)
    return PromptEmbeds(t5=seq, pooled=seq.new_zeros(len(prompts), 0)), lengths


def caption_tokens(tokenizer, captions: list[str]) -> list[int]:
    """Each caption's rows as encode_prompts keeps them before it cuts at `max_length`: the templated
    tokens after the 34 dropped (the caption, then the template's closing `<|im_end|>` and assistant
    turn). [data] max_text_length is at most 512, well inside the tokenizer's 1024 + 34."""
    ids = tokenizer([PROMPT_TEMPLATE.format(c) for c in captions])["input_ids"]
    return [len(i) - TEMPLATE_DROP for i in ids]


def text_mask(seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, L, D) zero-padded text rows -> (rows cut to the longest prompt, mask (B, L') or None when
    every row is real), as QwenImagePipeline.encode_prompt pads and masks a batch."""
    real = (seq != 0).any(dim=-1)                                              # (B, L)
    n = int(real.sum(dim=1).max()) if real.numel() else 0
    if n == 0:
        # No real row at all: a prompt always has some (the template's closing tokens), so these are
        # rows without values (the simulated GPU's fake tensors, the planner's meta ones): keep them.
        return seq, None
    seq, real = seq[:, :n], real[:, :n]
    return seq, (None if bool(real.all()) else real.to(torch.long))


# -- the forward call ---------------------------------------------------------------------------------------

def img_shapes(batch: int, latent_hw: tuple[int, int], references=()) -> list:
    """QwenImagePipeline's `img_shapes`: per image, the (frames, rows, cols) of each token grid."""
    h, w = latent_hw
    return [[(1, h // 2, w // 2), *[(1, rh // 2, rw // 2) for rh, rw in references]]] * batch


def predict(transformer, noisy_packed: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
            latent_hw: tuple[int, int], guidance=None) -> torch.Tensor:
    """One transformer call: packed noisy latents (B, N, 64) at sigma (B,) -> packed velocity.
    `guidance` is ignored: Qwen-Image has no guidance input (true CFG in sampling)."""
    dtype, device = noisy_packed.dtype, noisy_packed.device
    seq, mask = text_mask(embeds.t5)
    return transformer(
        hidden_states=noisy_packed,
        timestep=sigma.to(device=device, dtype=dtype),
        encoder_hidden_states=seq.to(device=device, dtype=dtype),
        encoder_hidden_states_mask=None if mask is None else mask.to(device),
        img_shapes=img_shapes(noisy_packed.shape[0], latent_hw),
        return_dict=False,
    )[0]


def probe_inputs(config, batch: int, latent_hw: tuple[int, int], text_length: int, dtype: torch.dtype) -> dict:
    """Forward kwargs on the meta device for the planner's activation probe (same shapes as predict)."""
    def meta(*shape, dtype=dtype):
        return torch.empty(*shape, device="meta", dtype=dtype)

    return {"hidden_states": meta(batch, image_tokens(*latent_hw), config.in_channels),
            "encoder_hidden_states": meta(batch, text_length, config.joint_attention_dim),
            "timestep": meta(batch), "img_shapes": img_shapes(batch, latent_hw), "return_dict": False}


def cfg_combine(v_neg: torch.Tensor, v_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """QwenImagePipeline's true CFG: the mix rescaled, per token, to the conditional velocity's norm."""
    comb = v_neg + scale * (v_pos - v_neg)
    return comb * (torch.norm(v_pos, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


# -- the family object ----------------------------------------------------------------------------------------

def _loader(name: str):
    """qwen_image_loading's `name`, looked up on each call (so a test may replace it)."""
    def call(*args, **kwargs):
        return getattr(qwen_image_loading, name)(*args, **kwargs)
    call.__name__ = name
    return call


def _schedule(variant: str, folder=None):
    return FlowSchedule.from_model_folder(folder, FlowSchedule.qwen_image())


def _timestep(sigma: torch.Tensor, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    return model_timestep(sigma, batch, dtype, device)


def _text_modules(encoders):
    """Nothing moves whole; Qwen2.5-VL's language model may run layer by layer (its vision tower
    and LM head are not used for text and stay on the host)."""
    return [], encoders.text_encoder.model.language_model


def _recognizes_keys(keys) -> bool:
    return any(k.endswith("img_mod.1.weight") for k in keys)


def _register():
    from ..family import ModelFamily, Sampling, register

    return register(ModelFamily(
        name="qwen-image", spec=QWEN_IMAGE_SPEC,
        resolve_sources=_loader("resolve_sources"), load_transformer=_loader("load_transformer"),
        load_text_encoders=_loader("load_text_encoders"), load_vae=load_vae,
        text_sources=("text_encoder", "tokenizer"),
        encode_prompts=encode_prompts, padding_side=lambda encoders: "right",
        latent_channels=LATENT_CHANNELS, vae_scale_factor=VAE_SCALE_FACTOR,
        pack_latents=pack_latents, unpack_latents=unpack_latents, image_tokens=image_tokens,
        predict=predict, probe_inputs=probe_inputs, describe=_loader("describe"),
        sampling=Sampling(guidance="cfg", variant=lambda transformer: "qwen-image", schedule=_schedule,
                          timestep=_timestep, combine=cfg_combine),
        text_modules=_text_modules, caption_tokens=caption_tokens,
        transformer_classes=("QwenImageTransformer2DModel",), recognizes_keys=_recognizes_keys,
        timestep_sampling="shift",
        text_phase=lambda rows, model_cfg=None, base_dir=None: text_encoding_phase(rows, model_cfg=model_cfg,
                                                                                    base_dir=base_dir),
    ))


QWEN_IMAGE = _register()


# -- the text-encoding phase, priced (leantune plan) -------------------------------------------------------

def text_encoding_phase(text_rows: int = DEFAULT_TEXT_LENGTH, batch: int = 8, dtype_bytes: int = 2,
                        model_cfg=None, base_dir=None) -> dict:
    """Predicted bytes of the caching phase's text encoding with Qwen2.5-VL streamed layer by layer
    (encode_prompts on a device that does not hold it): on the device, the embedding table and final
    norm resident, one decoder layer at a time and one layer's activations for `batch` prompts of
    `text_rows` rows (plus the template's 34 + 5); in host RAM, the whole encoder (vision tower and LM
    head included, as the folder holds them). `batch` is the cache's captions per encoder call.

    The encoder is the one a [model] section names (its text_encoder/config.json, built on meta to
    count its tensors), else Qwen-Image's Qwen2.5-VL-7B (models/configs/qwen25_vl_7b_text.json)."""
    from ..component_files import packaged_config

    config = _encoder_config(model_cfg, base_dir)
    if config is None:
        c = packaged_config("qwen25_vl_7b_text")
        config = {"text_config": {k: c[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                     "num_attention_heads", "num_key_value_heads", "vocab_size")}}
        vision = c["vision_parameters"]
    else:
        vision = None
    model = _meta_encoder(config)
    lm = model.model.language_model
    text = lm.config
    d, i = text.hidden_size, text.intermediate_size

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    layer = count(lm.layers[0])
    resident = count(lm.embed_tokens) + count(lm.norm)
    total = count(model) - count(model.model.visual) + (vision if vision is not None else count(model.model.visual))
    tokens = batch * (text_rows + TEMPLATE_DROP + 5)
    # the MLP's three (T, I) tensors alive at once (act(gate), up, their product), and the
    # hidden states, q/k/v and their rotary copies, attention output: about six (T, D)
    activations = (3 * tokens * i + 6 * tokens * d) * dtype_bytes
    return {"device": (resident + layer) * dtype_bytes + activations, "resident": resident * dtype_bytes,
            "layer": layer * dtype_bytes, "activations": activations, "host": total * dtype_bytes, "tokens": tokens}


def _encoder_config(model_cfg, base_dir) -> dict | None:
    """The text encoder's config.json of a [model] section, or None (none given, or not a folder)."""
    import json
    from pathlib import Path

    if model_cfg is None:
        return None
    try:
        sources = qwen_image_loading.resolve_sources(model_cfg, Path(base_dir or "."))
    except Exception:
        return None
    path = sources.text_encoder / "config.json" if sources.text_encoder is not None else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _meta_encoder(config: dict):
    """Qwen2_5_VLForConditionalGeneration of `config` on the meta device (shapes only)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(**{k: v for k, v in config.items() if not k.startswith("_")})
    with torch.device("meta"):
        return Qwen2_5_VLForConditionalGeneration(cfg)
