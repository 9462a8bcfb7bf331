"""Sampling as gpt-fast does it (``dalle_lightning/generation/cast.py``): under autocast, or with a ``dtype``, the
prior's weights are cast once per call (or once per ``Generator``) into a copy, the decode steps run that copy
without autocast, and the model itself is untouched; the copy's logits are the fp32 model's within bf16's
precision. On a GPU, the captured step reads that copy (16-bit weights), is captured with
``capture_error_mode="thread_local"``, and draws the eager tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dalle_lightning.generation import cast, generate, graph_decode, sampling
from dalle_lightning.generation.generate import Generator
from dalle_lightning.models.prior import DallePrior, KVCache
from tests.test_prior_score import Dvae, Tok

HEADS = ("ln_f.weight", "ln_f.bias", "text_head.weight", "image_head.weight")


def prior(device: str = "cpu", **kwargs: Any) -> DallePrior:
    torch.manual_seed(0)
    config = dict(text_vocab_size=50, text_len=6, image_vocab_size=40, image_grid=4, n_layer=2, n_head=2, d_head=16,
                  row_window=2, attn_impl="sparse") | kwargs
    return DallePrior(**config).to(device).eval()


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list]]:
    """Every cast copy made, and for every decode step the model it ran and whether autocast was on."""
    record: dict[str, list] = {"copies": [], "steps": []}
    make, decode_at = cast.sampling_copy, DallePrior.decode_at

    def copying(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
        record["copies"].append(dtype)
        return make(model, dtype)

    def decoding(self: DallePrior, *args: Any) -> torch.Tensor:
        record["steps"].append((self, torch.is_autocast_enabled("cpu")))
        return decode_at(self, *args)

    monkeypatch.setattr(cast, "sampling_copy", copying)
    monkeypatch.setattr(generate, "sampling_copy", copying)
    monkeypatch.setattr(DallePrior, "decode_at", decoding)
    yield record


def test_under_autocast_one_copy_per_call_runs_every_step_without_autocast(seen: dict[str, list]) -> None:
    model, text = prior(), torch.randint(1, 50, (3, 6))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            sampling.sample_image_tokens(model, text, top_k=8, generator=torch.Generator().manual_seed(0))
    assert seen["copies"] == [torch.bfloat16, torch.bfloat16]  # once per call, not per token
    steps = seen["steps"]
    assert len(steps) == 2 * (model.image_len - 1) and not any(autocast for _, autocast in steps)
    stepped = steps[0][0]
    assert stepped is not model and all(s is stepped for s, _ in steps[: model.image_len - 1])
    for name, p in stepped.named_parameters():
        assert p.dtype == (torch.float32 if name in HEADS else torch.bfloat16), name
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is untouched
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_without_autocast_the_weights_are_sampled_as_they_are(seen: dict[str, list]) -> None:
    model = prior()
    sampling.sample_image_tokens(model, torch.randint(1, 50, (2, 6)), generator=torch.Generator().manual_seed(0))
    assert seen["copies"] == [] and all(s is model for s, _ in seen["steps"])


@torch.no_grad()
def test_the_cast_copy_computes_the_fp32_logits_within_bf16_precision() -> None:
    model, text = prior(), torch.randint(1, 50, (4, 6))
    copy = cast.sampling_copy(model, torch.bfloat16)
    caches = KVCache(), KVCache()
    want, got = model.prefill(text, None, caches[0]), copy.prefill(text, None, caches[1])
    assert caches[1].layers[0].kv.dtype == torch.bfloat16 and got.dtype == torch.float32
    for n in range(5):
        token = want.argmax(-1)
        torch.testing.assert_close(got, want, rtol=0.0, atol=0.05 * want.abs().max().item())
        want, got = model.decode_at(token, n, caches[0]), copy.decode_at(token, n, caches[1])


def test_a_generator_with_a_dtype_casts_once_and_draws_what_a_call_with_that_dtype_draws(
        seen: dict[str, list]) -> None:
    model = prior(text_vocab_size=8, text_len=2, image_vocab_size=6, image_grid=3)
    gen = Generator(model, Dvae(), Tok(), dtype="bf16")
    first = gen.generate(["1", "3"], num_candidates=2, seed=4, graphs=False)
    second = gen.generate(["1", "3"], num_candidates=2, seed=4, graphs=False)
    assert seen["copies"] == [torch.bfloat16] and gen.sampler is not gen.prior  # one copy, at construction
    assert torch.equal(first.tokens, second.tokens)
    text = torch.tensor([[1, 0], [1, 0], [3, 0], [3, 0]])
    want = sampling.sample_image_tokens(model, text, generator=torch.Generator().manual_seed(4), dtype="bf16")
    assert torch.equal(first.tokens.flatten(0, 1), want)
    with pytest.raises(ValueError, match="sampling dtype"):
        Generator(model, Dvae(), Tok(), dtype="int8")


def test_the_graph_step_under_autocast_draws_the_eager_tokens_of_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph path on the CPU (a replay that rewrites its one output buffer, as a CUDA graph does) against the
    eager step, both under the caller's bf16 autocast: the same copy, the same tokens."""
    from tests.test_fast_path_fallbacks import replaying_capture

    model, text = prior(), torch.randint(1, 50, (4, 6))
    made: list[graph_decode.GraphDecoder] = []
    real = graph_decode.GraphDecoder

    def graph_decoder(*args: Any) -> graph_decode.GraphDecoder:
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(graph_decode, "capture", replaying_capture)
    monkeypatch.setattr(graph_decode, "GraphDecoder", graph_decoder)
    monkeypatch.setattr(sampling, "use_graphs", lambda mode, device, model=None: bool(mode))
    runs = {}
    for graphs in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs[graphs] = sampling.sample_image_tokens(model, text, cond_scale=3.0, top_k=8, graphs=graphs,
                                                        generator=torch.Generator().manual_seed(5))
    assert torch.equal(runs[True], runs[False])
    assert len(made) == 1 and made[0].captures == 1 and made[0].model.image_head.weight.dtype == torch.float32
    assert made[0].model.layers[0].mlp.fc.weight.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_cuda_the_captured_step_reads_bf16_weights_captured_thread_local(monkeypatch: pytest.MonkeyPatch) -> None:
    model, text = prior("cuda"), torch.randint(1, 50, (8, 6), device="cuda")
    modes, autocast, real = [], [], torch.cuda.graph

    def recording(graph: torch.cuda.CUDAGraph, **kwargs: Any) -> torch.cuda.graph:
        modes.append(kwargs.get("capture_error_mode"))
        autocast.append(torch.is_autocast_enabled("cuda"))
        return real(graph, **kwargs)

    monkeypatch.setattr(torch.cuda, "graph", recording)
    runs = {}
    for graphs in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            runs[graphs] = sampling.sample_image_tokens(model, text, top_k=8, graphs=graphs,
                                                        generator=torch.Generator("cuda").manual_seed(3))
    assert torch.equal(runs[True], runs[False])
    assert modes == ["thread_local"] and autocast == [False]

    # The buffer protocol on a real graph: logits kept from one step survive the next replay.
    copy = cast.sampling_copy(model, torch.bfloat16)
    caches = KVCache(), KVCache()
    with torch.no_grad():
        logits = copy.prefill(text, None, caches[0])
        copy.prefill(text, None, caches[1])
        step = graph_decode.GraphDecoder(copy, caches[1], torch.zeros(8, dtype=torch.long, device="cuda"))
        kept, want = [], []
        for n in range(model.image_len - 1):
            token = logits.argmax(-1)
            logits = copy.decode(token, caches[0])
            kept.append(step(token, n))
            want.append(logits)
    assert step.captures == 1 and all(torch.equal(a, b) for a, b in zip(kept, want))


def test_the_benchmark_counts_the_bytes_of_the_bf16_copy_the_step_reads() -> None:
    """``benchmarks/_sampling_rows.py``: a step reads the layers' weights in bf16 (2 bytes), the final LayerNorm and
    the image head in fp32 (4), and the gathered keys and values in bf16; counted here from the fp32 model's
    parameter counts, not from the copy."""
    import importlib.util
    from pathlib import Path

    from dalle_lightning.models.sparse_attention import decode_tables

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "_sampling_rows.py"
    spec = importlib.util.spec_from_file_location("benchmark_sampling_rows", path)
    assert spec is not None and spec.loader is not None
    rows = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rows)
    (row,) = rows.rows(torch.device("cpu"), smoke=True)
    torch.manual_seed(0)
    model, batch = DallePrior(**rows.TINY), 4
    layers = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers."))
    heads = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("ln_f", "image_head")))
    kv = sum(2 * batch * layer.attn.n_head * decode_tables(layer.attn.layout, torch.device("cpu"))[0].shape[1]
             * layer.attn.d_head for layer in model.layers)
    assert row["weights_dtype"] == "bfloat16" and row["same_tokens_as_eager"]
    assert row["bytes_per_step"] == 2 * layers + 4 * heads + 2 * kv
