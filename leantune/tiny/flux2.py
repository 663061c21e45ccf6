"""Tiny FLUX.2 components (dev-like and klein-like): the real classes with tiny configs, built offline.

`Flux2Transformer2DModel` with 2 double and 2 single blocks of 2 heads of 16 (width 32), 128 input
channels as the real ones (32 VAE channels x 2 x 2); `AutoencoderKLFlux2` with 8x compression, 32
latent channels and random batch-norm running statistics (so the pipelines' normalisation is not
the identity); a Mistral3ForConditionalGeneration (dev) of 32 text layers and a Qwen3ForCausalLM
(klein) of 28, both 16 wide, so the pipelines' hidden layers (10, 20, 30) / (9, 18, 27) exist and
the transformer's text width is 3 x 16.

The tokenizers are byte-level BPEs (Qwen2Tokenizer) built like Qwen-Image's tiny one, whose merges
build every word of the test corpus and of Flux2Pipeline's system message whole, with a Mistral-
style chat template ([SYSTEM_PROMPT]...[INST]...[/INST], content given as lists of parts as the
pipeline gives it) for dev and Qwen3's (thinking switched off by an empty <think> block) for klein.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import CORPUS, _randomize_zero_inits
from .qwen_image import _bytes_to_unicode

TEXT_WIDTH = 16
FLUX2_TINY = dict(patch_size=1, in_channels=128, num_layers=2, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=3 * TEXT_WIDTH, timestep_guidance_channels=32,
                  mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000)
FLUX2_VAE_TINY = dict(block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=32, norm_num_groups=4,
                      sample_size=64)
MISTRAL_TEXT_TINY = dict(hidden_size=TEXT_WIDTH, intermediate_size=32, num_hidden_layers=32, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, rms_norm_eps=1e-5)
PIXTRAL_TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                    image_size=64, patch_size=16)
QWEN3_TINY = dict(hidden_size=TEXT_WIDTH, intermediate_size=32, num_hidden_layers=28, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, rms_norm_eps=1e-6)

MISTRAL_SPECIAL = ("<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]")
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")

# Content may be a string or a list of {"type": "text", "text": ...} parts (Flux2Pipeline's format_input).
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['content'] is string %}{% set text = m['content'] %}"
    "{% else %}{% set text = m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% endif %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _bpe_tokenizer(texts: list[str], special: tuple[str, ...], **kwargs):
    """A Qwen2 byte-level BPE whose merges build every pre-tokenized word of `texts` whole."""
    import regex
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    table = _bytes_to_unicode()
    words: list[str] = []
    for text in texts:
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
    for tok in special:
        vocab[tok] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=1024, **kwargs)
    tok.add_special_tokens({"additional_special_tokens": list(special)})
    return tok


def mistral_tokenizer():
    """Dev's tokenizer: Mistral's special tokens and chat template, left padding."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    tok = _bpe_tokenizer([SYSTEM_MESSAGE, *CORPUS], MISTRAL_SPECIAL, pad_token="<pad>", bos_token="<s>",
                         eos_token="</s>", unk_token=None, padding_side="left")
    tok.chat_template = MISTRAL_TEMPLATE
    return tok


def qwen3_tokenizer():
    """Klein's tokenizer: Qwen's special tokens and Qwen3's chat template, right padding."""
    tok = _bpe_tokenizer(["user\nassistant\n", *CORPUS], QWEN_SPECIAL, pad_token="<|endoftext|>",
                         eos_token="<|im_end|>", unk_token=None, padding_side="right")
    tok.chat_template = QWEN3_TEMPLATE
    return tok


def mistral3_text_encoder(tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(seed)
    ids = tokenizer.convert_tokens_to_ids
    cfg = Mistral3Config(
        text_config=dict(MISTRAL_TEXT_TINY, model_type="mistral", vocab_size=len(tokenizer),
                         pad_token_id=ids("<pad>"), bos_token_id=ids("<s>"), eos_token_id=ids("</s>")),
        vision_config=dict(PIXTRAL_TINY, model_type="pixtral"), image_token_index=ids("[IMG]"),
        spatial_merge_size=2)
    return Mistral3ForConditionalGeneration(cfg).to(dtype).eval()


def qwen3_text_encoder(tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    ids = tokenizer.convert_tokens_to_ids
    cfg = Qwen3Config(**QWEN3_TINY, vocab_size=len(tokenizer), pad_token_id=ids("<|endoftext|>"),
                      eos_token_id=ids("<|im_end|>"))
    return Qwen3ForCausalLM(cfg).to(dtype).eval()


def flux2_transformer(variant: str = "dev", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """Dev-like (a guidance embedder) or klein-like (none)."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(**{**FLUX2_TINY, "guidance_embeds": variant == "dev", **overrides})
    _randomize_zero_inits(model, seed)
    return model.to(dtype).eval()


def flux2_vae(seed: int = 0, dtype: torch.dtype = torch.float32):
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(**FLUX2_VAE_TINY)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape, generator=g) * 0.3)
        vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape, generator=g) * 1.5 + 0.25)
    return vae.to(dtype).eval()


def flux2_scheduler():
    """FLUX.2's scheduler_config.json (dynamic shifting; the pipelines pass their own mu)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096, time_shift_type="exponential")


def flux2_components(variant: str = "dev", seed: int = 0, dtype: torch.dtype = torch.float32,
                     **transformer_overrides) -> dict:
    """All components of a tiny Flux2Pipeline (variant "dev") or Flux2KleinPipeline ("klein")."""
    if variant == "dev":
        tok = mistral_tokenizer()
        encoder = mistral3_text_encoder(tok, seed + 1, dtype)
    else:
        tok = qwen3_tokenizer()
        encoder = qwen3_text_encoder(tok, seed + 1, dtype)
    return dict(transformer=flux2_transformer(variant, seed, dtype, **transformer_overrides), vae=flux2_vae(seed, dtype),
                text_encoder=encoder, tokenizer=tok, scheduler=flux2_scheduler())


def flux2_pipeline(variant: str = "dev", seed: int = 0, dtype: torch.dtype = torch.float32, is_distilled: bool = False,
                   **transformer_overrides):
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    parts = flux2_components(variant, seed, dtype, **transformer_overrides)
    if variant == "dev":
        return Flux2Pipeline(**parts)
    return Flux2KleinPipeline(**parts, is_distilled=is_distilled)


def save_flux2_folder(path: str | Path, variant: str = "dev", seed: int = 0, is_distilled: bool = False) -> Path:
    """Write a complete tiny FLUX.2-dev (or klein) in the diffusers layout."""
    path = Path(path)
    flux2_pipeline(variant, seed, is_distilled=is_distilled).save_pretrained(path, safe_serialization=True)
    return path


__all__ = ["mistral_tokenizer", "qwen3_tokenizer", "mistral3_text_encoder", "qwen3_text_encoder", "flux2_transformer",
           "flux2_vae", "flux2_scheduler", "flux2_components", "flux2_pipeline", "save_flux2_folder"]
