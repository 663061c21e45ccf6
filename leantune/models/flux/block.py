"""Flux.1's blocks as training runs them: diffusers' FluxTransformerBlock and
FluxSingleTransformerBlock, the same ops in the same order, whose parts are kept for backward as
their inputs only when the plan splits blocks (Plan.split_blocks), each part recomputed at the
start of its own backward.

Why. The engine's checkpointing keeps each block's input between blocks, but recomputes a block
whole before its backward, so the step's activation peak is one block's internals at once: at
1024² (4096 image rows + 512 text rows) a single block saves its norm, q/k/v and attention, the
MLP's 4x-wide projection and activation, the 5x-wide concatenation of both into proj_out, and the
LoRA inputs of each Linear. On an 8 GiB card with an NF4 base held resident that one block is what
does not fit. The parts, each a non-reentrant checkpoint nested in the engine's block checkpoint
(memory/split_parts.part):
    double block  attention    both streams' norm1 and modulation, the joint attention, the gates
                  image MLP    norm2, modulation, the up projection   |  GELU, down, gate
                  text MLP     the same lines on the text stream      |  (two parts each)
    single block  attention    the joint attention on the shared norm's output
                  MLP in       proj_mlp (4x wide)
                  output       GELU, the concatenation, proj_out, gate
(the single block's MLP input part runs before its attention, as in diffusers' order: the
gradients of the shared norm's output are summed in the plain block's order)
The single block's norm (shared by its attention and MLP) runs once, outside the parts: a second
run would add its modulation Linear's gradient in two sums and change its bits. The residual adds
run between parts. Each part runs diffusers' own lines on the same tensors, so outputs and
gradients are the plain blocks' bit for bit (tests/test_flux_split_block.py); the price is one
more forward of each block per step, so the planner takes it only where it is the fastest plan
that fits (its probe measures the blocks split and unsplit).

When. The switch `split_parts` (memory/split_parts.py) set by the engine from the plan; a block
splits only in a forward that records gradients and takes no IP-adapter arguments
(joint_attention_kwargs: sampling's, never training's).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

from ...memory.split_parts import part


def _splits(block, joint_attention_kwargs) -> bool:
    return block.split_parts and torch.is_grad_enabled() and not joint_attention_kwargs


def _rotary(cos, sin):
    return None if cos is None else (cos, sin)


# A FeedForward("gelu-approximate") in two parts, split where its up projection is made:
# net[0] is GELU(proj, then tanh-approximate gelu), then dropout and the down projection.
def _mlp_in(norm, ff, hidden_states, shift, scale):
    norm_hidden_states = norm(hidden_states)
    norm_hidden_states = norm_hidden_states * (1 + scale[:, None]) + shift[:, None]
    return ff.net[0].proj(norm_hidden_states)


def _mlp_out(ff, up, gate):
    hidden_states = ff.net[0].gelu(up)
    for module in ff.net[1:]:
        hidden_states = module(hidden_states)
    return gate.unsqueeze(1) * hidden_states


class FluxSplitTransformerBlock(FluxTransformerBlock):
    # Set by the engine from Plan.split_blocks (memory/split_parts.set_split_parts).
    split_parts = False

    def _attention(self, hidden_states, encoder_hidden_states, temb, cos, sin):
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
            encoder_hidden_states, emb=temb
        )
        attn_output, context_attn_output = self.attn(
            hidden_states=norm_hidden_states,
            encoder_hidden_states=norm_encoder_hidden_states,
            image_rotary_emb=_rotary(cos, sin),
        )
        attn_output = gate_msa.unsqueeze(1) * attn_output
        context_attn_output = c_gate_msa.unsqueeze(1) * context_attn_output
        return (attn_output, context_attn_output, shift_mlp, scale_mlp, gate_mlp,
                c_shift_mlp, c_scale_mlp, c_gate_mlp)

    def _ff_in(self, hidden_states, shift, scale):
        return _mlp_in(self.norm2, self.ff, hidden_states, shift, scale)

    def _ff_out(self, up, gate):
        return _mlp_out(self.ff, up, gate)

    def _ff_context_in(self, hidden_states, shift, scale):
        return _mlp_in(self.norm2_context, self.ff_context, hidden_states, shift, scale)

    def _ff_context_out(self, up, gate):
        return _mlp_out(self.ff_context, up, gate)

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                joint_attention_kwargs=None):
        if not _splits(self, joint_attention_kwargs):
            return super().forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb=image_rotary_emb,
                                   joint_attention_kwargs=joint_attention_kwargs)
        cos, sin = (None, None) if image_rotary_emb is None else image_rotary_emb
        (attn_output, context_attn_output, shift_mlp, scale_mlp, gate_mlp, c_shift_mlp, c_scale_mlp,
         c_gate_mlp) = part(self._attention, hidden_states, encoder_hidden_states, temb, cos, sin)
        hidden_states = hidden_states + attn_output
        del attn_output
        up = part(self._ff_in, hidden_states, shift_mlp, scale_mlp)
        hidden_states = hidden_states + part(self._ff_out, up, gate_mlp)
        del up
        encoder_hidden_states = encoder_hidden_states + context_attn_output
        del context_attn_output
        up = part(self._ff_context_in, encoder_hidden_states, c_shift_mlp, c_scale_mlp)
        encoder_hidden_states = encoder_hidden_states + part(self._ff_context_out, up, c_gate_mlp)
        del up
        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
        return encoder_hidden_states, hidden_states


class FluxSplitSingleTransformerBlock(FluxSingleTransformerBlock):
    # Set by the engine from Plan.split_blocks (memory/split_parts.set_split_parts).
    split_parts = False

    def _attention(self, norm_hidden_states, cos, sin):
        return self.attn(hidden_states=norm_hidden_states, image_rotary_emb=_rotary(cos, sin))

    def _mlp_in(self, norm_hidden_states):
        return self.proj_mlp(norm_hidden_states)

    def _output(self, attn_output, up, gate):
        mlp_hidden_states = self.act_mlp(up)
        hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
        gate = gate.unsqueeze(1)
        return gate * self.proj_out(hidden_states)

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                joint_attention_kwargs=None):
        if not _splits(self, joint_attention_kwargs):
            return super().forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb=image_rotary_emb,
                                   joint_attention_kwargs=joint_attention_kwargs)
        cos, sin = (None, None) if image_rotary_emb is None else image_rotary_emb
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        residual = hidden_states
        norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
        up = part(self._mlp_in, norm_hidden_states)          # before the attention, as diffusers' order
        attn_output = part(self._attention, norm_hidden_states, cos, sin)
        hidden_states = part(self._output, attn_output, up, gate)
        del attn_output, up
        hidden_states = residual + hidden_states
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
        return encoder_hidden_states, hidden_states


def split_blocks(model) -> None:
    """Make `model`'s blocks the split classes (a class swap: the module tree, its names and weights
    are unchanged; ModelFamily.split_blocks). Blocks already of a split class keep theirs. They
    split once the engine switches `split_parts` on."""
    for block in model.transformer_blocks:
        if not isinstance(block, FluxSplitTransformerBlock):
            block.__class__ = FluxSplitTransformerBlock
    for block in model.single_transformer_blocks:
        if not isinstance(block, FluxSplitSingleTransformerBlock):
            block.__class__ = FluxSplitSingleTransformerBlock
