"""Krea 2's text conditioning: what Krea2Pipeline.encode_prompt gives (krea-ai/krea-2 encoder.py
`Qwen3VLConditioner`, the same steps), and the text rows `predict` hands the transformer.

The pipeline: the prompt after Qwen-Image's system template (`<|im_start|>system\\nDescribe the
image ...<|im_end|>\\n<|im_start|>user\\n`), tokenized with truncation and padding to
`max_length + 34 - 5` tokens, then the 5 tokens of `<|im_end|>\\n<|im_start|>assistant\\n` appended
after the padding; the attention mask is the tokenizer's (prompt and suffix real, padding not),
position ids count real tokens only (the suffix continues the prompt's positions), the same for
Qwen3-VL's three rotary axes. Qwen3-VL runs once asking for every hidden state, and the states at
`text_encoder_select_layers` (hidden_states[0] is the embedding; Qwen3-VL-4B: 2, 5, ..., 35 of its
36 layers) are stacked per token: (B, L, 12, 2560). The first 34 rows (the system part) are dropped:
`max_length` rows remain, [prompt | padding | suffix], with a boolean mask.

What leantune keeps (PromptEmbeds.t5): each prompt's real rows in order, prompt then suffix, the
12 layers flattened into one row of 12 x 2560 (the cache, batching and the planner see a (B, L, D)
sequence like every family's), zero rows after them (`lengths` = the real rows: the cache stores
only those, ~2 x 61 KB a token in bf16). A row of real hidden states is never all zeros, so
`predict` reads the rows back (`transformer_text`): it puts each prompt's last 5 real rows (the
suffix) at the end of the batch's rows and the padding between, as the pipeline lays them out, and
passes the mask the pipeline passes. The transformer masks padded text keys everywhere and its text
rotary positions are all zero, so the padding's values and count change nothing but rounding; at
the pipeline's length (a sample at max_length rows) the inputs are the pipeline's exactly, up to
the padded rows' values, which are masked.

Only Qwen3-VL's language model runs (the vision tower is not used for text), all its layers: the
last one (of 36; the deepest tap is 35) changes no number the pipeline keeps, but transformers 5
collects hidden states through hooks it installs once, on the layers present at the first call, so
cutting the layer list for a call would leave a model that reports fewer states afterwards (1/36 of
the encoding, paid in the caching phase only). When the encoder is on the host and encoding runs
on a device, its decoder layers are streamed there one at a time (streamed_encoder.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ..family import PromptEmbeds

DEFAULT_TEXT_LENGTH = 512            # Krea2Pipeline's max_sequence_length
PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
          "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
TEMPLATE_DROP = 34                   # the pipeline's prompt_template_encode_start_idx
SUFFIX_TOKENS = 5                    # prompt_template_encode_num_suffix_tokens


def text_model(encoders) -> nn.Module:
    """Qwen3-VL's language model (it holds `layers`)."""
    return encoders.text_encoder.language_model


def _placement(encoders, device: torch.device):
    from ..streamed_encoder import placement

    lm = text_model(encoders)
    return placement(lm, lm.layers, device)


