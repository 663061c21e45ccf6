"""Tiny Qwen-Image-2.1 components: the real classes with tiny configs, built offline.

`QwenImage21Transformer2DModel` with 2 single-stream blocks of 2 heads of 16 (width 32), the real
64 latent channels unpatched, rotary split (4, 6, 6) and block-causal conditioning as released
(`causal_condition=True`, so the pipeline's prefix KV cache is on). `AutoencoderKLQwenImage21` with
the real 16x spatial compression (five dim_mult stages), 64 latent channels and RGBA in and out, 4
channels wide. The text encoder is a `Qwen3VLForConditionalGeneration` (the pipeline's class; it
reads `text_encoder.model.language_model.norm` and `hidden_states[-1]`) whose text model is 32 wide
(the transformer's context_in_dim) with 2 layers, and a one-block vision tower with Qwen3-VL's 16
pixel patches merged 2x2: one vision token then covers 32x32 pixels, the 2x2 group of 16-pixel
latent tokens the transformer's `img_mask` says each image slot stands for.

The processor is a `Qwen3VLProcessor` over Qwen-Image's tiny byte-level BPE and Qwen2-VL's PIL
image processor with Qwen3-VL's patch geometry. The real processor also holds a video processor,
which needs torchvision (not installed, and never used for images): `ImageTextProcessor` keeps the
class and drops that one attribute. The folder's model_index names `Qwen3VLProcessor`, as the
published one does; since loading that class needs torchvision, `load_qwen_image21_pipeline` passes
the processor in, rebuilt from the folder's processor/ files (every other component is read from
the folder by diffusers itself).

The chat template models Qwen3-VL's for what the pipeline asks of it (a system message whose
content is a list of text parts): `<|im_start|>system\\n...<|im_end|>\\n`, so the pipeline's
`_drop_idx` (the system message's token count) is derived as with the real one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import _randomize_zero_inits
from .qwen_image import _token_id, qwen_tokenizer

QWEN_IMAGE21_TINY = dict(
    patch_size=1, in_channels=64, out_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=2,
    context_in_dim=32, mlp_ratio=3, axes_dims_rope=(4, 6, 6), causal_condition=True,
)
QWEN_IMAGE21_VAE_TINY = dict(base_dim=4, decoder_base_dim=4, z_dim=64, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
                             attn_scales=[], temperal_downsample=[False, True, True, True],
                             in_channels=4, out_channels=4)
QWEN3_VL_TEXT_TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                           "mrope_section": [2, 3, 3], "mrope_interleaved": True})
QWEN3_VL_VISION_TINY = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32,
                            patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                            deepstack_visual_indexes=[0])
# Qwen3-VL's chat template, as far as the pipeline uses it: list content is the concatenation of
# its text parts (and a vision placeholder per image part).
QWEN3_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% elif c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The size the tests sample and encode references at (QwenImage21Pipeline's `output_resolution`).
TINY_RESOLUTION = 64


def qwen_image21_transformer(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """The tiny QwenImage21Transformer2DModel; its zero-centred norm scales (effective 1 + weight)
    are randomised so that a scale lost or mixed up in loading shows."""
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(**{**QWEN_IMAGE21_TINY, **overrides})
    _randomize_zero_inits(model, seed)
    return model.to(dtype).eval()


def qwen_image21_vae(seed: int = 0, dtype: torch.dtype = torch.float32):
    """The tiny AutoencoderKLQwenImage21 (RGBA, 16x, 64 latent channels; the real mean/std)."""
    from diffusers import AutoencoderKLQwenImage21

    torch.manual_seed(seed)
    return AutoencoderKLQwenImage21(**QWEN_IMAGE21_VAE_TINY).to(dtype).eval()


def qwen3_vl_encoder(tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny Qwen3VLForConditionalGeneration (text 32 wide, 2 layers; a one-block vision tower)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    pad = _token_id(tokenizer, "<|endoftext|>")
    cfg = Qwen3VLConfig(
        text_config=dict(QWEN3_VL_TEXT_TINY, vocab_size=len(tokenizer), bos_token_id=pad,
                         eos_token_id=_token_id(tokenizer, "<|im_end|>"), pad_token_id=pad),
        vision_config=dict(QWEN3_VL_VISION_TINY),
        image_token_id=_token_id(tokenizer, "<|image_pad|>"), video_token_id=_token_id(tokenizer, "<|video_pad|>"),
        vision_start_token_id=_token_id(tokenizer, "<|vision_start|>"),
        vision_end_token_id=_token_id(tokenizer, "<|vision_end|>"),
    )
    return Qwen3VLForConditionalGeneration(cfg).to(dtype).eval()


def qwen3_vl_image_processor():
    """Qwen2-VL's PIL image processor with Qwen3-VL's geometry (16-pixel patches, 2x2 merge, mean
    and std 0.5); pixel bounds wide enough that the pipeline's 32-multiple sizes are kept as given, up to its
    default 1024² references."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                    min_pixels=32 * 32, max_pixels=1024 * 1024,
                                    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


