"""Loading straight into the disk tier (memory/disk_load.py, models/weights.parking; issue 39): the
disk-tier blocks are read one at a time and parked in the disk tier's loading file as each is
filled, so host RAM never holds them together; what was parked is the loaded model bit for bit;
a run loaded so trains bitwise as one loaded whole into RAM; a file changed during the load is
named; the planner prices the load that way."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from conftest import tiny_lora_rest, tiny_run_toml
from safetensors.torch import load_file

from leantune.config import load_config
from leantune.memory.disk_load import BlockSpill, blocks_for_room
from leantune.memory.disk_tier import DiskTierError
from leantune.models.family import get_family
from leantune.models.flux import FLUX_SPEC
from leantune.models.weights import LoadError, parking
from leantune.memory.plan import Plan
from leantune.models.weights import QUANTIZING_WORK_BYTES
from leantune.planner.host_model import HOST_BASELINE
from leantune.trainer import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from leantune.demo import draw_shapes

    folder = tmp_path_factory.mktemp("shapes") / "images"
    draw_shapes(folder, count=4, size=64, seed=5)
    return folder


def _sources(folder):
    fam = get_family("flux")
    cfg = load_config_model(folder)
    return fam, fam.resolve_sources(cfg, folder)


def load_config_model(folder):
    from leantune.config import ModelConfig

    return ModelConfig(path=str(folder), family="flux", dtype="fp32")


def _tensors(module: torch.nn.Module) -> dict[int, torch.Tensor]:
    out = {}
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for t in store.values():
                if t is not None and not t.is_meta:
                    out[id(t)] = t
    return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Watched(BlockSpill):
    """Records, each time a block is parked, the host bytes of the model's tensors that are not
    parked (filled and still in anonymous host memory): what the load holds at that moment."""

    def __init__(self, folder, blocks, model_of):
        super().__init__(folder, blocks)
        self.model_of, self.held, self.mapped = model_of, [], set()

    def park(self, name, block):
        model = self.model_of()
        if model is not None:
            self.held.append(_nbytes(t for t in _tensors(model).values()
                                     if t.untyped_storage().data_ptr() not in self.mapped))
        super().park(name, block)
        self.mapped |= {t.untyped_storage().data_ptr() for t in _tensors(block).values()}


def _watched_load(folder, blocks, tmp_path, monkeypatch, spill_cls=_Watched):
    """The tiny Flux loaded with `blocks` parked, the model under load seen by the spill."""
    from leantune.models.flux import loading

    fam, sources = _sources(folder)
    seen = {}
    real = loading.load_into_empty

    def spy(model, *a, **k):                          # the model being filled, for the spill to look at
        seen["model"] = model
        return real(model, *a, **k)

    spill = spill_cls(tmp_path, blocks, lambda: seen.get("model"))
    monkeypatch.setattr(loading, "load_into_empty", spy)
    with parking(spill):
        model = fam.load_transformer(sources, dtype=torch.float32)
    monkeypatch.undo()
    return model, spill


def test_the_load_holds_one_disk_tier_block_at_a_time_and_parks_the_loaded_bytes(tiny_flux_dir, tmp_path, monkeypatch):
    fam, sources = _sources(tiny_flux_dir)
    plain = fam.load_transformer(sources, dtype=torch.float32)
    names = [n for n, _ in FLUX_SPEC.blocks(plain)]
    disk = tuple(names[1::2]) + (names[0],)           # every other block, the first one among them
    size = {n: _nbytes(_tensors(b).values()) for n, b in FLUX_SPEC.blocks(plain)}
    total = _nbytes(_tensors(plain).values())
    model, spill = _watched_load(tiny_flux_dir, disk, tmp_path, monkeypatch)

    # While loading: the non-disk tensors, the blocks parked so far none, the block being filled.
    rest = total - sum(size[n] for n in disk)
    assert len(spill.held) == len(disk)
    assert max(spill.held) <= rest + max(size[n] for n in disk)
    assert spill.held[0] <= rest + size[disk[0]]      # the first parked: none of the others filled yet
    # After: the disk-tier blocks are all in the file, nothing of them in anonymous memory.
    assert spill.parked_bytes == sum(size[n] for n in disk) and set(spill.ranges) == set(disk) and spill.parked_blocks == len(disk)
    assert _nbytes(t for t in _tensors(model).values()
                   if t.untyped_storage().data_ptr() not in spill.mapped) == rest
    assert spill.cached_pages() == 0                  # written, synced, and dropped from the page cache
    assert os.listdir(tmp_path) == []                 # unlinked: nothing another program could write
    want, got = plain.state_dict(), model.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k].view(torch.uint8), got[k].view(torch.uint8)) if want[k].dim() else
               torch.equal(want[k], got[k]) for k in want)
    spill.close()


def test_a_run_loaded_straight_to_disk_trains_bitwise_as_one_loaded_into_ram(tmp_path, tiny_flux_dir, images, caplog):
    (tmp_path / "fast").mkdir()

    def config(memory, out):
        p = tmp_path / f"{out}.toml"
        p.write_text(tiny_run_toml(tiny_flux_dir, images, tiny_lora_rest(tmp_path / out, "t", f"[memory]\n{memory}\n",
                                                                         steps=2, save_every=0)))
        return load_config(p)

    # fp8 block Linears quantized as read: the parked blocks carry e4m3 weights and their scales
    common = 'streamed_blocks = "all"\ndebug_poison = true\nfp8 = true\n'
    ram = train(config(common, "ram"), progress=False)
    budget = f'ram_budget = "{HOST_BASELINE // 2**20}MiB"\ndisk_dir = "fast"\n'   # no block fits in RAM
    cfg = config(common + budget, "disk")
    fam = get_family("flux")
    meta = fam.load_transformer(fam.resolve_sources(cfg.model, tmp_path), dtype=torch.float32, device="meta",
                                quantize_fp8=True)
    from leantune.memory.engine import resolve_plan

    every = tuple(n for n, _ in FLUX_SPEC.blocks(meta))
    assert blocks_for_room(meta, FLUX_SPEC, resolve_plan(cfg.memory, FLUX_SPEC, meta), 0) == every
    with caplog.at_level("INFO", logger="leantune"):
        disk = train(cfg, progress=False)
    assert f"model: {len(every)} blocks" in caplog.text and "loaded straight to the disk tier" in caplog.text
    assert f"{len(every)} streamed blocks read from disk" in caplog.text
    assert len(ram.losses) == 2 and disk.losses == ram.losses
    for a, b in zip(sorted(ram.lora_files), sorted(disk.lora_files)):
        want, got = load_file(a), load_file(b)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert os.listdir(tmp_path / "fast") == []


def test_a_checkpoint_changed_during_the_load_is_named(tiny_flux_dir, tmp_path, monkeypatch):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_flux_dir, folder)
    shard = next((folder / "transformer").glob("*.safetensors"))

    class Touching(_Watched):
        def park(self, name, block):
            super().park(name, block)
            st = os.stat(shard)                       # another program rewrites the file
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    with pytest.raises(LoadError, match=rf"{shard}: the file was changed on disk while it was being loaded"):
        _watched_load(folder, ("transformer_blocks.0", "single_transformer_blocks.0"), tmp_path / "d", monkeypatch,
                      Touching)


def test_a_loading_file_changed_before_it_is_read_is_named(tiny_flux_dir, tmp_path, monkeypatch):
    model, spill = _watched_load(tiny_flux_dir, ("transformer_blocks.0",), tmp_path, monkeypatch)
    spill.release("single_transformer_blocks.9")      # not parked: nothing to do, no error
    os.ftruncate(spill.fd, os.fstat(spill.fd).st_size + 4096)   # written behind the load's back
    with pytest.raises(DiskTierError, match=r"\.load-.*: it was changed during the load"):
        spill.release("transformer_blocks.0")
    spill.close()


def test_the_planner_prices_the_load_into_the_tiers():
    from test_planner_disk_tier import CACHES, STAGING, UNLIMITED, _planner, _tight

    from leantune.planner.workload import Budget

    p = _planner(3e9)
    need, _ = _tight(p)
    everything = p.plan(Budget(vram=need, ram=UNLIMITED))
    limit = HOST_BASELINE + CACHES + STAGING + p.host(everything)["streamed blocks (pinned)"] // 2
    plan = p.plan(Budget(vram=need, ram=limit))
    assert plan.disk_blocks
    whole = p.host(replace(plan, disk_blocks=()))["transformer while loading"]
    tiered = p.host(plan)["transformer while loading"]
    index = {b.name: i for i, b in enumerate(p.weights.blocks)}
    loaded = [p._bytes[(False, False)][index[n]] for n in plan.disk_blocks]
    # the blocks on disk leave the load, beside the one being filled (the window)
    assert tiered == whole - sum(loaded) + max(loaded) < whole
    # every block on disk: the non-block weights and the largest block
    alldisk = p.host(replace(plan, disk_blocks=plan.streamed_blocks))["transformer while loading"]
    resident = sum(p._bytes[(False, False)][i] for i, b in enumerate(p.weights.blocks)
                   if b.name not in plan.streamed_blocks)
    assert alldisk == p._nb_bytes + resident + max(p._bytes[(False, False)][index[n]] for n in plan.streamed_blocks)
    # the sampler loads whole: no discount
    sampling = _planner(3e9)
    sampling.workload = replace(sampling.workload, mode="inference")
    assert sampling.parked(plan) is None


def test_a_re_plan_reads_the_disk_tier_back_one_block_at_a_time(tmp_path):
    from test_disk_tier import BLOCKS, SPEC, _model, _plan, _step

    from leantune.memory.engine import apply_memory

    plain, model = _model(), _model()
    frozen = lambda m: {id(t): t for t in _tensors(m).values() if not t.requires_grad}   # noqa: E731
    handle = apply_memory(model, SPEC, _plan(BLOCKS[1:]), "cpu", disk_dir=tmp_path)
    want, got = _step(plain), _step(model)
    unit = {n: _nbytes(frozen(b).values()) for n, b in SPEC.blocks(plain)}

    class Counting(BlockSpill):                       # anonymous frozen bytes of the model at each park
        held, mapped = [], set()

        def park(self, name, block, **options):
            self.held.append(_nbytes(t for t in frozen(model).values()
                                     if t.untyped_storage().data_ptr() not in self.mapped))
            super().park(name, block, **options)
            self.mapped |= {t.untyped_storage().data_ptr() for t in frozen(block).values()}

    spill = Counting(tmp_path, BLOCKS[1:])
    # the ring's slots are not what a re-plan reads back: the units not restored yet still view them
    Counting.mapped |= {s.buf.untyped_storage().data_ptr() for s in handle.streaming.engine.slots}
    handle.remove(device="cpu", keep_fp8=True, keep_host=True, park=spill)
    rest = _nbytes(frozen(plain).values()) - sum(unit[n] for n in BLOCKS[1:])
    # each unit back from disk is parked before the next is read: one at a time beside the rest
    assert len(Counting.held) == 3 and max(Counting.held) <= rest + max(unit[n] for n in BLOCKS[1:])
    assert spill.parked_bytes == sum(unit[n] for n in BLOCKS[1:])
    assert all(p.requires_grad and p.untyped_storage().data_ptr() not in Counting.mapped
               for p in model.parameters() if p.requires_grad)             # the adapters stay as they are
    again = apply_memory(model, SPEC, _plan(BLOCKS[2:]), "cpu", disk_dir=tmp_path, parked=spill)
    spill.close()
    assert again.streaming.disk_blocks == BLOCKS[2:]
    for seed in (1, 2):
        want, got = _step(plain, seed), _step(model, seed)
        assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    again.release()


def test_the_trainers_re_plan_parks_what_it_reads_back_from_disk(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from test_memory_helpers import block_names, lora_flux, make_batch

    from leantune import trainer
    from leantune.distributed import DistContext
    from leantune.memory import disk_load
    from leantune.memory.engine import apply_memory
    from leantune.memory.plan import Plan
    from leantune.models.flux import predict

    model = lora_flux(seed=0)
    blocks = tuple(block_names(model))
    first = Plan(streamed_blocks=blocks, ring_slots=2, disk_blocks=blocks[::2], debug_poison=True)
    x, sigma, embeds, hw, _ = make_batch(8, 8, seed=7)
    handle = apply_memory(model, FLUX_SPEC, first, "cpu", disk_dir=tmp_path)
    with torch.no_grad():
        before = predict(model, x, sigma, embeds, hw, guidance=3.5)
    parked = []
    real = disk_load.BlockSpill.park
    monkeypatch.setattr(disk_load.BlockSpill, "park", lambda self, name, block, **o: (parked.append(name),
                                                                                     real(self, name, block, **o)))
    mode = SimpleNamespace(spec=FLUX_SPEC, name="lora", drop_partial_step=lambda t: None, memory_options=lambda: {})
    t = SimpleNamespace(mode=mode, memory=handle, transformer=model, device=torch.device("cpu"), disk_dir=tmp_path,
                        dist=DistContext(), plan=first, share_host_weights=False)
    trainer._replan(t, replace(first, disk_blocks=blocks[1::2]))
    assert parked == list(blocks[::2])                # each read back from disk went to the loading file
    assert t.memory.streaming.disk_blocks == blocks[1::2]
    with torch.no_grad():
        assert torch.equal(predict(model, x, sigma, embeds, hw, guidance=3.5), before)
    t.memory.release()
    assert os.listdir(tmp_path) == []


def test_under_a_vram_budget_the_planners_disk_blocks_are_loaded_straight_to_disk(tmp_path, tiny_flux_dir, images,
                                                                                  monkeypatch, caplog):
    """The planned path (a vram_budget: the plan chosen on the meta model before the load names
    its disk_blocks): those blocks are parked as read, and the run equals the same plan's run
    with the blocks in RAM, bit for bit."""
    from leantune import trainer
    from leantune.memory.plan import Plan

    (tmp_path / "fast").mkdir()
    names = {}

    def planned(disk):
        def plan_before_load(cfg, spec, meta_model, machine):
            blocks = tuple(n for n, _ in spec.blocks(meta_model()))
            names["blocks"] = blocks
            return Plan(streamed_blocks=blocks, ring_slots=2, debug_poison=True,
                        disk_blocks=blocks[::2] if disk else ()), None, None
        return plan_before_load

    def config(out, disk):
        p = tmp_path / f"{out}.toml"
        memory = 'vram_budget = "1GiB"\n' + ('disk_dir = "fast"\n' if disk else "")
        p.write_text(tiny_run_toml(tiny_flux_dir, images, tiny_lora_rest(tmp_path / out, "t", f"[memory]\n{memory}",
                                                                         steps=2, save_every=0)))
        return load_config(p)

    monkeypatch.setattr(trainer, "_plan_before_load", planned(False))
    ram = train(config("ram", False), progress=False)
    monkeypatch.setattr(trainer, "_plan_before_load", planned(True))
    with caplog.at_level("INFO", logger="leantune"):
        disk = train(config("disk", True), progress=False)
    parked = len(names["blocks"][::2])
    assert f"model: {parked} blocks" in caplog.text and "loaded straight to the disk tier" in caplog.text
    assert len(ram.losses) == 2 and disk.losses == ram.losses
    for a, b in zip(sorted(ram.lora_files), sorted(disk.lora_files)):
        want, got = load_file(a), load_file(b)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_leantune_sample_reads_its_streamed_blocks_from_disk_as_from_ram(tiny_flux_dir, tmp_path, caplog):
    """`leantune sample` with [memory] disk_dir and a ram_budget no block fits: every streamed block
    loaded straight to disk and read from there at each step; the images equal the run with the
    blocks in RAM, byte for byte. A missing folder is named."""
    import numpy as np
    from PIL import Image

    from leantune.config import ConfigError
    from leantune.infer.request import validate_request
    from leantune.infer.run import run_sampling

    def request(out, **memory):
        data = {"model": {"path": str(tiny_flux_dir), "dtype": "fp32"}, "prompts": ["a red square", "a circle"],
                "seed": 3, "steps": 2, "width": 64, "height": 64, "max_text_length": 16, "out": str(tmp_path / out),
                "memory": {"streamed_blocks": "all", "debug_poison": True, **memory}}
        return validate_request(data, "test request", base_dir=tmp_path)

    ram = run_sampling(request("ram"))
    (tmp_path / "fast").mkdir()
    with caplog.at_level("INFO", logger="leantune"):
        disk = run_sampling(request("disk", disk_dir="fast", ram_budget=f"{HOST_BASELINE // 2**20}MiB"))
    blocks = len(disk.plan.streamed_blocks)
    assert "sample: %d streamed blocks read from disk" % blocks in caplog.text
    assert f"sample: {blocks} blocks" in caplog.text and "loaded straight to the disk tier" in caplog.text
    assert [f.name for f in disk.files] == [f.name for f in ram.files]
    for a, b in zip(ram.files, disk.files):
        assert np.array_equal(np.asarray(Image.open(a)), np.asarray(Image.open(b)))
    assert os.listdir(tmp_path / "fast") == []
    with pytest.raises(ConfigError, match=r"memory.disk_dir = 'nowhere': .* does not exist"):
        run_sampling(request("bad", disk_dir="nowhere"))


def test_the_load_price_with_a_quantizing_load_and_the_packing_after_it():
    """host_breakdown's formula on made-up sizes: three streamed blocks, two of them parked, the
    load quantizing to fp8 as it reads (the trainer's): the load holds the stored RAM-tier part,
    the largest parked block as stored and the workers' buffers; packing reads each parked block
    back beside its buffer."""
    from leantune.memory.plan import Plan
    from leantune.models.weights import QUANTIZING_WORK_BYTES
    from leantune.planner.host_model import host_breakdown

    M = 2**20
    plan = Plan(streamed_blocks=("a", "b", "c"), fp8=True, disk_blocks=("a", "c"))
    packed, stored_units = [50 * M, 60 * M, 70 * M], [49 * M, 59 * M, 69 * M]
    nb, resident = 10 * M, 100 * M
    stored = nb + resident + sum(stored_units)
    loaded = 2 * stored                                   # the file's bf16
    disk = [True, False, True]
    parked = [(98 * M, 49 * M), (0, 0), (138 * M, 69 * M)]
    common = dict(plan=plan, packed=packed, unit_stored=stored_units, loaded=loaded, stored=stored,
                  largest_conversion=0, offload=0, cache_bytes=0, quantizing_load=True, disk=disk)
    whole, tiered = host_breakdown(**common), host_breakdown(**common, parked=parked)
    assert whole["transformer while loading"] == stored + QUANTIZING_WORK_BYTES
    assert tiered["transformer while loading"] == stored - (49 + 69) * M + 69 * M + QUANTIZING_WORK_BYTES
    # packing: the RAM part, then each unit in turn: a (parked: read back 49 beside its 50),
    # b (its 60 beside its originals, then 1 of alignment kept), c (read back 69 beside its 70)
    ram_part = stored - (49 + 69) * M
    assert tiered["stored transformer + one unit while packing"] == ram_part + max(50 + 49, 60, 1 + 70 + 69) * M
    assert tiered["peak"] < whole["peak"]


def test_the_tiered_load_is_priced_in_the_base_format_the_load_keeps():
    """A load quantizing as it reads keeps each parked block in the plan's base format (fp8, int8
    or NF4 rows): the price subtracts those bytes, never more (a load priced below the non-block
    weights and one block would be a load that does not exist)."""
    from test_planner_disk_tier import _model

    from leantune.planner.machine import assumed_machine, with_disk
    from leantune.planner.search import Planner
    from leantune.planner.workload import Workload

    model = _model()                                  # measured afresh: fp8 storages priced too
    w = Workload(rank=4, buckets=((64, 64),), text_length=8, quantizes_on_load=True,
                 base_formats=("fp8", "int8", "nf4"))
    p = Planner(FLUX_SPEC, model, w, with_disk(assumed_machine(), 3e9, "test disk"))
    names = tuple(b.name for b in p.weights.blocks)
    seen = set()
    for fmt in ("fp8", "int8", "nf4"):
        plan = Plan(streamed_blocks=names, fp8=True, base_format=fmt, disk_blocks=names)
        key = p.stored_key(plan)
        if key not in p._bytes:
            continue
        seen.add(fmt)
        stored = p._bytes[key]
        loading = p.host(plan)["transformer while loading"]
        assert loading == p._nb_bytes + max(stored) + QUANTIZING_WORK_BYTES, fmt
    assert "fp8" in seen and len(seen) >= 2
