"""`leantune check` on the tiny Flux: it holds on plans that stream, checkpoint and store fp8 (LoRA
and full mode), and it fails, naming the technique, on each fault injected into the engine where
such a fault would really happen (a slot released before its backward, a stale slot reused, an
adapter cut off from the optimizer, a dropped write-back). Each fault test asserts the check's
verdict, so it fails if the check stops seeing the fault; the passing tests run the same plans
without the fault."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_lora_rest, tiny_run_toml

from leantune.check.run import run_check
from leantune.config import load_config
from leantune.demo import draw_shapes
from leantune.memory.streaming import StreamingEngine
from leantune.memory.trainable_streaming import TrainableStreamingEngine

STREAMED_LORA = '[memory]\nstreamed_blocks = 3\ncheckpointing = "blocks"\nfp8 = true\n'
STREAMING_ONLY = '[memory]\nstreamed_blocks = 3\n'

FULL = """
[train]
mode = "full"
steps = 6
learning_rate = 2e-4
mixed_precision = "no"
seed = 3

[full]
save_dtype = "fp32"

[memory]
streamed_blocks = 2
stream_non_blocks = true
checkpointing = "blocks"
pin_memory = false

[output]
dir = "out"
name = "t"
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("check_shapes") / "images"
    draw_shapes(folder, count=4, size=64, seed=5)
    return folder


def _config(tmp_path, tiny_flux_dir, images, rest: str, name: str = "run.toml"):
    """A run config whose caches are shared by every test of this module (filled once)."""
    p = tmp_path / name
    p.write_text(tiny_run_toml(tiny_flux_dir, images, rest))
    return p, load_config(p, [f'data.cache_dir="{images.parent / "cache"}"'])


def _lora(tmp_path, tiny_flux_dir, images, memory: str):
    return _config(tmp_path, tiny_flux_dir, images, tiny_lora_rest(tmp_path / "out", "t", memory))


def _line(result, start: str) -> str:
    found = [line for line in result.lines if line.startswith(start)]
    assert len(found) == 1, result.lines
    return found[0]


# -- it holds --------------------------------------------------------------------------------------

def test_check_holds_on_a_lora_plan_streaming_checkpointing_fp8(tmp_path, tiny_flux_dir, images):
    path, cfg = _lora(tmp_path, tiny_flux_dir, images, STREAMED_LORA)
    lines = []
    result = run_check(cfg, steps=2, emit=lines.append)
    assert result.rc == 0, result.lines
    assert lines == result.lines
    assert set(result.verdicts) == {"streaming", "fp8", "checkpointing", "plan"}
    assert all(v.held for v in result.verdicts.values())
    stream = _line(result, "streaming 3 of 4 blocks (pinned, poison mode): held")
    assert "bitwise equal over 2 step(s)" in stream
    assert "bitwise" in _line(result, "checkpointing (blocks): held")
    fp8 = _line(result, "fp8 storage (block Linears): held")
    assert "within the tolerance" in fp8
    measured = result.verdicts["fp8"].measured
    assert 0 < measured["loss_rel"] < 1e-2        # fp8 changed something, within its tolerance
    assert 0 < measured["grad_rel"] < 0.25 and measured["grad_cos"] > 0.97
    assert "against fp8 storage alone" in _line(result, "the whole plan")
    assert "VRAM not measured" in _line(result, "measured with the whole plan")
    # the variants ran outside the run's folder, and the user's output dir was never made
    assert not (tmp_path / "out").exists()
    ref, plan = result.records["reference"], result.records["plan"]
    assert len(ref.grads) == 2 and all(g is not None for g in ref.grads[1].values())
    assert ref.losses != result.records["fp8"].losses          # the comparison has something to see
    print(f"\ncheck on the tiny Flux LoRA: {result.seconds:.1f} s; fp8: {measured}")
    assert plan.losses == result.records["fp8"].losses


