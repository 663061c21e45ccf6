"""FLUX.2's text conditioning: what Flux2Pipeline.encode_prompt (dev, Mistral Small 3.x) and
Flux2KleinPipeline.encode_prompt (klein, Qwen3) give, exactly.

Both pipelines tokenize to exactly `max_length` tokens (padding="max_length", truncation), run the
text model once with every hidden state, and stack three intermediate layers' outputs channel-wise
per token: (B, L, 3 * D). Dev reads layers (10, 20, 30) after Mistral's chat template with the
pipeline's system message (batched, one `apply_chat_template` call); klein reads (9, 18, 27) after
Qwen's chat template with thinking disabled (one tokenizer call per prompt).

Every row is kept, padding included: the pipelines give the transformer all `max_length` rows and
no attention mask, so the padding rows condition the image like the prompt's. `lengths` is
therefore the full length for every prompt (the cache trims nothing) and `text_rows(n)` is `n`.

Only the text model runs (Mistral3's language model, Qwen3's base model), not the LM head the
pipelines' call also computes: the hidden states are the same numbers, without a (B, L, vocab)
logits tensor, and only the layers up to the deepest one read (dev: 30 of Mistral's 40, klein:
27 of Qwen3's 36; `layers_run`): the layers after it change no number the pipelines keep, and
skipping them saves a quarter of dev's encoding and of its file reads. When the encoder is on the host and encoding runs on a device, its decoder layers
are streamed there one at a time (memory/blockwise.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ...memory.lockstep import shared
from ..family import PromptEmbeds

DEFAULT_TEXT_LENGTH = 512                  # both pipelines' max_sequence_length
HIDDEN_LAYERS = {"mistral3": (10, 20, 30), "qwen3": (9, 18, 27)}


def text_model(encoders) -> torch.nn.Module:
    """The decoder-only text model whose hidden states are read (it holds `layers`)."""
    enc = encoders.text_encoder
    return enc.model.language_model if encoders.kind == "mistral3" else enc.model


def layers_run(kind: str, layers: int) -> int:
    """How many of the text model's `layers` decoder layers an encode runs: up to the deepest hidden
    state the pipeline stacks (hidden_states[k] is the output of layer k), all of them when that is
    the last (the model's final norm applies to it then)."""
    return min(layers, max(HIDDEN_LAYERS[kind]))


@contextmanager
def _first_layers(lm: torch.nn.Module, n: int):
    """`lm` with only its first `n` decoder layers, for the duration. The model's output ties its
    last hidden state to the final norm's output, so the norm is left out too when layers are cut:
    hidden_states[n] is then layer n's own output, as in the whole model's run."""
    layers, norm = lm.layers, lm.norm
    if n >= len(layers):
        yield
        return
    _capture_hooks_on_every_layer(lm)
    lm.layers, lm.norm = nn.ModuleList(list(layers)[:n]), nn.Identity()
    try:
        yield
    finally:
        lm.layers, lm.norm = layers, norm


def _capture_hooks_on_every_layer(lm: torch.nn.Module) -> None:
    """transformers installs the hooks that collect `hidden_states` once per model, on the layers
    present at its first call with outputs requested, and never again: were that first call made
    while `lm.layers` is cut, a later whole-model run (the pipeline's own encode, a reference check)
    would miss the hidden states of the layers left out. Installing them here, on the whole stack,
    before any cut makes the result independent of which encode ran first."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:         # a transformers without output capturing hooks has nothing to install
        return
    maybe_install_capturing_hooks(lm)


def _placement(encoders, device: torch.device):
    """The text model as it is when already on `device` (or for a host encode), else streamed layer
    by layer onto `device` (the caching phase)."""
    from ..streamed_encoder import placement

    lm = text_model(encoders)
    return placement(lm, lm.layers, device)       # from its files when it was left there


def _mistral_tokens(tokenizer, prompts: list[str], max_length: int):
    """Flux2Pipeline._get_mistral_3_small_prompt_embeds's tokenization (its own format_input and
    system message)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input

    inputs = tokenizer.apply_chat_template(format_input(prompts=prompts, system_message=SYSTEM_MESSAGE),
                                           add_generation_prompt=False, tokenize=True, return_dict=True,
                                           return_tensors="pt", padding="max_length", truncation=True,
                                           max_length=max_length)
    return inputs["input_ids"], inputs["attention_mask"]


def _qwen_tokens(tokenizer, prompts: list[str], max_length: int):
    """Flux2KleinPipeline._get_qwen3_prompt_embeds's tokenization: one prompt at a time."""
    ids, masks = [], []
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
        inputs = tokenizer(text, return_tensors="pt", padding="max_length", truncation=True, max_length=max_length)
        ids.append(inputs["input_ids"])
        masks.append(inputs["attention_mask"])
    return torch.cat(ids), torch.cat(masks)


def mistral_caption_tokens(tokenizer, captions: list[str]) -> list[int]:
    """Each caption's tokens in dev's template (system message included), as `_mistral_tokens`
    cuts them at max_length: a count over it loses the caption's end and the closing tokens."""
    from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input

    out = tokenizer.apply_chat_template(format_input(prompts=list(captions), system_message=SYSTEM_MESSAGE),
                                        add_generation_prompt=False, tokenize=True, return_dict=True)
    return [len(i) for i in out["input_ids"]]


def qwen_caption_tokens(tokenizer, captions: list[str]) -> list[int]:
    """Each caption's tokens in klein's template, as `_qwen_tokens` cuts them at max_length."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=False) for c in captions]
    return [len(i) for i in tokenizer(texts)["input_ids"]]


@torch.no_grad()
def encode_prompts(prompts: list[str], encoders, max_length: int = DEFAULT_TEXT_LENGTH,
                   device=None) -> tuple[PromptEmbeds, torch.Tensor]:
    """PromptEmbeds(t5=(B, max_length, 3 * D), pooled=(B, 0)) as the variant's pipeline encodes
    them, and the rows to keep per prompt (all of them: module docstring)."""
    device = torch.device(device or encoders.device)
    tokens = _mistral_tokens if encoders.kind == "mistral3" else _qwen_tokens
    input_ids, attention_mask = tokens(encoders.tokenizer, list(prompts), max_length)
    lm = text_model(encoders)
    n = layers_run(encoders.kind, len(lm.layers))
    # the cut is entered once per lock-step pass (its lanes share the model): memory/lockstep.py
    with shared(("first_layers", id(lm), n), lambda: _first_layers(lm, n)), _placement(encoders, device):
        out = lm(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                 output_hidden_states=True, use_cache=False)
    stacked = torch.stack([out.hidden_states[k] for k in HIDDEN_LAYERS[encoders.kind]], dim=1)
    stacked = stacked.to(dtype=encoders.text_encoder.dtype)
    b, n, length, d = stacked.shape
    seq = stacked.permute(0, 2, 1, 3).reshape(b, length, n * d)
    lengths = torch.full((b,), length, dtype=torch.long)
    return PromptEmbeds(t5=seq, pooled=seq.new_zeros(b, 0)), lengths


def padding_side(encoders) -> str:
    """Which end of a tokenized prompt holds the padding (every row is kept either way)."""
    tok = getattr(encoders.tokenizer, "tokenizer", encoders.tokenizer)     # a processor holds its tokenizer
    return getattr(tok, "padding_side", "right")


def text_rows(max_length: int) -> int:
    return max_length


def text_modules(encoders):
    """Nothing moves whole; the text model may run layer by layer (Mistral3's vision tower and both
    LM heads are not used for text and stay on the host)."""
    return [], text_model(encoders)
