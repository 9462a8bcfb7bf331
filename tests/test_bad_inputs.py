"""Every bad input gives one line (key, value, what is expected) and exit code 2, before any model loads.

The apps run in-process (as the console scripts do, through ``run_app``); one case runs as a real subprocess, to
check Hydra's own errors end the same way outside pytest.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import run_app

# One case a line: app | overrides (space-separated) | text the error line must hold.
# {work}, {file}, {junk} and {world} are filled in per test.
TABLE = """
data     | n_train=abc                      | n_train='abc'; expected an integer >= 0
data     | n_val=1.5                        | n_val=1.5; expected an integer >= 0
data     | shard_size=0                     | shard_size=0; expected an integer >= 1
data     | seed=abc                         | seed='abc'; expected an integer
data     | force=maybe                      | force='maybe'; expected true or false
data     | out_dir={file}/sub               | is a file
train    | stage=foo                        | Could not find 'stage/foo'; expected one of ['clip', 'dvae', 'prior', 'tokenizer']
train    | trainer.max_step=3               | Key 'max_step' is not in struct
train    | +trainr.max_steps=3              | unknown config key(s) ['trainr']
train    | --foo                            | unknown option(s) ['--foo']
train    | precision=foo                    | Could not find 'precision/foo'
train    | module.optimizer.lr=abc          | module.optimizer.lr='abc'; expected a number > 0
train    | trainer.max_steps=abc            | trainer.max_steps='abc'; expected an integer >= 1 or -1
train    | trainer.max_steps=0              | trainer.max_steps=0; expected an integer >= 1 or -1
train    | data.batch_size=0                | data.batch_size=0; expected an integer >= 1
train    | data.num_workers=-1              | data.num_workers=-1; expected an integer >= 0
train    | seed=abc                         | seed='abc'; expected an integer
train    | float32_matmul_precision=tf32    | float32_matmul_precision='tf32'; expected one of highest|high|medium
train    | model.compile=yes                | compile='yes'; expected true, false or auto
train    | stage.force=maybe                | stage.force='maybe'; expected true or false
train    | output=/proc/dalle.pt            | output='/proc/dalle.pt'; expected a writable location
train    | output={file}/dvae.pt            | is a file
train    | stage=prior paths.dvae={junk}    | is not a dalle-lightning model file
train    | stage=clip module.dvae={work}/prior.pt | module.dvae='{work}/prior.pt' is a prior model
encode   | out_dir={world}                  | holds image shards written by dalle-data
encode   | dvae={work}/prior.pt             | dvae='{work}/prior.pt' is a prior model; expected a dvae model
encode   | dvae={junk}                      | is not a dalle-lightning model file
encode   | batch_size=0                     | batch_size=0; expected an integer >= 1
encode   | bf16=maybe                       | bf16='maybe'; expected true, false or auto
encode   | tokenizer={work}/none.json       | tokenizer='{work}/none.json'; expected an existing file
generate | num_candidates=abc               | num_candidates='abc'; expected an integer >= 1
generate | batch_size=0                     | batch_size=0; expected an integer >= 1
generate | temperature=0                    | temperature=0; expected a number > 0
generate | top_k=0                          | top_k=0; expected an integer >= 1
generate | top_p=1.5                        | top_p=1.5; expected a number in (0, 1]
generate | cond_scale=abc                   | cond_scale='abc'; expected a number
generate | seed=abc                         | seed='abc'; expected an integer
generate | rerank=best                      | rerank='best'; expected one of clip|prior|both
generate | rerank=both                      | rerank='both'; expected clip or prior when clip=null
generate | dtype=float13                    | dtype='float13'; expected one of auto|fp32|bf16|fp16
generate | prior={work}/dvae.pt             | prior='{work}/dvae.pt' is a dvae model; expected a prior model
generate | prior={junk}                     | is not a dalle-lightning model file
generate | out_dir={file}/out               | is a file
generate | dvae={work}/other_dvae.pt        | made with the dVAE whose sha256
eval     | n_seen=abc                       | n_seen='abc'; expected an integer >= 0
eval     | n_seen=-1                        | n_seen=-1; expected an integer >= 0
eval     | n_seen=0 n_zeroshot=0            | expected at least one caption
eval     | candidates=[0]                   | candidates=[0]; expected a non-empty list
eval     | candidates=abc                   | candidates='abc'; expected a non-empty list
eval     | out=/proc/eval.json              | out='/proc/eval.json'; expected a writable location
eval     | plot={file}/eval.png             | is a file
eval     | fid=true                         | fid=true with clip=null
eval     | rerank=both                      | rerank='both'; expected clip or prior when clip=null
eval     | waterfall_plot={file}/w.png      | is a file
"""
NO_CUDA_TABLE = """
generate | device=cuda                      | device='cuda'; expected cpu (this machine has no CUDA device)
eval     | device=cuda                      | device='cuda'; expected cpu
train    | trainer.accelerator=gpu          | trainer.accelerator='gpu'; expected cpu or auto
"""


def _cases(table: str) -> list[tuple[str, list[str], str]]:
    rows = [line.split(" | ") for line in table.strip().splitlines()]
    return [(app.strip(), overrides.split(), expected.strip()) for app, overrides, expected in rows]


CASES = _cases(TABLE) + (_cases(NO_CUDA_TABLE) if not torch.cuda.is_available() else [])

DEFAULTS = {"data": [], "train": ["stage=dvae", "stage.force=true"], "encode": ["force=true"],
            "generate": ["clip=null", "num_candidates=1"], "eval": ["clip=null", "fid=false", "n_seen=1",
                                                                     "n_zeroshot=1", "candidates=[1]"]}


@pytest.fixture(scope="module")
def work(tiny_artifacts: Path, tiny_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny artifacts beside a world, a plain file and a file that is not a torch save."""
    import shutil

    work = tmp_path_factory.mktemp("bad_inputs")
    for name in ("tokenizer.json", "dvae.pt", "other_dvae.pt", "prior.pt"):
        shutil.copy(tiny_artifacts / name, work / name)
    (work / "world").symlink_to(tiny_world / "world")
    (work / "file").write_text("not a directory")
    (work / "junk.pt").write_text("not a torch save")
    return work


