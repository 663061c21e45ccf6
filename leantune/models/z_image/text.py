"""Z-Image's text conditioning: what ZImagePipeline.encode_prompt gives, exactly.

The pipeline puts each prompt into Qwen3's chat template as one user message with the generation
prompt and thinking switched on (`enable_thinking=True`: no empty <think> block), tokenizes the
batch to exactly `max_sequence_length` tokens (padding="max_length", truncation: the template's
tokens count), runs the text model with every hidden state and keeps `hidden_states[-2]` (the
output of the second-to-last decoder layer, before the final norm) at the prompt's real tokens
(the attention mask): one (n_i, 2560) tensor per prompt, n_i <= max_length.

Here only the layers up to that one run (35 of Qwen3-4B's 36: `layers_run`), with the final norm
left out, so the last hidden state is that layer's output: the same numbers without the last
layer's compute and reads. The rows of a batch are the pipeline's per-prompt tensors zero-padded to
the longest, with `lengths` saying how many are real (the cache trims the rest); a real row is never
all zeros, so `predict` cuts each prompt back to its rows (z_image/__init__.py), as the pipeline
hands the transformer a list. When the encoder is on the host and encoding runs on a device, its
decoder layers are streamed there one at a time (memory/blockwise.py), or read from its files
layer by layer when it was left there (streamed_encoder.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ...memory.lockstep import shared
from ..family import PromptEmbeds

DEFAULT_TEXT_LENGTH = 512          # ZImagePipeline's max_sequence_length


def layers_run(layers: int) -> int:
    """How many decoder layers an encode runs: up to the one whose output is hidden_states[-2]."""
    return max(layers - 1, 1)


@contextmanager
def _first_layers(lm: nn.Module, n: int):
    """`lm` with only its first `n` decoder layers and no final norm, for the duration: its last
    hidden state is then layer n's own output (hidden_states[n] of the whole model's run)."""
    layers, norm = lm.layers, lm.norm
    lm.layers, lm.norm = nn.ModuleList(list(layers)[:n]), nn.Identity()
    try:
        yield
    finally:
        lm.layers, lm.norm = layers, norm


def _placement(encoders, device: torch.device):
    from ..streamed_encoder import placement

    lm = encoders.text_encoder
    return placement(lm, lm.layers, device)


def _templated(tokenizer, prompts: list[str]) -> list[str]:
    """ZImagePipeline._encode_prompt's template around each prompt."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True, enable_thinking=True) for p in prompts]


def tokens(tokenizer, prompts: list[str], max_length: int):
    """ZImagePipeline._encode_prompt's template and tokenization: (input_ids, attention_mask)."""
    out = tokenizer(_templated(tokenizer, prompts), padding="max_length", max_length=max_length, truncation=True,
                    return_tensors="pt")
    return out.input_ids, out.attention_mask.bool()


def caption_tokens(tokenizer, captions: list[str]) -> list[int]:
    """Each caption's tokens in the template, as `tokens` cuts them at max_length (the template's
    own tokens count: a count over it loses the caption's end and the closing tokens)."""
    return [len(i) for i in tokenizer(_templated(tokenizer, captions))["input_ids"]]


@torch.no_grad()
def encode_prompts(prompts: list[str], encoders, max_length: int = DEFAULT_TEXT_LENGTH,
                   device=None) -> tuple[PromptEmbeds, torch.Tensor]:
    """PromptEmbeds(t5=(B, L, D) the pipeline's per-prompt hidden states zero-padded to the longest,
    pooled=(B, 0)) and the real rows per prompt (B,)."""
    device = torch.device(device or encoders.device)
    input_ids, mask = tokens(encoders.tokenizer, list(prompts), max_length)
    lm = encoders.text_encoder
    n = layers_run(len(lm.layers))
    # the cut is entered once per lock-step pass (its lanes share the model): memory/lockstep.py
    with shared(("first_layers", id(lm), n), lambda: _first_layers(lm, n)), _placement(encoders, device):
        hidden = lm(input_ids=input_ids.to(device), attention_mask=mask.to(device), use_cache=False).last_hidden_state
    mask = mask.to(hidden.device)
    rows = [h[m] for h, m in zip(hidden, mask)]                                   # (n_i, D), the pipeline's list
    longest = max(r.shape[0] for r in rows)
    seq = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
    seq = seq.to(dtype=lm.dtype)
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long)
    return PromptEmbeds(t5=seq, pooled=seq.new_zeros(len(prompts), 0)), lengths


def padding_side(encoders) -> str:
    """Which end of the cached rows holds the padding: the end (rows are the real tokens, then zeros)."""
    return "right"


def text_rows(max_length: int) -> int:
    return max_length


def text_modules(encoders):
    """Nothing moves whole; Qwen3Model runs layer by layer."""
    return [], encoders.text_encoder
