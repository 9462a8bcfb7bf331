"""The GPU check in one command: the precision plugin against Lightning's own precision, FlexAttention against the
other kernels, eager against compiled, on the paper's shapes; JSON lines.

One training step is forward, backward and fused AdamW, driven the way Lightning's loop drives it: the plugin
through ``convert_module`` and ``optimizer_step`` (its closure runs forward and backward), Lightning's
``MixedPrecision`` through ``forward_context`` (bf16-mixed; 16-mixed with its GradScaler: scale, unscale_, step,
update). Median of ``--steps`` steps after ``--warmup``; the compiled rows' first step (the compile) is reported as
``compile_s``. Each row prints one JSON line as it finishes, so a run cut short still reports what it measured.

- ``prior`` rows: the paper's stream (256 caption + 32x32 image positions, vocabularies 16384 / 8192), 24 layers of
  width 1024 (353M parameters) at batch 16, and width 2048 (1.31B) at batch 8. Model FLOPs are
  ``benchmarks/prior_throughput.py``'s count (6 x matmul parameters per position + 12 x width per attended pair).
- ``dvae`` rows: the paper's dVAE (``conf/model/dvae_paper.yaml``: 256x256, 8192 codes), batch 32, channels-last,
  the plugin against ``torch.autocast``; FLOPs from torch's flop counter.
- ``fraction_of_peak`` divides model FLOP/s by the bf16 matrix peak measured in the same process (8192^3).
- ``sample_*`` rows (``_sampling_rows.py``): the decode loop eager and on CUDA graphs, the demo prior at batch 64
  and the 353M prior at batch 16: ms per token step, images/s, the same tokens, and the step's bytes over the
  copy bandwidth measured in the same process (``times_the_bound``).
- The last line counts dynamo's graphs for FlexAttention and for each compiled region (cache entries of their code
  objects) and the recompile-limit or unfused-fallback warnings seen over the whole run.

fp32 matrix products (the prior's heads, which the paper keeps in fp32) use TF32 as Lightning advises
(``torch.set_float32_matmul_precision("high")``; ``--fp32-matmul highest`` turns it off).

Usage: ``python benchmarks/gpu.py [--rows NAME ...] [--steps 10] [--budget-s 280]``; ``--smoke`` runs every row
kind at a tiny shape on the CPU in seconds (eager; FlexAttention there is forward-only, so ``auto`` picks the
blocked kernel). ``--profile`` adds, per pair, the device-time ops where the plugin's step spends more than
Lightning's. ``--rows`` measures the rows named, in the order named; ``--first`` measures the rows named first, then
the others (a name that is not a row is ignored there). A row that raises prints its error as its line
(the traceback goes to stderr) and the rows after it still run; the exit status is then 1.

``python benchmarks/gpu.py --all [--smoke] [--out-dir DIR]`` is the whole GPU check (``benchmarks/_gpu_check.py``):
the CUDA tests, these training rows, the sampling rows, ``memory.py --device cuda``'s rows and the demo, each in its
own subprocess and time budget, into one JSON summary with every target of the GPU issues.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

if __name__ == "__main__" and "--all" in sys.argv[1:]:
    # The whole GPU check, dispatched before the imports below: it imports only the standard library, so that a
    # project import which fails on the GPU machine fails one of its steps, not the check.
    from _gpu_check import main as gpu_check

    sys.exit(gpu_check([a for a in sys.argv[1:] if a != "--all"]))

import torch  # noqa: E402
from _sampling_rows import rows as sampling_rows  # noqa: E402
from plugins_overhead import lightning_step  # noqa: E402
from prior_throughput import model_flops_per_token  # noqa: E402

from dalle_lightning.models.dvae import DiscreteVAE  # noqa: E402
from dalle_lightning.models.prior import DallePrior  # noqa: E402
from dalle_lightning_plugins import ResblockScalingPrecision  # noqa: E402

PAPER_STREAM = dict(text_vocab_size=16384, text_len=256, image_vocab_size=8192, image_grid=32, d_head=64, conv_kernel=11)
PRIORS = {"353M": (dict(PAPER_STREAM, n_layer=24, n_head=16), 16), "1.3B": (dict(PAPER_STREAM, n_layer=24, n_head=32), 8),
          "tiny": (dict(text_vocab_size=64, text_len=8, image_vocab_size=64, image_grid=4, d_head=16, n_layer=2,
                        n_head=2, conv_kernel=3), 4)}
DVAES = {"paper": (dict(image_size=256, group_count=4, n_hid=256, n_blk_per_group=2, vocab_size=8192, codebook_dim=128), 32),
         "tiny": (dict(image_size=16, group_count=2, n_hid=8, n_blk_per_group=1, vocab_size=32, codebook_dim=8), 2)}


@dataclass
class Row:
    """One measured configuration: model, shape, attention kernel, precision driver and dtype, compiled or not."""

    name: str
    model: str  # "prior" or "dvae"
    shape: str
    precision: str  # "plugin" (ResblockScalingPrecision) or "lightning" (MixedPrecision / torch.autocast)
    dtype: str  # "bf16" or "fp16"
    impl: str = "flex"
    compile: bool = False
    extra: dict = field(default_factory=dict)


def rows() -> list[Row]:
    out = []
    for compiled in (False, True):
        tag = "compiled" if compiled else "eager"
        for dtype in ("bf16", "fp16"):
            for precision in ("plugin", "lightning"):
                out.append(Row(f"prior_353M_flex_{precision}_{dtype}_{tag}", "prior", "353M", precision, dtype,
                               "flex", compiled))
        out.append(Row(f"prior_1.3B_flex_plugin_bf16_{tag}", "prior", "1.3B", "plugin", "bf16", "flex", compiled))
        for precision in ("plugin", "lightning"):
            out.append(Row(f"dvae_paper_{precision}_bf16_{tag}", "dvae", "paper", precision, "bf16", "", compiled))
    for impl in ("dense", "sparse"):
        out.append(Row(f"prior_353M_{impl}_plugin_bf16_eager", "prior", "353M", "plugin", "bf16", impl, False))
    return out


def bf16_peak(device: torch.device, size: int) -> float:
    """Best bf16 matrix-product FLOP/s over a few ``size``^3 products (after a warm-up)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    a @ b
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(row: Row, device: torch.device, smoke: bool) -> tuple[torch.nn.Module, Callable[[], torch.Tensor], float]:
    """The model on ``device``, its loss closure on a fixed batch, and its model FLOPs per step."""
    torch.manual_seed(0)
    shape = "tiny" if smoke else row.shape
    if row.model == "prior":
        config, batch = PRIORS[shape]
        impl = "auto" if smoke and row.impl == "flex" else row.impl
        model = DallePrior(**config, attn_impl=impl, compile=row.compile).to(device)
        text = torch.randint(1, config["text_vocab_size"], (batch, config["text_len"]), device=device)
        image = torch.randint(0, config["image_vocab_size"], (batch, config["image_grid"] ** 2), device=device)
        tokens = batch * (config["text_len"] + config["image_grid"] ** 2)
        return model, lambda: model(text, image)["loss"], model_flops_per_token(model) * tokens
    config, batch = DVAES[shape]
    model = DiscreteVAE(**config, compile=row.compile).to(device, memory_format=torch.channels_last)
    images = torch.rand(batch, 3, config["image_size"], config["image_size"], device=device)
    images = images.contiguous(memory_format=torch.channels_last)
    return model, lambda: model(images, temperature=1.0, kl_weight=1.0)["loss"], 0.0


