"""A torchrun worker that records what its launcher tells it, for ``tests/test_launch_identity.py``: the
environment torchrun sets and the launch start agreed on in its agents' store. It loads
``launch_identity.py`` by path (torch only, not the plugins' package), so a restart costs a torch import.

    torchrun ... tests/helpers/launch_env_worker.py OUT_DIR FAIL_FIRST
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "launch_identity", ROOT / "strategies" / "dalle_lightning_plugins" / "environments" / "launch_identity.py")
assert spec is not None and spec.loader is not None
identity = importlib.util.module_from_spec(spec)
sys.modules["launch_identity"] = identity  # dataclasses look their module up there
spec.loader.exec_module(identity)

out, fail_first = Path(sys.argv[1]), sys.argv[2] == "1"
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
record = {"env": {k: v for k, v in os.environ.items() if k.startswith(("TORCHELASTIC_", "MASTER_"))},
          "started": identity.agreed_start()}
(out / f"attempt{attempt}.json").write_text(json.dumps(record))
sys.exit(1 if fail_first and attempt == 0 else 0)  # a worker that died: torchrun restarts it
