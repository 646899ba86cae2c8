"""The parity rule (helpers.assert_parity) itself: it passes on exact zeros against rounding
noise when the configuration has a real scale, and fails on real errors: a flipped mask, a 1e-3
relative perturbation, a zeroed gradient where the reference has a real scale."""
import pytest
import torch

from helpers import assert_parity, reference_attention

REL = 5e-6


def _grads(mask):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, _ = reference_attention(q, k, v, attn_mask=mask)
    return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))


def test_exact_zero_against_noise_passes_at_a_real_configuration_scale():
    noise = 1e-9 * torch.randn(16, 16, dtype=torch.float64)
    real = torch.randn(16, 16, dtype=torch.float64)
    assert_parity(torch.zeros(16, 16), noise, REL, "noise", scale=[real, noise], n=16)


def test_exact_zero_against_noise_fails_without_a_configuration_scale():
    with pytest.raises(AssertionError):
        assert_parity(torch.zeros(16, 16), 1e-9 * torch.randn(16, 16, dtype=torch.float64), REL, "noise")


def test_a_perturbation_of_1e_3_fails():
    want = _grads(None)
    for g in want:
        with pytest.raises(AssertionError):
            assert_parity((g * (1 + 1e-3)).float(), g, REL, "perturbed", scale=want, n=8)
        assert_parity(g.float(), g, REL, "rounded to float32", scale=want, n=8)


def test_a_flipped_mask_fails():
    mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(1)) < 0.4
    mask[:, 0] = False
    flipped = mask.clone()
    flipped[:, 1:] = ~flipped[:, 1:]
    want, got = _grads(mask), _grads(flipped)
    with pytest.raises(AssertionError):
        for g, w in zip(got, want):
            assert_parity(g.float(), w, REL, "flipped mask", scale=want, n=8)


def test_a_zeroed_gradient_fails_where_the_reference_has_a_real_scale():
    want = _grads(None)
    for w in want:
        with pytest.raises(AssertionError):
            assert_parity(torch.zeros_like(w).float(), w, REL, "zeroed", scale=want, n=8)


def test_a_small_real_tensor_keeps_its_own_relative_bound():
    # 1e-2 of the configuration's scale is far above rounding: 1e-4 relative must still fail.
    small = 1e-2 * torch.randn(16, 16, dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_parity((small * (1 + 1e-4)).float(), small, REL, "small", scale=1.0, n=16)
