"""``compile=True``: each residual branch's body compiled as a region, against the same model run eagerly.

The references are the eager model itself (fp32, so the comparison is tight) and its module names. Compiled
regions must keep the precision plugin's boundary hooks working around them (the gradients carry the block
scales and are unscaled the same way), keep parameter names (the plugins and checkpoints address modules by
name), survive an EMA copy (``deepcopy``), and ``compile=auto`` must leave a CPU run eager. Compiling on the
CPU costs seconds per graph, hence ``slow``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from dalle_lightning.models.dvae import DiscreteVAE
from dalle_lightning.models.prior import DallePrior
from dalle_lightning.models.regions import check_compile
from dalle_lightning_plugins.precision.resblock_precision import ResblockScalingPrecision

PRIOR = dict(text_vocab_size=64, text_len=8, image_vocab_size=64, image_grid=4, n_layer=3, n_head=2, d_head=16)
DVAE = dict(image_size=16, vocab_size=32, n_hid=16, n_blk_per_group=1, group_count=2, codebook_dim=16)


def _prior_step(model: DallePrior) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    text, image = torch.randint(0, 64, (5, 8), generator=g), torch.randint(0, 64, (5, 16), generator=g)
    model.zero_grad()
    loss = model(text, image)["loss"]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _pair(cls: type, config: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    eager = cls(**config)
    compiled = cls(**config, compile=True)
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported")
@pytest.mark.parametrize("with_plugin", [False, True])
def test_compiled_prior_matches_eager(with_plugin: bool) -> None:
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = _pair(DallePrior, PRIOR)
    assert [n for n, _ in eager.named_parameters()] == [n for n, _ in compiled.named_parameters()]
    results = []
    for model in (eager, compiled):
        plugin = None
        if with_plugin:  # fp16 boundaries around fp32 branches: the hooks and scales, not 16-bit rounding, are tested
            plugin = ResblockScalingPrecision("fp16", init_scale_log2=10.0)
            plugin.convert_module(model)
            plugin._boundaries.dtype = torch.float32  # noqa: SLF001 - the same arithmetic in fp32 on both sides
        results.append(_prior_step(model))
        if plugin is not None:
            plugin.teardown()
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, atol=1e-5 * max(1.0, a.abs().max().item()), rtol=1e-4)
    assert counters["stats"]["unique_graphs"] >= 3  # the regions did compile (qkv, out, mlp)


@pytest.mark.slow
def test_compiled_dvae_matches_eager_and_survives_an_ema_copy() -> None:
    torch._dynamo.reset()
    eager, compiled = _pair(DiscreteVAE, DVAE)
    images = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    results = []
    for model in (eager, compiled):
        torch.manual_seed(5)  # the Gumbel noise
        out = model(images, temperature=1.0, kl_weight=0.1)
        out["loss"].backward()
        results.append((out["loss"].detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(b, a, atol=1e-5 * max(1.0, a.abs().max().item()), rtol=1e-4)
    ema = copy.deepcopy(compiled)  # what EMAWeightAveraging does; the copy runs its own weights
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
        torch.testing.assert_close(ema.encode(images), _halved(eager).encode(images), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(compiled.encode(images), eager.encode(images), atol=1e-5, rtol=1e-5)


def _halved(model: torch.nn.Module) -> torch.nn.Module:
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        for p in copy_.parameters():
            p.mul_(0.5)
    return copy_


def test_compile_auto_stays_eager_on_the_cpu_and_bad_values_raise() -> None:
    torch._dynamo.reset()
    counters.clear()
    model = DallePrior(**PRIOR, compile="auto")
    _prior_step(model)
    assert counters["stats"]["unique_graphs"] == 0
    assert check_compile("true") is True and check_compile("auto") == "auto"
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="expected true, false or auto"):
            DiscreteVAE(**DVAE, compile=bad)