def test_check_holds_in_full_mode_with_a_streamed_plan(tmp_path, tiny_flux_dir, images):
    _, cfg = _config(tmp_path, tiny_flux_dir, images, FULL)
    result = run_check(cfg, steps=2, emit=lambda line: None)
    assert result.rc == 0, result.lines
    assert set(result.verdicts) == {"streaming", "checkpointing", "plan"}
    _line(result, "streaming 2 of 4 blocks + non-block modules (pageable, poison mode): held")
    ref = result.records["reference"]
    assert all(g is not None for g in ref.grads[0].values())   # full mode's in-backward gradients caught
    assert len(ref.weights) == len(ref.grads[0])


def test_check_holds_with_the_host_optimizer_step_in_full_mode(tmp_path, tiny_flux_dir, images):
    _, cfg = _config(tmp_path, tiny_flux_dir, images, FULL.replace('checkpointing = "blocks"', "")
                     .replace("[full]", '[full]\nstreamed_step = "host"'))
    result = run_check(cfg, steps=2, emit=lambda line: None)
    assert result.rc == 0, result.lines
    assert set(result.verdicts) == {"streaming", "host step"}      # the whole plan is the host step's run
    assert "bitwise equal" in _line(result, "optimizer step of the streamed blocks on the host (2 of 4 blocks")


# -- it fails on each fault, naming the technique ---------------------------------------------------

def _release_slots_early(monkeypatch) -> None:
    """The hold that a streamed call's boundary takes for its backward ends at once: the block's
    backward then reads its slot after the slot was retired (poisoned)."""
    original = StreamingEngine.backward_boundary

    def release_early(self, boundary):
        original(self, boundary)
        unit = boundary.unit
        if any(u is unit for u in self.bwd_holds):
            self.bwd_holds[:] = [u for u in self.bwd_holds if u is not unit]
            self.release(unit)

    monkeypatch.setattr(StreamingEngine, "backward_boundary", release_early)


def test_a_slot_released_before_its_backward_is_caught(tmp_path, tiny_flux_dir, images, monkeypatch):
    """A slot released before its backward (_release_slots_early) is named on the streaming line."""
    _release_slots_early(monkeypatch)
    _, cfg = _lora(tmp_path, tiny_flux_dir, images, STREAMING_ONLY)
    result = run_check(cfg, steps=1, emit=lambda line: None)
    assert result.rc == 1
    line = _line(result, "streaming 3 of 4 blocks (pinned, poison mode): differs: ")
    assert "NaN in the gradient of " in line and "lora_" in line


def test_a_stale_slot_reused_is_caught(tmp_path, tiny_flux_dir, images, monkeypatch):
    """Backward's fetch into a slot another block used is skipped: the slot is taken as holding
    the block, and backward reads the other block's (retired, poisoned) bytes."""
    original = StreamingEngine._fetch

    def skip_fetch(self, unit, demand):
        slot = self.slots[unit.slot]
        if self.phase == "backward" and slot.owner is not None and slot.owner is not unit:
            slot.owner, slot.valid = unit, True
            return
        original(self, unit, demand)

    monkeypatch.setattr(StreamingEngine, "_fetch", skip_fetch)
    _, cfg = _lora(tmp_path, tiny_flux_dir, images, STREAMING_ONLY)
    result = run_check(cfg, steps=1, emit=lambda line: None)
    assert result.rc == 1
    line = _line(result, "streaming 3 of 4 blocks (pinned, poison mode): differs: ")
    assert "NaN in the gradient of " in line


