"""Float comparisons whose tolerance follows the tensor's own scale.

fp32 results that reach the same value by another summation order (a thread count, a padded
replay, a fused kernel) differ by a few units in the last place of the *largest* terms summed,
not of the element compared: SmolLM2's residual stream holds a few "massive activations" of
~22,000 beside ordinary values of ~20, and a fixed `atol=1e-4` failed on a 21.0 that differed by
9.5e-4 (4.4e-5 relative) when the thread count changed. So the absolute part of the tolerance is
`rel` times the expected tensor's largest magnitude; a real error (another position, another
layer, a missing term, bf16 rounding) is orders of magnitude larger than that.
"""

import torch


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5, msg: str = ""):
    """assert_close with atol = rel * max|expected| and rtol = rel."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, atol=rel * scale, rtol=rel,
                               msg=(lambda m: f"{msg} (scale {scale:.3g}, rel {rel:g}): {m}") if msg else None)
