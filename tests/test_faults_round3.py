"""Issue 41, round three of "every fault a sentence": symlinked dataset folders and link loops, a
sample that fails while training, reference images (sizes that differ in a batch, extreme aspects,
the dataset's own folder, a family that takes none), and SIGTERM while one long operation holds
Python. Each test failed on the code before it (the commit that added this file says how)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_run_toml
from PIL import Image

from leantune.cli import main
from leantune.config import DatasetConfig, load_config
from leantune.data.dataset import DataWarning
from leantune.demo import draw_shapes

REST = """
[lora]
rank = 2
targets = "attention"

[train]
steps = 2
learning_rate = 1e-3
mixed_precision = "no"
seed = 3

[output]
dir = "out"
name = "t"
formats = ["comfyui"]
"""


def _config(root: Path, model, images, rest: str = REST) -> Path:
    p = root / "run.toml"
    p.write_text(tiny_run_toml(model, images, rest))
    return p


# -- symlinked folders ---------------------------------------------------------------------------------

def test_symlinked_folders_are_followed_once_and_link_loops_are_named(tmp_path):
    """Before: the 4 images of a symlinked sub-folder were left out without a word, and a pair of
    image links pointing at each other was skipped silently."""
    from leantune.config import DataConfig
    from leantune.data.dataset import scan_datasets

    data = tmp_path / "data"
    draw_shapes(data, count=4, size=64, seed=1)
    draw_shapes(tmp_path / "elsewhere", count=4, size=64, seed=2)
    (data / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (data / "again").symlink_to(tmp_path / "elsewhere", target_is_directory=True)   # the same folder twice
    (data / "linked_sub").mkdir()
    (data / "linked_sub" / "up").symlink_to(data, target_is_directory=True)         # a loop back to the top
    (data / "a.png").symlink_to(data / "b.png")
    (data / "b.png").symlink_to(data / "a.png")                                     # a looping file pair
    with pytest.warns(DataWarning) as caught:
        items = scan_datasets(DataConfig(datasets=[DatasetConfig(path=str(data))], resolutions=[64]))
    said = "\n".join(str(w.message) for w in caught)
    elsewhere, top = (tmp_path / "elsewhere").resolve(), data.resolve()
    assert len(items) == 8
    assert len({it.sha256 for it in items}) == 8                                     # nothing counted twice
    assert f"followed 1 symlinked folder(s) into the dataset: {data / 'again'} -> {elsewhere}" in said
    assert "skipped 2 folder(s) reached a second time" in said
    assert f"{data / 'linked'} -> {elsewhere} (already scanned as {data / 'again'})" in said
    assert f"{data / 'linked_sub' / 'up'} -> {top} (already scanned as {data})" in said
    assert "skipped 2 unreadable image(s)" in said
    assert f"{data / 'a.png'}: a symlink that resolves nowhere (broken, or a loop of links)" in said
    assert f"{data / 'b.png'}: a symlink that resolves nowhere" in said


# -- a sample that fails while training ----------------------------------------------------------------

def test_a_failing_in_training_sample_is_reported_and_costs_no_training_state(tmp_path, tiny_flux_dir, monkeypatch,
                                                                             caplog):
    """Before: the sample's exception ended the run after step 1 with nothing saved (no checkpoint,
    no LoRA). Now it is one line, training goes on, saves as planned, and the run resumes."""
    from leantune.infer import sampler
    from leantune.train.state import list_checkpoints
    from leantune.trainer import train

    def fails(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 80.00 GiB\n(details on the next line)")

    monkeypatch.setattr(sampler, "sample_during_training", fails)
    draw_shapes(tmp_path / "images", count=2, size=64, seed=4)
    rest = REST + '\n[sample]\nevery = 1\nprompts = ["a red circle"]\nsteps = 1\nwidth = 64\nheight = 64\n'
    cfg = load_config(_config(tmp_path, tiny_flux_dir, tmp_path / "images", rest))
    result = train(cfg, progress=False)
    assert result.final_step == 2 and not result.interrupted and result.sample_files == []
    out = tmp_path / "out"
    assert (out / "t_comfyui.safetensors").is_file()
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == ["step-000002"]
    lines = [r.getMessage() for r in caplog.records if "in-training sample failed" in r.getMessage()]
    assert lines == [f"step {n}: the in-training sample failed (RuntimeError: CUDA out of memory. Tried to allocate "
                     f"80.00 GiB); training goes on without it, the [sample] settings are worth a look"
                     for n in (1, 2)]
    resumed = train(load_config(tmp_path / "run.toml", ["train.steps=3"]), resume=True, progress=False)
    assert resumed.final_step == 3 and len(resumed.losses) == 3 and resumed.losses[:2] == result.losses


# -- reference images ----------------------------------------------------------------------------------

EDIT = """
[model]
family = "{family}"
path = "{model}"
dtype = "fp32"

