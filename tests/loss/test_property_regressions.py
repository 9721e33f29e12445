"""Failures the property tests (tests/loss/test_properties.py) found, each pinned as a regular test on its shrunk
example and named for what it checks; both backends where both implement the config."""

from __future__ import annotations

import math

import pytest
import torch

from mp_grpo.config import load_config
from mp_grpo.loss import GlobalBatch, GRPOLoss, LossBackend

BACKENDS = [LossBackend.TORCH, LossBackend.TRITON]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_top_entropy_selection_compares_the_entropies_as_given(backend: LossBackend) -> None:
    """float32 log-probs with float64 entropies: the loss computes in float32, but the step's quantile is one of
    the given float64 values — the token exactly at the threshold is kept (it was dropped where float32 rounded
    its entropy down: 0.7 → 0.69999999)."""
    cfg = load_config(None, ["entropy.top_quantile=0.5"])
    entropy = torch.tensor([[0.5, 0.7, 0.9]], dtype=torch.float64)  # median 0.7, below it in float32
    lp = torch.tensor([[-1.0, -0.5, -0.2]], dtype=torch.float32, requires_grad=True)
    loss, metrics = GRPOLoss(cfg, backend=backend)(lp, None, torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool),
                                                   entropy=entropy)
    loss.backward()
    # on-policy ppo_clip: each kept token contributes −A·r/N = −1/3, with gradient −1/3
    torch.testing.assert_close(loss, torch.tensor(-2.0 / 3.0))
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1.0 / 3.0, -1.0 / 3.0]]))
    assert metrics["rejected_frac/entropy"].tolist() == [1.0, 3.0]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
@pytest.mark.parametrize("estimator", ["k3", "k2"])
@pytest.mark.parametrize("bias_correction", [False, True])
def test_kl_output_clamp_gives_zero_gradient_where_the_estimate_overflows(
    backend: LossBackend, estimator: str, bias_correction: bool
) -> None:
    """kl.input_clamp=null, output_clamp on: a token whose estimate overflows float32 (k3 of x = ref − log π = 95,
    k2 of x = 3e19) has the KL value output_clamp and a zero KL gradient — not 0 · inf = NaN (the torch path's
    autograd through the product gave NaN with a finite loss; the kernels' hand derivative gave 0)."""
    cfg = load_config(None, ["kl.coef=0.1", "kl.input_clamp=null", "kl.output_clamp=10", f"kl.estimator={estimator}",
                             f"kl.bias_correction={str(bias_correction).lower()}"])
    lp = torch.tensor([[-100.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-5.0 if estimator == "k3" else 3e19, -1.5]])
    old = lp.detach() + 0.01
    loss, metrics = GRPOLoss(cfg, backend=backend)(lp, old, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool),
                                                   ref_logprobs=ref)
    loss.backward()
    assert torch.isfinite(lp.grad).all(), lp.grad
    # token 0: the policy term only (its KL is clamped: no KL gradient): −A·r/N with r = e^−0.01
    ratio = torch.exp(torch.tensor(-0.01))
    torch.testing.assert_close(lp.grad[0, 0], -ratio / 2)
    kl_sum = float(metrics["kl"][0])
    assert math.isfinite(kl_sum) and kl_sum >= 10.0 - 1e-6  # token 0's KL is the bound (finite: no overflow)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_normalized_weights_average_one_with_bfloat16_inputs(backend: LossBackend) -> None:
    """bf16 log-probs: the GlobalBatch took d = old − rollout in bf16 (−0.453125 − 0.384765625 rounds to
    −0.8359375) while the loss takes it in float32, so one token's normalized IS weight came out 0.998, not 1.
    The step's weight mean is now of d in float64."""
    cfg = load_config(None, ["rollout_correction.weight_level=token", "rollout_correction.weight_max=1.05",
                             "rollout_correction.normalize_weights=true"])
    lp = torch.tensor([[-0.453125, -0.1]], dtype=torch.bfloat16, requires_grad=True)
    rollout = torch.tensor([[0.384765625, -0.3]], dtype=torch.bfloat16)
    loss, metrics = GRPOLoss(cfg, backend=backend)(lp, None, torch.tensor([1.0], dtype=torch.bfloat16),
                                                   torch.ones(1, 2, dtype=torch.bool), rollout_logprobs=rollout)
    applied_sum, count = metrics["is_weight/applied/mean"].tolist()
    assert count == 2.0 and applied_sum == pytest.approx(2.0, rel=1e-6)
    assert loss.item() == pytest.approx(-1.0, rel=1e-6)  # on-policy ppo_clip, A = 1: −mean of the applied weights


