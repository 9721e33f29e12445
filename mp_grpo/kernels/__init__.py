"""Triton kernels. No torch.distributed here: launches and collectives live in ``mp_grpo.ops``.

On a machine without a CUDA GPU the kernels can only run under Triton's interpreter, which
``triton.jit`` selects when it decorates a function (triton.language's own helpers are decorated
when triton is first imported); so the choice is made here, before anything imports triton —
``mp_grpo/__init__.py`` imports this package first. An explicit ``TRITON_INTERPRET`` is respected.
The variable is set for triton's import only and the choice then kept as Triton's in-process knob, so
importing mp_grpo does not change the environment that child processes inherit (a process that imports
mp_grpo without a GPU — e.g. a CPU-only actor of an RL framework that loads mp_grpo as a plug-in — must not
turn its GPU children's kernels into interpreted ones).
"""

import os

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401  triton.language's helpers are decorated for the interpreter here
        from triton import knobs
    except ImportError:  # a Triton without knobs (< 3.4) reads the variable at every decoration: keep it set
        pass
    else:
        knobs.runtime.interpret = True
        del os.environ["TRITON_INTERPRET"]

from mp_grpo.kernels.launch_config import LogprobLaunchConfig, logprob_launch_config  # noqa: E402
from mp_grpo.kernels.logprob_backward import logprob_backward_kernel  # noqa: E402
from mp_grpo.kernels.logprob_filter import logprob_radix_hist_kernel, logprob_radix_select_kernel  # noqa: E402
from mp_grpo.kernels.logprob_merge import logprob_merge_kernel  # noqa: E402
from mp_grpo.kernels.logprob_stats import logprob_stats_kernel  # noqa: E402

__all__ = [
    "LogprobLaunchConfig",
    "logprob_backward_kernel",
    "logprob_radix_hist_kernel",
    "logprob_radix_select_kernel",
    "logprob_launch_config",
    "logprob_merge_kernel",
    "logprob_stats_kernel",
]