[data]
resolutions = [64]
batch_size = 2
cache_dir = "cache"
max_text_length = 32
shuffle = false

[[data.datasets]]
path = "{images}"
reference_path = "{refs}"

[lora]
rank = 2
targets = "attention"

[train]
steps = {steps}
learning_rate = 1e-3
mixed_precision = "no"
seed = 3

[output]
dir = "out"
name = "t"
formats = ["diffusers"]
"""


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from leantune.tiny import qwen_image as tq

    return tq.save_qwen_image_folder(tmp_path_factory.mktemp("qwen") / "qwen-tiny")


@pytest.fixture(scope="module")
def flux2_dir(tmp_path_factory):
    from leantune.tiny import flux2 as tf

    return tf.save_flux2_folder(tmp_path_factory.mktemp("flux2") / "flux2-tiny", "dev", seed=0)


def _edit_dataset(root: Path, sizes) -> tuple[Path, Path]:
    """Targets (64 px shapes) and one reference each, of the given sizes, matched by file stem."""
    images, refs = root / "images", root / "refs"
    draw_shapes(images, count=len(sizes), size=64, seed=5)
    refs.mkdir()
    rng = np.random.default_rng(0)
    for target, (w, h) in zip(sorted(images.glob("*.png")), sizes):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(refs / target.name)
    return images, refs


def _edit_config(root: Path, family: str, model, images, refs, steps: int = 3) -> Path:
    p = root / "run.toml"
    p.write_text(EDIT.format(family=family, model=model, images=images, refs=refs, steps=steps))
    return p


@pytest.mark.parametrize("family", ["qwen-image-edit", "flux2-dev"])
def test_references_of_several_sizes_train_with_batch_size_2(tmp_path, family, qwen_dir, flux2_dir):
    """Before: a ValueError traceback at the first step, after the model loaded ("their aspect ratios
    differ", for FLUX.2 not even the reason: it encodes references at their own size). Targets of
    one bucket whose references are encoded at different sizes now train in separate batches, as
    targets of different buckets do, and the warning says how many batches that makes."""
    from leantune.data.cache import prepare_caches
    from leantune.trainer import train

    model = qwen_dir if family == "qwen-image-edit" else flux2_dir
    images, refs = _edit_dataset(tmp_path, [(64, 64), (64, 64), (96, 48), (48, 96)])
    cfg = load_config(_edit_config(tmp_path, family, model, images, refs))
    with pytest.warns(DataWarning, match=r"train in separate batches \(a batch stacks references of one size\): "
                                         r"3 batches per epoch instead of 2 at \[data\] batch_size 2"):
        result = train(cfg, progress=False)                                  # the 3 steps: one epoch
    assert result.final_step == 3 and all(np.isfinite(result.losses))
    assert (tmp_path / "out" / "t_diffusers.safetensors").is_file()
    with pytest.warns(DataWarning, match="separate batches"):
        data = prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32)
    batches = data.batches(seed=0)
    epoch = [next(batches) for _ in range(data.batches_per_epoch)]
    assert sorted(len(b.captions) for b in epoch) == [1, 1, 2]
    assert len({tuple(b.references[0].shape[2:]) for b in epoch}) == 3      # one reference size per batch


@pytest.mark.parametrize("case", ["strip", "rounds_to_nothing", "own_folder", "family_without"])
def test_reference_problems_are_one_sentence_before_the_model_is_read(tmp_path, case, capsys):
    """Before: a 20000x20 reference failed in the resize (a side rounded to 0), reference_path = the
    dataset's folder ended in "cannot batch an empty sample list", and a reference_path on a family
    that takes none was a ValueError traceback. The model path does not exist: each of these is
    told before anything of the model is read, and nothing is encoded."""
    sizes = {"strip": (20000, 20), "rounds_to_nothing": (320, 16)}.get(case, (64, 64))
    images, refs = _edit_dataset(tmp_path, [(64, 64), sizes])
    if case == "own_folder":
        refs = images
    family = "qwen-image" if case == "family_without" else "qwen-image-edit"
    config = _edit_config(tmp_path, family, tmp_path / "no-such-model", images, refs)
    assert main(["cache", str(config)]) == 1
    err = capsys.readouterr().err
    odd = sorted(images.glob("*.png"))[1].name
    expected = {
        "strip": [f"reference image {refs / odd}", "[[data.datasets]] #1 reference_path) is 20000x20 px, more "
                  "than 64 times as wide as tall"],
        "rounds_to_nothing": [f"reference image {refs / odd}", "[[data.datasets]] #1 reference_path) is 320x16 px: "
                              "qwen-image-edit would encode it at 288x0 px for the 64x64 bucket, a side under 16 px"],
        "own_folder": [f"[[data.datasets]] #1 reference_path: {images} is the dataset's own folder",
                       "every image there would be a reference and none a target"],
        "family_without": ['[[data.datasets]] #1 reference_path: family = "qwen-image" takes no reference images',
                           "remove the key"],
    }[case]
    assert all(part in err for part in expected), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "no-such-model" not in err
    assert not (tmp_path / "cache" / "latents").exists()


def test_groups_that_split_no_bucket_keep_the_batch_order_and_its_layout():
    """A run without references (or with one reference size per bucket) batches as before: a saved
    position from before resumes exactly."""
    from leantune.data.buckets import BatchOrder

    buckets = [(64, 64)] * 5 + [(96, 48)] * 3
    plain = BatchOrder(buckets, 2, seed=7)
    same = BatchOrder(buckets, 2, seed=7, groups=[((64, 64),)] * 5 + [((48, 48),)] * 3)
    split = BatchOrder(buckets, 2, seed=7, groups=[((64, 64),)] * 3 + [((32, 96),), ((96, 32),)] + [((48, 48),)] * 3)
    assert same.layout == plain.layout and not same.splits_buckets
    assert [next(same).samples for _ in range(8)] == [next(plain).samples for _ in range(8)]
    assert plain.batches_per_epoch == 5
    assert split.splits_buckets and split.layout != plain.layout and split.batches_per_epoch == 6


# -- SIGTERM while one long operation holds Python -------------------------------------------------------

STUCK = r"""
import signal, sys, time
from leantune.data import cache

def stuck_encode(vae, pixels):
    # One native operation of minutes, as a VAE encode of a 4096 px image on a CPU: Python cannot run
    # its signal handler until it returns. With the stop signals blocked in this thread the kernel
    # gives them to another, as it does while this one computes; the sleep is not cut short.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    print("encoding", flush=True)
    time.sleep(300)

cache.encode_latent = stuck_encode
from leantune.cli import main
sys.exit(main(["train", sys.argv[1], "--no-progress"]))
"""


def test_sigterm_during_a_long_cache_encode_ends_the_process_within_the_bound(tmp_path, tiny_flux_dir):
    """Before: the process said "SIGTERM: stopping now" only when the encode returned (minutes); a
    container's grace period ends long before. Now it ends STOP_BOUND_S after the signal, naming
    what it was doing, with exit 143 and the run folder unlocked.

    The stuck encode is simulated by a sleep with the stop signals blocked in its thread. Under
    pytest-xdist beside other tests the signal was seen to reach Python's handler anyway, about 2 s
    after it was sent (2 of 3 whole-suite runs, 1 of 2 runs of this file beside
    test_hostile_inputs.py; never alone, loaded or not; cause not found): the simulation did not
    hold, and that run says nothing about the watchdog. Such a run must still end in the bound with
    exit 143 and the folder unlocked; the scenario is then tried afresh, up to five times, and the
    watchdog's own ending must be seen at least once."""
    from leantune.train.run_folder import LOCK_NAME
    from leantune.train.stopping import STOP_BOUND_S

    draw_shapes(tmp_path / "images", count=1, size=64, seed=6)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1"}
    watchdog_line = (f"leantune: still running {STOP_BOUND_S:g} s after SIGTERM, while setting up the caches, model "
                     f"and memory plan (one long operation kept Python from stopping); ending the process now, the "
                     f"last saved state is intact")
    tries = []
    for attempt in range(5):
        run = tmp_path / f"try{attempt}"
        run.mkdir()
        config = _config(run, tiny_flux_dir, tmp_path / "images")
        proc = subprocess.Popen([sys.executable, "-c", STUCK, str(config)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline() == "encoding\n", proc.communicate(timeout=60)[1][-3000:]
            assert (run / "out" / LOCK_NAME).exists()
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=STOP_BOUND_S + 15)     # old code: the encode's 300 s
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 143, (proc.returncode, took, err[-3000:])   # how it ended, before how long it took
        assert took < STOP_BOUND_S + 5, (took, err[-3000:])
        assert not (run / "out" / LOCK_NAME).exists()
        tries.append((round(took, 2), watchdog_line in err))
        if watchdog_line in err:
            assert STOP_BOUND_S - 0.5 < took, (took, err[-3000:])        # the watchdog waited the bound
            break
        assert "stopped by SIGTERM" in err, err[-3000:]                  # the handler's own, orderly ending
    assert tries[-1][1], f"the watchdog never had to end the process: {tries}"


def test_the_stop_watchdog_waits_for_the_step_and_the_save_but_not_after_a_second_signal():
    """The bound's rules (train/stopping.py), on the watchdog's own thread with the signal numbers
    written to its pipe as CPython's C handler writes them: a SIGTERM inside a step starts the
    clock at the step's end, a save holds it, a second signal does not wait for the save, Ctrl-C
    alone never ends the process, and a run that returned (close) is not ended afterwards."""
    from leantune.train.stopping import StopWatchdog

    def watchdog():
        dog = StopWatchdog(bound=0.5)
        dog.ended = []

        def end():                                   # instead of os._exit: note the time, disarm
            dog.ended.append(time.monotonic())
            with dog._lock:
                dog._deadline = None
        dog._end = end
        dog._thread.start()
        return dog

    def hear(dog, signum=signal.SIGTERM):
        os.write(dog._write, bytes([signum]))

    dog = watchdog()
    dog.enter_step()
    hear(dog)
    time.sleep(1.0)
    assert dog.ended == []                           # the step goes on to its end
    dog.leave_step()
    with dog.saving():
        time.sleep(1.0)
        assert dog.ended == []                       # the resumable state is written whole
    saved = time.monotonic()
    time.sleep(2.0)
    assert len(dog.ended) == 1 and saved + 0.3 < dog.ended[0] < saved + 1.5, (saved, dog.ended)
    dog.close()

    dog = watchdog()
    hear(dog, signal.SIGINT)
    time.sleep(1.0)
    assert dog.ended == []                           # Ctrl-C alone: Python's own interrupt, never forced
    with dog.saving():
        hear(dog)                                    # a second signal: no more waiting for the save
        second = time.monotonic()
        time.sleep(2.0)
        assert len(dog.ended) == 1 and dog.ended[0] < second + 1.5, (second, dog.ended)
    dog.close()
    dog._thread.join(timeout=5)
    assert not dog._thread.is_alive()                # closed: the thread ends

    dog = watchdog()
    hear(dog)
    dog.close()                                      # the run raised its Terminated and returned
    time.sleep(1.0)
    assert dog.ended == []
