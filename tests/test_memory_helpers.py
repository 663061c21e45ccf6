"""Builders shared by the memory engine tests (this module holds no tests itself).

A tiny real-class Flux with a peft LoRA (fp32, nonzero lora_B so gradients are meaningful), batches
of two bucket shapes at batch size 2, and a short training run that records the loss, the LoRA
gradients and the LoRA values after each SGD step.
"""

from __future__ import annotations

import copy

import torch

from leantune.memory.engine import apply_memory
from leantune.memory.plan import Plan
from leantune import tiny
from leantune.models.flux import FLUX_SPEC, PromptEmbeds, pack_latents, predict

SHAPES = ((8, 8), (8, 12))      # latent h, w: two buckets (16 and 24 image tokens)
BATCH = 2
TEXT_LEN = 8


def lora_flux(seed: int = 0, dtype: torch.dtype = torch.float32, preset: str = "attention_mlp", **overrides):
    """Tiny Flux, frozen, with a rank-4 LoRA in fp32 whose lora_B is random (not zero)."""
    from peft import LoraConfig

    model = tiny.flux_transformer(seed=seed, dtype=dtype, **overrides)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                 target_modules=FLUX_SPEC.lora_target_regex(preset)))
    g = torch.Generator().manual_seed(seed + 100)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
            if "lora_B" in name:
                p.data = torch.randn(p.shape, generator=g) * 0.1
    return model


def make_batch(h: int, w: int, seed: int, device="cpu", dtype=torch.float32, text_dim: int = 32,
               pooled_dim: int = 32, batch: int = BATCH, text_len: int = TEXT_LEN):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 16, h, w, generator=g)
    embeds = PromptEmbeds(torch.randn(batch, text_len, text_dim, generator=g), torch.randn(batch, pooled_dim, generator=g))
    sigma = torch.rand(batch, generator=g)
    target = torch.randn(batch, (h // 2) * (w // 2), 64, generator=g)
    return (pack_latents(latents).to(device, dtype), sigma.to(device), embeds.to(device, dtype),
            (h, w), target.to(device))


def lora_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def base_state(model) -> dict[str, torch.Tensor]:
    """Every non-adapter parameter and buffer, detached copies on CPU."""
    out = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if "lora_" not in n}
    out.update({n: b.detach().to("cpu", copy=True) for n, b in model.named_buffers()})
    return out


def train(model, shapes=SHAPES, lr: float = 0.1, device="cpu") -> list[dict]:
    """One SGD step per bucket shape; per step: loss, LoRA grads, LoRA values after the step."""
    params = lora_params(model)
    opt = torch.optim.SGD(list(params.values()), lr=lr)
    records = []
    for step, (h, w) in enumerate(shapes):
        x, sigma, embeds, hw, target = make_batch(h, w, seed=step, device=device)
        opt.zero_grad(set_to_none=True)
        pred = predict(model, x, sigma, embeds, hw, guidance=1.0)
        loss = torch.nn.functional.mse_loss(pred.float(), target)
        loss.backward()
        grads = {n: (p.grad.detach().cpu().clone() if p.grad is not None else None) for n, p in params.items()}
        opt.step()
        records.append({"loss": loss.detach().cpu(), "grads": grads,
                        "values": {n: p.detach().cpu().clone() for n, p in params.items()}})
    return records


def run_plan(base, plan: Plan, device="cpu", **kw):
    """Apply `plan` to a copy of `base`, train two steps; returns (records, handle, model)."""
    model = copy.deepcopy(base)
    handle = apply_memory(model, FLUX_SPEC, plan, device, **kw)
    return train(model, device=device), handle, model


def assert_records_equal(got: list[dict], want: list[dict]) -> None:
    """Bitwise equality of losses, LoRA gradients and LoRA values, step by step."""
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g["loss"], w["loss"]), f"step {step}: loss {g['loss'].item()} != {w['loss'].item()}"
        assert g["grads"].keys() == w["grads"].keys()
        for name in w["grads"]:
            assert w["grads"][name] is not None, f"reference has no gradient for {name}"
            assert g["grads"][name] is not None, f"step {step}: no gradient for {name}"
            assert torch.equal(g["grads"][name], w["grads"][name]), (
                f"step {step}: gradient of {name} differs by "
                f"{(g['grads'][name] - w['grads'][name]).abs().max().item():.3e}")
            assert torch.equal(g["values"][name], w["values"][name]), f"step {step}: {name} after the step differs"


def block_names(model) -> list[str]:
    return [n for n, _ in FLUX_SPEC.blocks(model)]


def assert_quantized_base_streams_exactly(model, stored: int) -> None:
    """A LoRA model on a quantized base (GGUF, NF4, int8: `stored` block Linears holding uint8
    rows): two SGD steps with every block and the non-block group streamed (poison mode: a released
    slot's 0xFF bytes decode to NaN scales) and checkpointed equal the resident run bitwise (loss,
    adapter gradients and values); the streamed units carry the rows as uint8, as stored, bytes
    crossed to the device, and the base keeps its bytes after the engine is removed."""
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == torch.uint8}
    assert len(before) == stored
    want = train(copy.deepcopy(model))
    assert want[0]["grads"]
    plan = Plan(streamed_blocks=tuple(block_names(model)), stream_non_blocks=True, checkpointing="blocks",
                debug_poison=True)
    handle = apply_memory(model, FLUX_SPEC, plan, "cpu")
    assert sum(e.dtype == torch.uint8 for u in handle.streaming.units for e in u.entries) == stored
    got = train(model)
    assert all(torch.isfinite(r["loss"]) for r in got)
    assert_records_equal(got, want)
    assert handle.step_report()["bytes_h2d"] > 0
    handle.remove()
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p, before[n]), n


