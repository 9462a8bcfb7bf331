"""The demo's prior as a model file, safetensors (what ``save_model`` writes now) against the ``torch.save`` zip it
wrote before: file size, write time, and the time of each read the commands do, as one JSON object.

The prior is ``conf/model/prior_shapes.yaml`` with its ``${meta:...}`` sizes replaced by the demo's literal ones
(the shapes tokenizer's 351 ids and 20 positions, the shapes dVAE's 512 codes on an 8 x 8 grid), random weights
(seeded). Reads: ``read_record`` (the metadata: what ``${meta:...}``, the stage and lineage checks read),
``read_file`` (the tensors too, checked) and ``load_artifact`` (the model built and loaded). Each time is the median
of ``--repeats`` runs on a file in the page cache (the second and later reads of a file; the first read of a file
from disk adds the disk's time, the same bytes either way).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/model_file_format.py [--repeats 20]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from dalle_lightning.artifacts import load_artifact, read_file, read_record, save_model, weights_digest
from dalle_lightning.model_targets import build_model

ROOT = Path(__file__).resolve().parents[1]
DEMO_SIZES = {"text_vocab_size": 351, "text_len": 20, "image_vocab_size": 512, "image_grid": 8}


def demo_prior_config() -> dict[str, Any]:
    """``conf/model/prior_shapes.yaml`` with literal sizes in place of the ``${meta:...}`` reads."""
    raw = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "prior_shapes.yaml"), resolve=False)
    return {**raw, **DEMO_SIZES, "compile": False}


def cpu_name() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def median_s(run: Callable[[], Any], repeats: int) -> float:
    run()  # the file into the page cache, imports done
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = demo_prior_config()
    model = build_model({"_target_": "dalle_lightning.models.prior.DallePrior", **config}, "demo prior")
    config["_target_"] = "dalle_lightning.models.prior.DallePrior"
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    meta = {"stage": "prior", "parameters": sum(p.numel() for p in model.parameters()), **DEMO_SIZES}
    with tempfile.TemporaryDirectory() as folder:
        new, old = Path(folder) / "prior.pt", Path(folder) / "old_prior.pt"
        write_new = timed(lambda: save_model(new, config, model, meta=meta))
        # What save_model wrote before: the digest, then a torch.save zip of the same dict.
        write_old = timed(lambda: torch.save({"config": config, "state_dict": state,
                                              "meta": {**meta, "sha256": weights_digest(state)}}, old))
        for name, tensor in read_file(old)["state_dict"].items():  # both hold the same weights
            assert torch.equal(tensor, read_file(new)["state_dict"][name]), name
        formats = {}
        for label, path, write_s in (("safetensors", new, write_new), ("torch_zip", old, write_old)):
            formats[label] = {
                "bytes": path.stat().st_size,
                "write_s": round(write_s, 4),
                "read_record_s": round(median_s(lambda p=path: read_record(p, "prior"), args.repeats), 5),
                "read_file_s": round(median_s(lambda p=path: read_file(p), args.repeats), 5),
                "load_artifact_s": round(median_s(lambda p=path: load_artifact(p, stage="prior"), args.repeats), 5),
            }
    result = {
        "model": "conf/model/prior_shapes.yaml with literal sizes " + json.dumps(DEMO_SIZES),
        "parameters": meta["parameters"],
        "tensors": len(state),
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}",
        "formats": formats,
        "ratios_safetensors_over_torch_zip": {
            key: round(formats["safetensors"][key] / formats["torch_zip"][key], 3)
            for key in ("bytes", "read_record_s", "read_file_s", "load_artifact_s")
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
