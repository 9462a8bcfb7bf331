"""compression_report on a meta-device model: FSDP2 shard shapes, the per-matrix rule, and byte counts checked
against a hand computation and against what PowerSGD itself counts on real tensors of those shapes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dalle_lightning_plugins.compression.compression_report import compression_report, fsdp_shard_shape
from dalle_lightning_plugins.compression.powersgd import PowerSGD


class TinyTransformer(nn.Module):
    """A one-block pre-LN transformer (nanoGPT naming) small enough to count by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(10, 16)
        self.attn = nn.Linear(16, 48)
        self.fc = nn.Linear(16, 64)
        self.proj = nn.Linear(64, 16)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 10, bias=False)
        self.gate = nn.Linear(16, 2, bias=False)


def _meta_model() -> nn.Module:
    with torch.device("meta"):
        return TinyTransformer()


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 10, 13])
@pytest.mark.parametrize("shards", [1, 3, 4])
def test_shard_shapes_match_fsdp2_chunking(rows: int, shards: int) -> None:
    """Reference: FSDP2's _chunk_with_empty (torch.chunk on dim 0, missing chunks empty)."""
    chunks = list(torch.chunk(torch.empty(rows, 3), shards, dim=0))
    chunks += [torch.empty(0, 3)] * (shards - len(chunks))
    for index in range(shards):
        assert fsdp_shard_shape((rows, 3), shards, index) == tuple(chunks[index].shape)


def test_report_equals_hand_computation_on_meta_model() -> None:
    # 2 nodes x 4 devices, global rank 7 = node 1, shard 3; PowerSGD rank 2; min_compression 2.
    # Shard 3 of each parameter (chunk = ceil(rows / 4)):
    #   tok   (10,16) chunk 3 -> rows 9..9 = (1,16)  listed (embedding)   16 numel, padded 48
    #   attn.w (48,16) -> (12,16): 192 >= 2*2*28 -> r=2, P 24 + Q 32 = 56 factors
    #   attn.b (48,)  -> (12,) vector
    #   fc.w  (64,16) -> (16,16): 256 >= 2*2*32 -> r=2, P 32 + Q 32 = 64 factors
    #   fc.b  (64,)   -> (16,) vector
    #   proj.w (16,64) -> (4,64): 256 < 2*2*68 = 272 -> too small, 256
    #   proj.b (16,) -> 4; ln.w, ln.b (16,) -> 4 + 4 vectors
    #   head.w (10,16) -> (1,16): r = 1, 16 < 2*1*17 -> too small, 16 (padded 48)
    #   gate.w (2,16) chunk 1 -> shard 3 is empty (padded 16)
    report = compression_report(_meta_model(), nodes=2, devices_per_node=4, rank=7, powersgd_rank=2)
    json.dumps(report)  # JSON-able
    assert report["shard_index"] == 3
    assert report["params_total"] == 160 + 768 + 48 + 1024 + 64 + 1024 + 16 + 32 + 160 + 32
    assert report["params_per_rank"] == 16 + 192 + 12 + 256 + 16 + 256 + 4 + 8 + 16 + 0
    assert report["padded_params_per_rank"] == 48 + 192 + 12 + 256 + 16 + 256 + 4 + 8 + 48 + 16
    dense = 16 + 12 + 16 + 256 + 4 + 8 + 16
    assert report["uncompressed_bytes"] == 4 * 776
    assert report["compressed_bytes"] == 4 * dense + 4 * (56 + 64)
    assert report["compression"] == pytest.approx(1 - (4 * dense + 4 * 120) / (4 * 776))
    assert report["ring_bytes_per_step"] == report["compressed_bytes"]  # 2 (2-1)/2 = 1
    kinds = report["kinds"]
    assert kinds["compressed"] == {"params": 2, "numel": 448, "compressed_bytes": 480, "uncompressed_bytes": 1792}
    assert kinds["listed"] == {"params": 1, "numel": 16, "compressed_bytes": 64, "uncompressed_bytes": 64}
    assert kinds["vector"] == {"params": 5, "numel": 40, "compressed_bytes": 160, "uncompressed_bytes": 160}
    assert kinds["too_small"] == {"params": 2, "numel": 272, "compressed_bytes": 1088, "uncompressed_bytes": 1088}
    assert kinds["empty"]["params"] == 1 and kinds["empty"]["numel"] == 0

    bf16 = compression_report(_meta_model(), 2, 4, 7, 2, comm_dtype="bf16")
    assert bf16["compressed_bytes"] == 4 * dense + 2 * 120
    head_too = compression_report(_meta_model(), 2, 4, 7, 2, uncompressed=lambda n, p, m: n.startswith(("tok", "fc")))
    assert head_too["kinds"]["listed"]["numel"] == 16 + 256 and head_too["kinds"]["compressed"]["params"] == 1


@pytest.mark.parametrize("rank", range(4))
def test_report_matches_powersgd_byte_counts(rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's bytes equal what PowerSGD counts when it reduces real gradients of the local shard shapes.

    Two nodes, seen from one process: PowerSGD is told it has 2 replicas (its collectives are then skipped, as
    without a process group), so it compresses and counts as a rank of a 2-node mesh would."""
    model = _meta_model()
    report = compression_report(model, nodes=2, devices_per_node=4, rank=rank, powersgd_rank=2, comm_dtype="fp16")
    grads = [(n, torch.randn(fsdp_shard_shape(p.shape, 4, rank))) for n, p in model.named_parameters()]
    monkeypatch.setattr(PowerSGD, "replicas", property(lambda self: 2))
    psgd = PowerSGD(None, rank=2, comm_dtype=torch.float16)
    assert psgd.reduce(grads, uncompressed={"tok.weight"})
    assert psgd.stats.bytes_sent_last_step == report["compressed_bytes"]
    assert psgd.stats.uncompressed_bytes_last_step == report["uncompressed_bytes"]


def test_report_rejects_bad_mesh() -> None:
    with pytest.raises(ValueError, match=r"rank=8 must be in \[0, 8\)"):
        compression_report(_meta_model(), nodes=2, devices_per_node=4, rank=8, powersgd_rank=2)
    with pytest.raises(ValueError, match="powersgd_rank=0"):
        compression_report(_meta_model(), nodes=2, devices_per_node=4, rank=0, powersgd_rank=0)
