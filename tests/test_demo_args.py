"""The demo's own arguments: which steps, where, and which experiment sizes its training stages."""

from __future__ import annotations

import pytest

from dalle_lightning.demo import parse


def test_experiment_defaults_to_shapes_and_names_the_known_ones() -> None:
    assert parse([])["experiment"] == "shapes"
    assert parse(["experiment=paper_prior", "steps=prior"])["experiment"] == "paper_prior"
    with pytest.raises(SystemExit, match=r"experiment='shape' is not in conf/experiment; expected one of \[.*'shapes'"):
        parse(["experiment=shape"])


def test_unknown_argument_and_step_are_one_line_errors() -> None:
    with pytest.raises(SystemExit, match="unknown demo argument 'epochs=3'"):
        parse(["epochs=3"])
    with pytest.raises(SystemExit, match=r"unknown demo step\(s\) \['train'\]"):
        parse(["steps=data,train"])
