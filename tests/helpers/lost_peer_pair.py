"""Two processes of one gloo group, for ``tests/test_peer_loss.py``: ``peer`` joins and is SIGKILLed; ``survivor``
runs a collective after that inside ``dalle-train``'s error handling (``common.one_line_errors``), as a rank whose
peer node went does. The survivor's exit code and stderr are what the test reads.

    python lost_peer_pair.py survivor|peer PORT
"""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

role, port = sys.argv[1], sys.argv[2]
rank = 0 if role == "survivor" else 1
if role == "survivor":
    from omegaconf import OmegaConf

    from dalle_lightning.cli.common import one_line_errors
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(rank))
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
dist.barrier()
if role == "peer":
    os.kill(os.getpid(), signal.SIGKILL)


def train(cfg: object) -> None:
    time.sleep(0.5)  # the peer is gone by now
    dist.all_reduce(torch.ones(4))


one_line_errors(train)(OmegaConf.create({}))
sys.exit(0)
