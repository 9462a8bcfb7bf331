"""The precision plugin's branch boundaries fused into one compiled kernel each, against the eager passes.

The eager path (widening copy, GradScaler's unscale-and-check, ``nan_to_num_``) is the reference: the fused kernels
must give the same values and flags bit for bit, in both 16-bit dtypes, with Inf and NaN present, for contiguous
and channels-last gradients, and through the whole plugin on a deep residual model. Compiling on the CPU costs
seconds per graph, hence ``slow``; on a GPU the same functions compile to Triton (``fused_boundaries=None``).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dalle_lightning_plugins.precision.boundary_kernels import branch_grad, identity_grad
from dalle_lightning_plugins.precision.resblock_precision import ResblockScalingPrecision
from tests.helpers.deep_residual import DeepResidual, plugin_update, regression_data


def _with_bad_values(shape: tuple[int, ...], dtype: torch.dtype, channels_last: bool = False) -> Tensor:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 3000
    if channels_last:
        g = g.contiguous(memory_format=torch.channels_last)
    g = g.to(dtype)
    flat = g.permute(0, 2, 3, 1).reshape(-1) if channels_last else g.view(-1)
    flat[3], flat[11] = float("inf"), float("nan")
    if channels_last:
        g = flat.view(shape[0], shape[2], shape[3], shape[1]).permute(0, 3, 1, 2)
    return g


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("shape", "channels_last"), [((4, 9, 16), False), ((3, 5, 16), False), ((2, 8, 6, 6), True)])
def test_fused_boundaries_equal_the_eager_passes(dtype: torch.dtype, shape: tuple[int, ...], channels_last: bool) -> None:
    grad = _with_bad_values(shape, dtype, channels_last)
    inv = torch.tensor([2.0**-13])
    flags = [torch.zeros(1), torch.zeros(1)]
    eager, fused = (identity_grad(grad, inv, flag, fused=f) for flag, f in zip(flags, (False, True)))
    assert eager.dtype == fused.dtype == torch.float32 and torch.equal(eager, fused)
    assert flags[0].item() == flags[1].item() == 1.0 and bool(torch.isfinite(fused).all())
    clean = torch.zeros(1)
    identity_grad(torch.nan_to_num(grad, 0.0, 0.0, 0.0), inv, clean, fused=True)
    assert clean.item() == 0.0  # a finite gradient leaves the flag down
    if channels_last:
        assert fused.is_contiguous(memory_format=torch.channels_last)  # no hidden layout copy
    upstream = eager * 3000
    scale = torch.tensor([2.0**13])
    want, got = (branch_grad(upstream, scale, dtype, fused=f) for f in (False, True))
    assert got.dtype == dtype and torch.equal(want, got)  # including the Inf of a product beyond fp16's range


@pytest.mark.slow
def test_plugin_with_fused_boundaries_steps_as_the_eager_one() -> None:
    """Five fp16 updates of a deep residual model with an overflowing block on the first: same scales, flags,
    skipped updates and weights with and without fusion."""
    x, y = regression_data()
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = DeepResidual()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        plugin = ResblockScalingPrecision("fp16", init_scale_log2=24.0, fused_boundaries=fused)
        plugin.convert_module(model)
        for _ in range(5):
            plugin_update(plugin, opt, model, x, y)
        results.append((plugin.scales.log2.clone(), plugin.scales.skipped, [p.detach().clone() for p in model.parameters()]))
    (log2_a, skipped_a, weights_a), (log2_b, skipped_b, weights_b) = results
    assert skipped_a == skipped_b >= 1  # the start at 2^24 overflowed somewhere, so the filter had work to do
    assert torch.equal(log2_a, log2_b)
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b))


def test_fused_boundaries_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="fused_boundaries='yes'"):
        ResblockScalingPrecision("bf16", fused_boundaries="yes")  # type: ignore[arg-type]
