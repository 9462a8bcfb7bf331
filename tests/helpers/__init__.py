"""Helpers shared by the tests and by ``benchmarks/``, kept in one place so that neither copies the other.

- :mod:`tests.helpers.distributed`: run a function in N real ``torch.distributed`` processes on 127.0.0.1;
- :mod:`tests.helpers.deep_residual`: the deep residual toy model whose gradients outgrow one fp16 scale;
- :mod:`tests.helpers.grad_poison`: identity functions whose backward overflows, to inject non-finite gradients;
- :mod:`tests.helpers.dists`: build both distributions as ``make dist`` does;
- :mod:`tests.helpers.layout`: each import name's folder, read from the two ``pyproject.toml`` files.

Benchmarks run as ``python benchmarks/x.py`` put the repository root on ``sys.path`` first, then import these.
"""
