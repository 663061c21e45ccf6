"""Which attention kernel a step's calls take, and why (memory/attention_report.py; issue 40
finding 10: Qwen-Image batches with mixed prompt lengths, and issue 35: Qwen-Image-2.1's
block-causal mask). The real tiny diffusers transformers; the kernel is torch's own choice."""

from __future__ import annotations

import pytest
import torch

from leantune.memory.attention_report import AttentionWatch, chosen_kernel
from leantune.models.family import PromptEmbeds


def _qwen_image_calls(prompt_rows: list[int]):
    """The watched calls of one tiny Qwen-Image forward whose prompts have these real rows."""
    from leantune.models.qwen_image import predict
    from leantune.tiny import qwen_image as tq

    model = tq.qwen_image_transformer(0)
    seq = torch.randn(len(prompt_rows), max(prompt_rows), 32)
    for i, n in enumerate(prompt_rows):
        seq[i, n:] = 0                                      # the padding rows (text_mask reads them)
    with AttentionWatch() as watch:
        predict(model, torch.randn(len(prompt_rows), 16, 64), torch.full((len(prompt_rows),), 0.5),
                      PromptEmbeds(seq, torch.zeros(len(prompt_rows), 1)), (8, 8))
    return watch


def test_qwen_image_passes_a_mask_exactly_when_the_prompts_of_a_batch_differ_in_length():
    """Equal lengths (and a batch of one) pass no mask; mixed lengths pass one at every attention
    call; the sentence says which and why; SDPA is itself again after the watch."""
    same = _qwen_image_calls([6, 6])
    mixed = _qwen_image_calls([6, 3])
    layers = 2                                                # QWEN_IMAGE_TINY num_layers
    assert sum(same.calls.values()) == sum(mixed.calls.values()) == layers
    assert {masked for masked, _, _ in same.calls} == {False}
    assert {masked for masked, _, _ in mixed.calls} == {True}
    text = mixed.summary(torch.device("cpu"))
    assert "2 calls" in text and "an attention mask is passed" in text and "prompts of different lengths" in text
    assert "no mask" in same.summary(torch.device("cpu"))
    import torch.nn.functional as F
    assert F.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"    # restored after


def test_qwen_image21_masks_its_text_segment_and_leaves_the_image_block_unmasked(tmp_path):
    """Qwen-Image-2.1's layout is block-causal (text causal, each image block bidirectional), and
    diffusers' SDPA processor attends it segment by segment: per layer one call for the text with
    its causal mask, one for the target's image block with none (the flash kernel's on CUDA)."""
    from leantune.models.qwen_image21 import forward
    from leantune.tiny import qwen_image21 as tq21

    model = tq21.qwen_image21_transformer(0)
    cfg = model.config
    b, rows, (h, w) = 1, 5, (4, 4)
    with AttentionWatch() as watch:
        forward.predict(model, torch.randn(b, h * w, cfg.in_channels), torch.full((b,), 0.5),
                        torch.randn(b, rows, cfg.context_in_dim), None, torch.zeros(b, rows, dtype=torch.bool),
                        (h, w))
    layers = cfg.num_layers
    by_mask = {masked: sum(n for (m, _, _), n in watch.calls.items() if m == masked) for masked in (True, False)}
    assert by_mask == {True: layers, False: layers}
    assert "causal text segment" in watch.summary(torch.device("cpu"))


def test_the_kernel_is_torchs_own_choice_for_the_tensors():
    q = torch.randn(1, 2, 8, 16)
    assert chosen_kernel(q, q, q) == chosen_kernel(q, q, q, None)
    assert chosen_kernel(q, q, q) in {"flash", "math", "memory-efficient"}


@pytest.mark.gpu
def test_on_cuda_a_mask_moves_the_call_from_flash_to_memory_efficient():
    """GPU-only (bench/gpu_checks.sh): bf16 without a mask is flash; with a padding mask, the
    memory-efficient kernel, which is what the sentence says on CUDA."""
    q = torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 128, 128, device="cuda", dtype=torch.bool)
    mask[..., 100:] = False
    assert chosen_kernel(q, q, q) == "flash"
    assert chosen_kernel(q, q, q, mask) == "memory-efficient"
