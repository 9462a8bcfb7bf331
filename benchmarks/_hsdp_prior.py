"""The demo's prior under hybrid sharding without compression, as a Lightning user would write it.

Lightning's ``ModelParallelStrategy`` builds a 2-D mesh ``("data_parallel", "tensor_parallel")``; with
``data_parallel_size`` = nodes and ``tensor_parallel_size`` = devices per node, its second axis is the devices of
one node. ``fully_shard`` over that 2-D mesh in ``configure_model`` is FSDP2's HSDP: every resblock (and the
rest, as the root unit) sharded within a node, its gradient shards all-reduced in full between nodes. The
baseline that ``benchmarks/two_nodes.py --per-node 2`` (method ``hsdp``) sets the strategy against; loaded by
``_target_`` from the runs, which get the repository root on ``PYTHONPATH``.
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule, fully_shard
from typing_extensions import override

from dalle_lightning.lit.prior import PriorModule


class HSDPPriorModule(PriorModule):
    """:class:`PriorModule` with a ``configure_model`` that applies HSDP over the strategy's 2-D mesh."""

    @override
    def configure_model(self) -> None:
        if isinstance(self.model, FSDPModule):  # Lightning calls the hook once per stage: shard once
            return
        mesh = self.device_mesh  # (nodes, devices per node): replicate over the first, shard over the second
        for _, block in self.model.resblocks():
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