@pytest.mark.parametrize("entropy_dtype", [torch.bfloat16, torch.float16])
def test_entropy_gradient_of_a_16bit_entropy_with_float64_logprobs(entropy_dtype: torch.dtype) -> None:
    """float64 log-probs (compute in float64) with a bf16 entropy: the Triton path's entropy gradient was 0 — its
    backward stored the float64 gradient into bf16 directly, which Triton's interpreter turns into garbage (0, NaN,
    1e-40); it now converts through float32. The torch path's gradient, −bonus / N, is the reference."""
    cfg = load_config(None, ["entropy.bonus_coef=0.05"])
    grads = []
    for backend in BACKENDS:
        lp = torch.tensor([[-0.5, -1.0]], dtype=torch.float64, requires_grad=True)
        entropy = torch.tensor([[0.5, 1.0]], dtype=entropy_dtype, requires_grad=True)
        loss, _ = GRPOLoss(cfg, backend=backend)(lp, None, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool),
                                                 entropy=entropy)
        loss.backward()
        grads.append(entropy.grad)
    for grad in grads:
        assert grad.dtype == entropy_dtype
        # stored in the entropy's dtype: its rounding (fp16 eps 1e-3, bf16 8e-3) within 1e-2 of −0.025
        torch.testing.assert_close(grad.double(), torch.full((1, 2), -0.025, dtype=torch.float64), rtol=1e-2, atol=0)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_sapo_gradient_keeps_the_gate_tail(backend: LossBackend) -> None:
    """SAPO with τ·(r − 1) = 19 in float32: the gate's derivative sigmoid(x)·(1 − sigmoid(x)) rounded to 0 (the
    gate rounds to 1), while the float64 reference's gradient is ≈ 4·A·e^−19·r/N ≈ 1e-6; now taken from
    e = e^−|x| as e/(1 + e)²."""
    tau = 0.125
    cfg = load_config(None, ["policy.objective=sapo", f"policy.sapo_tau_pos={tau}", f"policy.sapo_tau_neg={tau}"])
    ratio = 1.0 + 19.0 / tau
    old = torch.tensor([[-3.0]])
    lp = (old + torch.log(torch.tensor(ratio))).requires_grad_(True)
    loss, _ = GRPOLoss(cfg, backend=backend)(lp, old, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool))
    loss.backward()
    lp64, old64 = lp.detach().double().requires_grad_(True), old.double()
    x = tau * (torch.exp(lp64 - old64) - 1.0)
    (-(4.0 / tau) * torch.sigmoid(x)).sum().backward()  # the float64 reference: A = 1, one token
    assert lp64.grad.item() > 0 or lp64.grad.item() < 0
    # rtol 1e-4, not float32's 2e-5: the gradient is ∝ e^−x, so float32 rounding of r (x = τ(r − 1) = 19) moves it by
    # ~x·eps32 relative before any arithmetic of the loss
    torch.testing.assert_close(lp.grad.double(), lp64.grad, rtol=1e-4, atol=0.0)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