def stepper(row: Row, model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor],
            device: torch.device) -> Callable[[], None]:
    """One training step of ``row``'s precision driver, as Lightning's loop makes it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    if row.precision == "plugin":
        plugin = ResblockScalingPrecision(row.dtype)
        plugin.convert_module(model)

        def closure() -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn()
            loss.backward()
            return loss

        return lambda: plugin.optimizer_step(optimizer, model, closure)
    return lightning_step(row.dtype, device.type, optimizer, loss_fn)


def measure(row: Row, device: torch.device, args: argparse.Namespace, peak: float) -> dict:
    model, loss_fn, flops = build(row, device, args.smoke)
    step = stepper(row, model, loss_fn, device)
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - start
    for _ in range(args.warmup - 1):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    if not flops:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            step()
        flops = counter.get_total_flops()
    report = {"row": row.name, "model": row.model, "shape": "tiny" if args.smoke else row.shape,
              "precision": row.precision, "dtype": row.dtype, "impl": row.impl, "compiled": row.compile,
              "step_ms": round(seconds * 1e3, 2), "first_step_s": round(first, 2),
              "fraction_of_peak": round(flops / seconds / peak, 3), "model_gflop_per_step": round(flops / 1e9, 3)}
    if row.compile:
        report["compile_s"] = round(first - seconds, 1)
    if row.model == "prior":
        config, batch = PRIORS[report["shape"]]
        report["tokens_per_s"] = round(batch * (config["text_len"] + config["image_grid"] ** 2) / seconds)
    else:
        report["images_per_s"] = round(DVAES[report["shape"]][1] / seconds, 1)
    if device.type == "cuda":
        report["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
    if args.profile and not row.compile:
        report["profile"] = profile_ops(step, device)
    del model, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return report


def profile_ops(step: Callable[[], None], device: torch.device, steps: int = 3, top: int = 12) -> dict[str, float]:
    """The ``top`` ops by self device time (CPU time on the CPU), ms per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, attr))[:top]
    return {e.key[:80]: round(getattr(e, attr) / steps / 1e3, 3) for e in events}


