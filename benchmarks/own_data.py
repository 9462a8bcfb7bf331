"""The README's own-data commands on an img2dataset-layout download of real photographs, timed step by step, as JSON.

The same commands, download and small sizes as ``tests/test_readme_own_data.py`` (which checks them): the
commands are parsed from README.md, the download is scikit-image's sample photographs in img2dataset's layout
with its broken samples (``tests/helpers/img2dataset_download.py``). Prints each step's wall time (a whole process:
start-up and imports included) and ``dalle-eval``'s val report, for each layout.

    python benchmarks/own_data.py [--layout split|flat|both] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.img2dataset_download import build_download  # noqa: E402
from tests.test_readme_own_data import run_readme  # noqa: E402


def run_layout(layout: str, root: Path) -> dict:
    download = build_download(root / f"download_{layout}", layout=layout)
    work = root / f"work_{layout}"
    work.mkdir(parents=True)
    ran = run_readme(download, work, cwd=root)
    steps = [{"command": r.shown.split(" paths.")[0], "seconds": round(r.seconds, 1), "exit": r.returncode} for r in ran]
    report = json.loads((work / "eval.json").read_text())
    report.pop("config", None)
    return {"layout": layout, "samples": download.n_samples, "steps": steps,
            "total_seconds": round(sum(r.seconds for r in ran), 1), "eval": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("split", "flat", "both"), default="both")
    parser.add_argument("--keep", type=Path, default=None, help="work here and keep the outputs")
    args = parser.parse_args()
    layouts = ("split", "flat") if args.layout == "both" else (args.layout,)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        results = [run_layout(layout, root) for layout in layouts]
    print(json.dumps({"benchmark": "own_data", "results": results}))


if __name__ == "__main__":
    main()
