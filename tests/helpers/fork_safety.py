"""Whether a child forked from this process can run autograd.

Forking the test process skips the child's imports (seconds each on the shared 2-core machine), but once this
process has traced a compiled function with autograd (AOTAutograd: ``torch.compile`` of anything that requires
grad, which the compile tests do in-process), torch's autograd engine refuses to run in a forked child ("Unable to
handle autograd's threading in combination with fork-based multiprocessing"). Which tests ran earlier in a pytest
worker depends on the scheduler, so the helpers that fork ask first and start a fresh interpreter instead when
forking is unsafe. Plain eager backwards in the parent do not make forking unsafe (checked on torch 2.14).
"""

from __future__ import annotations

import sys


def autograd_survives_fork() -> bool:
    """False once this process has loaded AOTAutograd, which ``torch.compile`` imports at its first compile (a
    plain fit, FSDP2 or Lightning do not): a sticky sign, unlike dynamo's counters, which ``torch._dynamo.reset()``
    clears while the engine's state that makes forking unsafe stays."""
    return "torch._functorch.aot_autograd" not in sys.modules
