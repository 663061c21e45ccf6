"""Wan's block as training runs it: diffusers' WanTransformerBlock, the same ops in the same order,
its parts kept for backward as their inputs when the plan splits blocks, and TI2V-5B's per-token
modulation applied per latent frame, not per token.

Why the split. A Wan step's activations grow with its frames: at 480 x 832 x 81 frames (32 760
tokens of width 5120) one A14B block keeps ~32 block outputs' worth for its backward (9.9 GiB
predicted), and the engine's checkpointing, which keeps only block inputs between blocks,
recomputes a block whole before its backward, so a step needs that much at once whatever it
streams. Split (memory/split_parts.py: nested non-reentrant checkpoints in the engine's block
checkpoint), a block keeps its parts' inputs and recomputes one part at a time:
    self-attention     norm1, modulation, attn1, gated residual
    cross-attention    norm2, attn2, residual
    FFN, first half    norm3, modulation, the input projection (kept: ffn_dim wide)
    FFN, second half   GELU, the output projection, gated residual
The probe (planner/activation_probe.py, LoRA r32, bf16 autocast, fp8 base, A14B at 480 x 832 x 81)
prices a block's kept bytes from 9.87 GiB (31.6 block outputs) to 1.78 GiB (5.7), its backward
transient from 2.00 to 6.37 GiB (the self-attention's recompute: float32 norms, the rotary's
float64 products), 8.15 GiB at once instead of 11.87; TI2V-5B at 704 x 1280 x 121: 5.55 to 1.20
GiB kept, transient 1.61 to 3.54. Splitting each attention at its kernel too (its q, k, v kept
between two parts) was measured and keeps more than it saves: q and k leave the rotary in float32
(A14B: 3.34 kept + 5.11 transient for the self-attention split, 3.98 + 4.63 for both). Each part
runs diffusers' own lines on the same tensors, so outputs and gradients are the plain block's bit
for bit (tests/test_wan_split_block.py); the price is one more forward of each block per step.

Why per frame. TI2V-5B takes a timestep per token (WanPipeline(expand_timesteps=True)), and
diffusers builds the time projection per token, (B, L, 6, D), then adds the block's
scale_shift_table to all of it in every block: 1.9 GiB of float32 per block at 704 x 1280 x 121
(27 280 tokens), which each block keeps for its backward through the gate (the probe: 8.05 GiB kept
per block per token, 5.55 per frame). But the tokens of one
latent frame share one timestep (every token in text-to-video; image-to-video's first frame takes
0), so their rows of the projection are equal, and every op that reads them is elementwise per row.
`compact_modulation` hands the blocks one row per frame, (B, F, 6, D), and the block applies each
row to its frame's tokens by broadcasting (the tokens viewed as (B, F, tokens per frame, D)): the
same float op on the same values for every element, so bitwise diffusers' result. The projection
itself is still computed per token by diffusers' own embedder (a GEMM's rows need not be the same
at another row count), and a real tensor's rows are compared before it is compacted: rows that
differ (timesteps not constant per frame) keep diffusers' per-token path. Where every token shares
one row (text-to-video) the output norm's temb is compacted too, (B, 1, D), which diffusers'
own broadcast takes. Where a modulation tensor trains (a full fine-tune of the time projection or
of scale_shift_table), its gradient would sum the rows in another order: such a step keeps the
per-token path. On tensors without values (the planner's probe, the simulated GPU) the structure
decides: a timestep expanded along the tokens (ti2v.token_timesteps, probe_inputs) is one row,
any other one row per frame, as the family's predict builds them.
"""

from __future__ import annotations

import logging

import torch
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel, WanTransformerBlock

from ...memory.split_parts import part

log = logging.getLogger("leantune")


def _rows_view(temb: torch.Tensor, hidden_states: torch.Tensor):
    """(to_rows, to_tokens): views of a (B, L, D) tensor as (B, S, L / S, D) for a (B, S, 6, D)
    modulation of S rows (S = L: diffusers' per-token layout) and back; identity for the (B, 6, D)
    modulation of one timestep per sample, which diffusers broadcasts itself."""
    if temb.ndim != 4:
        return (lambda x: x), (lambda x: x)
    rows = temb.shape[1]
    if hidden_states.shape[1] % rows:
        raise ValueError(f"a Wan block's modulation has {rows} rows for {hidden_states.shape[1]} tokens "
                         f"(a row per token, per latent frame or one for all)")
    return (lambda x: x.unflatten(1, (rows, -1))), (lambda x: x.flatten(1, 2))