@pytest.mark.parametrize("name", ["logprobs", "old_logprobs", "rollout_logprobs", "loss_mask", "advantages"])
def test_strided_token_inputs_read_as_given(backend: LossBackend, name: str) -> None:
    """A micro-batch cut as ``x[:, :1]`` of a ``[B, T]`` tensor: ``reshape(-1)`` flattens it to a strided view (stride
    T), which the fused kernels read as if dense — the Triton path took the wrong mask (loss 0, nothing counted) or
    the wrong log-probs. Each token input strided alone gives the result of the dense inputs, value and gradient."""
    cfg = load_config(None, ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2"])
    g = torch.Generator().manual_seed(0)
    wide = {n: torch.randn(3, 8, generator=g, dtype=torch.float64) - 1.0
            for n in ("logprobs", "old_logprobs", "rollout_logprobs", "advantages")}
    wide["loss_mask"] = torch.rand(3, 8, generator=g) < 0.6
    wide["loss_mask"][:, 0] = torch.tensor([False, True, True])

    def run(strided: str | None):
        inputs = {n: (v[:, :1] if n == strided else v[:, :1].contiguous()) for n, v in wide.items()}
        lp = inputs.pop("logprobs")
        lp = lp.detach().requires_grad_(True) if strided != "logprobs" else wide["logprobs"].clone().requires_grad_(True)
        x = lp[:, :1] if strided == "logprobs" else lp
        batch = GlobalBatch.from_masks([inputs["loss_mask"]])
        loss, _ = GRPOLoss(cfg, backend=backend)(x, inputs["old_logprobs"], inputs["advantages"], inputs["loss_mask"],
                                                 rollout_logprobs=inputs["rollout_logprobs"], batch=batch)
        loss.backward()
        return loss.detach(), lp.grad[:, :1]

    dense_loss, dense_grad = run(None)
    loss, grad = run(name)
    assert dense_loss != 0
    torch.testing.assert_close(loss, dense_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, dense_grad, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_normalized_weights_average_one_in_a_float64_loss(backend: LossBackend) -> None:
    """float64 log-probs with float32 old / rollout log-probs: the loss computes d = old − rollout in float64, the
    GlobalBatch took it in float32 — the applied weights' mean missed 1 by 1e-9 (a float64 loss, rtol 1e-10). The
    GlobalBatch now takes d in float64 whatever the inputs' dtype."""
    cfg = load_config(None, ["rollout_correction.weight_level=token", "rollout_correction.normalize_weights=true",
                             "rollout_correction.weight_max=1e6"])
    g = torch.Generator().manual_seed(3)
    old = (torch.randn(2, 5, generator=g) * 0.3 - 1.0).float()
    # opposite signs: old − rollout is a sum of magnitudes, inexact in float32 (a difference of close values is exact)
    rollout = (-0.85 * old.double() + torch.randn(2, 5, generator=g, dtype=torch.float64) * 0.01).float()
    lp = old.double().requires_grad_(True)
    mask = torch.ones(2, 5, dtype=torch.bool)
    batch = GlobalBatch.from_rollouts(cfg, [mask], old_logprobs=[old], rollout_logprobs=[rollout])
    _, metrics = GRPOLoss(cfg, backend=backend)(lp, old, torch.tensor([1.0, -0.5], dtype=torch.float64), mask,
                                                rollout_logprobs=rollout, batch=batch)
    applied_sum, count = metrics["is_weight/applied/mean"].tolist()
    assert count == 10.0 and applied_sum == pytest.approx(10.0, rel=1e-13, abs=0)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_a_sequence_sum_holds_only_its_own_tokens(backend: LossBackend) -> None:
    """The fused kernels summed each sequence's tokens within a block as the difference of the block's running
    totals: a row of trained tokens with log-probs −1e30 (its OPSM divergence rollout − log π ≈ 1e30) left the next
    row's divergence sum 1e30 + 4 − 1e30 = 0, so that row's negative-advantage tokens, 1 nat off the rollout policy
    (OPSM δ = 0.5), were trained instead of masked: loss 0 for −0.5. Both rows lie in one block of the kernels
    (16 tokens under the interpreter, 1024 on a GPU)."""
    cfg = load_config(None, ["opsm.delta=0.5"])
    lp = torch.tensor([[-1e30] * 4, [-2.0] * 4], requires_grad=True)
    rollout = torch.full((2, 4), -1.0)
    loss, metrics = GRPOLoss(cfg, backend=backend)(lp, lp.detach(), torch.tensor([1.0, -1.0]),
                                                   torch.ones(2, 4, dtype=torch.bool), rollout_logprobs=rollout)
    loss.backward()
    # on-policy ppo_clip, token_mean over 8 tokens: row 0 (A = 1) −1/8 a token, row 1 masked by OPSM
    assert loss.item() == pytest.approx(-0.5, rel=1e-6)
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.125] * 4, [0.0] * 4]))
    assert metrics["rejected_frac/opsm"].tolist() == [4.0, 8.0]