_PROCESSOR_CLASS = None


def _image_text_processor_class():
    """The processor class, made once (so the folder's model_index names one class)."""
    global _PROCESSOR_CLASS
    if _PROCESSOR_CLASS is not None:
        return _PROCESSOR_CLASS
    from transformers import Qwen3VLProcessor

    class ImageTextProcessor(Qwen3VLProcessor):
        """Qwen3VLProcessor without its video processor (which needs torchvision)."""

        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)

    _PROCESSOR_CLASS = ImageTextProcessor
    return ImageTextProcessor


def qwen3_vl_processor(tokenizer=None):
    """The tiny Qwen3-VL processor (images and text) with the chat template above."""
    tokenizer = tokenizer or qwen_tokenizer()
    return _image_text_processor_class()(image_processor=qwen3_vl_image_processor(), tokenizer=tokenizer,
                                         chat_template=QWEN3_VL_TEMPLATE)


def qwen_image21_scheduler():
    """A flow-matching Euler scheduler with Qwen-Image's dynamic shift (the pipeline computes mu
    from the target's token count with base/max shift 0.5..1.15 over 256..4096 unless configured)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096, time_shift_type="exponential")


def qwen_image21_components(seed: int = 0, dtype: torch.dtype = torch.float32, **transformer_overrides) -> dict:
    """All components of a tiny QwenImage21Pipeline, keyed as its constructor expects."""
    processor = qwen3_vl_processor()
    return dict(transformer=qwen_image21_transformer(seed, dtype, **transformer_overrides),
                vae=qwen_image21_vae(seed, dtype), text_encoder=qwen3_vl_encoder(processor.tokenizer, seed + 1, dtype),
                processor=processor, scheduler=qwen_image21_scheduler())


def qwen_image21_pipeline(seed: int = 0, **transformer_overrides):
    """The tiny QwenImage21Pipeline."""
    from diffusers import QwenImage21Pipeline

    return QwenImage21Pipeline(**qwen_image21_components(seed, **transformer_overrides))


def save_qwen_image21_folder(path: str | Path, seed: int = 0) -> Path:
    """Write a complete tiny Qwen-Image-2.1 in the diffusers layout (processor/ included)."""
    import json

    path = Path(path)
    qwen_image21_pipeline(seed).save_pretrained(path, safe_serialization=True)
    # The published folder names transformers' Qwen3VLProcessor; diffusers wrote the tiny subclass.
    index = json.loads((path / "model_index.json").read_text(encoding="utf-8"))
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    (path / "model_index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
    return path


def load_qwen_image21_pipeline(path: str | Path, dtype: torch.dtype = torch.float32):
    """The folder as diffusers loads it: every model component read by `from_pretrained`, the
    processor rebuilt from the folder's processor/ files (see the module docstring)."""
    from diffusers import QwenImage21Pipeline
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers import AutoTokenizer

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(path / "processor")
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path / "processor")
    processor = _image_text_processor_class()(image_processor=image_processor, tokenizer=tokenizer,
                                              chat_template=QWEN3_VL_TEMPLATE)
    return QwenImage21Pipeline.from_pretrained(path, processor=processor, dtype=dtype)


__all__ = ["qwen_image21_transformer", "qwen_image21_vae", "qwen3_vl_encoder", "qwen3_vl_processor",
           "qwen_image21_scheduler", "qwen_image21_components", "qwen_image21_pipeline",
           "save_qwen_image21_folder", "load_qwen_image21_pipeline", "QWEN_IMAGE21_TINY", "TINY_RESOLUTION"]
