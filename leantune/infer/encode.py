"""Stage 1 of sampling: every prompt of a request is encoded, then the text encoders leave the GPU.

Which modules are the text encoders is the family's answer (`ModelFamily.text_modules`): Flux has
CLIP-L and T5-XXL, SD3.5 CLIP-L, CLIP-G and T5-XXL (or no T5). Negative prompts (classifier-free
guidance) are encoded in the same stage, so the encoders are placed once per request.

T5-XXL is 4.7 B parameters (9.5 GB in bf16): on its own more than a 6 GB budget. It runs once per
request, so it does not need the training engine's ring of prefetched slots: `blockwise_offload`
keeps the embedding and final norm on the GPU and brings one T5 block at a time (about 400 MB in
bf16), dropping it right after its forward. That costs one pass over the weights per request
(≈0.4 s at 25 GB/s) and bounds the stage's peak at one block plus activations. The CLIPs (123 M
and, for SD3.5, 695 M parameters) simply move to the GPU and back.

An encoder too large for host RAM (FLUX.2-dev's 24B Mistral) is loaded file-backed
(models/streamed_encoder.py): nothing of it is on the host, and the family's encode reads each
layer from the files onto the device as it runs.

While a block is not in use its parameters hold empty placeholders, not host copies, so any use of
an offloaded weight fails loudly instead of silently computing on the host; the same code path runs
on CPU, which is how the tests check the schedule.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..memory.blockwise import blockwise_offload
from ..models.family import ModelFamily, PromptEmbeds, get_family
from ..models.streamed_encoder import is_file_backed


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def t5_blocks(text_encoder_2: nn.Module) -> nn.ModuleList:
    """The repeated blocks of the streamable text encoder: a transformers T5EncoderModel's
    `encoder.block`, or a decoder-only text model's `layers` (Qwen-Image's Qwen2.5-VL)."""
    for path in ("encoder.block", "layers"):
        try:
            return text_encoder_2.get_submodule(path)
        except AttributeError:
            continue
    raise TypeError(f"{type(text_encoder_2).__name__} has neither an encoder.block nor a layers list; expected a "
                    f"T5EncoderModel or a decoder-only text model")


def _free_device_cache(device) -> None:
    """Hand the encoders' freed blocks back to the driver, so stage 2 starts from an empty device."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def text_encoder_bytes(text_encoders, family: ModelFamily) -> int:
    """Bytes of every text encoder module the family uses (what stage 1 puts on the device at once
    without T5 streaming)."""
    whole, streamable = family.text_modules(text_encoders)
    return sum(module_bytes(m) for m in whole) + (module_bytes(streamable) if streamable is not None else 0)


@torch.no_grad()
def encode_prompts_stage(text_encoders, prompts: list[str], *, max_length: int = 512, device="cpu",
                         stream_t5: bool = False, batch_size: int = 8, family: ModelFamily | None = None,
                         negative_prompts: list[str] | None = None, images: list | None = None):
    """Encode `prompts` on `device`; return one (1, L, D) PromptEmbeds per prompt on the host.

    `text_encoders` is what the family's `load_text_encoders` returns, on the host; they are back
    on the host when this returns, so the next stage has the device to itself. `stream_t5` runs T5
    block by block (see module docstring) for budgets it does not fit in. Prompts are encoded
    `batch_size` at a time, as the pipelines tokenize and encode them.

    With `negative_prompts` (a list, possibly empty) the return value is a pair (prompt embeddings,
    negative embeddings), the negatives encoded as their own batches while the encoders are placed.

    `images`: reference images (PIL) the text encoder reads with every prompt, negatives included
    (an edit family whose encoder sees them, infer/references.py); None: the text alone.
    """
    family = family or get_family("flux")
    whole, t5 = family.text_modules(text_encoders)
    modules = list(whole) + ([t5] if t5 is not None else [])
    if t5 is None or is_file_backed(t5):     # a file-backed encoder is placed by the family's encode
        t5_ctx = _nothing()
    else:
        t5_ctx = _moved(t5, device) if not stream_t5 else blockwise_offload(t5, t5_blocks(t5), device)
    lists = [prompts] + ([negative_prompts] if negative_prompts is not None else [])
    results = []
    with _eval_mode(*modules), _all_moved(whole, device), t5_ctx:
        for texts in lists:
            # One (1, L, D) embedding per prompt; L is its encoder batch's (T5 pads every prompt to
            # max_length; Qwen-Image pads to the batch's longest prompt).
            items = []
            for i in range(0, len(texts), batch_size):
                batch = texts[i:i + batch_size]
                extra = {} if images is None else {"images": [images] * len(batch)}
                emb, _ = family.encode_prompts(batch, text_encoders, max_length=max_length,
                                               device=torch.device(device), **extra)
                pooled, seq = emb.pooled.to("cpu"), emb.t5.to("cpu")      # (b, D_pooled), (b, L, D_text)
                items.extend(PromptEmbeds(t5=seq[j:j + 1], pooled=pooled[j:j + 1]) for j in range(seq.shape[0]))
            results.append(items)
    _free_device_cache(device)
    return results[0] if negative_prompts is None else (results[0], results[1])


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextmanager
def _all_moved(modules, device) -> Iterator[None]:
    """Move each module to `device` for the duration, then back where it was."""
    if not modules:
        yield
        return
    with _moved(modules[0], device), _all_moved(modules[1:], device):
        yield


@contextmanager
def _moved(module: nn.Module, device) -> Iterator[None]:
    """Move a whole module to `device` for the duration, then back where it was."""
    home = next(module.parameters()).device
    module.to(device)
    try:
        yield
    finally:
        module.to(home)


@contextmanager
def _eval_mode(*modules: nn.Module) -> Iterator[None]:
    """Dropout off while encoding (T5 has 0.1): the same prompt must always give the same embedding."""
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, was in zip(modules, modes):
            m.train(was)

