"""Prior images (train/priors.py, data/buckets.py MixedOrder): mixed in at their ratio, resumable;
differential output preservation's target is the base model's own prediction, and its loss is zero
while the adapter is."""

import copy

import pytest
import torch
from conftest import tiny_lora_rest, tiny_run_toml

from leantune.config import LoraConfig, load_config
from leantune.data.buckets import BatchOrder, MixedOrder
from leantune.demo import draw_shapes
from leantune.models.family import PromptEmbeds, get_family
from leantune.train.lora import add_lora, lora_layers
from leantune.train.priors import base_prediction, trained_adapter_off
from leantune.trainer import train


def _mixed(ratio=0.25, n_train=6, n_prior=5):
    train_index, prior_index = list(range(n_train)), list(range(n_train, n_train + n_prior))
    return MixedOrder(BatchOrder([(64, 64)] * n_train, 2, seed=1), train_index,
                      BatchOrder([(64, 64)] * n_prior, 2, seed=2), prior_index, ratio)


def test_prior_batches_come_at_their_ratio_from_their_own_images_and_resume_exactly():
    order = _mixed()
    slots = [next(order) for _ in range(12)]
    assert [s.prior for s in slots] == [False, False, False, True] * 3
    assert all(set(s.samples) <= set(range(6, 11)) for s in slots if s.prior)
    assert all(set(s.samples) <= set(range(6)) for s in slots if not s.prior)

    again = _mixed()
    for _ in range(5):
        next(again)
    saved = again.state_dict()
    resumed = _mixed()
    resumed.load_state_dict(saved)
    assert [next(resumed) for _ in range(7)] == slots[5:]
    with pytest.raises(ValueError, match="another mix of training and prior images"):
        _mixed(ratio=0.5).load_state_dict(saved)
    with pytest.raises(ValueError, match="saved without prior batches"):
        _mixed().load_state_dict(BatchOrder([(64, 64)] * 6, 2, seed=1).state_dict())


def _flux_with_lora():
    from leantune import tiny

    fam = get_family("flux")
    model = tiny.flux_transformer(seed=0)
    add_lora(model, fam.spec, LoraConfig(rank=2, targets="attention_mlp"))
    return fam, model


def _predictor(fam, model):
    g = torch.Generator().manual_seed(3)
    x = fam.pack_latents(torch.randn(1, 16, 8, 8, generator=g))
    cfg = model.config
    embeds = PromptEmbeds(t5=torch.randn(1, 4, cfg.joint_attention_dim, generator=g),
                          pooled=torch.randn(1, cfg.pooled_projection_dim, generator=g))
    return lambda: fam.predict(model, x, torch.tensor([0.6]), embeds, (8, 8), 1.0)


def test_the_dop_target_is_the_base_models_prediction_and_zero_while_the_adapter_is():
    fam, model = _flux_with_lora()
    predict = _predictor(fam, model)
    assert torch.equal(base_prediction(predict, model), predict())      # B = 0: the adapter adds nothing

    base = copy.deepcopy(model)
    with torch.no_grad():
        for layer in lora_layers(model, "default").values():
            layer.lora_B["default"].weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
    trained = predict()
    target = base_prediction(predict, model)
    assert not torch.equal(trained, target)
    assert torch.equal(target, _predictor(fam, base)())                # the model as it was, bit for bit
    assert not target.requires_grad
    assert torch.equal(predict(), trained)                             # the adapter is back on after
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)

    plain = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="no active adapter 'default'"):
        with trained_adapter_off(plain):
            pass


PRIOR_DATASET = '\n[[data.datasets]]\npath = "{prior}"\nrole = "prior"\n'


def _config(tmp_path, model, images, prior, out, extra=()):
    p = tmp_path / f"{out}.toml"
    p.write_text(tiny_run_toml(model, images, PRIOR_DATASET.format(prior=prior) + tiny_lora_rest(tmp_path / out, "p")))
    return load_config(p, ['data.prior_loss="dop"', "data.prior_ratio=0.5", *extra])


def test_a_dop_run_trains_resumes_exactly_and_its_keys_are_checked(tmp_path, tiny_flux_dir):
    images, prior = tmp_path / "images", tmp_path / "prior"
    draw_shapes(images, count=4, size=64, seed=8)
    draw_shapes(prior, count=4, size=64, seed=9)
    full = train(_config(tmp_path, tiny_flux_dir, images, prior, "full"), progress=False)
    assert len(full.losses) == 4 and full.losses[1] > 0 and full.losses[3] > 0        # steps 2 and 4: prior
    cfg = _config(tmp_path, tiny_flux_dir, images, prior, "parts")
    assert train(cfg, stop_after=2, progress=False).final_step == 2
    assert train(cfg, resume=True, progress=False).losses == full.losses

    # the same run with every block streamed and checkpointed (debug_poison: a slot read after its
    # release is NaN): the adapter-off forward inside the step leaves the engine's ring as it was
    streamed = train(_config(tmp_path, tiny_flux_dir, images, prior, "streamed",
                             extra=['memory.streamed_blocks="all"', 'memory.checkpointing="offload"',
                                    "memory.debug_poison=true", "memory.stream_non_blocks=true"]), progress=False)
    assert streamed.losses == pytest.approx(full.losses, rel=1e-5)

    with pytest.raises(Exception, match="prior_loss = \"dop\": .*\\[train\\] mode = \"full\""):
        _config(tmp_path, tiny_flux_dir, images, prior, "f", extra=['train.mode="full"'])


def test_prior_keys_without_a_prior_dataset_are_named(tmp_path):
    p = tmp_path / "run.toml"
    images = tmp_path / "i"
    images.mkdir()
    p.write_text(tiny_run_toml(tmp_path, images, "").replace("[data]\n", "[data]\nprior_ratio = 0.3\n"))
    with pytest.raises(Exception, match="prior_ratio: set, but no \\[\\[data.datasets\\]\\] has role = \"prior\""):
        load_config(p)
    p.write_text(tiny_run_toml(tmp_path, images, "role = \"prior\"\n"))
    with pytest.raises(Exception, match="every \\[\\[data.datasets\\]\\] has role = \"prior\""):
        load_config(p)
