"""A handed file costs bounded memory and time (issue 75): small crafted files that cost without bound before are
refused in one line naming the file, exit code 2, at the command a user types, in seconds and without
the memory their crafting asked for:

- a pickle-memo DAG (``x = [x, x]``, one list shared at every level) in an old model file's ``meta`` or a
  checkpoint's ``hyper_parameters``: a few KB, 2^24 paths for a recursive walk;
- an old torch-zip model file whose record is DEFLATEd: 256 KB on disk, 256 MiB inflated by torch;
- a prior whose config's sizes its tensors do not back (``d_head`` large, no tensors): built and initialised before
  ``load_state_dict`` noticed; a dVAE whose ``meta.vocab_size`` (10**12) a later stage would build from;
- deeply nested JSON, a non-finite float, tensors of the wrong shapes, an allocation failure: one line each;
- a ClipModule checkpoint changes no architecture process-wide (open_clip's registry is untouched).
"""

from __future__ import annotations

import json
import math
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import TINY_DVAE_CONFIG, run_app
from tests.test_files_are_data import work  # noqa: F401 - the pipeline the commands run on

MiB = 2**20
# A bound on the whole command (Hydra and all), which on a loaded CI machine took up to 2.1 s: far under what the
# unbounded costs take (the walk of dag(24) about 2**10 times the 6.9 s measured at depth 14). The refusal's wording
# says the budget stopped the walk, and the peak memory that the compressed record was never inflated.
COMMAND_SECONDS = 15


def dag(depth: int) -> list:
    """One list shared at every level: ``depth`` levels, 2**depth paths, a few bytes per level pickled."""
    x: list = []
    for _ in range(depth):
        x = [x, x]
    return x


def tiny_dvae_state() -> dict[str, torch.Tensor]:
    from hydra.utils import instantiate

    torch.manual_seed(0)
    return {k: v.contiguous() for k, v in instantiate(TINY_DVAE_CONFIG).state_dict().items()}


DVAE_META = {"stage": "dvae", "vocab_size": 32, "grid_size": 8, "image_size": 64}


def safetensors_file(path: Path, state: dict[str, torch.Tensor], config: Any, meta: Any = None,
                     config_text: str | None = None, meta_text: str | None = None) -> Path:
    header = {"format": "pt", "dalle_lightning_model_file": "1",
              "config": config_text if config_text is not None else json.dumps(config),
              "meta": meta_text if meta_text is not None else json.dumps(meta if meta is not None else {})}
    save_file(state, path, metadata=header)
    return path


@contextmanager
def peak_growth() -> Iterator[dict[str, float]]:
    """The growth of this process's peak resident memory (MiB) and the wall time (s) of the block: the peak is
    reset first (``/proc/self/clear_refs``), so earlier tests' peaks do not hide it."""
    def status(key: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
        raise KeyError(key)

    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("this kernel does not reset the peak resident memory")
    before, start = status("VmRSS"), time.perf_counter()
    cost: dict[str, float] = {}
    try:
        yield cost
    finally:
        cost["seconds"] = time.perf_counter() - start
        cost["mib"] = status("VmHWM") - before


def refused(capsys: pytest.CaptureFixture, app: str, *args: str) -> str:
    """Run ``app`` with ``args``: it must end with exit code 2 and one ``error:`` line, which is returned."""
    from dalle_lightning.cli import encode, generate, train

    main = {"train": train.main, "encode": encode.main, "generate": generate.main}[app]
    with pytest.raises(SystemExit) as exit_info:
        run_app(main, *args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0]


def encode_args(work: Path, tmp_path: Path, dvae: Path) -> list[str]:  # noqa: F811
    return [f"paths.work_dir={work}", f"hydra.run.dir={tmp_path / 'run'}", f"out_dir={tmp_path / 'tokens'}",
            "force=true", f"dvae={dvae}"]


# --------------------------------------------------------------------------------------------- 1: shared values
def test_a_shared_list_in_an_old_model_files_meta_costs_its_size(work: Path, tmp_path: Path,  # noqa: F811
                                                                 capsys: pytest.CaptureFixture) -> None:
    crafted = tmp_path / "dvae.pt"
    torch.save({"config": dict(TINY_DVAE_CONFIG), "state_dict": tiny_dvae_state(),
                "meta": {**DVAE_META, "note": dag(24)}}, crafted)
    assert crafted.stat().st_size < 300_000
    with peak_growth() as cost:
        line = refused(capsys, "encode", *encode_args(work, tmp_path, crafted))
    assert line.startswith(f"error: {str(crafted)!r}: meta.note[0]") and "expands to more than" in line, line
    assert cost["seconds"] < COMMAND_SECONDS, cost


def test_a_shared_list_in_a_checkpoints_hyper_parameters_costs_its_size(work: Path, tmp_path: Path,  # noqa: F811
                                                                       capsys: pytest.CaptureFixture) -> None:
    crafted = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}, "global_step": 3, "pytorch-lightning_version": "2.6.6",
                "hyper_parameters": {"lr": 1e-3, "note": dag(24)}}, crafted)
    with peak_growth() as cost:
        line = refused(capsys, "train", f"paths.work_dir={work}", f"hydra.run.dir={tmp_path / 'run'}", "stage=dvae",
                       f"output={tmp_path / 'o.pt'}", f"resume={crafted}")
    assert str(crafted) in line and "hyper_parameters.note[0]" in line and "expands to more than" in line, line
    assert cost["seconds"] < COMMAND_SECONDS, cost


