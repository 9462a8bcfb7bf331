"""The process side of the plugins' strategies: Lightning's ``ParallelStrategy`` with what they need of
``ModelParallelStrategy``, written here instead of inherited.

Why not derive from ``ModelParallelStrategy``: Lightning's connector refuses ``precision="16-mixed"`` for every
instance of it (``The ModelParallelStrategy does not support Fabric(..., precision='16-mixed')``), a string that
trains under ``ddp`` and under these strategies alike. The only way past that check for a subclass was to replace
it in Lightning's ``_AcceleratorConnector`` for the whole process, at import: every Trainer of the process, with any
strategy, then ran the plugins' check. From ``ParallelStrategy`` the strategy reaches Lightning's connector as a
user's own strategy does: Lightning's check stays whole and applies to every strategy it names, and the precision
strings the strategies do not train in are refused by the strategy itself when Lightning hands it the precision
plugin (:mod:`dalle_lightning_plugins.strategies.precision_choice`). ``is_distributed`` says what Lightning's list of
its own distributed strategies said for ``ModelParallelStrategy``: ``sync_dist`` reduces, samplers are distributed.

What is taken from ``ModelParallelStrategy``, as it does it: the launcher that reruns the script, the default
process group from the cluster environment (with the run's timeout), world ranks, the device, Lightning's
``barrier``/``broadcast``/``reduce`` (taking sharded values and naming a lost peer), restoring a checkpoint after setup (the strategy loads optimizer state
itself), meta-device init under ``init_module(empty_init=True)``, optimizers made afresh at each fit. Its own mesh,
its FSDP1 check, its ``configure_model`` requirement and its checkpoint format are not: the strategies build their
own ``("replicate", "shard")`` mesh and write their own checkpoints.

A stage also leaves nothing of its own behind: what a strategy installs for a stage (an op rule, a thread count) is
undone by :meth:`ShardedParallelStrategy.teardown`, through :meth:`ShardedParallelStrategy.until_teardown`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_only as utils_rank_zero_only  # lightning_utilities' own
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.io.checkpoint_io import atomic_io
from dalle_lightning_plugins.io.dcp_checkpoint import export_full_state_dict
from dalle_lightning_plugins.strategies.collective_failures import CollectiveFailures, lost_peer_line
from dalle_lightning_plugins.strategies.dtensor_collectives import DTensorCollectives
from dalle_lightning_plugins.strategies.optimizer_step import refuse_reevaluating_optimizers
from dalle_lightning_plugins.strategies.precision_choice import check_precision_plugin

DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's and Lightning's default for a process group


class ShardedParallelStrategy(ParallelStrategy):
    """A ``ParallelStrategy`` over one process per device, with a device mesh of the subclass's making."""

    def __init__(self, process_group_backend: str | None = None,
                 timeout: timedelta | None = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self._process_group_backend: str | None = process_group_backend
        self._timeout: timedelta | None = timeout
        self._device_mesh: DeviceMesh | None = None
        self._stage_undo: list[Callable[[], None]] = []
        self.num_nodes = 1
        self.collective_failures = CollectiveFailures(lost_peer_line)  # a subclass may word it with its nodes
        self.dtensor_collectives = DTensorCollectives(type(self).__name__)

    # ------------------------------------------------------------------ what Lightning asks of a strategy

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError(f"{type(self).__name__}.device_mesh before setup_environment: the processes do not "
                               "exist yet")
        return self._device_mesh

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's connector for strategies not in its own list: ``sync_dist`` then reduces over the
        ranks and the samplers are distributed, as for ``ddp``."""
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the strategy's load_checkpoint needs the sharded model and the optimizers

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restored the optimizers already

    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        return ParallelStrategy.precision_plugin.fget(self)  # type: ignore[attr-defined]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning sets it inside Trainer(...), from precision="..." or plugins=[...]: a refused one fails there.
        check_precision_plugin(plugin, type(self).__name__)
        ParallelStrategy.precision_plugin.fset(self, plugin)  # type: ignore[attr-defined]

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = compat.subprocess_script_launcher(self.cluster_environment, self.num_processes,
                                                               self.num_nodes)

    def _setup_distributed(self) -> None:
        """This rank's device, the seed, the world ranks and the default process group (as ``ddp`` makes them)."""
        super().setup_environment()  # Strategy's: the accelerator selects this rank's device
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        compat.init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                                    device_id=device_id)

    def _start_processes(self, per_node: int) -> tuple[int, str]:
        """The stage's processes, as every Lightning strategy starts them: this rank's device first
        (``torch.cuda.set_device`` on CUDA, so ``devices=[2, 3]`` or an already initialised CUDA context cannot put
        two ranks on one GPU), a share of the cores, the default process group. Returns the devices per node (a
        world smaller than ``per_node``, the same code run on fewer devices, is one node of them, said in one line)
        and the backend."""
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # Lightning's launcher divides the cores among its processes only in the process that launches the
            # others (after starting them): every other rank would run as many threads as there are cores. For the
            # stage only: at its teardown the count is what it was, as ddp leaves it.
            self.until_teardown(functools.partial(torch.set_num_threads, torch.get_num_threads()))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.num_processes)))
        self._setup_distributed()
        if self.world_size < per_node:
            rank_zero_info(f"{type(self).__name__}(devices_per_node={per_node}) on a world of {self.world_size}: "
                           f"one node of {self.world_size} device(s)")
            per_node = self.world_size
        return per_node, self._get_process_group_backend()

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        # Fresh at every fit: a stage before may have left optimizers over parameters the module no longer holds.
        self.optimizers = []
        self.lr_scheduler_configs = []
        super().setup_optimizers(trainer)
        refuse_reevaluating_optimizers(self.optimizers, type(self).__name__)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """Files written atomically unless a checkpoint IO is given (:func:`~dalle_lightning_plugins.io.checkpoint_io.atomic_io`)."""
        self._checkpoint_io = atomic_io(self._checkpoint_io)
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the unsharded model state dict on CPU for single-device use (complete on rank 0 only)."""
        assert self.lightning_module is not None
        return export_full_state_dict(self.lightning_module)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # restored after setup: the strategy's load_checkpoint loaded the model's state

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # restored after setup: the strategy's load_checkpoint loaded the optimizers' state

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Under empty_init the parameters are made on the meta device and materialised after sharding (setup).
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ Lightning's collectives, as ddp's
    # On sharded values as ddp's on the full ones (DTensorCollectives); a lost peer in one line naming the
    # collective (CollectiveFailures).

    @override
    def barrier(self, name: str | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        with self.collective_failures.named("Lightning's barrier"):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        with self.collective_failures.named("Lightning's broadcast"):
            box = [self.dtensor_collectives.to_send(obj)]
            dist.broadcast_object_list(box, src, group=dist.group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        with self.collective_failures.named("Lightning's reduce (a checkpoint's decision or a logged metric)"):
            tensor = self.dtensor_collectives.to_reduce(tensor)
            if isinstance(tensor, torch.Tensor):
                tensor = compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        return super().all_gather(self.dtensor_collectives.to_send(tensor), group=group, sync_grads=sync_grads)

    # ------------------------------------------------------------------ the end of a stage

    def until_teardown(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` at this stage's teardown (the last registered first): what a stage installs in the
        process, it removes."""
        self._stage_undo.append(undo)

    def _undo_stage(self) -> None:
        while self._stage_undo:
            self._stage_undo.pop()()

    @override
    def teardown(self) -> None:
        # ModelParallelStrategy's: the module stays where it is (its weights are the user's after the stage).
        try:
            assert self.cluster_environment is not None and self.accelerator is not None
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
        finally:
            self._undo_stage()

    @override
    def __getstate__(self) -> dict:
        """Pickled (``torch.save(trainer)``) without the stage's undo steps, which belong to this process."""
        state = super().__getstate__()
        state["_stage_undo"] = []
        return state
