import math

import pytest
import torch

from leantune.train import flow_matching as fm


def test_noising_interpolates_data_and_noise_and_target_is_their_velocity():
    x0 = torch.randn(3, 16, 4, 4)
    eps = torch.randn_like(x0)
    sigma = torch.tensor([0.0, 0.25, 1.0])
    noisy = fm.add_noise(x0, eps, sigma)
    assert torch.equal(noisy[0], x0[0]) and torch.equal(noisy[2], eps[2])
    assert torch.allclose(noisy[1], 0.75 * x0[1] + 0.25 * eps[1])
    # d(noisy)/d(sigma) is the velocity target: the straight path from data to noise.
    v = fm.velocity_target(x0, eps)
    assert torch.allclose(fm.add_noise(x0, eps, sigma + 0.1) - noisy, 0.1 * v, atol=1e-6)


def test_loss_is_mse_in_fp32():
    pred = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    target = torch.tensor([[0.0, 0.0]])
    loss = fm.flow_matching_loss(pred, target)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(2.5)


def test_flux_mu_matches_bfl_endpoints_and_time_shift_formula():
    assert fm.flux_mu(256) == pytest.approx(0.5) and fm.flux_mu(4096) == pytest.approx(1.15)
    s = torch.tensor([0.5])
    assert fm.time_shift(math.log(3.0), s).item() == pytest.approx(0.75)  # shift 3 maps 0.5 -> 0.75


@pytest.mark.parametrize("method", ["uniform", "sigmoid", "shift", "flux_shift"])
def test_sigma_sampling_is_in_range_and_reproducible(method):
    a = fm.sample_sigmas(4096, method, torch.Generator().manual_seed(0), shift=3.0, image_seq_len=4096)
    b = fm.sample_sigmas(4096, method, torch.Generator().manual_seed(0), shift=3.0, image_seq_len=4096)
    assert torch.equal(a, b) and a.min() > 0 and a.max() < 1


def test_sigma_distributions_have_the_documented_shape():
    g = lambda: torch.Generator().manual_seed(1)
    uniform = fm.sample_sigmas(20000, "uniform", g())
    sigmoid = fm.sample_sigmas(20000, "sigmoid", g())
    shifted = fm.sample_sigmas(20000, "shift", g(), shift=3.0)
    hi_res = fm.sample_sigmas(20000, "flux_shift", g(), image_seq_len=4096)
    lo_res = fm.sample_sigmas(20000, "flux_shift", g(), image_seq_len=256)
    assert abs(uniform.mean() - 0.5) < 0.01 and abs(sigmoid.mean() - 0.5) < 0.01
    assert sigmoid.std() < uniform.std()                  # logit-normal concentrates mid-range
    assert shifted.mean() > 0.65                          # shift 3 pushes toward noise
    assert hi_res.mean() > lo_res.mean() > sigmoid.mean()  # more tokens, more shift