def synchronizes_beyond_the_profiler(prof_events) -> list[str]:
    """The synchronizing CUDA calls in a profile beyond those the profiler makes itself.

    torch's profiler (seen with torch 2.11 on an H100) records a cudaDeviceSynchronize of its own
    around any profiled region, even one that only adds two tensors; a check that the code under
    test never synchronizes compares against a profile of such a region."""
    from collections import Counter

    names = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    x = torch.ones(8, device="cuda")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as control:
        x.add_(1)
    torch.cuda.synchronize()
    base = Counter(e.name for e in control.events() if e.name in names)
    seen = Counter(e.name for e in prof_events if e.name in names)
    return sorted((seen - base).elements())


def decoded_copy(model):
    """`model` with every quantized base Linear (GGUF / NF4 / int8 rows) replaced by a plain fp32
    Linear holding the weight its rows decode to: the base an adapter on the quantized one must
    train exactly as on."""
    from leantune.train.quantized_adapters import decoded_weight, is_quantized

    plain = copy.deepcopy(model)
    for parent in list(plain.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and is_quantized(child):
                new = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                with torch.no_grad():
                    new.weight.copy_(decoded_weight(child))
                    if child.bias is not None:
                        new.bias.copy_(child.bias)
                setattr(parent, child_name, new.requires_grad_(False))
    return plain


ADAPTER_NAMES = ("lora_", "lokr_", "hada_")


def _step(model, params, seed: int = 0):
    x, sigma, embeds, hw, target = make_batch(8, 8, seed=seed)
    loss = torch.nn.functional.mse_loss(predict(model, x, sigma, embeds, hw, guidance=1.0).float(), target)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in params]


def _applies_from_its_file(trained, quantized, plain, kind: str) -> None:
    """The adapter trained on the quantized base, saved and read back (kohya layout), applied on a
    fresh quantized base and on the decoded one: both compute what the trained model computes."""
    import tempfile
    import warnings
    from pathlib import Path

    from leantune.train.lora import apply_lora, lora_weights_from_model
    from leantune.train.lora_formats import LoraCompatibilityWarning, read_lora, save_lora

    x, sigma, embeds, hw, _ = make_batch(8, 12, seed=3)
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", LoraCompatibilityWarning)       # DoRA's note on stock ComfyUI
        want = predict(trained, x, sigma, embeds, hw, guidance=1.0)
        weights = read_lora(save_lora(lora_weights_from_model(trained), Path(tmp) / "a.safetensors", "comfyui"))
        assert weights.kind == kind
        for base in (quantized, plain):
            m = copy.deepcopy(base)
            apply_lora(m, weights)
            got = predict(m, x, sigma, embeds, hw, guidance=1.0)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda s: f"{kind} from its file: {s}")


def assert_adapters_train_as_on_the_decoded_base(model, stored: int, kinds=("lokr", "loha", "dora")) -> None:
    """LoKr, LoHa and DoRA added to a quantized base (`stored` uint8 block Linears) start as the same
    adapter and give the loss and adapter gradients they give on the decoded fp32 base (to fp32
    rounding: the base's own matmul may sum in another order); the rows stay stored; streamed and
    checkpointed in poison mode, the step equals the resident one bitwise; its saved file applies to
    the quantized and the decoded base as trained."""
    from leantune.config import LoraConfig
    from leantune.train.lora import add_lora

    plain = decoded_copy(model)
    for kind in kinds:
        runs = []
        for base in (model, plain):
            m = copy.deepcopy(base)
            torch.manual_seed(0)
            params = add_lora(m, FLUX_SPEC, LoraConfig(type=kind, rank=4, targets="all"))
            init = [p.detach().clone() for p in params]
            g = torch.Generator().manual_seed(7)
            with torch.no_grad():
                for p in params:
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
            runs.append((m, params, init, _step(m, params)))
        (mq, pq, iq, (lq, gq)), (_, _, ip, (lp, gp)) = runs
        assert len(iq) == len(ip) and all(torch.equal(a, b) for a, b in zip(iq, ip)), f"{kind}: another init"
        assert sum(p.dtype == torch.uint8 for p in mq.parameters()) == stored, kind
        torch.testing.assert_close(lq, lp, rtol=1e-5, atol=1e-7, msg=lambda s: f"{kind} loss: {s}")
        for i, (a, b) in enumerate(zip(gq, gp)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7, msg=lambda s: f"{kind} gradient {i}: {s}")
        _applies_from_its_file(mq, model, plain, kind)
        for p in pq:
            p.grad = None
        resident = _step(mq, pq, seed=1)
        for p in pq:
            p.grad = None
        plan = Plan(streamed_blocks=tuple(block_names(mq)), stream_non_blocks=True, checkpointing="blocks",
                    debug_poison=True)
        handle = apply_memory(mq, FLUX_SPEC, plan, "cpu")
        try:
            streamed = _step(mq, pq, seed=1)
        finally:
            handle.remove()
        assert torch.equal(streamed[0], resident[0]), kind
        assert all(torch.equal(a, b) for a, b in zip(streamed[1], resident[1])), kind