def test_the_walk_keeps_the_checks_and_names_of_a_tree() -> None:
    """An honest value (a tree) gets the same checks and the same first key as the recursive walk gave; a list
    that holds itself or nests past the bound is one line, never a RecursionError."""
    from dalle_lightning.artifact_schema import refuse_interpolations
    from dalle_lightning.plain_yaml import interpolations
    from dalle_lightning.safe_files import UnsafeFile, check_plain
    from dalle_lightning.stored_values import MAX_DEPTH, StoredValueTooLarge

    value = {"a": [1, {"b": "x"}, ("y", {"c": "${oc.env:HOME}"})], "${k}": 1, "d": "${e}"}
    assert list(interpolations(value)) == ["a[2][1].c", "<key>", "d"]
    with pytest.raises(UnsafeFile, match=r"^'f': m\.a\[2\]\[1\]\.c is a string holding"):
        refuse_interpolations(value, "f", "m")
    with pytest.raises(UnsafeFile, match=r"^'f': m\.a\[1\] has the key 3 of type int"):
        check_plain({"a": [0, {3: 1}]}, "f", "m")
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(StoredValueTooLarge, match=r"^'f': m\[0\] holds itself"):
        check_plain(cycle, "f", "m")
    deep: list = []
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(StoredValueTooLarge, match=f"nests more than {MAX_DEPTH} levels deep"):
        check_plain(deep, "f", "m")


