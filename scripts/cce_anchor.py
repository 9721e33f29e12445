"""Apple's cut-cross-entropy as an anchor for the fused-output-layer benchmarks (scripts/bench_fused.py,
scripts/bench_precision.py): which copy of it to import, and its per-token log-probs.

Two copies, one package name (``cut_cross_entropy``):

- ``installed``: the PyPI release as installed (``pip install cut-cross-entropy``; 25.1.1 has impl ``cce`` only —
  no ``cce_exact`` and no vocabulary parallelism);
- ``repository``: the package tree of github.com/apple/ml-cross-entropy extracted under
  ``.ext/ml-cross-entropy/`` (not part of this repository; put on ``sys.path`` here, at run time only) — impls
  ``cce`` and ``cce_exact`` (no gradient filter, Kahan-compensated fp32 gradient accumulation) and
  ``VocabParallelOptions`` for a vocabulary split over TP ranks. To extract it::

      git --git-dir=<clone>/.git archive HEAD cut_cross_entropy LICENSE | tar -x -C .ext/ml-cross-entropy

:func:`load` drops whichever copy was imported before, so one process can measure both in turn.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPOSITORY_TREE = Path(__file__).resolve().parents[1] / ".ext" / "ml-cross-entropy"
"""Where the repository's package tree is looked for."""
SOURCES = ("installed", "repository")


class Unavailable(RuntimeError):
    """This copy, impl or TP size cannot be measured here (the row is skipped with this reason)."""


_loaded: dict[str, object] = {}
"""The copy imported last: ``{source: module}`` (one at a time)."""


def load(source: str):
    """The ``cut_cross_entropy`` module of ``source`` (``installed`` or ``repository``); the other copy, if imported
    before, is dropped first."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if source in _loaded:
        return _loaded[source]
    _loaded.clear()
    for name in [m for m in sys.modules if m == "cut_cross_entropy" or m.startswith("cut_cross_entropy.")]:
        del sys.modules[name]
    tree = str(REPOSITORY_TREE)
    while tree in sys.path:
        sys.path.remove(tree)
    if source == "repository":
        if not (REPOSITORY_TREE / "cut_cross_entropy" / "__init__.py").is_file():
            raise Unavailable(f"the ml-cross-entropy tree is not at {REPOSITORY_TREE} (see scripts/cce_anchor.py)")
        sys.path.insert(0, tree)
    try:
        import cut_cross_entropy
    except ImportError as err:
        raise Unavailable(f"cut_cross_entropy ({source}) not importable: {err}") from err
    if from_tree(cut_cross_entropy) != (source == "repository"):
        where = Path(cut_cross_entropy.__file__).parent
        raise Unavailable(f"cut_cross_entropy ({source}) resolved to {where}")
    _loaded[source] = cut_cross_entropy
    return cut_cross_entropy


def from_tree(module) -> bool:
    """Whether ``module`` was imported from the repository tree: the real paths of both compared, so that a tree
    reached through a symbolic link (a snapshot of this repository whose ``.ext/ml-cross-entropy`` links to the
    extracted tree) or a relocated checkout counts as the tree, and an installed copy never does."""
    return Path(module.__file__).resolve().is_relative_to(REPOSITORY_TREE.resolve())


def describe(cce, source: str) -> str:
    return f"cut-cross-entropy {cce.__version__} ({'PyPI' if source == 'installed' else 'repository'})"


def check_available(cce, impl: str, tp_size: int) -> None:
    """Raise :class:`Unavailable` when this copy lacks ``impl`` or (TP > 1) vocabulary parallelism."""
    impls = {m.name.lower() for m in cce.LinearCrossEntropyImpl}
    if impl not in impls:
        raise Unavailable(f"cut-cross-entropy {cce.__version__} has no impl {impl!r} (it has {sorted(impls)})")
    if tp_size > 1 and not hasattr(cce, "VocabParallelOptions"):
        raise Unavailable(f"cut-cross-entropy {cce.__version__} has no vocabulary parallelism (VocabParallelOptions)")


def logprobs(cce, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, impl: str,
             tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Per-token log-probs ``-linear_cross_entropy(..., reduction="none")`` (fp32), differentiable.

    Under TP (``weight`` this rank's contiguous shard, Megatron's layout) with ``VocabParallelOptions(...,
    reduce_e_grad=False)``: the hidden gradient stays this rank's partial sum, as mp_grpo's ops leave it (Megatron's
    input mapping all-reduces it), so both do the same work."""
    kwargs = {}
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        v_local, rank = weight.shape[0], dist.get_rank(tp_group)
        kwargs["vocab_parallel_options"] = cce.VocabParallelOptions(
            start=rank * v_local, stop=(rank + 1) * v_local, group=tp_group, reduce_e_grad=False)
    return -cce.linear_cross_entropy(hidden, weight, target, reduction="none", impl=impl, **kwargs)


def run_without_compile() -> None:
    """For CPU dry runs: ``torch.compile`` becomes the identity (cut-cross-entropy compiles helpers at import and
    its ``torch_compile`` impl, which a dry run calls in place of the GPU-only Triton impls)."""
    torch.compile = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)  # noqa: E731
