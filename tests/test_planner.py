"""The planner: byte counts against real models, activation predictions against a real CPU step,
the search's guarantees, infeasible budgets, host RAM, OOM handling, calibration and `leantune plan`."""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from leantune.config import ConfigError, LoraConfig
from leantune.memory.plan import Plan
from leantune.planner.corrections import CalibrationStore, architecture_key
from leantune.planner.feedback.calibrate import PlanCalibrator
from leantune.errors import is_out_of_memory
from leantune.planner.feedback.oom import NoPlanFits, OomGuard
from leantune.planner.from_config import budget_from_config, parse_vram, plan_for_config
from leantune.planner.host_model import HOST_BASELINE
from leantune.models.weights import QUANTIZING_WORK_BYTES
from leantune.planner.machine import assumed_machine, probe_machine
from leantune.planner.meta import build_meta_flux
from leantune.planner.report import format_plan
from leantune.planner.search import Planner
from leantune.planner.weight_bytes import measure_weights
from leantune.planner.workload import Budget, InfeasibleBudget, Workload
from leantune.memory.host_buffers import STAGING_CHUNK
from leantune import tiny
from leantune.models.flux import FLUX_SPEC, PromptEmbeds, pack_latents, predict
from leantune.train.lora import add_lora

GiB = 2**30
UNLIMITED = 2**62


def tiny_lora_model(dtype=torch.float32, rank=4, double=2, single=2, **lora):
    model = tiny.flux_transformer(dtype=dtype, num_layers=double, num_single_layers=single)
    model.requires_grad_(False)
    add_lora(model, FLUX_SPEC, LoraConfig(rank=rank, **lora))
    return model


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    """Measurements and calibrations go to the test's folder, never to the user's cache."""
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))