# ------------------------------------------------------------------------------------------ 2: compressed records
def deflated_model_file(path: Path, inflated: int) -> Path:
    """An old (torch zip) dVAE file whose record ``data/0`` inflates to ``inflated`` bytes of zeros: the records of
    a real save, the big one DEFLATEd and written streaming (the test never holds it)."""
    plain = path.with_suffix(".plain")
    torch.save({"config": dict(TINY_DVAE_CONFIG), "state_dict": {"w": torch.zeros(1)}, "meta": {"stage": "dvae"}},
               plain)
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(path, "w") as sink:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("/data/0"):
                record = zipfile.ZipInfo(info.filename)
                record.compress_type = zipfile.ZIP_DEFLATED
                with sink.open(record, "w", force_zip64=True) as stream:
                    chunk = bytes(MiB)
                    for _ in range(inflated // MiB):
                        stream.write(chunk)
            else:
                sink.writestr(info, data)
    plain.unlink()
    return path


def test_a_compressed_record_in_an_old_model_file_is_refused_unread(work: Path, tmp_path: Path,  # noqa: F811
                                                                    capsys: pytest.CaptureFixture) -> None:
    crafted = deflated_model_file(tmp_path / "dvae.pt", 256 * MiB)
    with zipfile.ZipFile(crafted) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
        assert info.compress_type == zipfile.ZIP_DEFLATED and info.file_size == 256 * MiB
    assert crafted.stat().st_size < 2 * MiB
    with peak_growth() as cost:
        line = refused(capsys, "encode", *encode_args(work, tmp_path, crafted))
    assert line.startswith(f"error: dalle-lightning model file {str(crafted)!r}: its record ") and \
        "is compressed" in line, line
    assert cost["mib"] < 64 and cost["seconds"] < COMMAND_SECONDS, cost


def test_torch_save_stores_every_record_and_the_plugins_refuse_a_compressed_one(tmp_path: Path) -> None:
    from dalle_lightning_plugins.io.refusal import CheckpointRefused, inflated_record, torch_load

    torch.save({"w": torch.zeros(1000), "step": 3}, tmp_path / "ok.pt")
    assert inflated_record(tmp_path / "ok.pt") is None
    crafted = deflated_model_file(tmp_path / "meta.pt", 4 * MiB)
    with pytest.raises(CheckpointRefused, match=r"^refusing checkpoint '.*meta\.pt': its record .* is compressed"):
        torch_load(crafted, crafted, True, map_location="cpu")


# ------------------------------------------------------------------------------------------------ 3: typed sizes
def prior_config(work: Path, d_head: int) -> dict[str, Any]:  # noqa: F811
    from dalle_lightning.artifacts import read_file

    return {**read_file(work / "prior.pt", tensors=False)["config"], "d_head": d_head}


def test_a_prior_whose_sizes_its_tensors_do_not_back_is_refused_before_it_is_built(
        work: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:  # noqa: F811
    crafted = safetensors_file(tmp_path / "prior.pt", {}, prior_config(work, 1000), {"stage": "prior"})
    assert crafted.stat().st_size < 2000
    with peak_growth() as cost:
        line = refused(capsys, "generate", f"paths.work_dir={work}", f"out_dir={tmp_path / 'samples'}", "clip=null",
                       "num_candidates=1", f"prior={crafted}")
    assert line.startswith(f"error: {str(crafted)!r}: its tensors are not those of the "
                           "dalle_lightning.models.prior.DallePrior its config builds ("), line
    assert "missing, first 'bos' of shape [2000]" in line, line
    assert cost["mib"] < 64, cost  # the model alone is 96 M parameters (384 MB) before it is initialised
    from dalle_lightning.artifacts import read_record
    from dalle_lightning.safe_files import UnsafeFile

    start = time.perf_counter()  # the check itself (the command's time is Hydra's and the imports')
    with pytest.raises(UnsafeFile, match="its tensors are not those of"):
        read_record(crafted)
    assert time.perf_counter() - start < 1


def test_a_meta_size_beyond_its_bound_or_its_model_is_refused(work: Path, tmp_path: Path,  # noqa: F811
                                                              capsys: pytest.CaptureFixture) -> None:
    state = tiny_dvae_state()
    huge = safetensors_file(tmp_path / "huge.pt", state, TINY_DVAE_CONFIG, {**DVAE_META, "vocab_size": 10**12})
    args = [f"paths.work_dir={work}", f"hydra.run.dir={tmp_path / 'run'}", "stage=prior",
            f"output={tmp_path / 'out.pt'}", f"paths.dvae={huge}"]
    line = refused(capsys, "train", *args)
    assert f"{str(huge)!r}: meta.vocab_size=1000000000000 is a int; expected a positive int of at most 1048576" \
        in line, line
    other = safetensors_file(tmp_path / "other.pt", state, TINY_DVAE_CONFIG, {**DVAE_META, "vocab_size": 4096})
    line = refused(capsys, "train", *args[:-1], f"paths.dvae={other}")
    assert f"{str(other)!r}: meta.vocab_size=4096, but the model its config builds has vocab_size=32" in line, line
    assert not (tmp_path / "out.pt").exists()


def test_a_config_of_a_million_layers_is_refused_while_built_on_the_meta_device(work: Path,  # noqa: F811
                                                                                tmp_path: Path) -> None:
    from dalle_lightning.artifacts import read_record
    from dalle_lightning.safe_files import UnsafeFile

    crafted = safetensors_file(tmp_path / "prior.pt", {"bos": torch.zeros(16)},
                               {**prior_config(work, 8), "n_layer": 10**6, "attn_pattern": "paper"},
                               {"stage": "prior"})
    start = time.perf_counter()
    with pytest.raises(UnsafeFile, match="its config builds a dalle_lightning.models.prior.DallePrior of more than"):
        read_record(crafted)
    assert time.perf_counter() - start < 2


# ------------------------------------------------------------------------------------ 4: one line for every refusal
@pytest.mark.parametrize("how", ["deep-json", "inf-config", "nan-meta", "wrong-shape"])
def test_every_refusal_is_one_line(how: str, work: Path, tmp_path: Path,  # noqa: F811
                                   capsys: pytest.CaptureFixture) -> None:
    crafted = tmp_path / "dvae.pt"
    state = tiny_dvae_state()
    if how == "deep-json":  # json's parser raised RecursionError
        safetensors_file(crafted, state, TINY_DVAE_CONFIG, meta_text='{"note": ' + "[" * 100_000 + "]" * 100_000
                         + "}")
        expected = f"error: {str(crafted)!r}: its header's meta nests too deep to parse"
    elif how == "inf-config":  # 1e999 parses to inf
        safetensors_file(crafted, state, TINY_DVAE_CONFIG,
                         config_text=json.dumps(TINY_DVAE_CONFIG)[:-1] + ', "codebook_init_std": 1e999}',
                         meta=DVAE_META)
        expected = f"error: {str(crafted)!r}: config.codebook_init_std=inf is not a finite number"
    elif how == "nan-meta":
        torch.save({"config": dict(TINY_DVAE_CONFIG), "state_dict": state, "meta": {**DVAE_META, "x": math.nan}},
                   crafted)
        expected = f"error: {str(crafted)!r}: meta.x=nan is not a finite number"
    else:  # load_state_dict raised a size mismatch
        key = next(iter(state))
        safetensors_file(crafted, {**state, key: torch.zeros(3)}, TINY_DVAE_CONFIG, DVAE_META)
        expected = f"error: {str(crafted)!r}: its tensors are not those of the dalle_lightning.models.dvae."
    line = refused(capsys, "encode", *encode_args(work, tmp_path, crafted))
    assert line.startswith(expected), line


@pytest.mark.parametrize("error", [RecursionError("maximum recursion depth exceeded"), MemoryError(),
                                   RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: "
                                                "can't allocate memory: you tried to allocate 7300000000 bytes.")])
def test_running_out_of_stack_or_memory_is_one_line(error: BaseException, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli.common import one_line_errors

    def main(cfg: Any) -> None:
        raise error

    with pytest.raises(SystemExit) as exit_info:
        one_line_errors(main)(None)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and err.startswith("error: an input "), err
    assert type(error).__name__ in err


# ---------------------------------------------------------------------------------------- 5: nothing process-wide
def test_a_clip_checkpoint_registers_nothing_process_wide(tmp_path: Path) -> None:
    import open_clip

    from dalle_lightning.generation.rerank import Reranker
    from dalle_lightning.models import clip

    default = clip.create(clip.SHAPES_CLIP)
    wider = {**clip.SHAPES_CLIP_CONFIG, "embed_dim": 32}
    configs = dict(open_clip.factory._MODEL_CONFIGS)
    other = clip._create_from_config(wider, dict(default.visual.preprocess_cfg), "cpu")
    checkpoint = {"state_dict": {f"model.{k}": v for k, v in other.state_dict().items()},
                  "open_clip_spec": {"name": clip.SHAPES_CLIP, "model_cfg": wider,
                                     "preprocess_cfg": dict(default.visual.preprocess_cfg)}}
    torch.save(checkpoint, tmp_path / "clip.ckpt")
    reranker = Reranker.from_checkpoint(tmp_path / "clip.ckpt")
    assert reranker.model.text_projection.shape[-1] == 32  # the checkpoint's own architecture
    assert open_clip.factory._MODEL_CONFIGS == configs  # and nothing registered
    assert clip.create(clip.SHAPES_CLIP).text_projection.shape[-1] == 64  # a later build gets the name's own
    short = {**checkpoint, "state_dict": dict(list(checkpoint["state_dict"].items())[:-1])}
    torch.save(short, tmp_path / "short.ckpt")
    with pytest.raises(ValueError, match=r"its tensors are not those of the model its open_clip_spec builds \(1 "
                                         "missing"):
        Reranker.from_checkpoint(tmp_path / "short.ckpt")


# ------------------------------------------------------------------------------------------------ output markers
def test_a_marker_beyond_any_marker_is_refused_unread_and_a_fifo_is_not_waited_on(
        work: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:  # noqa: F811
    """A handed samples folder's ``.dalle-lightning.json`` was read whole by ``outputs.read_marker``: a sparse
    16 MiB + 1 file is refused in one line before it is read, and a FIFO under its name (which ``read_text`` waited
    on forever) is no marker, so the folder is nobody's output and nothing in it is deleted."""
    import os

    from dalle_lightning.outputs import MARKER, MAX_MARKER_BYTES

    out = tmp_path / "samples"
    out.mkdir()
    (out / "0.png").write_bytes(b"a user's image")
    with open(out / MARKER, "wb") as sparse:
        sparse.truncate(MAX_MARKER_BYTES + 1)
    args = [f"prior={work / 'prior.pt'}", f"dvae={work / 'dvae.pt'}", f"tokenizer={work / 'tokenizer.json'}",
            "clip=null", "prompts=[a red square]", "num_candidates=1", "batch_size=1", "device=cpu",
            f"out_dir={out}", f"paths.work_dir={tmp_path}"]
    line = refused(capsys, "generate", *args)  # before: read whole, then taken for no marker
    assert line == (f"error: marker {str(out / MARKER)!r} holds more than {MAX_MARKER_BYTES // 2**20} MiB, so it was "
                    f"not read; expected a marker a dalle-lightning command wrote (a few KB), or delete {MARKER}"), line
    (out / MARKER).unlink()
    os.mkfifo(out / MARKER)
    line = refused(capsys, "generate", *args)  # at once: the FIFO is never opened
    assert "holds files no dalle-lightning writer made" in line, line
    assert (out / "0.png").read_bytes() == b"a user's image"
