"""CPU-measurable memory effects of the engine, as a markdown table (no GPU needed).

1. Activation memory kept for backward by one LoRA training step of a small real-class Flux,
   for checkpointing none / blocks / offload: bytes autograd saves on the compute device.
2. Host RAM while applying weight streaming to a wide real-class Flux (Linux /proc): peak and
   steady extra resident memory, versus the streamed bytes.

    python bench/cpu_memory.py [--out docs/cpu-memory.md]

These are what the CPU can show; VRAM peaks and step times need `bench_engine.py` on a GPU.
"""

from __future__ import annotations

import argparse
import copy
import gc
import re
from pathlib import Path

import torch

from leantune.memory.engine import apply_memory
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC, PromptEmbeds, pack_latents, predict
from leantune.tiny import wide_flux_transformer

MiB = 2**20


def lora_model(width_heads: int = 4, head_dim: int = 32):
    from peft import LoraConfig
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4,
                                   attention_head_dim=head_dim, num_attention_heads=width_heads,
                                   joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=True,
                                   axes_dims_rope=(8, 12, 12)).requires_grad_(False)
    model.add_adapter(LoraConfig(r=8, lora_alpha=8, target_modules=FLUX_SPEC.lora_target_regex("attention_mlp")))
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
    return model


def saved_activation_bytes(model, hw=(64, 64)) -> int:
    g = torch.Generator().manual_seed(0)
    h, w = hw
    x = pack_latents(torch.randn(1, 16, h, w, generator=g))
    embeds = PromptEmbeds(torch.randn(1, 32, 64, generator=g), torch.randn(1, 64, generator=g))
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = predict(model, x, torch.tensor([0.5]), embeds, hw, guidance=1.0).float().pow(2).mean()
    loss.backward()
    return sum(seen.values())


def _status() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.MULTILINE)}


def host_ram_while_streaming() -> tuple[int, int, int, int]:
    """(model bytes, streamed bytes, peak extra RSS during apply, extra RSS after apply)."""
    model = wide_flux_transformer(n_single=8)
    singles = tuple(n for n, _ in FLUX_SPEC.blocks(model) if n.startswith("single"))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    start = _status()["VmRSS"]
    Path("/proc/self/clear_refs").write_text("5")
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=singles), "cpu")
    st = _status()
    streamed = sum(handle.streaming.unit_bytes().values())
    handle.release()
    return model_bytes, streamed, st["VmHWM"] - start, st["VmRSS"] - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = ["| measurement | value |", "|---|---|"]
    base = lora_model()
    saved = {}
    for mode in ("none", "blocks", "offload"):
        model = copy.deepcopy(base)
        handle = apply_memory(model, FLUX_SPEC, Plan(checkpointing=mode), "cpu", offload_min_bytes=0)
        saved[mode] = saved_activation_bytes(model)
        handle.remove()
    for mode, b in saved.items():
        rows.append(f"| saved activations on the compute device, checkpointing={mode} (Flux width 128, 2+4 blocks, "
                    f"64x64 latent, LoRA r8) | {b / MiB:.2f} MiB ({b / saved['none']:.1%}) |")
    model_b, streamed_b, peak_b, end_b = host_ram_while_streaming()
    rows.append(f"| host RAM: model / streamed blocks (width 1024, 1+8 blocks, bf16) | {model_b / MiB:.0f} MiB / "
                f"{streamed_b / MiB:.0f} MiB |")
    rows.append(f"| host RAM: extra peak while applying streaming / extra after | {peak_b / MiB:.0f} MiB / "
                f"{end_b / MiB:.0f} MiB |")
    table = "\n".join(rows)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
