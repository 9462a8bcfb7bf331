"""Reusable Lightning plugins: intra-node sharding with PowerSGD between nodes, and per-resblock 16-bit scaling.

The distribution ``dalle-lightning-plugins`` (built from this folder by its own ``pyproject.toml``); it needs
``torch`` and ``lightning`` only. Never imports ``dalle_lightning``: models talk to these plugins through the
``resblocks()`` protocol (see ``protocol.py``) or through module classes / name patterns given in config.
"""

from importlib import metadata as _metadata

from dalle_lightning_plugins.strategies.local_steps import LocalStepsStrategy
from dalle_lightning_plugins.io.dcp_checkpoint import checkpoint_to_full_state_dict, export_full_state_dict
from dalle_lightning_plugins.strategies.mesh import build_mesh, mesh_shape
from dalle_lightning_plugins.strategies.prefetch import apply_prefetch, prefetch_plan
from dalle_lightning_plugins.protocol import GroupUnscalingPrecision, UnscalingPrecision, find_resblocks
from dalle_lightning_plugins.precision.resblock_precision import ResblockScalingPrecision
from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy

try:
    __version__ = _metadata.version("dalle-lightning-plugins")  # the folder's VERSION file, at install time
except _metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = [
    "GroupUnscalingPrecision",
    "LocalStepsStrategy",
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
