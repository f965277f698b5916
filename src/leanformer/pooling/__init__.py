"""Token reduction: the methods (one module per family), the registry that names them, budgets
and their GFLOPs solver, the reducer interface, and the per-model state ``model.token_pooling``.
Nothing here knows a host model: :mod:`leanformer.patch` maps hosts' blocks onto it."""

# Every method registers itself as its module is imported: importing any part of the
# package fills the registry first.
from leanformer.pooling import methods as _methods  # noqa: F401
