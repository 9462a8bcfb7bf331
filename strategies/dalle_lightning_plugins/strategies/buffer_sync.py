"""When every rank takes rank 0's buffers (batch-norm running statistics), as ``ddp`` does.

``DistributedDataParallel(broadcast_buffers=True)`` broadcasts its rank 0's buffers before a forward when the
forward before it through the wrapper was grad-enabled and synchronised (``require_forward_param_sync``, set
after every forward: ``torch.is_grad_enabled() and require_backward_grad_sync``; a new wrapper starts with it
set). Lightning's ``DDPStrategy`` sends ``training_step`` through its wrapper, and ``validation_step`` too while
fitting (the sanity check's included); ``validate``, ``test`` and ``predict`` call the module itself. So under
``ddp``:

* the first forward of a fit broadcasts (a fresh wrapper), and every training forward that follows a synchronised
  one;
* the first validation forward of each epoch broadcasts (it follows a training forward), the others do not; a
  ``WeightAveraging`` callback has swapped its averaged buffers into the module by then, so they are what goes;
* with gradient accumulation the first micro-batch of a window broadcasts (it follows the window's synchronised
  last), the others do not;
* a training forward right after a validation does not broadcast (validation's forwards are without grad).

:class:`BufferBroadcasts` is that rule, per stage; the strategy asks it before each of those forwards. A resumed
fit starts from rank 0's buffers on every rank, as every ``ddp`` rank loads rank 0's file (:meth:`BufferBroadcasts.share`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dalle_lightning_plugins.strategies.broadcasts import broadcast_buffers


class BufferBroadcasts:
    """``ddp``'s ``require_forward_param_sync`` for one strategy: whether the next forward starts from rank 0's
    buffers. A stage's first forward finds it set, as a fit's fresh ``DistributedDataParallel`` does.

    ``scope`` (each call's): the ranks that share the first one's buffers, and how many (every rank; a node under
    local steps).
    """

    def __init__(self) -> None:
        self.pending = True  # the last forward was synchronised and grad-enabled (or there was none this stage)

    def begin_stage(self) -> None:
        """A stage's setup: its first forward broadcasts, as a fit's fresh ``DistributedDataParallel`` does."""
        self.pending = True

    def before_forward(self, module: nn.Module | None, synchronised: bool,
                       scope: tuple[dist.ProcessGroup | None, int]) -> None:
        """Collective over ``scope`` when a broadcast is due: rank 0's buffers before this forward; then note
        whether this forward (grad-enabled, ``synchronised``: not inside ``block_backward_sync``) makes the next
        one broadcast."""
        if self.pending and module is not None:
            self.share(module, scope)
        self.pending = torch.is_grad_enabled() and synchronised

    @staticmethod
    def share(module: nn.Module, scope: tuple[dist.ProcessGroup | None, int]) -> None:
        """Collective over ``scope``: every rank of it takes the scope's first rank's buffers (before a forward, and
        after a resume, as every ``ddp`` rank loads rank 0's file)."""
        group, size = scope
        if size > 1:
            broadcast_buffers(module, group)
