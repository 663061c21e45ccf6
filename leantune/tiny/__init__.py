"""Tiny presets of the real classes, for the demo and the tests.

Every component is the real diffusers / transformers class with a tiny config, so code paths are
exactly those a full-size checkpoint takes. Tokenizers are trained offline on a small corpus
(nothing is fetched from a hub). Weights are deterministic for a given seed.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

import torch

# A Flux with 2 double and 2 single blocks, 2 heads of 16: inner width 32. sum(axes_dims_rope) == head dim.
FLUX_TINY = dict(
    patch_size=1, in_channels=64, out_channels=None, num_layers=2, num_single_layers=2,
    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
    pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
)
# 8x spatial compression and 16 latent channels, like Flux's VAE.
VAE_TINY = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
    latent_channels=16, norm_num_groups=4, sample_size=64, scaling_factor=0.3611, shift_factor=0.1159,
    use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True,
)
CLIP_TINY = dict(
    hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=77, projection_dim=32, hidden_act="quick_gelu", layer_norm_eps=1e-5,
)
T5_TINY = dict(
    d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
    relative_attention_max_distance=16, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
    use_cache=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
)
T5_TINY_MAX_LENGTH = 32

CORPUS = [
    "a photo of a cat", "a red circle on a white background", "a blue square on a black background",
    "a green triangle", "a yellow star", "sks person riding a horse", "a painting of a dog in the style of sks",
    "a small orange ellipse next to a large purple square", "two shapes, a circle and a square",
    "an empty canvas", "a cyan cross", "a magenta diamond on grey", "lnt style shapes",
]


def _corpus() -> list[str]:
    return CORPUS * 20


def _corpus_words() -> Counter:
    """Lower-cased words and punctuation runs of the corpus with their counts."""
    words: Counter = Counter()
    for line in _corpus():
        words.update(re.findall(r"\w+|[^\w\s]+", line.lower()))
    return words


def _bpe_merges(words: Counter, n_merges: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Byte-pair merges learned deterministically (ties broken by the pair itself), CLIP style
    with a `</w>` end-of-word marker. The library trainers break ties by hash order, which makes
    token ids differ between processes; tests and caches need them stable."""
    split = {w: tuple(w[:-1]) + (w[-1] + "</w>",) for w in words}
    symbols = sorted({sym for parts in split.values() for sym in parts} | set("abcdefghijklmnopqrstuvwxyz0123456789"))
    symbols += [c + "</w>" for c in "abcdefghijklmnopqrstuvwxyz0123456789,.;:!?" if c + "</w>" not in symbols]
    vocab, merges = list(symbols), []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, parts in split.items():
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        (a, b), _count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append((a, b))
        vocab.append(a + b)
        for w, parts in split.items():
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            split[w] = tuple(out)
    return vocab, merges