@pytest.mark.parametrize("app,overrides,expected", CASES, ids=[f"{a}:{' '.join(o)}" for a, o, _ in CASES])
def test_bad_input_is_one_line_with_exit_code_2(app: str, overrides: list[str], expected: str, work: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import data, encode, evaluate, generate, train

    main = {"data": data.main, "train": train.main, "encode": encode.main, "generate": generate.main,
            "eval": evaluate.main}[app]
    fill = dict(work=work, file=work / "file", junk=work / "junk.pt", world=work / "world")
    outputs = {"data": [f"out_dir={work / 'out_data'}"], "encode": [f"out_dir={work / 'out_encode'}"],
               "generate": [f"out_dir={work / 'out_generate'}"], "eval": [f"out={work / 'eval.json'}", "plot=null"],
               "train": []}[app]
    args = [f"paths.work_dir={work}", f"hydra.run.dir={work / 'runs'}", *outputs, *DEFAULTS[app],
            *(o.format(**fill) for o in overrides)]
    with pytest.raises(SystemExit) as exit_info:
        run_app(main, *args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1, err
    assert expected.format(**fill) in errors[0], errors[0]
    assert "Traceback" not in err


@pytest.mark.slow
def test_hydra_errors_from_the_console_script_are_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dalle_lightning.cli.train", f"paths.work_dir={tmp_path}", "trainer.max_step=3"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: Could not override 'trainer.max_step'; Key 'max_step' is not in struct; "
        "To append to your config use +trainer.max_step=3"]
