"""Reusable Lightning plugins: intra-node sharding with PowerSGD between nodes, and per-resblock 16-bit scaling.

Never imports ``dalle_lightning``: models talk to these plugins through the ``resblocks()`` protocol
(see ``strategies/protocol.py``) or through module classes / name patterns given in config.
"""

from strategies.dcp_checkpoint import checkpoint_to_full_state_dict, export_full_state_dict
from strategies.mesh import build_mesh, mesh_shape
from strategies.prefetch import apply_prefetch, prefetch_plan
from strategies.protocol import UnscalingPrecision, find_resblocks
from strategies.resblock_precision import ResblockScalingPrecision
from strategies.sharded_powersgd import ShardedPowerSGDStrategy

__all__ = [
    "ResblockScalingPrecision",
    "ShardedPowerSGDStrategy",
    "UnscalingPrecision",
    "apply_prefetch",
    "build_mesh",
    "checkpoint_to_full_state_dict",
    "export_full_state_dict",
    "find_resblocks",
    "mesh_shape",
    "prefetch_plan",
]
