"""Per-token formulas of the GRPO loss, written once for the fused kernels and the torch path (issue 17, item 3).

Each formula is a ``@triton.jit`` function in a restricted dialect, so that :mod:`mp_grpo.loss.dialect` can run
the very same source on torch tensors (it rebinds ``tl``, ``K`` and the helpers below in the function's
globals). The dialect: arithmetic; ``tl.where`` and ``tl.zeros_like``; compile-time branches on the codes
of :mod:`mp_grpo.kernels.grpo_loss_common` (``K.*``) and on ``tl.constexpr`` flags; the helpers
``expm1`` (``torch.expm1`` on the torch path) and :func:`stop_gradient` (the identity here, ``detach``
there). Each formula returns its value and its derivative with respect to its input: the kernels chain
derivatives by hand, the torch path differentiates the value with autograd, and a test checks that the two
agree (``tests/loss/test_dialect.py``).

Converted so far: the KL estimators (:func:`kl_estimator`). Still written twice (torch in ``mp_grpo/loss``,
Triton in ``grpo_loss_combine.py`` / ``grpo_loss_common.py``): the objectives, the rollout correction,
OPSM, the clamps, the mismatch metrics.
"""

import triton
import triton.language as tl

from mp_grpo.kernels import grpo_loss_common as K
from mp_grpo.kernels.grpo_loss_common import expm1


@triton.jit
def stop_gradient(x):
    """``x``; on the torch path ``x.detach()`` (the value counts, its gradient does not)."""
    return x


@triton.jit
def kl_estimator(x, ESTIMATOR: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr):
    """Schulman's estimator of KL(π_θ ‖ π_ref) from ``x = log π_ref − log π_θ`` (http://joschu.net/blog/kl-approx.html):
    ``(value, ∂value/∂x)``. k1 = −x; k2 = x²/2; k3 = eˣ − x − 1 (as expm1(x) − x: exact near 0); with
    ``STRAIGHT_THROUGH`` (k3 only) the value of k3 with the gradient of k2 (verl's ``k3+``)."""
    if ESTIMATOR == K.KL_K1:
        value = -x
        d_value = tl.zeros_like(x) - 1.0
    elif ESTIMATOR == K.KL_K2:
        value = 0.5 * (x * x)
        d_value = x
    else:
        x_expm1 = expm1(x)
        k3 = x_expm1 - x
        if STRAIGHT_THROUGH:
            k2 = 0.5 * (x * x)
            value = k2 + stop_gradient(k3 - k2)
            d_value = x
        else:
            value = k3
            d_value = x_expm1
    return value, d_value
