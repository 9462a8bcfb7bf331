"""The decode step a CUDA graph replays (``dalle_lightning/generation/graph_decode.py``) against the eager decode:
on the CPU the static step (position on the device, static inputs, cache written in place) gives the same logits,
cache and tokens as the eager one, super-conditioning and priming included; on a GPU the replayed graph draws the
same tokens as the eager loop for the same seed and settings."""

from __future__ import annotations

import pytest
import torch

from dalle_lightning.generation import graph_decode, sampling
from dalle_lightning.generation.graph_decode import GraphDecoder, StaticDecoder, use_graphs
from dalle_lightning.models.prior import DallePrior, KVCache


def prior(device: str = "cpu") -> DallePrior:
    torch.manual_seed(0)
    model = DallePrior(text_vocab_size=50, text_len=6, image_vocab_size=40, image_grid=4, n_layer=4, n_head=2,
                       d_head=16, row_window=2, attn_impl="sparse").to(device)
    return model.eval()


def clone(cache: KVCache) -> KVCache:
    copy = KVCache(length=cache.length)
    copy.layers = [type(kv)(kv.max_len, kv.kv.clone()) for kv in cache.layers]  # type: ignore[union-attr]
    return copy


@torch.no_grad()
def test_the_static_step_equals_the_eager_decode_at_every_position() -> None:
    model = prior()
    text = torch.randint(1, 50, (3, 6))
    eager = KVCache()
    logits = model.prefill(text, None, eager)
    static = clone(eager)
    step = StaticDecoder(model, static, torch.zeros(3, dtype=torch.long))
    for n in range(model.image_len - 1):
        token = logits.argmax(-1)
        logits = model.decode(token, eager)
        assert torch.equal(step(token, n), logits), n
    for a, b in zip(eager.layers, static.layers):
        assert torch.equal(a.kv, b.kv)  # type: ignore[arg-type]


@pytest.mark.parametrize("cond_scale,prefix", [(1.0, 0), (3.0, 0), (3.0, 5)])
def test_sampling_through_the_static_step_draws_the_eager_tokens(monkeypatch: pytest.MonkeyPatch, cond_scale: float,
                                                                 prefix: int) -> None:
    """sample_image_tokens with every decode through the static inputs (the graph's plumbing, uncaptured) against
    the eager loop: the same tokens, with super-conditioning (a 2B batch) and an image prefix."""
    model = prior()
    text = torch.randint(1, 50, (4, 6))
    image_prefix = torch.randint(0, 40, (4, prefix)) if prefix else None
    kwargs = dict(cond_scale=cond_scale, top_k=8, image_prefix=image_prefix, temperature=0.9)
    want = sampling.sample_image_tokens(model, text, generator=torch.Generator().manual_seed(1), graphs=False, **kwargs)
    made: list[StaticDecoder] = []

    def static(model: DallePrior, cache: KVCache, token: torch.Tensor, graphs: bool) -> StaticDecoder:
        made.append(StaticDecoder(model, cache, token))
        return made[-1]

    monkeypatch.setattr(sampling, "decode_step", static)
    got = sampling.sample_image_tokens(model, text, generator=torch.Generator().manual_seed(1), **kwargs)
    assert len(made) == 1  # one static step for the whole call
    assert torch.equal(got, want)


def test_graphs_are_chosen_where_they_apply() -> None:
    cpu = torch.device("cpu")
    assert use_graphs("auto", cpu) is False and use_graphs(False, cpu) is False
    with pytest.raises(ValueError, match="graphs=true on cpu; expected a CUDA device"):
        use_graphs(True, cpu)
    with pytest.raises(ValueError, match="graphs='sometimes'; expected true, false or auto"):
        use_graphs("sometimes", cpu)


def shipped_prior(device: str) -> DallePrior:
    """The prior as it ships and trains: ``attn_impl="auto"`` (a FlexAttention prefill on CUDA), ``compile="auto"``
    (each branch's body compiled on CUDA, so inside the capture) and the precision plugin's branch hooks (bf16, as
    ``make demo`` trains)."""
    from dalle_lightning_plugins.precision.resblock_precision import ResblockScalingPrecision

    torch.manual_seed(0)
    model = DallePrior(text_vocab_size=50, text_len=6, image_vocab_size=40, image_grid=4, n_layer=4, n_head=2,
                       d_head=16, row_window=2, attn_impl="auto", compile="auto").to(device).eval()
    ResblockScalingPrecision(dtype="bf16").convert_module(model)
    return model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("cond_scale", [1.0, 3.0])
def test_the_replayed_graph_draws_the_eager_tokens_on_cuda(monkeypatch: pytest.MonkeyPatch, cond_scale: float) -> None:
    """The shipped settings, sampled as ``PriorModule.fid_generate`` samples under the plugin (bf16 autocast: one
    cast copy per call, run without autocast), eager against the captured step."""
    model = shipped_prior("cuda")
    text = torch.randint(1, 50, (8, 6), device="cuda")
    made: list[GraphDecoder] = []
    real = graph_decode.decode_step

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        step = real(*args, **kwargs)
        made.append(step)
        return step

    monkeypatch.setattr(sampling, "decode_step", counted)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        runs = {g: sampling.sample_image_tokens(model, text, cond_scale=cond_scale, top_k=8, graphs=g,
                                                generator=torch.Generator("cuda").manual_seed(3)) for g in (False, True)}
    assert torch.equal(runs[True], runs[False])
    assert isinstance(made[1], GraphDecoder) and made[1].captures == 1  # one capture, replayed for every token
    assert made[1].model is not model and made[1].model.layers[0].mlp.fc.weight.dtype == torch.bfloat16


def test_the_shipped_prior_draws_the_eager_tokens_through_the_static_step_on_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA test's model and sampling on the CPU, where the shipped settings resolve to the blocked kernel and
    eager regions: the bf16 copy keeps the plugin's branch hooks, and the static step (the graph's plumbing,
    uncaptured) draws the eager loop's tokens."""
    model = shipped_prior("cpu")
    text = torch.randint(1, 50, (4, 6))
    made: list[StaticDecoder] = []

    def static(model: DallePrior, cache: KVCache, token: torch.Tensor, graphs: bool) -> StaticDecoder:
        made.append(StaticDecoder(model, cache, token))
        return made[-1]

    runs = {}
    for graphs in (False, True):
        if graphs:
            monkeypatch.setattr(sampling, "decode_step", static)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs[graphs] = sampling.sample_image_tokens(model, text, cond_scale=3.0, top_k=8, graphs=False,
                                                        generator=torch.Generator().manual_seed(2))
    assert torch.equal(runs[True], runs[False])
    copy = made[0].model
    assert copy is not model and copy.layers[0].mlp.fc.weight.dtype == torch.bfloat16
    assert copy.layers[0].mlp._forward_pre_hooks and copy.layers[0].attn._forward_hooks  # the plugin's hooks