@pytest.fixture
def one_thread():
    """Real CPU steps run single-threaded: tiny ops gain nothing from threads, and on a busy shared
    machine OpenMP barriers make two threads orders of magnitude slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def flux_dev_planner():
    """The full-size Flux-dev architecture on meta, LoRA r16, 1024 px: what `leantune plan` plans."""
    model = build_meta_flux("dev")
    return Planner(FLUX_SPEC, model, Workload(rank=16, buckets=((1024, 1024),)))


# -- weights -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_equal_the_real_parameter_bytes(dtype):
    model = tiny_lora_model(dtype=dtype)
    weights = measure_weights(FLUX_SPEC, model)
    real = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    real += sum(b.numel() * b.element_size() for b in model.buffers())
    assert weights.native_bytes == real
    assert weights.total(torch.finfo(dtype).bits // 8) == real
    for (name, block), w in zip(FLUX_SPEC.blocks(model), weights.blocks):
        assert w.name == name
        assert w.bytes(torch.finfo(dtype).bits // 8) == sum(
            p.numel() * p.element_size() for n, p in block.named_parameters() if "lora_" not in n)


def test_flux_dev_meta_build_has_the_published_parameter_count():
    dev, schnell = build_meta_flux("dev"), build_meta_flux("schnell")
    assert all(p.device.type == "meta" for p in dev.parameters())
    w = measure_weights(FLUX_SPEC, dev)
    assert w.numel == 11_901_408_320          # BFL's Flux.1-dev transformer
    assert [b.kind for b in w.blocks].count("double") == 19 and len(w.blocks) == 57
    assert measure_weights(FLUX_SPEC, schnell).numel < w.numel    # no guidance embedder
    with pytest.raises(ValueError, match="unknown Flux variant"):
        build_meta_flux("pro")


@pytest.mark.parametrize("fp8,mod,pin", [(False, False, False), (True, False, False), (False, False, True),
                                         (True, True, True)])
def test_unit_slot_and_fp8_bytes_equal_the_engine(fp8, mod, pin):
    """What the planner prices is exactly what fp8 storage (modulation Linears included or not)
    and the streaming engine allocate (pinned or not: the engine pins a unit's exact size)."""
    from leantune.memory.fp8 import apply_fp8_storage
    from leantune.memory.streaming import apply_streaming, remove_streaming

    model = tiny_lora_model(dtype=torch.bfloat16)
    weights = measure_weights(FLUX_SPEC, model)
    if fp8:
        handle = apply_fp8_storage(model, FLUX_SPEC, modulation=mod)
        assert handle.bytes_after == sum(b.bytes(2, fp8=True, modulation=mod) - (b.numel - b.e4m3_numel(True, mod)) * 2
                                         for b in weights.blocks)
        real_blocks = sum(t.numel() * t.element_size() for _, blk in FLUX_SPEC.blocks(model)
                          for n, t in list(blk.named_parameters()) + list(blk.named_buffers()) if "lora_" not in n)
        assert real_blocks == sum(b.bytes(2, fp8=True, modulation=mod) for b in weights.blocks)
    names = tuple(n for n, _ in FLUX_SPEC.blocks(model))
    plan = Plan(streamed_blocks=names, stream_non_blocks=True, fp8=fp8, fp8_modulation=mod, ring_slots=3, pin_memory=pin)
    stream = apply_streaming(model, FLUX_SPEC, plan, "cpu")
    try:
        real = stream.unit_bytes()
        assert real["non_blocks"] == weights.non_blocks.unit_bytes(2)
        for b in weights.blocks:
            assert real[b.name] == b.unit_bytes(2, fp8, mod), b.name
        planner = Planner(FLUX_SPEC, tiny_lora_model(dtype=torch.bfloat16),
                            Workload(rank=4, buckets=((128, 128),), text_length=8, allow_fp8=True))
        vram, host, _ = planner.memory(plan)
        slots = stream.engine.slots
        assert vram["stream slots"] == len(slots) * slots[0].buf.numel()
        assert host[f"streamed blocks ({'pinned' if pin else 'pageable'})"] == stream.host_bytes
        assert host["staging buffers"] == (0 if pin else 2 * STAGING_CHUNK)
    finally:
        remove_streaming(stream, "cpu")


def _real_width_flux():
    """A real-class Flux at width 1024 (one double, eight single blocks, 324 MiB in bf16), its bf16
    weights a constant: built on meta and every page written (so it counts as resident), which costs
    a fraction of a random fp32 init and a cast. The tests that use it count bytes, never values."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=8,
                                       attention_head_dim=128, num_attention_heads=8, joint_attention_dim=64,
                                       pooled_projection_dim=64, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.data = torch.empty(p.shape, dtype=torch.bfloat16).fill_(0.01)
    return model


def _rss() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.MULTILINE)}


def _can_reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")      # VmHWM := current VmRSS
        return "VmHWM" in _rss()
    except OSError:
        return False


@pytest.mark.skipif(not _can_reset_rss_peak(), reason="needs Linux /proc/self/status and a writable clear_refs")
def test_planned_host_ram_matches_the_engine_while_packing():
    """The host RAM the planner predicts for applying a plan is what the engine's resident set
    really grows by: the largest unit beside the model (units are packed one by one, each
    original freed before the next), then the streamed units once, in buffers of their exact size.

    A real-class Flux at width 1024 (one double, eight single blocks, 324 MiB in bf16) so that one
    block (30 MiB) stands far above allocator noise and far below the eight streamed (240 MiB).
    """
    from leantune.memory.engine import apply_memory

    model = _real_width_flux()
    model.requires_grad_(False).eval()
    workload = Workload(mode="inference", buckets=((64, 64),), text_length=4, autocast=False, allow_fp8=False)
    planner = Planner(FLUX_SPEC, model, workload)
    singles = tuple(n for n, _ in FLUX_SPEC.blocks(model) if n.startswith("single"))
    plan = Plan(streamed_blocks=singles, ring_slots=2)
    host = planner.memory(plan)[1]
    predicted_extra = host["stored transformer + one unit while packing"] - host["transformer while loading"]
    gc.collect()
    start = _rss()["VmRSS"]
    Path("/proc/self/clear_refs").write_text("5")
    handle = apply_memory(model, FLUX_SPEC, plan, "cpu")
    measured = _rss()["VmHWM"] - start
    try:
        units = handle.streaming.unit_bytes()
        assert host["streamed blocks (pinned)"] == handle.streaming.host_bytes == sum(units.values())
        assert sum(units.values()) > 7 * max(units.values())        # packing all first would be far off
        assert abs(measured - predicted_extra) <= 6 * 2**20, (measured / 2**20, predicted_extra / 2**20)
    finally:
        handle.remove()


def test_an_fp8_checkpoint_is_priced_in_fp8_in_every_plan():
    """Block Linears that arrive in e4m3 (an fp8 checkpoint, with the loader's per-row scales) stay
    e4m3 whatever plan.fp8 says: the planner prices them at 1 byte plus their own scales, exactly
    as the model holds them and as the engine packs them."""
    from leantune.memory.engine import apply_memory
    from leantune.memory.fp8 import FP8_MAX, block_linears, use_fp8_weight

    def checkpoint_like():
        model = tiny_lora_model(dtype=torch.bfloat16)
        with torch.no_grad():
            for _, rel, lin in block_linears(FLUX_SPEC, model):
                if FLUX_SPEC.keeps_compute_dtype(rel):
                    continue
                w = lin.weight.float()
                scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX      # (out, 1)
                lin.weight.data = (w / scale).to(torch.float8_e4m3fn)
                use_fp8_weight(lin, scale)
        return model

    model = checkpoint_like()
    weights = measure_weights(FLUX_SPEC, model)
    assert weights.prequantized
    for (name, block), w in zip(FLUX_SPEC.blocks(model), weights.blocks):
        real = sum(t.numel() * t.element_size() for n, t in list(block.named_parameters()) + list(block.named_buffers())
                   if "lora_" not in n)
        assert w.bytes(2) == w.bytes(2, fp8=True) == real < w.numel * 2, name
    workload = Workload(rank=4, buckets=((128, 128),), text_length=8)
    planner = Planner(FLUX_SPEC, model, workload)
    plain = Planner(FLUX_SPEC, tiny_lora_model(dtype=torch.bfloat16), workload)
    resident = Plan()
    assert planner.memory(resident)[0]["weights resident"] < plain.memory(resident)[0]["weights resident"]
    names = tuple(n for n, _ in FLUX_SPEC.blocks(model))
    plan = Plan(streamed_blocks=names, fp8=False, ring_slots=2)
    handle = apply_memory(checkpoint_like(), FLUX_SPEC, plan, "cpu")
    try:
        real = handle.streaming.unit_bytes()
        assert [real[n] for n in names] == planner.units(plan)
        assert planner.memory(plan)[1]["streamed blocks (pinned)"] == handle.streaming.host_bytes
    finally:
        handle.remove()


@pytest.mark.parametrize("targets,blocks", [("attention", None), ("attention_mlp", None), ("all", None),
                                            ("attention_mlp", {"double": [1], "single": []})])
def test_adapter_parameters_equal_peft(targets, blocks):
    model = tiny_lora_model(rank=3, targets=targets, blocks=blocks)
    real = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    w = measure_weights(FLUX_SPEC, model, Workload(rank=3, targets=targets, lora_blocks=blocks))
    assert w.adapter_params(3) == real > 0


# -- activations: predicted on meta, measured on a real CPU step -----------------------------------------------

class _Mallinfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo
    return libc


def _heap_in_use() -> int:
    """Bytes the C heap has handed out (small chunks + mmapped ones): the CPU allocator's truth."""
    m = _libc().mallinfo2()
    return m.uordblks + m.hblkhd


@pytest.fixture(scope="module")
def fresh_process():
    """`run(fn, *args)`: `fn(*args)` (a function of a test module) in a new Python process that the
    module's cases share, for a heap peak sampled after every op of a real step. glibc's mallinfo2
    walks every free chunk of the heap: late in a pytest-xdist worker, after a few hundred tests,
    one call took 4 ms (measured: 6458 calls, 27 s of a 32 s step that takes 2 s alone). A fresh
    process samples an unfragmented heap, as the module run alone does, for ~2 CPU-s of imports."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # An executor, not a Pool: a child that dies raises BrokenProcessPool instead of hanging.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        # each case with its own test's cache folder (_cache_in_tmp), as when it ran in this process
        yield lambda fn, *args: pool.submit(_with_cache, os.environ["LEANTUNE_CACHE"], fn, *args).result()


def _with_cache(cache: str, fn, *args):
    os.environ["LEANTUNE_CACHE"] = cache
    return fn(*args)


class _HeapPeak(TorchDispatchMode):
    """Samples the heap after every op of a real run; the peak is relative to the start."""

    def __enter__(self):
        self.base, self.peak = _heap_in_use(), 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, _heap_in_use() - self.base)
        return out


def _kept_per_block(model, spec, forward) -> list[tuple[str, int, int]]:
    """Per block of a real forward (`forward()`, run once before to warm up): the bytes of the distinct
    storages autograd newly keeps for backward while the block runs (saved_tensors_hooks, by data
    pointer, parameters left out), and the heap's growth from the previous block's end (the first
    block: the forward's start) to its end.

    The first is what a GPU would hold; the second adds the autograd graph's own nodes (host memory).
    """
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: set[int] = set()
    current: list[str | None] = [None]
    kept: dict[str, int] = {}
    heap: dict[str, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if current[0] is not None and ptr not in weights and ptr not in seen:
            seen.add(ptr)
            kept[current[0]] += storage.nbytes()
        return t

    def pre(name):
        def hook(_m, _a):
            current[0] = name
            kept[name] = 0
        return hook

    def post(name):
        def hook(_m, _a, _o):
            current[0] = None
            heap[name] = _heap_in_use()
        return hook

    handles = []
    for name, block in spec.blocks(model):
        handles += [block.register_forward_pre_hook(pre(name)), block.register_forward_hook(post(name))]
    try:
        forward()
        seen.clear()
        gc.collect()
        start = _heap_in_use()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
        ends = [start, *heap.values()]
        rows = [(name, kept[name], end - before) for name, before, end in zip(heap, ends, ends[1:])]
        del out
    finally:
        for h in handles:
            h.remove()
    return rows


def test_saved_bytes_per_block_match_a_real_forward(one_thread):
    """What the probe says a double and a single block keep equals what autograd keeps for backward in
    the interior blocks of a real 5+5-block forward on CPU (LoRA r4, 512 px)."""
    from leantune.planner.activation_probe import probe_activations

    res, text = 512, 32
    model = tiny_lora_model(double=5, single=5)
    workload = Workload(rank=4, buckets=((res, res),), text_length=text, dtype=torch.float32, autocast=False,
                        allow_fp8=False)
    kinds = probe_activations(FLUX_SPEC, model, workload, (res, res)).kinds
    g = torch.Generator().manual_seed(0)
    h = res // 8
    packed = pack_latents(torch.randn(1, 16, h, h, generator=g))
    embeds = PromptEmbeds(torch.randn(1, text, 32, generator=g), torch.randn(1, 32, generator=g))
    sigma = torch.rand(1, generator=g)
    rows = _kept_per_block(model, FLUX_SPEC, lambda: predict(model, packed, sigma, embeds, (h, h), 1.0))
    for kind, prefix in (("double", "transformer_blocks."), ("single", "single_transformer_blocks.")):
        interior = [kept for name, kept, _ in rows if name.startswith(prefix)][1:-1]
        assert len(interior) == 3 and len(set(interior)) == 1, interior
        assert abs(kinds[kind].saved - interior[0]) <= 0.01 * interior[0], (kind, kinds[kind].saved, interior)


def _flux_step_peak(checkpointing: str) -> tuple[int, int]:
    """(predicted, measured) activation peak of the 3+5-block tiny Flux's real step at 768 px (the
    test below; run in a fresh process, see fresh_process)."""
    from leantune.memory.checkpointing import apply_checkpointing

    torch.set_num_threads(1)            # as the one_thread fixture
    res, text = 768, 32
    model = tiny_lora_model(double=3, single=5)
    workload = Workload(rank=4, buckets=((res, res),), text_length=text, dtype=torch.float32, autocast=False,
                          allow_fp8=False)
    predicted = Planner(FLUX_SPEC, model, workload).activation_peak((res, res), False, checkpointing)
    if checkpointing == "blocks":
        apply_checkpointing(model, FLUX_SPEC)
    g = torch.Generator().manual_seed(0)
    h = res // 8
    packed = pack_latents(torch.randn(1, 16, h, h, generator=g))          # (1, h/2*w/2, 64)
    embeds = PromptEmbeds(torch.randn(1, text, 32, generator=g), torch.randn(1, 32, generator=g))
    target = torch.randn(packed.shape, generator=g)
    sigma = torch.rand(1, generator=g)

    def step():
        loss = ((predict(model, packed, sigma, embeds, (h, h), 1.0).float() - target) ** 2).mean()
        loss.backward()

    step()                                 # warm-up: thread pools and allocator caches
    for p in model.parameters():
        p.grad = None
    gc.collect()
    with _HeapPeak() as heap:
        step()
    return predicted, heap.peak


@pytest.mark.parametrize("checkpointing", ["none", "blocks"])
def test_predicted_activation_peak_matches_a_real_cpu_step(checkpointing, fresh_process):
    """The meta probe (2+2 blocks) extrapolated to a 3+5-block model predicts the heap peak of a real
    forward+backward on CPU (with the engine's own checkpointing for "blocks") within 5%, plus
    1 MiB for the scratch buffers of CPU attention kernels, which the flash kernels modelled lack."""
    predicted, peak = fresh_process(_flux_step_peak, checkpointing)
    assert abs(peak - predicted) <= 0.05 * predicted + 2**20, (peak, predicted)


def test_checkpointing_trades_activations_and_fp8_halves_block_bytes(flux_dev_planner):
    pl = flux_dev_planner
    bucket = (1024, 1024)
    none, blocks, offload = (pl.activation_peak(bucket, False, c) for c in ("none", "blocks", "offload"))
    assert none > 5 * blocks > 5 * offload > 0
    w = pl.weights
    double = w.blocks[0]
    assert 0.6 < double.bytes(2, fp8=True) / double.bytes(2) < 0.75   # modulation and norms stay bf16
    # A double block moves ~2.4x more bytes per FLOP than a single one: singles stream first, spread out.
    assert pl.order == ["single", "double"]
    assert [pl.kinds[i] for i in pl.streamed_set(38)] == ["single"] * 38
    two = pl.streamed_set(40)
    assert [w.blocks[i].name for i in two if pl.kinds[i] == "double"] == ["transformer_blocks.4", "transformer_blocks.14"]
    assert [w.blocks[i].name for i in pl.streamed_set(2)] == ["single_transformer_blocks.9",
                                                              "single_transformer_blocks.28"]


# -- the search ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flux_dev_512_planner():
    return Planner(FLUX_SPEC, build_meta_flux("dev"), Workload(rank=16, buckets=((512, 512),)))


@pytest.mark.parametrize("res,start", [(512, 10), (1024, 12)])
def test_more_budget_never_streams_more_turns_fp8_on_or_slows_the_step(res, start, flux_dev_planner,
                                                                       flux_dev_512_planner):
    """Along budgets from the smallest that works (2.5 / 3 GiB; split blocks at the smallest 1024 px ones) to 80 GiB in quarter-GiB steps,
    every plan fits, fp8 modulation and then fp8 (and split blocks) only ever turn off, and while the
    storage and the split stay the same the step time, the streamed parameters and the bytes copied to the GPU per step never grow;
    at 80 GiB everything is resident."""
    planner = flux_dev_512_planner if res == 512 else flux_dev_planner
    with pytest.raises(InfeasibleBudget):
        planner.plan(Budget(vram=(start - 1) * GiB // 4, ram=UNLIMITED))
    rows = []
    for quarter_gib in range(start, 321):
        budget = Budget(vram=quarter_gib * GiB // 4, ram=UNLIMITED)
        plan = planner.plan(budget)
        n = plan.notes
        assert n["predicted_peak_vram"] <= budget.usable_vram
        params = sum(u.numel for u in planner.unit_weights(plan))
        rows.append((quarter_gib / 4, (plan.fp8_modulation, plan.fp8), n["predicted_step_s"], params,
                     n["h2d_bytes_per_step"], plan.split_blocks))
    for (gib, st, step_s, params, moved, split), (gib2, st2, step_s2, params2, moved2, split2) in zip(rows, rows[1:]):
        assert st2 <= st and split2 <= split, (gib, gib2)     # each only ever turns off
        if st2 == st and split2 == split:
            assert step_s2 <= step_s + 1e-6 and params2 <= params and moved2 <= moved, (gib, gib2)
    assert rows[-1][3:5] == (0, 0) and not rows[-1][5]
    assert rows[0][1] == (True, True) and rows[0][4] > 0     # the smallest budget needs fp8 modulation
    assert rows[1][1] != (True, True)                        # and a quarter GiB more does not


def test_fp8_modulation_is_chosen_only_when_nothing_else_fits(flux_dev_planner):
    """fp8 for the modulation Linears is not priced against speed but held back: at 1024 px it is
    chosen only below the smallest budget that works without it, where it makes a plan fit.
    fp8_modulation = false refuses those budgets, true uses it at every budget."""
    pl = flux_dev_planner
    without = Planner(FLUX_SPEC, build_meta_flux("dev"), replace(pl.workload, fp8_modulation=False))
    forced = Planner(FLUX_SPEC, build_meta_flux("dev"), replace(pl.workload, fp8_modulation=True))
    assert without.storages == [(False, False), (True, False)] and forced.storages == [(False, True), (True, True)]
    with pytest.raises(InfeasibleBudget) as info:
        without.plan(Budget(vram=11 * GiB // 4, ram=UNLIMITED))
    plain_min = info.value.needed_vram
    with pytest.raises(InfeasibleBudget) as info:
        pl.plan(Budget(vram=11 * GiB // 4, ram=UNLIMITED))
    mod_min = info.value.needed_vram
    assert mod_min < plain_min and "fp8=on + modulation" in str(info.value)
    tight = pl.plan(Budget(vram=mod_min, ram=UNLIMITED))
    assert tight.fp8 and tight.fp8_modulation
    assert tight.notes["predicted_peak_vram"] <= Budget(vram=mod_min).usable_vram
    at_min = pl.plan(Budget(vram=plain_min, ram=UNLIMITED))
    assert not at_min.fp8_modulation
    for gib in (4, 8, 24):
        assert not pl.plan(Budget(vram=gib * GiB, ram=UNLIMITED)).fp8_modulation
        assert forced.plan(Budget(vram=gib * GiB, ram=UNLIMITED)).fp8_modulation
    # the weights it prices: a double block's modulation Linears are 2 x 6 x 3072 x 3072 elements
    double = pl.weights.blocks[0]
    mod_numel = double.e4m3_numel(True, True) - double.e4m3_numel(True, False)
    assert mod_numel == 2 * 6 * 3072 * 3072
    assert double.bytes(2, True, False) - double.bytes(2, True, True) == 2 * mod_numel - (mod_numel + 4 * mod_numel // 64)


def test_host_ram_picks_fp8_modulation_when_only_it_fits(flux_dev_planner):
    """With caches in host RAM, the streamed blocks' host buffers decide the host peak: a RAM budget
    that only the fp8-modulation plans fit chooses one, one that fp8 alone fits does not."""
    pl = Planner(FLUX_SPEC, build_meta_flux("dev"), replace(flux_dev_planner.workload, host_cache_bytes=15 * GiB))
    budget = Budget(vram=6 * GiB, ram=UNLIMITED)
    fits = [p for p in pl.candidates() if sum(pl.memory(p)[0].values()) <= budget.usable_vram]
    host = {st: min(pl.memory(p)[1]["peak"] for p in fits if p.storage == st) for st in pl.storages}
    assert host[(True, True)] < host[(True, False)] < host[(False, False)]
    plan = pl.plan(replace(budget, ram=(host[(True, True)] + host[(True, False)]) // 2))
    assert plan.storage == (True, True) and plan.notes["predicted_peak_host"] <= host[(True, False)]
    plan = pl.plan(replace(budget, ram=(host[(True, False)] + host[(False, False)]) // 2))
    assert plan.storage == (True, False)


def test_a_quantizing_load_is_priced_at_what_it_keeps(flux_dev_planner):
    """The trainer quantizes the block Linears an fp8 plan stores as it reads them
    (Workload.quantizes_on_load), so its loading phase is the fp8 model plus the quantizing workers'
    buffers, not the bf16 file: a 20 GiB RAM budget, less than Flux-dev's 23.8 GB of bf16 weights,
    starts an fp8 LoRA run. The sampler loads as stored and converts afterwards: the same budget is
    refused it, naming the loading phase."""

    sampler_like = flux_dev_planner
    trainer = Planner(FLUX_SPEC, build_meta_flux("dev"), replace(flux_dev_planner.workload, quantizes_on_load=True))
    quantized, as_stored = trainer.memory(Plan(fp8=True))[1], sampler_like.memory(Plan(fp8=True))[1]
    stored = quantized["stored transformer + one unit while packing"]          # nothing streams: the stored model
    assert quantized["transformer while loading"] == stored + QUANTIZING_WORK_BYTES
    assert quantized["transformer while converting to fp8"] == 0
    assert as_stored["transformer while loading"] > 1.4 * stored      # bf16 first (the modulation stays bf16)
    assert as_stored["transformer while converting to fp8"] > as_stored["transformer while loading"]
    assert trainer.memory(Plan())[1] == sampler_like.memory(Plan())[1]            # nothing to quantize: the same
    budget = Budget(vram=80 * GiB, ram=20 * GiB)
    plan = trainer.plan(budget)
    assert plan.fp8 and plan.notes["predicted_peak_host"] <= 20 * GiB
    with pytest.raises(InfeasibleBudget, match="loading the transformer alone takes"):
        sampler_like.plan(budget)


def test_fp8_is_chosen_only_where_it_buys_a_tenth_of_the_step(flux_dev_planner, flux_dev_512_planner):
    """At 512 px a block computes in a quarter of its 1024 px time, so bf16 copies hide less: fp8
    (half the bytes) is chosen at tight budgets, and only while the best plan without it is at
    least 10% slower. At 1024 px bf16 copies hide and fp8 is never worth its error."""
    chosen = {}
    for res, planner in ((512, flux_dev_512_planner), (1024, flux_dev_planner)):
        bf16_only = Planner(FLUX_SPEC, build_meta_flux("dev"), replace(planner.workload, allow_fp8=False))
        for gib in (4, 6, 8, 12, 16, 24):
            budget = Budget(vram=gib * GiB, ram=UNLIMITED)
            plan, plain = planner.plan(budget), bf16_only.plan(budget)
            assert not plain.fp8
            if plan.fp8:
                assert plain.notes["predicted_step_s"] >= 1.1 * plan.notes["predicted_step_s"], (res, gib)
            chosen[res, gib] = plan.fp8
    assert chosen[512, 4] and not chosen[512, 16] and not any(chosen[1024, g] for g in (4, 6, 8, 12, 16, 24))


def test_infeasible_budget_names_the_smallest_budget_that_works(flux_dev_planner):
    with pytest.raises(InfeasibleBudget) as info:
        flux_dev_planner.plan(Budget(vram=2 * GiB, ram=UNLIMITED))
    err = info.value
    needed = err.needed_vram
    assert needed > 2 * GiB
    assert f"smallest budget that works is {needed / GiB:.2f} GiB" in str(err)
    assert "[data] resolutions" in str(err) and "[lora] rank" in str(err)
    plan = flux_dev_planner.plan(Budget(vram=needed, ram=UNLIMITED))      # the stated minimum works ...
    assert plan.notes["predicted_peak_vram"] <= Budget(vram=needed).usable_vram
    with pytest.raises(InfeasibleBudget):                                  # ... and is the minimum
        flux_dev_planner.plan(Budget(vram=needed - 32 * 2**20, ram=UNLIMITED))


def test_inference_budget_hint_names_the_sample_request_keys():
    """A sampling workload that does not fit is told in the sample request's terms (its keys and
    `leantune sample` flags), not the training config's."""
    model = tiny.flux_transformer(dtype=torch.bfloat16)
    workload = Workload(mode="inference", batch_size=2, buckets=((256, 512),), text_length=16, autocast=False)
    planner = Planner(FLUX_SPEC, model, workload, replace(assumed_machine(), workspace=0))
    with pytest.raises(InfeasibleBudget) as info:
        planner.plan(Budget(vram=2**16, ram=UNLIMITED, min_margin=0))
    message = str(info.value)
    assert "512x256, 2 image(s) per forward" in message
    for key in ("width/height (--width/--height)", "images_per_prompt (--images-per-prompt)", "batch_size",
                "max_text_length", "--vram, or [memory] vram_budget in the request"):
        assert key in message, key
    assert "[data]" not in message and "[lora]" not in message and "[train]" not in message
    needed = info.value.needed_vram
    plan = planner.plan(Budget(vram=needed, ram=UNLIMITED, min_margin=0))     # the stated minimum works
    assert plan.notes["predicted_peak_vram"] <= Budget(vram=needed, min_margin=0).usable_vram


def test_host_ram_budget_picks_fp8_then_refuses_early(flux_dev_planner):
    """Host RAM peaks while the bf16 transformer loads and, for plans without fp8, while the engine
    packs a unit beside the stored model; a budget between the two must choose fp8, and one below
    loading must be refused with the smallest host need, before anything is loaded."""
    pl = flux_dev_planner
    budget = Budget(vram=8 * GiB, ram=UNLIMITED)
    fits = [p for p in pl.candidates() if sum(pl.memory(p)[0].values()) <= budget.usable_vram]
    assert fits and all(p.pin_memory for p in pl.candidates())   # exact-size pinning: pageable saves nothing
    loaded = pl.weights.total(2)
    host = {fp8: min(pl.memory(p)[1]["peak"] for p in fits if p.fp8 == fp8) for fp8 in (False, True)}
    largest_unit = max(b.unit_bytes(2) for b in pl.weights.blocks)
    assert HOST_BASELINE + loaded < host[False] <= HOST_BASELINE + loaded + largest_unit + 2**20
    assert host[True] < host[False]
    ram = (host[False] + host[True]) // 2
    plan = pl.plan(replace(budget, ram=ram))
    assert plan.fp8 and plan.notes["predicted_peak_host"] <= ram
    with pytest.raises(InfeasibleBudget, match=r"ram_budget is 16\.00 GiB") as info:
        pl.plan(replace(budget, ram=16 * GiB))
    assert info.value.needed_ram == HOST_BASELINE + loaded     # nothing after loading adds to that
    assert "loading the transformer alone takes" in str(info.value)


# -- OOM -------------------------------------------------------------------------------------------------------

def test_oom_guard_replans_tighter_and_redoes_the_same_step(one_thread):
    """A simulated allocator that fails whenever a plan's real peak (20% above the prediction) exceeds
    the device; the guard must re-plan until it fits and redo the step with the same batch, leaving the
    same gradients as an uninterrupted step."""
    res, text = 128, 8
    workload = Workload(rank=4, buckets=((res, res),), text_length=text, dtype=torch.float32, autocast=False)
    model = tiny_lora_model()
    reference = tiny_lora_model()
    reference.load_state_dict(model.state_dict())
    # No fixed workspace or margin, so that a tiny model's plans differ by their activations.
    planner = Planner(FLUX_SPEC, model, workload, replace(assumed_machine(), workspace=0))
    budget = Budget(vram=GiB, ram=UNLIMITED, min_margin=0)
    first = planner.plan(budget)
    capacity = int(first.notes["predicted_peak_vram"] * 1.2 * 0.97)       # the first plan will not fit
    current = {"plan": first}

    def real_peak(plan):
        return int(planner.estimate(plan).peak_vram * 1.2)

    g = torch.Generator().manual_seed(1)
    h = res // 8
    batch = (pack_latents(torch.randn(1, 16, h, h, generator=g)),
             PromptEmbeds(torch.randn(1, text, 32, generator=g), torch.randn(1, 32, generator=g)))
    sigma = torch.tensor([0.4])

    def step(m, packed, embeds):
        loss = predict(m, packed, sigma, embeds, (h, h), 1.0).pow(2).mean()
        loss.backward()
        if m is model and real_peak(current["plan"]) > capacity:        # the allocator fails late in the step
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (simulated)")
        return float(loss.detach())

    def apply_plan(plan):
        current["plan"] = plan
        for p in model.parameters():
            p.grad = None                  # the failed step's partial gradients must not count twice

    guard = OomGuard(planner, budget, first, apply_plan)
    loss = guard.run(step, model, *batch, step=7)
    expected = step(reference, *batch)
    assert loss == pytest.approx(expected, rel=0, abs=0)
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad), n
    assert current["plan"] != first and real_peak(current["plan"]) <= capacity
    assert len(guard.events) >= 1 and "out of memory at step 7: re-planned" in guard.events[0]

    def always_fails(*_):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    stuck = OomGuard(planner, budget, first, lambda plan: None, shrink=0.5)
    with pytest.raises(NoPlanFits, match="resumable"):
        stuck.run(always_fails, step=3)

    def broken(*_):
        raise ValueError("not a memory problem")

    with pytest.raises(ValueError, match="not a memory problem"):
        OomGuard(planner, budget, first, apply_plan).run(broken)


def _tight_tiny_planner():
    """A tiny model with no fixed workspace or margin, so that its plans differ by their activations."""
    workload = Workload(rank=4, buckets=((128, 128),), text_length=8, dtype=torch.float32, autocast=False)
    planner = Planner(FLUX_SPEC, tiny_lora_model(), workload, replace(assumed_machine(), workspace=0))
    return planner, Budget(vram=GiB, ram=UNLIMITED, min_margin=0)


def test_a_plan_that_runs_out_of_memory_while_being_applied_is_replanned_tighter():
    """Applying the tighter plan after an OOM can itself run out of memory (weights moving onto the
    device): that is caught by the same guard, which re-plans tighter again instead of failing."""
    planner, budget = _tight_tiny_planner()
    first = planner.plan(budget)
    applied, attempts = [], []

    def apply_plan(plan):
        applied.append(plan)
        if len(applied) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory while applying (simulated)")

    def step():
        attempts.append(len(applied))
        if not applied:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return "done"

    guard = OomGuard(planner, budget, first, apply_plan)
    assert guard.run(step, step=3) == "done"
    assert attempts == [0, 2]                       # redone once, after the second plan went in
    peaks = [p.notes["predicted_peak_vram"] for p in (first, *applied)]
    assert peaks[0] > peaks[1] > peaks[2] and guard.plan == applied[-1] and guard.replans == 2


def test_calibration_after_an_oom_works_from_the_plan_and_budget_in_use():
    """After an OOM re-plan the calibrator compares the plan that now runs, re-plans within the
    tightened budget, and a peak below the prediction does not plan back towards the plan that failed."""
    planner, budget = _tight_tiny_planner()
    first = planner.plan(budget)
    applied = []
    guard = OomGuard(planner, budget, first, applied.append)
    failed = {"n": 0}

    def step():
        if not failed["n"]:
            failed["n"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    guard.run(step, step=1)
    after_oom, tight = guard.plan, guard.budget
    assert after_oom != first and tight.vram < budget.vram
    calibrator = PlanCalibrator(guard)
    bucket = (128, 128)
    predicted = planner.memory(after_oom)[2]["128x128"]["peak_vram"]
    assert calibrator.observe(bucket, predicted // 4) is None        # lower than predicted: not trusted now
    assert guard.plan == after_oom and planner.calibration.activation_scale == {}
    higher = PlanCalibrator(guard)
    new = higher.observe(bucket, tight.usable_vram + 2 * tight.margin_bytes)
    assert new is not None and guard.plan == new == applied[-1]
    assert new.notes["predicted_peak_vram"] <= tight.usable_vram and guard.budget == tight


def test_oom_guard_frees_the_failed_step_after_its_handler_and_persists_no_calibration_from_it(
        monkeypatch, tmp_path):
    """While the `except` block runs, the traceback holds the failed step's frames and so its
    tensors: freeing there (gc, empty_cache, the peak reset) frees nothing and starts the peak at the
    near-OOM level. The guard must free after leaving the handler, when the failed step's tensors are
    gone. And a calibration observed in a run that already ran out of memory is used for this run
    but not stored: the next run starts from the uncorrected model, not from a near-OOM reading."""
    import sys
    import weakref

    from leantune.planner.feedback import oom

    planner, budget = _tight_tiny_planner()
    first = planner.plan(budget)
    held, seen = [], []

    def free():
        gc.collect()
        seen.append((held[0]() is not None, sys.exc_info()[0] is not None))

    monkeypatch.setattr(oom, "_free_memory", free)

    def step():
        if not held:
            activations = torch.empty(1 << 20)            # what the failed step's graph holds
            held.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return "done"

    guard = OomGuard(planner, budget, first, lambda plan: None)
    assert guard.run(step, step=1) == "done"
    assert seen == [(False, False)], "freed while the failed step's tensors were still held"

    store = CalibrationStore(tmp_path / "calibration.json")
    calibrator = PlanCalibrator(guard, store)
    tight = guard.budget
    assert calibrator.observe((128, 128), tight.usable_vram + 2 * tight.margin_bytes) is not None   # used now
    assert planner.calibration.activation_scale
    assert store.get(planner.key) is None                           # not kept for later runs


def test_out_of_memory_errors_are_recognised():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


# -- calibration ---------------------------------------------------------------------------------------------

def test_calibration_replans_once_and_is_kept_for_the_next_run(tmp_path):
    res = 128
    key_bucket = f"{res}x{res}"
    workload = Workload(rank=4, buckets=((res, res),), text_length=8, dtype=torch.float32, autocast=False)
    model = tiny_lora_model()
    store = CalibrationStore(tmp_path / "calibration.json")
    planner = Planner(FLUX_SPEC, model, workload)
    roomy = planner.plan(Budget(vram=GiB, ram=UNLIMITED, min_margin=0))
    budget = Budget(vram=int(1.6 * roomy.notes["predicted_peak_vram"]), ram=UNLIMITED, min_margin=0)
    plan = planner.plan(budget)
    predicted = plan.notes["per_bucket"][key_bucket]["peak_vram"]
    applied = []
    guard = OomGuard(planner, budget, plan, applied.append)
    calibrator = PlanCalibrator(guard, store)
    assert calibrator.observe((res, res), predicted + budget.margin_bytes // 2) is None     # within the margin
    assert calibrator.changes == [] and applied == []
    measured = budget.usable_vram + budget.margin_bytes          # the plan really does not fit
    new = calibrator.observe((res, 2 * res), measured)          # an aspect bucket maps to its nearest
    assert new is not None and new != plan and "re-planned" in calibrator.changes[0]
    assert applied == [new] and guard.plan == new                # applied once, through the plan's owner
    assert calibrator.observe((res, res), measured * 2) is None                                 # only once
    saved = json.loads((tmp_path / "calibration.json").read_text())
    key = architecture_key(model, workload)
    assert saved[key]["activation_scale"][f"{key_bucket}:{plan.checkpointing}"] > 1.0
    again = Planner(FLUX_SPEC, model, workload, calibration=store.get(key))                # the next run
    assert again.memory(plan)[2][key_bucket]["peak_vram"] == pytest.approx(measured, rel=0.01)
    assert again.plan(budget).notes["predicted_peak_vram"] <= budget.usable_vram   # starts right

    roomy_budget = Budget(vram=GiB, ram=UNLIMITED, min_margin=0)
    fits = PlanCalibrator(OomGuard(Planner(FLUX_SPEC, model, workload), roomy_budget, roomy, applied.append))
    off = roomy.notes["predicted_peak_vram"] + 2 * roomy_budget.margin_bytes
    assert fits.observe((res, res), off) is None and "still fits" in fits.changes[0]

    (tmp_path / "calibration.json").write_text("{not json")
    assert store.get(key) is None                  # unreadable: ignored, the plan starts uncalibrated


def test_calibration_and_the_memory_monitor_read_the_same_step_peak(monkeypatch, tmp_path):
    """The peak statistics start at step 1 (caching and loading allocate more than a step) and each
    step's peak is read by the calibration before the memory monitor reads and resets it, so both
    see the step's own peak. The CUDA allocator's statistics are stood in for by a counter."""
    from types import SimpleNamespace

    from leantune.distributed import DistContext
    from leantune.memory import monitor as monitor_mod
    from leantune.memory.monitor import MemoryMonitor
    from leantune import trainer

    stats = {"peak": 0}
    for name, fn in {"max_memory_allocated": lambda *a, **k: stats["peak"],
                     "max_memory_reserved": lambda *a, **k: stats["peak"],
                     "memory_allocated": lambda *a, **k: 0, "memory_reserved": lambda *a, **k: 0,
                     "reset_peak_memory_stats": lambda *a, **k: stats.update(peak=0)}.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(monitor_mod, "_cuda_in_use", lambda: True)
    seen = []
    calibrator = SimpleNamespace(observe=lambda bucket, peak, *rest: seen.append(peak), replanned=False, seen=0,
                                 steps=3)
    t = SimpleNamespace(calibrator=calibrator, device=torch.device("cuda"), last_bucket=(64, 64), dist=DistContext())
    monitor = MemoryMonitor(tmp_path)

    stats["peak"] = 9 * GiB                       # setup: text encoders, VAE, loading
    trainer._reset_peaks(t)
    for step, peak in ((1, 3 * GiB), (2, 2 * GiB)):
        stats["peak"] = max(stats["peak"], peak)  # the step
        trainer._calibrate(t, 1.0, {})
        monitor.record(step)
        assert seen[-1] == peak == monitor.samples[-1].peak_allocated, step


# -- configuration and the command ------------------------------------------------------------------------------

def test_budget_from_config_sizes_auto_and_errors():
    from leantune.config import MemoryConfig

    machine = assumed_machine()
    b = budget_from_config(MemoryConfig(vram_budget="8GiB", ram_budget="32 GB"), machine)
    assert (b.vram, b.ram) == (8 * GiB, 32 * GiB)
    with pytest.raises(ConfigError, match="needs a GPU"):
        budget_from_config(MemoryConfig(vram_budget="auto"), machine)
    with pytest.raises(ConfigError, match=r"--vram: 'lots'"):
        parse_vram("lots", machine, "--vram")
    gpu = replace(machine, vram_total=24 * GiB, vram_free=22 * GiB, measured=True)
    assert budget_from_config(MemoryConfig(vram_budget="auto"), gpu).vram == 22 * GiB


def _run_plan(capsys, *argv):
    from leantune.cli import main

    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_command_for_flux_dev_at_several_budgets_is_consistent(capsys):
    budgets = ["6GiB", "8", "12GiB", "24 GB", "80GiB"]        # a bare number is GiB, GB means GiB
    args = ["--model", "flux-dev", "--mode", "lora", "--rank", "16", "--resolution", "1024"]
    for b in budgets:
        args += ["--vram", b]
    rc, out, _ = _run_plan(capsys, *args, "--json")
    assert rc == 0
    data = json.loads(out)
    names = {f"transformer_blocks.{i}" for i in range(19)} | {f"single_transformer_blocks.{i}" for i in range(38)}
    times = []
    for entry, b in zip(data["plans"], budgets):
        plan, n = entry["plan"], entry["plan"]["notes"]
        assert entry["budget_bytes"] == int(re.match(r"\d+", b).group()) * GiB
        assert n["predicted_peak_vram"] <= entry["budget_bytes"] - n["margin_vram"]
        assert set(plan["streamed_blocks"]) <= names and len(set(plan["streamed_blocks"])) == len(plan["streamed_blocks"])
        kinds = {"double": sum(x.startswith("transformer_blocks.") for x in plan["streamed_blocks"]),
                 "single": sum(x.startswith("single_") for x in plan["streamed_blocks"])}
        assert {k: v for k, v in kinds.items() if v} == n["streamed_by_kind"]
        assert (n["vram_breakdown"]["stream slots"] > 0) == bool(plan["streamed_blocks"])
        assert (n["h2d_bytes_per_step"] == 0) == (not plan["streamed_blocks"] and plan["checkpointing"] != "offload")
        assert plan["ring_slots"] >= 2 and plan["checkpointing"] in ("none", "blocks", "offload")
        times.append(n["predicted_step_s"])
    assert times == sorted(times, reverse=True) and times[0] > times[-1]

    rc, text, _ = _run_plan(capsys, "--model", "flux-dev", "--resolution", "1024", "--vram", "8GiB")
    assert rc == 0
    eight = data["plans"][1]["plan"]["notes"]
    assert "VRAM at peak" in text and "rates assumed, not measured" in text
    total = re.search(r"total \(predicted peak\)\s+([\d.]+)", text).group(1)
    assert float(total) == pytest.approx(eight["predicted_peak_vram"] / GiB, abs=0.006)


def test_plan_command_reports_an_infeasible_budget(capsys):
    rc, out, err = _run_plan(capsys, "--model", "flux-schnell", "--resolution", "1024", "--vram", "1GiB")
    assert rc == 1
    assert "smallest budget that works is" in err and "infeasible: smallest working budget" in out


def test_plan_command_reads_the_architecture_from_a_config(capsys, tmp_path, tiny_flux_dir):
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""
[model]
path = "{tiny_flux_dir}"
[data]
datasets = [{{ path = "images" }}]
resolutions = [256]
max_text_length = 16
[lora]
rank = 4
[memory]
vram_budget = "1GiB"
""")
    rc, out, _ = _run_plan(capsys, str(cfg), "--json")
    assert rc == 0
    data = json.loads(out)
    notes = data["plans"][0]["plan"]["notes"]
    assert notes["total_blocks"] == 4 and data["plans"][0]["budget_bytes"] == GiB
    assert "LoRA r4" in data["workload"] and "256x256" in data["workload"] and "text 16 tokens" in data["workload"]
    rc, _, err = _run_plan(capsys, str(cfg), "--model", "flux-dev")
    assert rc == 2 and "either a config file or --model" in err

    # A BFL single file: the architecture comes from the header's shapes, no tensor is read.
    from leantune.models.flux.loading import save_bfl_transformer

    save_bfl_transformer(tiny.flux_transformer(num_layers=3, num_single_layers=1), tmp_path / "flux.safetensors",
                         dtype=torch.bfloat16)
    single = tmp_path / "single.toml"
    single.write_text(cfg.read_text().replace(f'path = "{tiny_flux_dir}"', 'path = "flux.safetensors"'))
    rc, out, _ = _run_plan(capsys, str(single), "--json")
    assert rc == 0 and json.loads(out)["plans"][0]["plan"]["notes"]["total_blocks"] == 4
    assert json.loads(out)["plans"][0]["plan"]["notes"]["vram_breakdown"]["weights resident"] == 2 * sum(
        p.numel() for p in tiny.flux_transformer(num_layers=3, num_single_layers=1).parameters())
    cfg.write_text(cfg.read_text().replace('vram_budget = "1GiB"', ""))
    rc, _, err = _run_plan(capsys, str(cfg))
    assert rc == 2 and "no VRAM budget" in err


def _plan_toml(tmp_path, name: str, weights: Path, resolution: int = 256, text: int = 16, memory: str = "") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[model]
path = "{weights}"
[data]
datasets = [{{ path = "images" }}]
resolutions = [{resolution}]
max_text_length = {text}
[lora]
rank = 4
[memory]
vram_budget = "8GiB"
{memory}
""")
    return path


def _held_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


@pytest.mark.parametrize("fp8,modulation", [(None, "auto"), ("e4m3", "auto"), ("scaled", "auto"), ("scaled", False)])
def test_a_config_is_planned_from_the_dtypes_its_file_stores(capsys, tmp_path, fp8, modulation):
    """`leantune plan my.toml` prices the checkpoint as the loader holds it: an fp8 file's block
    weights in e4m3 with their scales (modulation Linears too, unless [memory] fp8_modulation =
    false upcasts them), a bf16 file's in bf16. The predicted load phase and resident weights equal
    the bytes the real loader holds, and the fp8 file is planned smaller."""
    from leantune.config import load_config
    from leantune.models.flux.loading import load_transformer, resolve_sources, save_bfl_transformer

    source = tiny.flux_transformer(num_layers=2, num_single_layers=2)
    file = tmp_path / "flux.safetensors"
    save_bfl_transformer(source, file, dtype=torch.bfloat16, fp8=fp8)
    toml = _plan_toml(tmp_path, "run", file, memory="" if modulation == "auto" else "fp8_modulation = false")
    rc, out, _ = _run_plan(capsys, str(toml), "--json")
    assert rc == 0
    notes = json.loads(out)["plans"][0]["plan"]["notes"]
    cfg = load_config(toml)
    loaded = load_transformer(resolve_sources(cfg.model, tmp_path), dtype=torch.bfloat16,
                              fp8_modulation=cfg.memory.fp8_modulation is not False)
    held = _held_bytes(loaded)
    assert notes["host_breakdown"]["transformer while loading"] == held
    assert notes["vram_breakdown"]["weights resident"] == held          # a tiny model stays resident
    assert notes["stored_fp8"] == (fp8 is not None)
    mod_weight = loaded.transformer_blocks[0].norm1.linear.weight
    assert notes["stored_fp8_modulation"] == (mod_weight.dtype == torch.float8_e4m3fn) == (
        fp8 is not None and modulation == "auto")
    assert notes["host_breakdown"]["transformer while converting to fp8"] == 0
    bf16 = 2 * sum(p.numel() for p in source.parameters())
    assert (held < 0.8 * bf16) if fp8 else (held == bf16)

    # The measurement is kept for the next plan, keyed by the file: replacing the file measures again.
    save_bfl_transformer(source, file, dtype=torch.bfloat16, fp8=None if fp8 else "e4m3")
    rc, out, _ = _run_plan(capsys, str(toml), "--json")
    assert rc == 0 and json.loads(out)["plans"][0]["plan"]["notes"]["stored_fp8"] == (fp8 is None)


_PLAN_AGAIN = """
import json, sys
from leantune.cli import main
rc = main(["plan", "--model", "flux-schnell", "--resolution", "256", "--json", "--ram", "64GiB", *sys.argv[1:]])
print(json.dumps({"heavy": sorted(m for m in ("diffusers", "peft", "transformers", "torch") if m in sys.modules)}))
sys.exit(rc)
"""


@pytest.mark.slow
def test_a_second_plan_of_the_same_model_and_workload_comes_from_the_cache(tmp_path, monkeypatch, capsys):
    """`leantune plan` keeps what it measured: planning the same architecture and workload again
    builds no model and traces nothing (diffusers and peft are not even imported), with the same
    plans; asking the very same `--model` question again on a machine without a GPU imports not even
    torch, and answers the same (the machine line read afresh).

    The first plan runs in this process (what it imports is not the claim, and this process has
    imported everything already): that it measured, building the model, is checked directly. The
    two plans after it run in fresh processes, where what they import is seen."""
    import os
    import subprocess
    import sys

    from leantune.planner import spec_cache
    from leantune.planner.machine import gpu_device_visible

    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "cache"))
    import torch

    # the fresh processes with this one's thread count: the kept LoRA host-step rate is per thread
    # count (planner/lora_host_rate.py), and an earlier test may have left this process on one thread
    env = {**os.environ, "LEANTUNE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    built = []
    measure = spec_cache.measure_model
    monkeypatch.setattr(spec_cache, "measure_model", lambda *a, **k: built.append(a[1]) or measure(*a, **k))
    # --ram: a host-RAM budget of its own, not the moment's free RAM (another test's processes use
    # some on a busy machine, and a plan re-made in a fresh process would see less)
    rc, out, _ = _run_plan(capsys, "--model", "flux-schnell", "--resolution", "256", "--json", "--ram", "64GiB",
                           "--vram", "6GiB", "--vram", "12")
    assert rc == 0 and len(built) == 1 and built[0].device.type == "meta"   # the first plan measured
    runs = [(json.loads(out), None)]
    for vram in (["6GiB", "12"], ["6GiB", "12", "8GiB"]):
        flags = [x for v in vram for x in ("--vram", v)]
        run = subprocess.run([sys.executable, "-c", _PLAN_AGAIN, *flags], capture_output=True, text=True, env=env,
                             check=True)
        *plans, heavy = run.stdout.strip().splitlines()
        runs.append((json.loads("\n".join(plans)), json.loads(heavy)["heavy"]))
    (first, _), (again, again_heavy), (more, more_heavy) = runs
    assert more_heavy == ["torch"]
    assert again_heavy == ([] if not gpu_device_visible() else ["torch"])

    def predicted(entry):      # the plan and its predictions, not the machine's free RAM of the moment
        plan = dict(entry["plan"])
        plan["notes"] = {k: v for k, v in plan["notes"].items() if k not in ("machine", "budget_ram")}
        return plan

    assert [predicted(p) for p in again["plans"]] == [predicted(p) for p in first["plans"]]
    assert [predicted(p) for p in more["plans"][:2]] == [predicted(p) for p in first["plans"]]
    assert again["machine"].keys() == first["machine"].keys()


_MEASURE_LOAD = """
import gc, json, re, sys
from pathlib import Path
import torch
from leantune.config import load_config
from leantune.models.flux.loading import load_transformer, resolve_sources

def rss():
    text = Path("/proc/self/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\\s+(\\d+) kB", text, re.MULTILINE)}

from diffusers import FluxTransformer2DModel  # imports before the measurement: they are not the load
import leantune.memory.fp8

cfg = load_config(sys.argv[1])
sources = resolve_sources(cfg.model, Path(sys.argv[1]).parent)
gc.collect()
start = rss()["VmRSS"]
Path("/proc/self/clear_refs").write_text("5")
quantize = {"quantize_fp8": True} if sys.argv[2:] == ["quantize"] else {}   # the trainer's load under an fp8 plan
model = load_transformer(sources, dtype=torch.bfloat16, **quantize)
held = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
print(json.dumps({"measured": rss()["VmHWM"] - start, "held": held}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not _can_reset_rss_peak(), reason="needs Linux /proc/self/status and a writable clear_refs")
def test_the_predicted_load_phase_of_an_fp8_file_is_the_measured_load_peak(tmp_path):
    """A real-width Flux (one double, eight single blocks, width 1024) saved as an fp8 file and as a
    bf16 file: the host RAM the planner predicts for loading each is what loading it really adds to
    the resident set of a fresh process (within the loader's 8 MiB read buffer and allocator noise)."""
    import subprocess
    import sys

    from leantune.commands.plan import meta_model_for_config
    from leantune.config import load_config
    from leantune.models.flux.loading import save_bfl_transformer

    model = _real_width_flux()      # bf16 already: the files are written without a cast
    workload = Workload(mode="inference", buckets=((64, 64),), text_length=4, autocast=False)
    loads = {}
    for fp8 in (None, "e4m3"):
        file = tmp_path / f"flux-{fp8}.safetensors"
        save_bfl_transformer(model, file, dtype=torch.bfloat16, fp8=fp8)
        toml = _plan_toml(tmp_path, f"run-{fp8}", file, resolution=64, text=4)
        planner = Planner(FLUX_SPEC, meta_model_for_config(load_config(toml)), workload)
        predicted = planner.memory(Plan())[1]["transformer while loading"]
        run = subprocess.run([sys.executable, "-c", _MEASURE_LOAD, str(toml)], capture_output=True, text=True,
                             check=True)
        got = json.loads(run.stdout.strip().splitlines()[-1])
        assert predicted == got["held"], fp8
        assert abs(got["measured"] - predicted) <= 16 * 2**20, (fp8, got["measured"] / 2**20, predicted / 2**20)
        loads[fp8] = predicted
    assert loads["e4m3"] < 0.7 * loads[None]

    # The trainer's load of the bf16 file under an fp8 plan quantizes as it reads: the planner prices
    # what it keeps (as the e4m3 file) plus the workers' buffers, and the load stays within that.
    quantizing = Planner(FLUX_SPEC, meta_model_for_config(load_config(tmp_path / "run-None.toml")),
                         replace(workload, quantizes_on_load=True))
    predicted = quantizing.memory(Plan(fp8=True))[1]["transformer while loading"]
    run = subprocess.run([sys.executable, "-c", _MEASURE_LOAD, str(tmp_path / "run-None.toml"), "quantize"],
                         capture_output=True, text=True, check=True)
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert predicted == got["held"] + QUANTIZING_WORK_BYTES
    assert got["held"] <= got["measured"] <= predicted, (got, predicted)
    assert got["held"] < 0.7 * loads[None]          # what it keeps: e4m3 block Linears and their scales


def test_plan_for_config_is_what_the_trainer_gets(tmp_path, tiny_flux_dir):
    from leantune.config import validate

    raw = {"model": {"path": str(tiny_flux_dir), "dtype": "fp32"}, "data": {
        "datasets": [{"path": "x"}], "resolutions": [128], "max_text_length": 8},
        "lora": {"rank": 4}, "train": {"mixed_precision": "no"}, "memory": {"vram_budget": "2GiB"}}
    cfg = validate(raw)
    model = tiny_lora_model()
    store = CalibrationStore(tmp_path / "cal.json")
    plan = plan_for_config(cfg, FLUX_SPEC, model, store=store)
    assert plan.notes["budget_vram"] == 2 * GiB and plan.notes["predicted_peak_vram"] > 0
    assert plan.streamed_blocks == () and plan.checkpointing == "none"   # a tiny model fits resident
    cfg_small = validate({**raw, "memory": {"vram_budget": "1MiB"}})
    with pytest.raises(ConfigError, match=r"\[memory\] vram_budget = '1MiB': no memory plan fits"):
        plan_for_config(cfg_small, FLUX_SPEC, model, store=store)


@pytest.mark.gpu
def test_machine_probe_measures_a_gpu():
    m = probe_machine()
    assert m.measured and m.vram_total >= m.vram_free > 0
    assert 1e9 < m.h2d_pinned < 1e12 and m.flops > 1e12 and m.hbm > m.h2d_pinned


def test_the_activation_probe_builds_no_adapter_memory_at_a_huge_rank(one_thread):
    """`leantune plan --rank 100000` priced the adapters by building them: peft creates each on the
    CPU and draws its init before moving it to the probe's meta device. The probe now creates them
    on meta: nothing the size of an adapter is allocated anywhere but on meta, and the LoRA
    activations still grow with the rank."""
    from leantune.memory.simulated import DeviceMemoryTracker
    from leantune.planner.activation_probe import probe_activations

    model = tiny_lora_model(rank=4)
    res = 256
    saved = {}
    for rank in (4, 100000):
        workload = Workload(rank=rank, buckets=((res, res),), text_length=8, dtype=torch.float32, autocast=False,
                            allow_fp8=False)
        tracker = DeviceMemoryTracker()
        with tracker:
            profile = probe_activations(FLUX_SPEC, model, workload, (res, res))
        off_meta = {d: b for d, b in tracker.peak.items() if d != "meta"}
        assert sum(off_meta.values()) < 1 << 20, off_meta       # a rank-100000 adapter is > 10 MB here
        saved[rank] = profile.kinds["double"].saved
    assert saved[100000] > saved[4]
