"""A run directory's YAML stays text: a ``${oc.env:...}`` that a stranger wrote into ``overrides.yaml`` or
``multirun.yaml`` is never resolved by ``dalle-sweep-summary`` or by ``resume=auto``'s reading of a sweep, and
its variable's value appears in no output file and in nothing printed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dalle_lightning.cli import sweep_summary
from dalle_lightning.plain_yaml import StoredInterpolation, read_yaml, refuse_stored
from dalle_lightning.run.resume import sweep_job_runs

SECRET = "s3cr3t-value-7d1f"
STORED = "a=${oc.env:SECRET_TOKEN}"


def _sweep(root: Path, objective: str = "val/loss") -> Path:
    """A sweep folder as Hydra and dalle-train leave it: job 0 finished (metrics.json), job 1 failed (only its
    ``.hydra/overrides.yaml``, which a stranger edited)."""
    sweep = root / "sweep"
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "metrics.json").write_text(json.dumps({"overrides": ["a=1"], "metrics": {"val/loss": 0.5}}))
    (sweep / "1" / ".hydra").mkdir(parents=True)
    (sweep / "1" / ".hydra" / "overrides.yaml").write_text(f"- {STORED}\n")
    (sweep / "multirun.yaml").write_text(f"objective: {objective}\nhydra:\n  sweeper:\n    direction: minimize\n")
    return sweep


def _written(sweep: Path) -> str:
    return "".join(p.read_text() for p in sweep.glob("summary.*"))


def test_sweep_summary_shows_a_stored_override_literally_and_never_the_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("SECRET_TOKEN", SECRET)
    sweep = _sweep(tmp_path)
    assert sweep_summary.main([str(sweep)]) == 0
    printed = capsys.readouterr()
    assert SECRET not in printed.out + printed.err + _written(sweep)
    summary = json.loads((sweep / "summary.json").read_text())
    failed = next(row for row in summary["runs"] if row["run"] == "1")
    assert failed["overrides"] == [STORED] and failed["params"] == {"a": "${oc.env:SECRET_TOKEN}"}
    assert "${oc.env:SECRET_TOKEN}" in (sweep / "summary.txt").read_text()


def test_a_stored_objective_is_never_resolved_either(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("SECRET_TOKEN", "val/loss")  # resolved, it would name the logged metric
    sweep = _sweep(tmp_path, objective="${oc.env:SECRET_TOKEN}")
    assert sweep_summary.main([str(sweep), "--json"]) == 0  # the literal names no metric: val/loss by default
    printed = capsys.readouterr()
    assert json.loads(printed.out)["metric"] == "val/loss" and not printed.err
    monkeypatch.setenv("SECRET_TOKEN", SECRET)
    (sweep / "0" / "metrics.json").write_text(json.dumps({"overrides": ["a=1"], "metrics": {"other": 1.0}}))
    assert sweep_summary.main([str(sweep)]) == 2  # no metric to summarise: one line, the objective as stored
    printed = capsys.readouterr()
    assert printed.err.count("\n") == 1 and "${oc.env:SECRET_TOKEN}" in printed.err
    assert SECRET not in printed.out + printed.err + _written(sweep)


def test_a_python_tag_in_a_run_directory_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sweep = _sweep(tmp_path)
    ran = tmp_path / "ran"
    (sweep / "1" / ".hydra" / "overrides.yaml").write_text(
        f"- !!python/object/apply:os.system ['touch {ran}']\n")
    assert sweep_summary.main([str(sweep)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "overrides.yaml' is not plain YAML" in err and not ran.exists()


def test_resume_auto_in_a_sweep_compares_the_saved_override_texts_unresolved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_TOKEN", SECRET)
    sweep = _sweep(tmp_path)
    job = sweep / "1"
    assert sweep_job_runs(sweep, [STORED, "resume=auto"]) == [job]  # the same text: the same job
    assert sweep_job_runs(sweep, [f"a={SECRET}"]) == []  # resolved, the stored text would have matched this


def test_refuse_stored_names_the_file_and_key_never_the_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_TOKEN", SECRET)
    path = tmp_path / "config.yaml"
    path.write_text("model:\n  layers: [1, '${oc.env:SECRET_TOKEN}']\n")
    value = read_yaml(path)
    assert value == {"model": {"layers": [1, "${oc.env:SECRET_TOKEN}"]}}  # plain values, nothing resolved
    with pytest.raises(StoredInterpolation) as info:
        refuse_stored(value, path)
    line = str(info.value)
    assert len(line.splitlines()) == 1 and repr(str(path)) in line and "model.layers[1]" in line
    assert SECRET not in line and "oc.env" not in line


def test_a_marker_holding_an_interpolation_is_refused_in_one_line(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A marker's records travel on into a prior's ``meta.trained_with``: a ``${`` in one never does."""
    from dalle_lightning.outputs import MARKER, claim

    monkeypatch.setenv("SECRET_TOKEN", SECRET)
    folder = tmp_path / "tokens" / "train"
    folder.mkdir(parents=True)
    (folder / "000000.tar").write_bytes(b"")
    record = {"kind": "tokens", "writer": "dalle-encode", "dvae": {"sha256": "${oc.env:SECRET_TOKEN}"}}
    (folder / MARKER).write_text(json.dumps(record))
    with pytest.raises(StoredInterpolation) as info:
        claim(folder, "tokens")
    line = str(info.value)
    assert len(line.splitlines()) == 1 and repr(str(folder / MARKER)) in line and "dvae.sha256" in line
    assert SECRET not in line and (folder / "000000.tar").exists()


def test_escaped_text_reads_back_from_omegaconf_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    from omegaconf import OmegaConf

    from dalle_lightning.plain_yaml import escaped

    monkeypatch.setenv("SECRET_TOKEN", SECRET)
    for text in ("/runs/${oc.env:SECRET_TOKEN}", "/runs/\\${oc.env:SECRET_TOKEN}", "a\\\\${oc.env:SECRET_TOKEN}${x}",
                 "plain\\path"):
        assert OmegaConf.create({"run": escaped(text)}).run == text


def test_a_run_directory_named_with_dollar_brace_is_checked_as_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """``hydra.run.dir='...\\${...}'`` names a literal ``${``; its check reads it back as that text."""
    from dalle_lightning.cli import train
    from tests.conftest import run_app

    monkeypatch.setenv("SECRET_TOKEN", SECRET)
    taken = tmp_path / "r${oc.env:SECRET_TOKEN}"
    taken.write_text("a file, not a directory")
    with pytest.raises(SystemExit) as exit_info:
        run_app(train.main, "stage=dvae", f"paths.work_dir={tmp_path}", f"hydra.run.dir={tmp_path}/r\\${{oc.env:SECRET_TOKEN}}")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "a directory, not a file" in err and str(taken) in err and SECRET not in err


def test_aliases_a_fifo_and_an_oversized_file_are_refused_before_they_cost_anything(tmp_path: Path) -> None:
    from dalle_lightning.plain_yaml import MAX_YAML_BYTES

    bomb = tmp_path / "overrides.yaml"
    rows = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    rows += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(8)]
    bomb.write_text("\n".join(rows) + "\n")  # 10**9 values once walked
    with pytest.raises(ValueError, match=r"overrides.yaml' is not plain YAML \(an anchor or alias"):
        read_yaml(bomb)
    big = tmp_path / "multirun.yaml"
    with open(big, "wb") as stream:
        stream.truncate(MAX_YAML_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ValueError, match=r"multirun.yaml' holds \d+ bytes, so it was not read"):
        read_yaml(big)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"fifo.yaml' is not a regular file"):
        read_yaml(fifo)
