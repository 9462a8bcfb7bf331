"""A real multi-node launch: two ``torchrun`` agents (node ranks 0 and 1, one rendezvous) on 127.0.0.1.

Each agent starts 2 processes that run ``dalle-train stage=prior`` under the strategy, exactly as on two
machines (README, "Multi-node launch"). Lightning finds the torchrun environment by itself; the mesh is
2 nodes x 2 devices with PowerSGD between the nodes. Both agents must finish, and the copies of every shard on
the two nodes must be identical at the end (the strategy's ``replica_divergence``, a collective comparing each
shard with its copy on node 0, logged as ``replica_divergence``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_app
from tests.test_sharded_stages import free_port


@pytest.mark.slow
@pytest.mark.distributed
def tiny_prior_inputs(work_dir: Path) -> None:
    """What the prior stage reads, as small as it gets: a 64-image world, its tokenizer, a 2-update dVAE, tokens."""
    from dalle_lightning.cli import data, encode
    from dalle_lightning.cli import train as train_app

    work = f"paths.work_dir={work_dir}"
    run_app(data.main, work, "n_train=64", "n_val=16", "n_zeroshot=8", "shard_size=32")
    run_app(train_app.main, "stage=tokenizer", work)
    run_app(train_app.main, "stage=dvae", work, "model.n_hid=8", "model.vocab_size=32", "model.codebook_dim=16",
            "data.batch_size=8", "trainer.max_steps=2", "trainer.enable_progress_bar=false")
    run_app(encode.main, work, "batch_size=32")


def test_two_torchrun_nodes_train_the_prior_and_end_identical(tmp_path: Path) -> None:
    tiny_prior_inputs(tmp_path)
    work = f"paths.work_dir={tmp_path}"

    port = free_port()
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK"):
        env.pop(key, None)
    agents = [
        subprocess.Popen(
            [torchrun, "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}", "--master-addr=127.0.0.1",
             f"--master-port={port}", "-m", "dalle_lightning.cli.train", "stage=prior", work,
             "strategy=sharded_powersgd", "trainer.devices=2", "trainer.num_nodes=2", "trainer.max_steps=4",
             "model.n_layer=2", "model.n_head=2", "model.d_head=8", "data.batch_size=4", "callbacks.fid=null",
             "callbacks.sample_grid=null", "callbacks.ema.update_starting_at_step=1", "trainer.enable_progress_bar=false",
             "trainer.log_every_n_steps=1",
             f"hydra.run.dir={tmp_path}/node{node}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
        )
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    for node, (agent, out) in enumerate(zip(agents, outputs)):
        assert agent.returncode == 0, f"node {node}:\n{out[-4000:]}"
    assert "MEMBER: 4/4" in outputs[0] + outputs[1]  # one world of 4 processes
    import csv

    (log,) = (tmp_path / "node0").rglob("metrics.csv")
    sent = [float(r["powersgd/inter_node_bytes_per_rank"]) for r in csv.DictReader(log.open())
            if r.get("powersgd/inter_node_bytes_per_rank")]
    assert sent and min(sent) > 0  # gradients crossed between the two nodes, compressed
    metrics = json.loads((tmp_path / "node0" / "metrics.json").read_text())["metrics"]
    assert metrics["replica_divergence"] == 0.0
    assert (tmp_path / "prior.pt").is_file()