def clip_tokenizer(max_length: int = 77):
    """A CLIP-style BPE tokenizer (end-of-word suffix, lowercase) built offline, identical every time."""
    from transformers import CLIPTokenizer

    symbols, merges = _bpe_merges(_corpus_words(), n_merges=120)
    tokens = ["<|startoftext|>", "<|endoftext|>"] + symbols
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def t5_tokenizer(max_length: int = T5_TINY_MAX_LENGTH):
    """A T5-style Unigram tokenizer (pad=0, eos=1, unk=2 as real T5) built offline, identical every time."""
    from transformers import T5Tokenizer

    words = _corpus_words()
    total = sum(words.values())
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + w, math.log(c / total)) for w, c in sorted(words.items())]
    chars = sorted({ch for w in words for ch in w} | set("abcdefghijklmnopqrstuvwxyz0123456789"))
    pieces += [(ch, -12.0) for ch in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def flux_transformer(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**{**FLUX_TINY, **overrides})
    _randomize_zero_inits(model, seed)
    return model.to(dtype).eval()


def _randomize_zero_inits(model: torch.nn.Module, seed: int) -> None:
    """diffusers zero-initialises some output layers; a random tiny model should not be degenerate."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() and torch.count_nonzero(p) == 0 and p.dim() >= 1 and p.numel() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def wide_flux_transformer(n_single: int = 8):
    """A real-class Flux at width 1024 (8 heads of 128, 1 double + `n_single` single blocks, 324 MiB
    in bf16 for 8), built on meta and filled with a constant: every page is touched, so it counts as
    resident memory, without the cost of a random init. For host-memory measurements, where blocks
    must dwarf allocator noise."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=n_single,
                                       attention_head_dim=128, num_attention_heads=8, joint_attention_dim=64,
                                       pooled_projection_dim=64, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.data = torch.empty(p.shape, dtype=torch.bfloat16).fill_(0.01)
    return model.requires_grad_(False).eval()


def vae(seed: int = 0, dtype: torch.dtype = torch.float32):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(**VAE_TINY).to(dtype).eval()


def clip_text_encoder(tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    cfg = CLIPTextConfig(**CLIP_TINY, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return CLIPTextModel(cfg).to(dtype).eval()


def t5_text_encoder(tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    cfg = T5Config(**T5_TINY, vocab_size=len(tokenizer))
    return T5EncoderModel(cfg).to(dtype).eval()


def flux_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )


def flux_components(seed: int = 0, dtype: torch.dtype = torch.float32, guidance_embeds: bool = True,
                    **transformer_overrides) -> dict:
    """All components of a tiny FluxPipeline, keyed as FluxPipeline's constructor expects;
    `transformer_overrides` change FLUX_TINY (e.g. the demo's wider model)."""
    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    return dict(
        transformer=flux_transformer(seed, dtype, guidance_embeds=guidance_embeds, **transformer_overrides),
        vae=vae(seed, dtype),
        text_encoder=clip_text_encoder(tok, seed, dtype),
        text_encoder_2=t5_text_encoder(tok2, seed, dtype),
        tokenizer=tok,
        tokenizer_2=tok2,
        scheduler=flux_scheduler(),
    )


def save_flux_folder(path: str | Path, seed: int = 0, guidance_embeds: bool = True, **transformer_overrides) -> Path:
    """Write a complete tiny Flux model in the diffusers (FLUX.1-dev repository) layout, as safetensors."""
    from diffusers import FluxPipeline

    path = Path(path)
    pipe = FluxPipeline(**flux_components(seed, guidance_embeds=guidance_embeds, **transformer_overrides))
    pipe.save_pretrained(path, safe_serialization=True)
    return path


# -- SD3.5 ----------------------------------------------------------------------------------------
# Two joint blocks, 4 heads of 8 (width 32). Large-style: plain MMDiT blocks; Medium-style: MMDiT-X,
# the first block with the second (image-only) attention. Both with qk-norm, as SD3.5. The text
# widths keep SD3's proportions: CLIP-L (16) + CLIP-G (32) < T5 (64), so the CLIP states are
# zero-padded to T5's width; pooled = 16 + 16 projected.
SD3_TINY_LARGE = dict(
    sample_size=32, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
    joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=32, out_channels=16,
    pos_embed_max_size=96, qk_norm="rms_norm", dual_attention_layers=(),
)
SD3_TINY_MEDIUM = dict(SD3_TINY_LARGE, dual_attention_layers=(0,))
SD3_TINY = {"large": SD3_TINY_LARGE, "medium": SD3_TINY_MEDIUM}
CLIP_L_SD3_TINY = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                       max_position_embeddings=77, projection_dim=16, hidden_act="quick_gelu", layer_norm_eps=1e-5)
CLIP_G_SD3_TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       max_position_embeddings=77, projection_dim=16, hidden_act="gelu", layer_norm_eps=1e-5)
T5_SD3_TINY = dict(T5_TINY, d_model=64, d_kv=16)
# SD3's VAE: Flux's architecture, its own latent statistics.
VAE_SD3_TINY = dict(VAE_TINY, scaling_factor=1.5305, shift_factor=0.0609)


def sd3_transformer(style: str = "large", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**{**SD3_TINY[style], **overrides})
    _randomize_zero_inits(model, seed)
    return model.to(dtype).eval()


def _clip_with_projection(tokenizer, config: dict, seed: int, dtype: torch.dtype):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    cfg = CLIPTextConfig(**config, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return CLIPTextModelWithProjection(cfg).to(dtype).eval()


def sd3_scheduler():
    """SD3.5's scheduler: flow matching with a fixed shift of 3."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)


def sd3_components(style: str = "large", seed: int = 0, dtype: torch.dtype = torch.float32, t5: bool = True) -> dict:
    """All components of a tiny StableDiffusion3Pipeline, keyed as its constructor expects
    (`t5=False`: text_encoder_3 and tokenizer_3 are None, as the pipeline allows)."""
    from diffusers import AutoencoderKL
    from transformers import T5Config, T5EncoderModel

    tok, tok2, tok3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(seed + 3)
    t5_model = T5EncoderModel(T5Config(**T5_SD3_TINY, vocab_size=len(tok3))).to(dtype).eval()
    torch.manual_seed(seed)
    return dict(
        transformer=sd3_transformer(style, seed, dtype),
        vae=AutoencoderKL(**VAE_SD3_TINY).to(dtype).eval(),
        text_encoder=_clip_with_projection(tok, CLIP_L_SD3_TINY, seed + 1, dtype),
        text_encoder_2=_clip_with_projection(tok2, CLIP_G_SD3_TINY, seed + 2, dtype),
        text_encoder_3=t5_model if t5 else None,
        tokenizer=tok, tokenizer_2=tok2, tokenizer_3=tok3 if t5 else None,
        scheduler=sd3_scheduler(),
    )


def save_sd3_folder(path: str | Path, style: str = "large", seed: int = 0) -> Path:
    """Write a complete tiny SD3.5 model in the diffusers (stable-diffusion-3.5 repository) layout."""
    from diffusers import StableDiffusion3Pipeline

    path = Path(path)
    StableDiffusion3Pipeline(**sd3_components(style, seed)).save_pretrained(path, safe_serialization=True)
    return path
