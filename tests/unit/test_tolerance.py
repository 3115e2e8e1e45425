"""The scale-aware comparison used against transformers' hidden states can pass and can fail."""

import pytest
import torch

from tests.helpers.tolerance import assert_close_to_scale


def _residual_like(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 576, generator=g) * 20
    x[:, 7] = 22_000.0  # a massive activation, as SmolLM2's middle layers hold
    return x


def test_another_summation_order_passes():
    """The same values summed in another order (as another thread count does) pass."""
    terms = [_residual_like(s) / 30 for s in range(30)]
    forward = sum(terms)
    backward = sum(reversed(terms))
    assert not torch.equal(forward, backward)  # fp32 rounding differs...
    assert_close_to_scale(backward, forward)  # ...within the tensor's own scale


def test_an_ordinary_value_off_by_what_a_fixed_atol_rejected_passes():
    """The flake: 9.5e-4 on a value of ~21 next to 22,000-sized activations (4.4e-5 relative)."""
    expected = _residual_like()
    actual = expected.clone()
    actual[3, 100] += 9.5e-4
    with pytest.raises(AssertionError):
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-5)
    assert_close_to_scale(actual, expected)


@pytest.mark.parametrize("error", [0.5, 5.0])
def test_a_real_error_fails(error):
    """A wrong value at one ordinary element, far smaller than the tensor's typical spread, fails."""
    expected = _residual_like()
    actual = expected.clone()
    actual[3, 100] += error
    with pytest.raises(AssertionError, match="scale"):
        assert_close_to_scale(actual, expected, msg="resid")


def test_another_position_fails():
    expected = _residual_like()
    with pytest.raises(AssertionError):
        assert_close_to_scale(expected.roll(1, dims=0), expected)
