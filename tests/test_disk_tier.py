"""The disk as the third memory tier (memory/disk_tier.py; issue 39): streamed frozen blocks whose
packed bytes are read from a file into pinned staging on the staging worker, instead of living in
host RAM.

A LoRA'd model of four blocks, every block and the non-block modules streamed on a ring of 2 in
poison mode (a weight read outside its hold is NaN), against the same model streamed from host RAM
and unstreamed: outputs and gradients bit for bit. What host RAM and the page cache hold is
measured: the disk units' host buffers are gone, and after the steps none of the file's pages is
left in the page cache (mincore over the file)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from leantune.memory.disk_tier import DiskTierError, cached_pages
from leantune.memory.plan import Plan
from leantune.memory.streaming import apply_streaming, release_streaming, remove_streaming
from leantune.spec import BlockList, ModelSpec

WIDTH = 256           # 2 x 256 KiB Linears per block: a file of whole pages many times over
SPEC = ModelSpec(family="toy", block_lists=(BlockList("blocks", "block", "blocks"),), fp8_skip=(),
                 non_block_modules=("embed", "head"))
BLOCKS = tuple(f"blocks.{i}" for i in range(4))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        return h + self.out(torch.tanh(self.lin(h)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _model() -> Model:
    torch.manual_seed(0)
    m = Model()
    m.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["lin", "out"], init_lora_weights=False), m)
    return m


def _step(model, seed: int = 1):
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    out = model(x)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    for p in model.parameters():
        p.grad = None
    return out.detach(), grads, x.grad


def _plan(disk: tuple[str, ...]) -> Plan:
    return Plan(streamed_blocks=BLOCKS, stream_non_blocks=True, ring_slots=2, debug_poison=True, disk_blocks=disk)


def test_streamed_from_disk_equals_streamed_from_ram_and_the_plain_model_bitwise(tmp_path):
    plain = _model()
    ram, disk = copy.deepcopy(plain), copy.deepcopy(plain)
    h_ram = apply_streaming(ram, SPEC, _plan(()), "cpu")
    h_disk = apply_streaming(disk, SPEC, _plan(BLOCKS[1:]), "cpu", disk_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []                     # unlinked once open: nothing left behind
    unit = {u.name: u for u in h_disk.units}
    assert h_disk.disk_bytes == sum(unit[n].nbytes for n in BLOCKS[1:]) > 3 * 2 * WIDTH * WIDTH * 4
    assert h_disk.host_bytes == h_ram.host_bytes - h_disk.disk_bytes - sum(
        u.host.numel() - u.nbytes for u in h_ram.units if u.name in BLOCKS[1:])
    for seed in (1, 2):                                       # two steps: every slot refilled from disk
        want = _step(plain, seed)
        for got in (_step(ram, seed), _step(disk, seed)):
            assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
            assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert cached_pages(h_disk.disk.fd) == 0                  # every page read was dropped
    assert h_disk.engine.stats.copies >= 2 * len(BLOCKS)
    remove_streaming(h_disk, "cpu")
    assert h_disk.disk is None
    restored = disk.state_dict()
    assert all(torch.equal(restored[k], v) for k, v in plain.state_dict().items())
    release_streaming(h_ram)


def test_a_disk_tier_file_changed_during_the_run_is_named(tmp_path):
    model = _model()
    handle = apply_streaming(model, SPEC, _plan(BLOCKS), "cpu", disk_dir=tmp_path)
    _step(model)
    with open(f"/proc/self/fd/{handle.disk.fd}", "r+b") as f:    # the unlinked file, written behind its back
        f.seek(100)
        f.write(b"\x00" * 8)
    with pytest.raises(DiskTierError, match="changed or replaced during the run"):
        _step(model)
    release_streaming(handle)


def test_the_disk_tier_is_refused_where_it_cannot_hold(tmp_path):
    from leantune.memory.trainable_streaming import TrainableStreamingEngine

    with pytest.raises(ValueError, match="needs a folder"):
        apply_streaming(_model(), SPEC, _plan(BLOCKS), "cpu")
    with pytest.raises(ValueError, match=r"are not streamed"):
        apply_streaming(_model(), SPEC, Plan(streamed_blocks=BLOCKS[:2], disk_blocks=BLOCKS[2:]), "cpu",
                        disk_dir=tmp_path)
    with pytest.raises(ValueError, match="frozen blocks"):
        apply_streaming(_model(), SPEC, _plan(BLOCKS), "cpu", disk_dir=tmp_path, engine_cls=TrainableStreamingEngine)
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    from leantune.memory.disk_tier import DiskTierError as E
    with pytest.raises(E, match=r"disk tier.s folder .*file: cannot write"):
        apply_streaming(_model(), SPEC, _plan(BLOCKS), "cpu", disk_dir=blocked)
    assert os.listdir(tmp_path) == ["file"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only (bench/gpu_checks.sh window 1): the disk "
                                                          "tier's pinned staging and H2D on CUDA's copy stream")
def test_streamed_from_disk_equals_streamed_from_ram_on_cuda(tmp_path):
    """On a CUDA device the disk-tier blocks go file -> pinned staging -> the copy stream: two steps
    equal the same blocks streamed from host RAM bitwise, and no page of the file stays cached."""
    def step(model, seed):
        x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(seed)).cuda().requires_grad_(True)
        out = model(x)
        out.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        return out.detach().cpu(), [g.cpu() for g in grads], x.grad.cpu()

    plain = _model()
    ram, disk = copy.deepcopy(plain), copy.deepcopy(plain)
    h_ram = apply_streaming(ram, SPEC, _plan(()), "cuda")
    h_disk = apply_streaming(disk, SPEC, _plan(BLOCKS[1:]), "cuda", disk_dir=tmp_path)
    try:
        for seed in (1, 2):
            want, got = step(ram, seed), step(disk, seed)
            assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
            assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        assert cached_pages(h_disk.disk.fd) == 0
    finally:
        remove_streaming(h_disk, "cpu")
        release_streaming(h_ram)