class _Seen(logging.Handler):
    """Dynamo's recompile-limit messages (logged, not raised, when the fallback is allowed)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "recompile_limit" in message or "cache_size_limit" in message:
            self.messages.append(message.splitlines()[0][:200])


def graph_counts() -> dict[str, int]:
    """Compiled graphs held for FlexAttention and for each compiled region (cache entries of their code objects)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention.flex_attention import flex_attention

    from dalle_lightning.models import dvae, prior

    codes = {"flex_attention": flex_attention.__code__, "prior.qkv": prior._QKV.fn.__code__,
             "prior.out": prior._OUT.fn.__code__, "prior.mlp": prior._MLP.fn.__code__,
             "dvae.res_path": dvae._RES_PATH.fn.__code__}
    return {name: len(_debug_get_cache_entry_list(code)) for name, code in codes.items()}


def failed_line(name: str, error: BaseException) -> dict:
    """A row that raised: its line names the error (the traceback goes to stderr), and the run goes on."""
    traceback.print_exc()
    text = " ".join(str(error).split())[:300]
    return {"row": name, "error": f"{type(error).__name__}: {text}" if text else type(error).__name__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=None, help="row names (default: all; see --list)")
    parser.add_argument("--first", nargs="+", default=[], help="rows to measure first, then the others")
    parser.add_argument("--list", action="store_true", help="print the row names and exit")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=280.0, help="skip the rows left once this much has passed")
    parser.add_argument("--fp32-matmul", choices=["highest", "high", "medium"], default="high")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, eager rows only")
    parser.add_argument("--no-sampling", action="store_true", help="skip the sampling rows (benchmarks/_sampling_rows.py)")
    parser.add_argument("--sampling-only", action="store_true", help="the sampling rows alone")
    args = parser.parse_args()
    every = rows()
    if args.list:
        print("\n".join(r.name for r in every))
        return
    by_name = {r.name: r for r in every}
    chosen = [] if args.sampling_only else every if args.rows is None else [by_name[n] for n in args.rows if n in by_name]
    first = [n for n in args.first if n in {r.name for r in chosen}]
    chosen = [by_name[n] for n in first] + [r for r in chosen if r.name not in first]
    unknown = set(args.rows or ()) - {r.name for r in every}
    if unknown:
        raise SystemExit(f"error: unknown rows {sorted(unknown)}; expected names from --list")
    if args.smoke:
        device = torch.device("cpu")
        chosen = [r for r in chosen if not r.compile]
        args.steps, args.warmup = min(args.steps, 2), 1
    elif not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device; expected a GPU (or --smoke for the CPU path)")
    else:
        device = torch.device("cuda")
    torch.set_float32_matmul_precision(args.fp32_matmul)
    seen = _Seen()
    logging.getLogger("torch._dynamo").addHandler(seen)
    began = time.perf_counter()
    peak = bf16_peak(device, 1024 if args.smoke else 8192)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"device": name, "torch": torch.__version__, "bf16_peak_tflop_s": float(f"{peak / 1e12:.3g}"),  # 3 figures: a CPU without bf16 units reads 0.03
                      "fp32_matmul_precision": args.fp32_matmul, "date": time.strftime("%Y-%m-%d")}), flush=True)
    skipped, failed = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for row in chosen:
            if time.perf_counter() - began > args.budget_s:
                skipped.append(row.name)
                continue
            try:
                print(json.dumps(measure(row, device, args, peak)), flush=True)
            except torch.OutOfMemoryError:
                print(json.dumps({"row": row.name, "error": "out of memory"}), flush=True)
                torch.cuda.empty_cache()
            except Exception as error:  # noqa: BLE001 - one row's failure is its line; the others still run
                failed.append(row.name)
                print(json.dumps(failed_line(row.name, error)), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if not args.no_sampling:
            if time.perf_counter() - began > args.budget_s:
                skipped.append("sampling")
            else:
                try:
                    for line in sampling_rows(device, args.smoke):
                        print(json.dumps(line), flush=True)
                except Exception as error:  # noqa: BLE001
                    failed.append("sampling")
                    print(json.dumps(failed_line("sampling", error)), flush=True)
    fallbacks = [str(w.message).splitlines()[0][:200] for w in caught if "without torch.compile" in str(w.message)]
    try:
        graphs: dict = graph_counts()
    except Exception as error:  # noqa: BLE001 - a private dynamo helper; its absence must not hide the rows' figures
        graphs = {"error": f"{type(error).__name__}: {error}"[:300]}
    print(json.dumps({"graphs": graphs, "recompile_limit_messages": seen.messages,
                      "unfused_fallback_warnings": fallbacks, "skipped_rows": skipped, "failed_rows": failed,
                      "wall_s": round(time.perf_counter() - began, 1)}), flush=True)
    if seen.messages or fallbacks or failed:
        sys.exit(1)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
