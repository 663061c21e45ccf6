"""Tiny Qwen-Image (and Qwen-Image-Edit) components: the real classes with tiny configs, built offline.

`QwenImageTransformer2DModel` with 2 blocks of 2 heads of 16 (width 32), `AutoencoderKLQwenImage`
with 8x spatial compression and 16 latent channels (Qwen's latent mean/std), and a
`Qwen2_5_VLForConditionalGeneration` whose text model is 32 wide (the transformer's
joint_attention_dim) with a one-block vision tower (the Edit pipelines feed it reference images).

The tokenizer is a byte-level BPE (Qwen2Tokenizer, Qwen's pre-tokenizer) whose merges build every
word of the prompt templates and of the test corpus whole, so the Qwen-Image system prompt before
the user's text tokenizes to 34 tokens, as with the real tokenizer: the pipeline's fixed
`prompt_template_encode_start_idx = 34` then drops exactly the template here too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import CORPUS, _randomize_zero_inits

QWEN_IMAGE_TINY = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6),
)
QWEN_VAE_TINY = dict(base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                     temperal_downsample=[False, True, True])
QWEN_TEXT_TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=2048, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]})
QWEN_VISION_TINY = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32,
                        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                        fullatt_block_indexes=[0])

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
# The pipelines' templates, whose words the tokenizer keeps whole.
TEMPLATE_TEXT = (
    "system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:\nuser\nassistant\n"
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then "
    "explain how the user's text instruction should alter or modify the image. Generate a new image that meets "
    "the user's requirements while maintaining consistency with the original input where appropriate.\n"
    "Picture 1: Picture 2: Picture 3: "
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def qwen_tokenizer():
    """A Qwen2 byte-level BPE tokenizer built offline, identical every time: all 256 bytes, then one
    merge chain per corpus word (built left to right), then the special tokens."""
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    import regex

    table = _bytes_to_unicode()
    words: list[str] = []
    for text in [TEMPLATE_TEXT, *CORPUS]:
        for piece in regex.findall(PRETOKENIZE_REGEX, text):
            w = "".join(table[b] for b in piece.encode("utf-8"))
            if w not in words:
                words.append(w)
    vocab = {ch: i for i, ch in enumerate(table[b] for b in range(256))}
    merges: list[tuple[str, str]] = []
    for w in words:
        prefix = w[0]
        for ch in w[1:]:
            merged = prefix + ch
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((prefix, ch))
            prefix = merged
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=2048)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    return tok


def _token_id(tokenizer, token: str) -> int:
    return tokenizer.convert_tokens_to_ids(token)


def qwen_text_encoder(tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny Qwen2.5-VL (text 32 wide, 2 layers; a one-block vision tower)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    pad = _token_id(tokenizer, "<|endoftext|>")
    cfg = Qwen2_5_VLConfig(
        text_config=dict(QWEN_TEXT_TINY, vocab_size=len(tokenizer), bos_token_id=pad,
                         eos_token_id=_token_id(tokenizer, "<|im_end|>"), pad_token_id=pad),
        vision_config=dict(QWEN_VISION_TINY),
        image_token_id=_token_id(tokenizer, "<|image_pad|>"), video_token_id=_token_id(tokenizer, "<|video_pad|>"),
        vision_start_token_id=_token_id(tokenizer, "<|vision_start|>"),
        vision_end_token_id=_token_id(tokenizer, "<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(cfg).to(dtype).eval()


def qwen_image_transformer(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**{**QWEN_IMAGE_TINY, **overrides})
    _randomize_zero_inits(model, seed)
    return model.to(dtype).eval()


def qwen_vae(seed: int = 0, dtype: torch.dtype = torch.float32):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    return AutoencoderKLQwenImage(**QWEN_VAE_TINY).to(dtype).eval()


def qwen_scheduler():
    """Qwen-Image's published scheduler_config.json (dynamic shift 0.5..0.9 over 256..8192 tokens,
    stretched so the last sigma is 0.02)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )


def qwen_image_components(seed: int = 0, dtype: torch.dtype = torch.float32, **transformer_overrides) -> dict:
    """All components of a tiny QwenImagePipeline, keyed as its constructor expects."""
    tok = qwen_tokenizer()
    return dict(transformer=qwen_image_transformer(seed, dtype, **transformer_overrides), vae=qwen_vae(seed, dtype),
                text_encoder=qwen_text_encoder(tok, seed + 1, dtype), tokenizer=tok, scheduler=qwen_scheduler())


def qwen_image_processor():
    """Qwen2-VL's image processor (PIL backend), small pixel bounds for the tiny vision tower."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56 * 4)


def qwen_processor(tokenizer=None):
    """A Qwen2.5-VL processor for the Edit pipelines, built offline: images and text only (the real
    one also holds a video processor, which needs torchvision)."""
    from transformers import Qwen2_5_VLProcessor

    class ImageTextProcessor(Qwen2_5_VLProcessor):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)

    return ImageTextProcessor(image_processor=qwen_image_processor(), tokenizer=tokenizer or qwen_tokenizer())


def qwen_image_edit_components(seed: int = 0, dtype: torch.dtype = torch.float32, **transformer_overrides) -> dict:
    """All components of a tiny QwenImageEditPlusPipeline (Qwen-Image-Edit-2509 layout: a processor too)."""
    parts = qwen_image_components(seed, dtype, **transformer_overrides)
    parts["processor"] = qwen_processor(parts["tokenizer"])
    return parts


def save_qwen_image_folder(path: str | Path, seed: int = 0, edit: bool = False) -> Path:
    """Write a complete tiny Qwen-Image (or, `edit`, Qwen-Image-Edit-2509) in the diffusers layout."""
    from diffusers import QwenImageEditPlusPipeline, QwenImagePipeline

    path = Path(path)
    if edit:
        QwenImageEditPlusPipeline(**qwen_image_edit_components(seed)).save_pretrained(path, safe_serialization=True)
    else:
        QwenImagePipeline(**qwen_image_components(seed)).save_pretrained(path, safe_serialization=True)
    return path


__all__ = ["qwen_tokenizer", "qwen_text_encoder", "qwen_image_transformer", "qwen_vae", "qwen_scheduler",
           "qwen_image_components", "qwen_image_edit_components", "save_qwen_image_folder"]