@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_a_long_sequence_log_ratio_is_summed_in_float64(backend: LossBackend) -> None:
    """A float32 loss (no log-ratio clamp) over one 400-token sequence whose rollout log-ratios are ±50–300 a token
    and sum to ~0.3: the
    torch path summed them in float32 (each addition rounded at the partial sum's ~1e-5, in an order set by the
    batch's width), so exp of the sum — the sequence's χ² and IS weight — was off by ~1e-4 relative and differed
    between micro-batch splits; the fused kernels sum in float64. Both now round the float64 sum once."""
    g = torch.Generator().manual_seed(7)
    n = 400
    lp = -1000.0 - 10.0 * torch.rand(1, n, generator=g, dtype=torch.float64)
    x = (50.0 + 250.0 * torch.rand(n // 2, generator=g, dtype=torch.float64)).float().double()
    d = torch.stack([x, -x], dim=-1).reshape(1, n)  # pairs that cancel, then 0.3 on one token: the sum is 0.3
    d[0, 0] += 0.3
    lp32 = lp.float()
    rollout32 = (lp32.double() - d).float()  # old − rollout is exact in float32 here (the two within a factor 2)
    s = float((lp32.double() - rollout32.double()).sum())
    cfg = load_config(None, ["rollout_correction.weight_level=sequence", "policy.log_ratio_clamp=null"])
    mask = torch.ones(1, n, dtype=torch.bool)
    _, metrics = GRPOLoss(cfg, backend=backend)(lp32.clone().requires_grad_(), None, torch.tensor([1.0]), mask,
                                                rollout_logprobs=rollout32)
    chi2_sum, count = metrics["mismatch/chi2_seq"].tolist()
    assert count == 1.0
    assert chi2_sum == pytest.approx(math.expm1(2.0 * s), rel=2e-6)
    weight = metrics["is_weight/raw/mean"].tolist()
    assert weight[0] / weight[1] == pytest.approx(math.exp(s), rel=2e-6)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
@pytest.mark.parametrize("x", [18.5, -3.0, 0.25])
def test_score_function_k3_gradient_is_minus_x(backend: LossBackend, x: float) -> None:
    """The score-function k3 KL (NeMo-RL's default): d/dlog π of (eˣ − x − 1)·e^{log π − sg(log π)} with
    x = ref − log π is −(eˣ − 1) + (eˣ − x − 1) = −x. Both paths summed the two terms in float32, each 1.1e8 at
    x = 18.5 (ref 18.5 nats above the policy, inside the input clamp of 20), and kept −16 (kernels) or −20 (torch)
    of −18.5; now −x exactly. Found by the on_logits property on a GPU (a rejected token whose KL is all it trains)."""
    cfg = load_config(None, ["kl.coef=0.5", "kl.estimator=k3", "kl.score_function=true", "kl.output_clamp=null",
                             "rollout_correction.reject_level=token", "rollout_correction.reject_max=1.001"])
    lp = torch.tensor([[-1.9647116661071777, -2.5]], requires_grad=True)
    ref = lp.detach() + torch.tensor([[x, 0.5]])
    old = lp.detach()
    rollout = old - torch.tensor([[40.0, 40.0]])  # ratio e^40 to the rollout: every policy term rejected
    loss, _ = GRPOLoss(cfg, backend=backend)(lp, old, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool),
                                             rollout_logprobs=rollout, ref_logprobs=ref)
    loss.backward()
    x_exact = (ref.double() - lp.detach().double())[0]  # the float32 inputs' difference, exact in float64
    torch.testing.assert_close(lp.grad[0].double(), -0.5 * x_exact / 2, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_on_logits_forms_differences_of_logits_before_the_temperature(backend: LossBackend) -> None:
    """The GPU soak's on_logits failure (seed 2644094361): fp32 logits near −34 at temperature 0.7, a k2 KL whose
    per-token coefficient 0.05·(log π − ref) depends on the log-prob's absolute error. The kernels formed
    x_t / T − M / T, each term rounded at |x| / T = 48 (2.1e-6 nats off in log π, 2.6e-4 relative in the gradient
    through log π − ref = −0.009); (x_t − M) / T is exact (Sterbenz) and leaves 6e-8."""
    from mp_grpo import vocab_parallel_logprobs
    from tests.loss import properties as P

    cfg = load_config(None, ["policy.eps_low=null", "policy.eps_high=null", "rollout_correction.reject_level=token",
                             "rollout_correction.reject_max=1.001", "kl.coef=0.05", "kl.estimator=k2"])
    temperature = 0.7
    logits = torch.tensor([[[-33.775196075439, -34.570804595947]]], dtype=torch.float32)
    target = torch.tensor([[1]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    inputs = {"rollout_logprobs": torch.tensor([[-1.517877340317]]), "ref_logprobs": torch.tensor([[-1.408635258675]]),
              "advantages": torch.tensor([-0.673102438450])}
    ref = P.logits_reference(cfg, logits, target, inputs, mask, temperature, 1.0)
    lp, entropy = vocab_parallel_logprobs(logits, target, with_entropy=True, temperature=temperature)
    batch = GlobalBatch.from_rollouts(cfg, [mask], old_logprobs=[lp], rollout_logprobs=[inputs["rollout_logprobs"]],
                                      entropies=[entropy])
    x = logits.clone().requires_grad_()
    loss, _ = GRPOLoss(cfg, backend=backend).on_logits(
        x, target, None, inputs["advantages"], mask, batch=batch, temperature=temperature,
        rollout_logprobs=inputs["rollout_logprobs"], ref_logprobs=inputs["ref_logprobs"])
    loss.backward()
    P.assert_grad_close(x.grad, ref.grad, ref.grad_mask, torch.float32, "on_logits d/dlogits vs reference", rtol=1e-4,
                        atol=ref.grad_atol)
    # the log-prob itself: exact to fp32 rounding of its own magnitude, not of the logits'
    want = torch.log_softmax(logits.double() / temperature, -1)[0, 0, 1]
    assert abs(float(lp[0, 0]) - float(want)) < 2e-7, (float(lp[0, 0]), float(want))


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_on_logits_gradient_is_exact_to_its_float32_log_prob(backend: LossBackend) -> None:
    """The GPU soak's second on_logits failure (seed 2008789365): a target 55 logits below the maximum at T = 0.7,
    log π = −78.618, and a k2 KL alone (advantage 0) whose coefficient 0.05·(log π − ref) sees log π's absolute
    error. fp32 spaces values near 78.6 by 7.6e-6, so that the float32 log-prob the op returns is 5.7e-6 off the
    float64 one (0.75 of a spacing) and the gradient 2.7e-4 off the float64 reference's — a limit of the float32
    output, not of the kernels: the gradient equals the float64 one taken at the op's own log-prob to 1e-6. (The
    property's tolerance now counts this: ∂J/∂log π moved by the rounding of log π.)"""
    from mp_grpo import vocab_parallel_logprobs

    cfg = load_config(None, ["policy.objective=cispo", "kl.coef=0.05", "kl.estimator=k2"])
    temperature = 0.7
    logits = torch.tensor([[[46.229881286621094, -8.80286693572998]]], dtype=torch.float32)  # the example's, exact
    target, mask, advantages = torch.tensor([[1]]), torch.ones(1, 1, dtype=torch.bool), torch.tensor([0.0])
    exact = torch.log_softmax(logits.double() / temperature, -1)[0, 0, 1]
    ref = (exact + 0.021).reshape(1, 1)  # log π − ref = −0.021, as in the shrunk example
    lp, entropy = vocab_parallel_logprobs(logits, target, with_entropy=True, temperature=temperature)
    batch = GlobalBatch.from_rollouts(cfg, [mask], old_logprobs=[lp], entropies=[entropy])
    x = logits.clone().requires_grad_()
    loss, _ = GRPOLoss(cfg, backend=backend).on_logits(x, target, None, advantages, mask, batch=batch,
                                                       temperature=temperature, ref_logprobs=ref.float())
    loss.backward()

    def k2_gradient(log_prob: torch.Tensor) -> torch.Tensor:  # 0.05·(log π − ref)·(onehot − p) / T, float64
        p = torch.softmax(logits.double() / temperature, -1)[0, 0]
        return 0.05 * (log_prob - float(ref.float())) * (torch.tensor([0.0, 1.0], dtype=torch.float64) - p) / temperature

    torch.testing.assert_close(x.grad[0, 0].double(), k2_gradient(lp.double()[0, 0]), rtol=1e-6, atol=0)
    # the float32 log-prob: within one spacing of fp32 at 78.6 (2**6 eps), yet off enough to move the k2 coefficient
    assert 2e-6 < abs(float(lp[0, 0]) - float(exact)) <= 64 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
@pytest.mark.parametrize("adv_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_m2po_clip_quadrants_reads_the_sign_of_16bit_advantages(backend: LossBackend, adv_dtype: torch.dtype) -> None:
    """m2po.scope=clip_quadrants with 16-bit per-token advantages: a token with A < 0 and d < 0 is a candidate. The
    fused kernel compared the loaded advantage with 0 in its own dtype, which Triton's interpreter does on a bf16
    value's raw 16 bits (a negative bf16 is never < 0 there): it kept the A < 0 candidates (the shrunk example:
    rejected_frac/m2po 0.275 vs the reference's 0.3). Compiled kernels compare bf16 by value; the sign is now read
    in float64 on both."""
    cfg = load_config(None, ["m2po.bound=0.0", "m2po.scope=clip_quadrants"])
    lp = torch.tensor([[-1.0, -2.0, -0.5, -1.5]], requires_grad=True)
    old = lp.detach().clone()
    rollout = old + torch.tensor([[0.25, -0.25, 0.5, -0.125]])  # d = old − rollout: −0.25, 0.25, −0.5, 0.125
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0]], dtype=adv_dtype)  # quadrants: tokens 0 and 1 are candidates
    mask = torch.ones(1, 4, dtype=torch.bool)
    batch = GlobalBatch.from_rollouts(cfg, [mask], old_logprobs=[old], rollout_logprobs=[rollout], advantages=[adv])
    loss, metrics = GRPOLoss(cfg, backend=backend)(lp, old, adv, mask, rollout_logprobs=rollout, batch=batch)
    loss.backward()
    # bound 0: every candidate is dropped (its d² > 0); the others keep −A·r/N with r = 1
    assert metrics["rejected_frac/m2po"].tolist() == [2.0, 4.0]
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, -0.25, 0.25]]))
