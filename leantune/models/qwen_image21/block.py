"""Qwen-Image-2.1's block as training runs it: diffusers' QwenImage21TransformerBlock, the same
ops in the same order, whose parts are kept for backward as their inputs only when the plan splits
blocks (Plan.split_blocks), each part recomputed at the start of its own backward.

Why. References multiply the joint sequence (1024², 3 references: 16.9 k rows, the target's 4.1 k
of them), and a block's backward holds everything its forward saved, for every row at once: the
plain 7B block saves 37 block outputs' worth (4.8 GiB at 3 references) and its recompute adds a
transient of 2.5 GiB, so no plan fits 8 GiB whatever it streams (the engine's checkpointing keeps
only block inputs between blocks, but recomputes each block whole before its backward). The prefix
rows (text and references) cannot be left out of that backward: block-causal, they never read the
target, but the target reads their keys and values in every block, and a LoRA's gradient flows
back through them. What can go is holding all of a block's internals at once. Three parts, each a
non-reentrant checkpoint nested in the engine's block checkpoint:
    attention branch  norm, modulation, q/k/v, rotary, the per-segment attention, out, gate
    MLP, first part   norm, modulation, the gate and up projections (kept: both, mlp_ratio wide)
    MLP, second part  SiLU, product, down projection, gate
A block then keeps 8 block outputs (its input to the MLP, the two projections, its output) and
recomputes one part at a time: at 3 references the step's activations fall from 7.9 to 4.2 GiB
(planner, docs/benchmarks.md). Splitting the attention branch too (keeping q, k, v) was measured
and gains nothing: the MLP's backward is the peak. Each part runs diffusers' own lines on the same
tensors, so outputs and gradients are the plain block's bit for bit (tests/
test_qwen_image21_split_block.py); the price is one more forward of each block per step.

When. A plan choice (Plan.split_blocks, memory/split_parts.py's seam): the engine switches the
blocks' `split_parts` on where the planner found the split plan the fastest that fits (with
references at 8 GiB and below, as a rule); then the block splits in every forward that records
gradients with no prefix KV cache (the sampler's is a no-grad side effect), a text-to-image batch
too (the planner prices that step split as well). The planner's probe runs this class
(meta_model.py's block derives from it) with the switch off and on, so its price follows what the
block keeps; a recompute runs under the torch function modes of its forward (split_parts.same_modes),
which is how the probe's bf16 autocast emulation and the meta copy's host layout reach it.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21TransformerBlock, _select_modulation_rows

from ...memory.split_parts import part


class QwenImage21SplitBlock(QwenImage21TransformerBlock):
    # Set by the engine from Plan.split_blocks (memory/split_parts.set_split_parts).
    split_parts = False

    def _attention_branch(self, hidden_states, mod1, rotary_emb, target_token_mask, key_valid, attention_mask,
                          segments):
        img_modulated, img_gate1 = self._modulate(self.img_norm1(hidden_states), mod1, target_token_mask)
        attn_output = self.attn(hidden_states=img_modulated, attention_mask=attention_mask, rotary_emb=rotary_emb,
                                layer_cache=None, kv_cache_mode=None, cache_write_slice=None, segments=segments,
                                key_valid=key_valid)
        return img_gate1.tanh() * attn_output

    # The MLP in two parts: _modulate's and QwenImage21SwiGLUFeedForward.forward's lines, split
    # where the two projections are made.
    def _mlp_in(self, hidden_states, mod2, target_token_mask):
        img_modulated2, _ = self._modulate(self.img_norm2(hidden_states), mod2, target_token_mask)
        mlp = self.img_mlp
        return mlp.gate_layer(img_modulated2), mlp.proj(img_modulated2)

    def _mlp_out(self, gate, proj, mod2, target_token_mask):
        mlp = self.img_mlp
        out = mlp.out(mlp.activation_fn(gate) * proj)
        _, g = mod2.chunk(2, dim=-1)             # _modulate's gate, as it computes it
        return _select_modulation_rows(g, target_token_mask).tanh() * out

    def forward(self, hidden_states, modulation, rotary_emb=None, attention_mask=None, target_token_mask=None,
                layer_cache=None, kv_cache_mode=None, cache_write_slice=None, segments=None, key_valid=None):
        if not (self.split_parts and torch.is_grad_enabled() and layer_cache is None and kv_cache_mode is None):
            return super().forward(hidden_states, modulation, rotary_emb=rotary_emb, attention_mask=attention_mask,
                                   target_token_mask=target_token_mask, layer_cache=layer_cache,
                                   kv_cache_mode=kv_cache_mode, cache_write_slice=cache_write_slice,
                                   segments=segments, key_valid=key_valid)
        mod1, mod2 = modulation.chunk(2, dim=-1)
        # A flex BlockMask and the segment list are not tensors: passed by closure. Tensors go
        # positionally, so checkpoint saves them (and the engine's offload hooks see them).
        def attn(h, m, r, t, k):
            return self._attention_branch(h, m, r, t, k, attention_mask, segments)

        branch = part(attn, hidden_states, mod1, rotary_emb, target_token_mask, key_valid)
        hidden_states = hidden_states + branch
        del branch
        g, p = part(self._mlp_in, hidden_states, mod2, target_token_mask)
        hidden_states = hidden_states + part(self._mlp_out, g, p, mod2, target_token_mask)
        del g, p
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states


def split_blocks(model, block_class: type = QwenImage21SplitBlock) -> None:
    """Make `model`'s blocks QwenImage21SplitBlocks (a class swap: the module tree, its names and
    weights are unchanged; ModelFamily.split_blocks). Blocks already of a split class (the meta
    copy's, meta_model.py) keep theirs. They split once the engine switches `split_parts` on."""
    for block in model.transformer_blocks:
        if not isinstance(block, QwenImage21SplitBlock):
            block.__class__ = block_class
