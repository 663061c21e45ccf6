"""Wan's text conditioning: what WanPipeline.encode_prompt gives, exactly.

The pipeline cleans each prompt (ftfy where installed, HTML entities, runs of whitespace:
`prompt_clean`, used here as diffusers has it), tokenizes it with umT5's tokenizer to exactly
`max_sequence_length` tokens (padding="max_length", truncation, the end token added), runs
UMT5EncoderModel with the attention mask and keeps the last hidden state at the real tokens, then
pads every prompt back to `max_sequence_length` rows with zeros. The transformer attends to all
of those rows: its text embedder maps a zero row to its bias, not to zero, so the padding rows are
part of the conditioning. `lengths` is therefore the whole `max_length` for every prompt (the cache
keeps every row), and a batch of prompts is the pipeline's tensor as it is.

When the encoder is on the host and encoding runs on a device, its blocks are streamed there one at
a time (memory/blockwise.py), or read from its files block by block when it was left there
(streamed_encoder.py).
"""

from __future__ import annotations

import torch

from ..family import PromptEmbeds

DEFAULT_TEXT_LENGTH = 512          # WanPipeline's max_sequence_length (Wan-AI's text_len)


def _placement(encoders, device: torch.device):
    from ..streamed_encoder import placement

    lm = encoders.text_encoder
    return placement(lm, lm.encoder.block, device)


def tokens(tokenizer, prompts: list[str], max_length: int):
    """WanPipeline._get_t5_prompt_embeds's cleaning and tokenization: (input_ids, attention_mask)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    out = tokenizer([prompt_clean(p) for p in prompts], padding="max_length", max_length=max_length,
                    truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    return out.input_ids, out.attention_mask


@torch.no_grad()
def encode_prompts(prompts: list[str], encoders, max_length: int = DEFAULT_TEXT_LENGTH,
                   device=None) -> tuple[PromptEmbeds, torch.Tensor]:
    """PromptEmbeds(t5=(B, max_length, D): each prompt's hidden states at its real tokens, zeros after,
    pooled=(B, 0)) and the rows to keep per prompt (B,): all of them (see the module's docstring)."""
    device = torch.device(device or encoders.device)
    input_ids, mask = tokens(encoders.tokenizer, list(prompts), max_length)
    lm = encoders.text_encoder
    with _placement(encoders, device):
        hidden = lm(input_ids.to(device), mask.to(device)).last_hidden_state
    real = mask.gt(0).sum(dim=1).long()
    rows = [h[:n] for h, n in zip(hidden, real.tolist())]
    seq = torch.stack([torch.cat([r, r.new_zeros(max_length - r.shape[0], r.shape[1])]) for r in rows])
    lengths = torch.full((len(prompts),), max_length, dtype=torch.long)
    return PromptEmbeds(t5=seq, pooled=seq.new_zeros(len(prompts), 0)), lengths


def padding_side(encoders) -> str:
    """Which end of the text rows holds the padding: the end (the real tokens, then zero rows)."""
    return "right"


def text_rows(max_length: int) -> int:
    return max_length


def text_modules(encoders):
    """Nothing moves whole; UMT5EncoderModel runs block by block."""
    return [], encoders.text_encoder
