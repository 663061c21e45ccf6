"""Which attention kernel a run's transformer calls take, and why: watched on the first step, said once.

Why: torch's scaled-dot-product attention picks its kernel per call from the inputs, and the
choice decides the step's speed and memory: the flash kernel takes no attention mask (only
`is_causal`), so a call that passes one runs on the memory-efficient kernel (or the math one)
instead. Whether a mask is passed depends on the family and the batch, not on a setting:
Qwen-Image passes one exactly when the prompts of a batch differ in length (the padding rows are
masked; a batch of one, or of equal lengths, passes none); Qwen-Image-2.1's block-causal layout
(text causal, each image block bidirectional) is attended segment by segment by diffusers' SDPA
processor: the text segment's calls pass its causal mask, each image block's (references, the
target) none unless the batch pads its prompts, so the image rows, most of the sequence, keep the
flash kernel; Flux and SD3.5 pass none. A user
comparing step times deserves to be told, rather than guess.

`AttentionWatch` wraps `torch.nn.functional.scaled_dot_product_attention` (diffusers and
transformers call it through the module at each call) for one step and records, per call, whether
a mask was passed and the backend torch itself chooses for those very tensors
(`torch._fused_sdp_choice`, the function SDPA dispatches with); `summary()` is the sentence. On the
CPU torch's own flash kernel takes a mask, so there the mask changes nothing.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

_NAMES = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "memory-efficient", "MATH": "math",
          "CUDNN_ATTENTION": "cuDNN", "OVERRIDEABLE": "a backend's own", "ERROR": "none (refused)"}


def kernel_name(choice: int) -> str:
    """torch's SDPBackend value -> its name in words."""
    from torch.nn.attention import SDPBackend

    try:
        return _NAMES.get(SDPBackend(choice).name, SDPBackend(choice).name.lower())
    except ValueError:
        return f"backend {choice}"


def chosen_kernel(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale=None, enable_gqa: bool = False) -> str:
    """The kernel torch picks for these arguments (its own dispatch function, on their device)."""
    choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                     enable_gqa=enable_gqa)
    return kernel_name(int(choice))


class AttentionWatch:
    """Within: every scaled_dot_product_attention call is recorded as (mask passed, kernel)."""

    def __init__(self):
        self.calls: Counter = Counter()

    def __enter__(self):
        self._original = F.scaled_dot_product_attention
        original = self._original

        def watched(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, **kwargs):
            try:
                kernel = chosen_kernel(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            except Exception:     # noqa: BLE001 - a tensor subclass (fake, meta) with no dispatch to ask
                kernel = "unknown"
            self.calls[(attn_mask is not None, bool(is_causal), kernel)] += 1
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa, **kwargs)

        F.scaled_dot_product_attention = watched
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self._original
        return False

    def summary(self, device: torch.device) -> str | None:
        """One sentence: the kernels the watched calls ran on, with why; None when none was seen
        (a model whose attention does not go through SDPA)."""
        if not self.calls:
            return None
        total = sum(self.calls.values())
        parts = []
        for (masked, causal, kernel), n in sorted(self.calls.items(), key=lambda kv: -kv[1]):
            why = ("an attention mask is passed: padding of prompts of different lengths in the batch, or a "
                   "causal text segment" if masked else "causal, no mask" if causal else "no mask")
            if masked and kernel != "flash" and device.type == "cuda":
                why += "; the flash kernel takes no mask"
            parts.append(f"{n} on the {kernel} kernel ({why})")
        return f"attention on {device.type}, {total} calls in the first step: " + "; ".join(parts)