def test_an_adapter_whose_gradient_does_not_reach_the_optimizer_is_caught(tmp_path, tiny_flux_dir, images,
                                                                          monkeypatch):
    """Streaming replaces an adapter Parameter of a streamed block with a copy (as a `.to()` that
    makes a new Parameter does): the forward trains the copy, the optimizer holds the original,
    whose gradient never comes. Loss and most gradients stay right; the adapter learns nothing."""
    from leantune.memory import engine

    original = engine.apply_streaming
    replaced = []

    def cut_off(model, spec, plan, device, **kwargs):
        handle = original(model, spec, plan, device, **kwargs)
        for mod in handle.units[0].modules[0].modules():
            for name, p in list(mod._parameters.items()):
                if p is not None and p.requires_grad and not replaced:
                    mod._parameters[name] = torch.nn.Parameter(p.detach().clone())
                    replaced.append(name)
        return handle

    monkeypatch.setattr(engine, "apply_streaming", cut_off)
    _, cfg = _lora(tmp_path, tiny_flux_dir, images, STREAMING_ONLY)
    result = run_check(cfg, steps=1, emit=lambda line: None)
    assert replaced, "the fault was not injected"
    assert result.rc == 1
    line = _line(result, "streaming 3 of 4 blocks (pinned, poison mode): differs: ")
    assert "got no gradient at step 1 (it does not reach the optimizer)" in line
    assert f"{replaced[0]}" in line and "transformer_blocks." in line


def test_a_dropped_write_back_in_full_mode_is_caught_and_train_check_does_not_train(tmp_path, tiny_flux_dir,
                                                                                    images, monkeypatch, capsys):
    """Full mode: a streamed block's update is never copied home from its slot. `leantune train
    --check` reports it and trains nothing (exit code 1, no run folder)."""
    from leantune.cli import main

    monkeypatch.setattr(TrainableStreamingEngine, "_write_back", lambda self, unit, slot, poison: None)
    path, _ = _config(tmp_path, tiny_flux_dir, images, FULL)
    cache = f'data.cache_dir="{images.parent / "cache"}"'
    rc = main(["train", str(path), "--check", "--no-progress", "--set", cache])
    out = capsys.readouterr()
    assert rc == 1, out
    lines = out.out.splitlines()
    stream = [line for line in lines if line.startswith("streaming 2 of 4 blocks + non-block modules")]
    assert len(stream) == 1 and ": differs: " in stream[0], lines
    assert "expected bitwise" in stream[0]
    assert any(line.startswith("checkpointing (blocks): held") for line in lines)   # not streamed: unaffected
    assert "not training" in out.err
    assert not (tmp_path / "out").exists()


def test_fp8_outside_its_tolerance_is_caught(tmp_path, tiny_flux_dir, images, monkeypatch):
    """The fp8 forward dequantizes with a scale 1.5 times too large (a scale of another layout):
    the run stays finite, and the loss and gradients leave fp8's tolerance."""
    from leantune.memory import fp8

    def wrong_scale(self, x):
        lin = self.linear
        return fp8._Fp8Linear.apply(x, lin.weight, getattr(lin, fp8.SCALE_ATTR) * 1.5, lin.bias)

    monkeypatch.setattr(fp8._Fp8Forward, "__call__", wrong_scale)
    _, cfg = _lora(tmp_path, tiny_flux_dir, images, "[memory]\nfp8 = true\n")
    result = run_check(cfg, steps=2, emit=lambda line: None)
    assert result.rc == 1
    line = _line(result, "fp8 storage (block Linears): differs: ")
    assert "outside the tolerance" in line
    assert all(v == v for v in result.records["fp8"].losses)        # finite: the tolerance caught it, not a NaN


def test_a_variant_that_fails_to_build_is_a_failure_of_its_technique(tmp_path, tiny_flux_dir, images, monkeypatch):
    from leantune.memory import engine

    def refuse(*args, **kwargs):
        raise RuntimeError("streaming: no slot for this unit")

    monkeypatch.setattr(engine, "apply_streaming", refuse)
    _, cfg = _lora(tmp_path, tiny_flux_dir, images, STREAMING_ONLY)
    result = run_check(cfg, steps=1, emit=lambda line: None)
    assert result.rc == 1
    line = _line(result, "streaming 3 of 4 blocks (pinned, poison mode): differs: ")
    assert "the run failed: building the run: RuntimeError: streaming: no slot for this unit" in line


# -- the command ------------------------------------------------------------------------------------

