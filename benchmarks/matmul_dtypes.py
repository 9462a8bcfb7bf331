"""Matrix-product rate of each dtype on this machine, and the precision ``precision=auto`` picks here, as JSON.

Whether bf16 is the fast format is a property of the hardware, not of the project: on CPUs with AVX512 or AMX
bf16 products run several times faster than fp32, on an AVX2-only CPU 100-160x slower (oneDNN's reference
path). ``dalle_lightning/hardware.py`` decides from the CPU's features; this script shows the rates
that decision stands for.

Usage: ``python benchmarks/matmul_dtypes.py [--size 1024] [--threads N]``.
"""

from __future__ import annotations

import argparse
import json

import torch
from _peak import matmul_peak

from dalle_lightning.hardware import auto_precision, native_bf16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="side of the square matrices")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rates = {str(dtype).removeprefix("torch."): round(matmul_peak(dtype, args.size, reps=3), 2)
             for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    print(json.dumps({"size": args.size, "threads": torch.get_num_threads(),
                      "cpu_capability": torch.backends.cpu.get_cpu_capability(), "gflops": rates,
                      "bf16_over_fp32": round(rates["bfloat16"] / rates["float32"], 3),
                      "native_bf16": native_bf16("cpu"), "precision_auto": auto_precision("cpu")}, indent=1))


if __name__ == "__main__":
    main()