class WanSplitBlock(WanTransformerBlock):
    # Set by the engine from Plan.split_blocks (memory/split_parts.set_split_parts).
    split_parts = False

    def _modulation(self, temb: torch.Tensor):
        """The block's six modulation tensors as diffusers' forward computes them, but for a
        (B, S, 6, D) temb each is left (B, S, 1, D), a row per S-th of the tokens (_rows_view)."""
        if temb.ndim == 4:
            return (self.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        return (self.scale_shift_table + temb.float()).chunk(6, dim=1)

    # diffusers' forward in four parts, each its lines on the same tensors; the modulation is
    # recomputed in each part from temb (a few rows: cheaper to recompute than to keep).
    def _self_attention(self, hidden_states, temb, freqs_cos, freqs_sin):
        shift_msa, scale_msa, gate_msa, _, _, _ = self._modulation(temb)
        rows, tokens = _rows_view(temb, hidden_states)
        norm_hidden_states = tokens(rows(self.norm1(hidden_states.float())) * (1 + scale_msa) + shift_msa
                                    ).type_as(hidden_states)
        attn_output = self.attn1(norm_hidden_states, None, None, (freqs_cos, freqs_sin))
        return tokens(rows(hidden_states.float()) + rows(attn_output) * gate_msa).type_as(hidden_states)

    def _cross_attention(self, hidden_states, encoder_hidden_states):
        norm_hidden_states = self.norm2(hidden_states.float()).type_as(hidden_states)
        attn_output = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
        return hidden_states + attn_output

    # The FFN in two halves: FeedForward.forward's modules, split after GELU's projection.
    def _ffn_in(self, hidden_states, temb):
        _, _, _, c_shift_msa, c_scale_msa, _ = self._modulation(temb)
        rows, tokens = _rows_view(temb, hidden_states)
        norm_hidden_states = tokens(rows(self.norm3(hidden_states.float())) * (1 + c_scale_msa) + c_shift_msa
                                    ).type_as(hidden_states)
        return self.ffn.net[0].proj(norm_hidden_states)

    def _ffn_out(self, projected, hidden_states, temb):
        _, _, _, _, _, c_gate_msa = self._modulation(temb)
        rows, tokens = _rows_view(temb, hidden_states)
        ff_output = self.ffn.net[0].gelu(projected)
        for module in self.ffn.net[1:]:
            ff_output = module(ff_output)
        return tokens(rows(hidden_states.float()) + rows(ff_output.float()) * c_gate_msa).type_as(hidden_states)

    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        split = self.split_parts and torch.is_grad_enabled()
        if not split and (temb.ndim != 4 or temb.shape[1] == hidden_states.shape[1]):
            return super().forward(hidden_states, encoder_hidden_states, temb, rotary_emb)   # diffusers' block
        run = part if split else (lambda fn, *tensors: fn(*tensors))
        freqs_cos, freqs_sin = rotary_emb
        hidden_states = run(self._self_attention, hidden_states, temb, freqs_cos, freqs_sin)
        hidden_states = run(self._cross_attention, hidden_states, encoder_hidden_states)
        projected = run(self._ffn_in, hidden_states, temb)
        return run(self._ffn_out, projected, hidden_states, temb)


def _valueless(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.is_meta or is_fake(t)


def _same_rows(proj: torch.Tensor, rows: int) -> bool:
    """Whether (B, L, N) `proj` is `rows` runs of equal rows (L / rows each), compared run by run
    (one run's comparison at a time, one host sync)."""
    runs = proj.unflatten(1, (rows, -1))
    return bool(torch.stack([(runs[:, r] == runs[:, r, :1]).all() for r in range(rows)]).all())


def compact_modulation(model: WanTransformer3DModel) -> None:
    """Hand `model`'s blocks TI2V-5B's per-token time projection as one row per latent frame (or one
    row for all tokens), where those rows are equal and nothing in the modulation trains; see the
    module's docstring. Two hooks: the model's forward pre-hook reads the latents' frame layout and
    the timestep, the condition embedder's forward hook compacts what it returns."""
    state = {}

    def layout(module, args, kwargs):
        state.clear()
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        timestep = kwargs["timestep"] if "timestep" in kwargs else args[1]
        if timestep.ndim != 2:                 # one timestep per sample: diffusers' (B, 6, D) already
            return
        p_t, p_h, p_w = module.config.patch_size
        frames, h, w = hidden.shape[2] // p_t, hidden.shape[3] // p_h, hidden.shape[4] // p_w
        if timestep.shape[1] != frames * h * w:
            return
        state["frames"] = frames
        state["one_row"] = timestep.stride(1) == 0        # expanded along the tokens: one timestep
        state["trains"] = module.scale_shift_table.requires_grad or \
            any(b.scale_shift_table.requires_grad for b in module.blocks)

    def compact(embedder, args, output):
        temb, timestep_proj, text, image = output
        frames = state.pop("frames", None)
        if frames is None or timestep_proj.ndim != 3 or state["trains"] or timestep_proj.requires_grad or \
                temb.requires_grad:
            return None
        if _valueless(timestep_proj):
            rows = 1 if state.get("one_row") else frames
        elif _same_rows(timestep_proj, 1):
            rows = 1
        elif _same_rows(timestep_proj, frames):
            rows = frames
        else:
            log.warning("Wan: the per-token timesteps differ within a latent frame: the blocks modulate per "
                        "token (diffusers' layout), beyond what the plan priced")
            return None
        b, length = timestep_proj.shape[:2]
        step = length // rows
        # copies (a one-row slice counts as contiguous: it would keep the whole projection alive)
        proj = timestep_proj[:, ::step].clone(memory_format=torch.contiguous_format)      # (B, rows, 6 D)
        if rows == 1:                      # the output norm's temb too: (B, 1, D) broadcasts in diffusers
            temb = temb[:, :1].clone(memory_format=torch.contiguous_format)
        return temb, proj, text, image

    model.register_forward_pre_hook(layout, with_kwargs=True)
    model.condition_embedder.register_forward_hook(compact)


def split_blocks(transformer, block_class: type = WanSplitBlock) -> None:
    """Make the blocks of `transformer` (a WanTransformer3DModel, or both experts' WanExperts)
    WanSplitBlocks (a class swap: the module tree, its names and weights are unchanged;
    ModelFamily.split_blocks), and compact TI2V-5B's per-token modulation (compact_modulation).
    The blocks split once the engine switches `split_parts` on."""
    for model in transformer.modules():
        if not isinstance(model, WanTransformer3DModel) or getattr(model, "_wan_split", False):
            continue
        for block in model.blocks:
            if not isinstance(block, WanSplitBlock):
                block.__class__ = block_class
        compact_modulation(model)
        model._wan_split = True