def test_check_command_exit_codes_and_lines(tmp_path, tiny_flux_dir, images, capsys):
    from leantune.cli import main

    path, _ = _config(tmp_path, tiny_flux_dir, images, FULL)
    cache = f'data.cache_dir="{images.parent / "cache"}"'
    assert main(["check", str(path), "--steps", "1", "--set", cache, "--set", 'memory.checkpointing="none"']) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("check: explicit [memory] keys: stream 2 blocks + non-blocks")
    assert any(line.startswith("streaming 2 of 4 blocks + non-block modules (pageable, poison mode): held — "
                               "losses, gradients and weights bitwise equal over 1 step(s)") for line in out)
    assert out[-1].startswith("check: every technique held")
    # a config error: exit code 2, the key named
    assert main(["check", str(path), "--set", cache, "--set", 'memory.streamed_blocks=["nope"]']) == 2
    assert "memory.streamed_blocks" in capsys.readouterr().err
    assert main(["check", str(path), "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err


def test_a_planned_run_is_checked_with_its_plan_and_its_prediction(tmp_path, tiny_flux_dir, images, monkeypatch):
    """Under [memory] vram_budget the check takes the trainer's plan (chosen before loading) and
    prints the plan's predicted step time beside the measured one; the reference, run twice on
    request, is bitwise reproducible on the CPU."""
    from leantune.memory.plan import Plan
    from leantune.planner import from_config

    chosen = Plan(streamed_blocks=("transformer_blocks.1", "single_transformer_blocks.0"), checkpointing="blocks",
                  notes={"predicted_peak_vram": 123 * 2**20, "predicted_step_s": 0.5})
    asked = []

    def choose(planner, budget, cfg):
        asked.append(budget)
        return chosen

    monkeypatch.setattr(from_config, "choose_plan", choose)
    _, cfg = _lora(tmp_path, tiny_flux_dir, images, '[memory]\nvram_budget = "6GiB"\n')
    result = run_check(cfg, steps=1, emit=lambda line: None, repeat_reference=True)
    assert result.rc == 0, result.lines
    assert len(asked) == 1                   # planned once, by the check; the variants are explicit keys
    assert result.lines[0].startswith("check: planned: stream 2 blocks")
    assert "reference run twice: bitwise reproducible on this device" in result.lines
    _line(result, "streaming 2 of 4 blocks (pinned, poison mode): held")
    assert "predicted 0.500 s" in _line(result, "measured with the whole plan")


def _blocks(t) -> int:
    return len(t.transformer.transformer_blocks) + len(t.transformer.single_transformer_blocks)


def _whole_plain_model_runs_out(monkeypatch, seen: list, always: bool = False) -> None:
    """A device on which the plain model with all 4 blocks does not fit (`always`: not even cut)."""
    from leantune import trainer

    step = trainer.train_step

    def runs_out(t, cfg):
        seen.append((bool(t.plan.streamed_blocks), _blocks(t)))
        if not t.plan.streamed_blocks and (always or _blocks(t) == 4):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return step(t, cfg)

    monkeypatch.setattr(trainer, "train_step", runs_out)


STREAMING_TWO = '[memory]\nstreamed_blocks = ["transformer_blocks.0", "transformer_blocks.1"]\ncheckpointing = "blocks"\n'


def test_a_reference_that_does_not_fit_is_made_on_a_subset_of_the_models_blocks(tmp_path, tiny_flux_dir, images,
                                                                                 monkeypatch):
    """The plain model does not fit: every run is made on the plan's first ring + 1 streamed blocks
    (here both double blocks) and one resident block per list, the techniques hold there, and the
    report says which blocks."""
    seen = []
    _whole_plain_model_runs_out(monkeypatch, seen)
    _, cfg = _lora(tmp_path, tiny_flux_dir, images, STREAMING_TWO)
    result = run_check(cfg, steps=1, emit=lambda line: None)
    assert result.rc == 0, result.lines
    said = _line(result, "the whole reference does not fit: the reference ran out of memory")
    assert ("every run of the check is made on 3 of the model's 4 blocks instead (transformer_blocks 0, 1, "
            "single_transformer_blocks 0)") in said
    assert set(result.verdicts) == {"streaming", "checkpointing", "plan"} and all(v.held for v in result.verdicts.values())
    _line(result, "streaming 2 of 3 blocks (pinned, poison mode): held")
    assert seen[0] == (False, 4) and all(n == 3 for _, n in seen[1:]), seen      # the whole model tried once


def test_a_fault_is_caught_on_the_subset_too(tmp_path, tiny_flux_dir, images, monkeypatch):
    """A slot released before its backward (_release_slots_early) still shows on the cut model."""
    _release_slots_early(monkeypatch)
    _whole_plain_model_runs_out(monkeypatch, [])
    _, cfg = _lora(tmp_path, tiny_flux_dir, images, STREAMING_TWO)
    result = run_check(cfg, steps=1, emit=lambda line: None)
    assert result.rc == 1
    _line(result, "the whole reference does not fit")
    assert "NaN in the gradient of " in _line(result, "streaming 2 of 3 blocks (pinned, poison mode): differs: ")


def test_a_reference_that_does_not_fit_even_cut_is_said_and_nothing_is_compared(tmp_path, tiny_flux_dir, images,
                                                                                monkeypatch):
    _whole_plain_model_runs_out(monkeypatch, [], always=True)
    _, cfg = _lora(tmp_path, tiny_flux_dir, images, STREAMING_ONLY)
    result = run_check(cfg, steps=1, emit=lambda line: None)
    assert result.rc == 3
    assert not result.verdicts
    _line(result, "the whole reference does not fit")
    _line(result, "check not done: the reference ran out of memory, even on a subset of the blocks")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the check on CUDA (bench/gpu_checks.sh window 1)")
def test_check_on_cuda_runs_the_reference_twice_and_measures_the_peak(tmp_path, tiny_flux_dir, images):
    """The CUDA paths no CPU run takes: the reference run twice (is this device bitwise
    reproducible?), pinned streaming through real copy streams, and the peak VRAM measured."""
    _, cfg = _lora(tmp_path, tiny_flux_dir, images, STREAMED_LORA)
    result = run_check(cfg, steps=2, emit=lambda line: None)
    assert any(line.startswith("reference run twice: ") for line in result.lines), result.lines
    assert result.rc == 0, result.lines
    assert all(v.held for v in result.verdicts.values()), result.lines
    measured = [line for line in result.lines if line.startswith("measured with the whole plan")]
    assert measured and "peak VRAM" in measured[0] and "not measured" not in measured[0], result.lines


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_a_pinned_base_format_is_a_technique_checked_against_the_bf16_base(tmp_path, tiny_flux_dir, images, fmt):
    """[memory] base_format = "int8" / "nf4": the reference and the exact techniques run on the bf16
    base, the format's rows alone are held to their tolerance, and the whole plan is bitwise the
    format alone."""
    if fmt == "nf4":
        pytest.importorskip("bitsandbytes")
    _, cfg = _lora(tmp_path, tiny_flux_dir, images, f'[memory]\nbase_format = "{fmt}"\n' + STREAMING_TWO[9:])
    result = run_check(cfg, steps=2, emit=lambda line: None)
    assert result.rc == 0, result.lines
    assert set(result.verdicts) == {"streaming", fmt, "checkpointing", "plan"}
    stored = _line(result, f"{fmt} storage (block Linears): held")
    assert "within the tolerance" in stored
    assert "against " + fmt + " storage alone): held — losses, gradients and weights bitwise equal" in \
        _line(result, "the whole plan")
    assert result.verdicts[fmt].measured["grad_rel"] > 0             # the rows do round: not the bf16 base


def test_int8_rows_outside_their_tolerance_are_caught(tmp_path, tiny_flux_dir, images, monkeypatch):
    """A wrong row scale (1.5x, as test_fp8_outside_its_tolerance_is_caught does for e4m3) is named
    on the int8 line."""
    from leantune.memory import int8_storage as i8

    real = i8.quantize

    def off_scale(w, g):
        raw = real(w, g)
        codes, scale = i8.unpack(raw, w.shape[1])
        return i8.pack(codes, scale * 1.5)

    monkeypatch.setattr(i8, "quantize", off_scale)
    _, cfg = _lora(tmp_path, tiny_flux_dir, images, '[memory]\nbase_format = "int8"\n' + STREAMING_TWO[9:])
    result = run_check(cfg, steps=2, emit=lambda line: None)
    assert result.rc == 1
    assert _line(result, "int8 storage (block Linears): differs: ")


SPLIT_LORA = '[memory]\nstreamed_blocks = 2\ncheckpointing = "offload"\nsplit_blocks = true\n'


def _stale_recompute(monkeypatch):
    """A split part whose recompute in backward does not reproduce its forward (as a part that
    read state the forward changed would): its output scaled by 1.001 from its second call on."""
    from leantune.models.flux import block

    original = block.part
    seen: set = set()

    def part(fn, *tensors):
        def run(*a):
            out = fn(*a)
            again = fn in seen
            seen.add(fn)
            if not again:
                return out
            return tuple(o * 1.001 for o in out) if isinstance(out, tuple) else out * 1.001
        return original(run, *tensors)

    monkeypatch.setattr(block, "part", part)


def test_a_split_plan_is_checked_bitwise_and_a_stale_recompute_is_caught(tmp_path, tiny_flux_dir, images,
                                                                           monkeypatch):
    """[memory] split_blocks = true is a technique of its own: the split blocks (with checkpointing
    and offload) equal the reference bitwise, and the whole plan holds; with a split part that
    recomputes otherwise than it ran forward the split line differs."""
    _, cfg = _lora(tmp_path, tiny_flux_dir, images, SPLIT_LORA)
    result = run_check(cfg, steps=1, emit=lambda line: None)
    assert result.rc == 0, result.lines
    assert set(result.verdicts) == {"streaming", "checkpointing", "split blocks", "plan"}, result.lines
    line = _line(result, "split blocks (each block's parts recomputed one at a time; blocks, inputs offloaded")
    assert ": held" in line and "bitwise equal" in line, line
    assert ", split blocks" in _line(result, "the whole plan")
    _stale_recompute(monkeypatch)
    result = run_check(cfg, steps=1, emit=lambda line: None)
    assert result.rc == 1
    assert ": differs: " in _line(result, "split blocks (each block's parts"), result.lines
    assert result.verdicts["checkpointing"].held and result.verdicts["streaming"].held


def test_a_lora_host_step_is_checked_against_the_device_step(tmp_path, tiny_flux_dir, images, monkeypatch):
    """[lora] optimizer_step = "host" is a technique of its own: the reference and the other
    techniques step on the device, the host step (torch's fused CPU AdamW) holds to fp32 rounding
    against the device step, and the whole plan runs with it; a host step whose update is scaled by
    1.5 is caught."""
    from leantune.train import lora_host_step

    _, cfg = _lora(tmp_path, tiny_flux_dir, images, STREAMING_ONLY)
    cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"optimizer_step": "host"})})
    result = run_check(cfg, steps=2, emit=lambda line: None)
    assert result.rc == 0, result.lines
    assert set(result.verdicts) == {"streaming", "host step", "plan"}, result.lines
    line = _line(result, "optimizer step of the LoRA on the host")
    assert ": held" in line and "within the tolerance" in line, line
    measured = result.verdicts["host step"].measured
    print("host step against the device step:", measured)         # the numbers docs/check.md states
    assert result.records["reference"].losses[0] == result.records["host step"].losses[0]   # the same first loss
    build = lora_host_step.build_host_optimizer

    def scaled(params, train, fused=None):         # each host update 1.5 times what the optimizer made
        opt = build(params, train, fused)
        inner = opt.step

        def step(*a, **k):
            before = [p.detach().clone() for p in params]
            out = inner(*a, **k)
            with torch.no_grad():
                for p, b in zip(params, before):
                    p.copy_(b + 1.5 * (p - b))
            return out

        opt.step = step
        return opt

    monkeypatch.setattr(lora_host_step, "build_host_optimizer", scaled)
    result = run_check(cfg, steps=2, emit=lambda line: None)
    assert result.rc == 1
    assert ": differs: " in _line(result, "optimizer step of the LoRA on the host"), result.lines
