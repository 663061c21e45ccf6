import torch

from leantune.train.state import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint


def _optimizer_with_state():
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([w], lr=1e-2)
    w.grad = torch.randn_like(w)
    opt.step()
    return w, opt


def test_nested_state_round_trips_exactly_including_optimizer_int_keys(tmp_path):
    w, opt = _optimizer_with_state()
    state = {"w": w.detach(), "optimizer": opt.state_dict(), "pos": {"epoch": 2, "order": [3, 1, 2]},
             "tuple": (1, 2.5, "x"), "none": None}
    save_checkpoint(tmp_path, 7, state)
    step, back = load_checkpoint(latest_checkpoint(tmp_path))
    assert step == 7 and torch.equal(back["w"], w.detach())
    assert back["pos"] == state["pos"] and back["tuple"] == (1, 2.5, "x") and back["none"] is None
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = torch.optim.AdamW([w2], lr=1e-2)
    opt2.load_state_dict(back["optimizer"])
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt2.state[w2][k], opt.state[w][k])
    # The restored optimizer continues exactly like the original.
    g = torch.randn_like(w)
    w.grad, w2.grad = g.clone(), g.clone()
    opt.step(), opt2.step()
    assert torch.equal(w, w2)


def test_keep_last_prunes_and_incomplete_folders_are_ignored(tmp_path):
    for s in (1, 2, 3, 4):
        save_checkpoint(tmp_path, s, {"x": torch.tensor([s])}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000003", "step-000004"]
    (tmp_path / "step-000009").mkdir()          # a crashed save: no state.json
    assert latest_checkpoint(tmp_path).name == "step-000004"


def test_failed_save_leaves_previous_checkpoint_intact(tmp_path):
    save_checkpoint(tmp_path, 1, {"x": torch.tensor([1.0])})

    class Unstorable:
        pass

    try:
        save_checkpoint(tmp_path, 2, {"x": torch.tensor([2.0]), "bad": Unstorable()})
    except TypeError as e:
        assert "bad" in str(e)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000001"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    assert load_checkpoint(latest_checkpoint(tmp_path))[1]["x"].item() == 1.0


def test_a_state_with_non_finite_weights_is_refused_and_the_previous_save_kept(tmp_path):
    import pytest

    from leantune.train.state import NonFiniteStateError

    save_checkpoint(tmp_path, 1, {"trainable": {"a": torch.ones(3)}})
    bad = {"trainable": {"a": torch.tensor([1.0, float("nan"), 2.0])}, "rng": torch.zeros(4, dtype=torch.uint8)}
    with pytest.raises(NonFiniteStateError, match=r"trainable\.a.*NaN.*step-000001.*is kept"):
        save_checkpoint(tmp_path, 2, bad)
    with pytest.raises(NonFiniteStateError, match=r"inf"):
        save_checkpoint(tmp_path, 2, {"optimizer": {"m": torch.tensor([float("inf")], dtype=torch.bfloat16)}})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000001"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def _flip_a_byte_inside_the_data(path):
    """Bit rot: one byte of the tensor data changes, the length stays (the header still parses)."""
    raw = bytearray(path.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    raw[8 + header + 2] ^= 0x40
    path.write_bytes(bytes(raw))


def test_bit_rot_in_a_checkpoint_is_caught_by_its_checksum_and_the_previous_save_used(tmp_path):
    from leantune.train.state import load_latest

    save_checkpoint(tmp_path, 1, {"w": torch.arange(8.0)})
    save_checkpoint(tmp_path, 2, {"w": torch.arange(8.0) * 2})
    _flip_a_byte_inside_the_data(tmp_path / "step-000002" / "tensors.safetensors")
    ckpt, step, state = load_latest(tmp_path)
    assert step == 1 and torch.equal(state["w"], torch.arange(8.0))
    assert (tmp_path / "corrupt-step-000002").is_dir()


def test_a_loaded_state_with_non_finite_values_falls_back_too(tmp_path):
    """A checkpoint written before checksums were stored (or by a bad save) holding NaN."""
    import json

    from leantune.train.state import load_latest

    save_checkpoint(tmp_path, 1, {"w": torch.ones(2)})
    save_checkpoint(tmp_path, 2, {"w": torch.ones(2)})
    from safetensors.torch import save_file
    save_file({"w": torch.tensor([1.0, float("nan")])}, str(tmp_path / "step-000002" / "tensors.safetensors"))
    meta = json.loads((tmp_path / "step-000002" / "state.json").read_text())
    meta.pop("checksums", None)                   # as an older save has none
    (tmp_path / "step-000002" / "state.json").write_text(json.dumps(meta))
    _, step, _ = load_latest(tmp_path)
    assert step == 1