def tokens(tokenizer, prompts: list[str], max_length: int):
    """Krea2Pipeline.get_text_hidden_states's input ids, mask (bool) and position ids (3, B, L)."""
    text = tokenizer([PREFIX + p for p in prompts], truncation=True, padding="max_length",
                     max_length=max_length + TEMPLATE_DROP - SUFFIX_TOKENS, return_tensors="pt")
    suffix = tokenizer([SUFFIX] * len(prompts), return_tensors="pt")
    input_ids = torch.cat([text.input_ids, suffix.input_ids], dim=1)
    mask = torch.cat([text.attention_mask, suffix.attention_mask], dim=1).bool()
    position_ids = (mask.long().cumsum(dim=-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
    return input_ids, mask, position_ids


@torch.no_grad()
def caption_tokens(tokenizer, captions: list[str]) -> list[int]:
    """Each caption's rows as `tokens` limits them to max_length: the caption after the 34 dropped
    template tokens, plus the 5 suffix tokens appended after it (the templated caption is cut at
    max_length + 34 - 5 tokens, so a count over max_length loses the caption's end)."""
    ids = tokenizer([PREFIX + c for c in captions])["input_ids"]
    return [len(i) - TEMPLATE_DROP + SUFFIX_TOKENS for i in ids]


def pipeline_hidden_states(prompts: list[str], encoders, max_length: int = DEFAULT_TEXT_LENGTH, device=None):
    """(B, max_length, layers, D) stacked hidden states and the (B, max_length) mask, exactly as
    Krea2Pipeline.encode_prompt returns them."""
    device = torch.device(device or encoders.device)
    input_ids, mask, position_ids = tokens(encoders.tokenizer, list(prompts), max_length)
    lm = text_model(encoders)
    select = tuple(encoders.select_layers)
    with _placement(encoders, device):
        out = lm(input_ids=input_ids.to(device), attention_mask=mask.to(device), position_ids=position_ids.to(device),
                 output_hidden_states=True, use_cache=False)
    stacked = torch.stack([out.hidden_states[i] for i in select], dim=2)         # (B, L_tok, N, D)
    return stacked[:, TEMPLATE_DROP:], mask[:, TEMPLATE_DROP:].to(stacked.device)


@torch.no_grad()
def encode_prompts(prompts: list[str], encoders, max_length: int = DEFAULT_TEXT_LENGTH,
                   device=None) -> tuple[PromptEmbeds, torch.Tensor]:
    """PromptEmbeds(t5=(B, max_length, layers * D), pooled=(B, 0)): each prompt's real rows first
    (prompt, then the template's suffix), zeros after; and the real rows per prompt (B,)."""
    hidden, mask = pipeline_hidden_states(prompts, encoders, max_length, device)
    b, length, n, d = hidden.shape
    flat = hidden.reshape(b, length, n * d).to(dtype=encoders.text_encoder.dtype)
    seq = flat.new_zeros(b, length, n * d)
    lengths = mask.sum(dim=1).to(torch.long).cpu()
    for i in range(b):
        real = flat[i][mask[i]]                                                  # (n_i, N*D)
        seq[i, : real.shape[0]] = real
    return PromptEmbeds(t5=seq, pooled=seq.new_zeros(b, 0)), lengths


def transformer_text(seq: torch.Tensor, num_text_layers: int):
    """Our rows (B, L, N * D: real rows first, zeros after) -> the transformer's text input as the
    pipeline lays it out: (B, L, N, D) with each prompt's suffix (its last 5 real rows) at the end
    and the padding before it, and the (B, L) bool mask, None when no row is padding. Rows without
    values (the planner's and simulated device's tensors, which read as zeros) pass unmasked."""
    b, length, width = seq.shape
    stacked = seq.view(b, length, num_text_layers, width // num_text_layers)
    real = (seq != 0).any(dim=-1)                                                # (B, L)
    counts = real.sum(dim=1).tolist()
    if max(counts, default=0) == 0 or all(c == length for c in counts):
        return stacked, None
    order, mask = [], torch.zeros(b, length, dtype=torch.bool, device=seq.device)
    for i, n in enumerate(counts):
        tail = min(SUFFIX_TOKENS, n)
        head = n - tail
        idx = list(range(head)) + list(range(n, length)) + list(range(head, n))
        order.append(idx)
        mask[i, :head] = True
        mask[i, length - tail:] = True
    index = torch.tensor(order, device=seq.device)                               # (B, L)
    moved = torch.gather(stacked, 1, index[:, :, None, None].expand_as(stacked))
    return moved, mask


def padding_side(encoders) -> str:
    """Real rows first, padding after (the cache trims the end)."""
    return "right"


def text_rows(max_length: int) -> int:
    """A prompt's rows are at most max_length (the pipeline's max_sequence_length: prompt + suffix)."""
    return max_length


def text_modules(encoders):
    """Nothing moves whole; Qwen3-VL's language model may run layer by layer (its vision tower is
    not used for text and stays on the host)."""
    return [], text_model(encoders)
