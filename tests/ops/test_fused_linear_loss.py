"""fused_linear_loss on one process (TP = 1): the loss and its gradients against the float64 reference.

The float64 reference computes the log-probs with ``linear_logprobs_reference`` (logits rounded to the
compute dtype, as any op computing them in that dtype must), applies the same loss in float64 and
differentiates through it; the op's backward is driven by a random upstream gradient ``g`` (Megatron's
loss scaling). Gradients are sums of rounded terms and are compared on the scale of their largest entry.
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo.loss import GlobalBatch, GRPOLoss, LossBackend
from mp_grpo.config import load_config
from mp_grpo.ops.fused_linear_logprobs import fused_linear_logprobs
from mp_grpo.ops.fused_linear_loss import fused_linear_loss
from tests.loss.helpers import make_batch
from tests.reference import grpo_objective_reference, linear_logprobs_reference
from tests.tolerances import assert_close


def _case(shape, hidden_size, vocab, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * (2.0 / hidden_size**0.5)).to(dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    target.view(-1)[::5] = -100
    return hidden, weight, target, gen


def _assert_sum_close(actual, expected, dtype, msg):
    scale = expected.detach().abs().max().item()
    assert scale > 0, f"{msg}: degenerate reference"
    assert_close(actual.detach().double() / scale, expected.detach().double() / scale, dtype, msg)


def _nonlinear_loss(a: torch.Tensor, b: torch.Tensor):
    """A token-separable loss with a clip and an entropy term (the shape of a PPO surrogate)."""

    def loss_fn(lp, ent):
        ratio = torch.exp(lp - lp.detach().clamp(max=0.0) * 0.5)
        term = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a) + 0.3 * lp**2
        total = term.sum() - (b * ent).sum()
        return total, {"mean_lp": lp.detach().mean()}

    return loss_fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [None, 1, 4])
def test_matches_reference(dtype, chunk_tokens):
    hidden, weight, target, gen = _case((13,), 24, 37, dtype, seed=3 + int(chunk_tokens or 0))
    a, b = torch.randn(13, generator=gen), torch.randn(13, generator=gen)
    g = torch.rand((), generator=gen) * 3 + 0.5  # the upstream gradient (loss scaling)
    loss_fn = _nonlinear_loss(a, b)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, aux = fused_linear_loss(h, w, target, loss_fn, with_entropy=True, chunk_tokens=chunk_tokens)
    loss.backward(g)

    ref_h, ref_w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp, ent = linear_logprobs_reference(ref_h, ref_w, target, logits_dtype=dtype)
    ref_loss, ref_aux = loss_fn(lp, ent)
    (ref_loss * g.double()).backward()

    tag = f"({dtype}, chunk_tokens {chunk_tokens})"
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close(loss, ref_loss, torch.float32, f"loss {tag}")
    assert_close(aux["mean_lp"], ref_aux["mean_lp"], torch.float32, f"aux of the last call {tag}")
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    _assert_sum_close(h.grad, ref_h.grad, dtype, f"grad hidden {tag}")
    _assert_sum_close(w.grad, ref_w.grad, dtype, f"grad weight {tag}")


def test_same_gradients_as_the_per_token_op():
    """One design or the other: the with-loss op and the recompute op + the loss agree (fp32, several chunks)."""
    hidden, weight, target, gen = _case((5, 3), 16, 29, torch.float32, seed=11)
    a, b = torch.randn(5, 3, generator=gen), torch.randn(5, 3, generator=gen)
    loss_fn = _nonlinear_loss(a, b)
    grads = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            loss, _ = fused_linear_loss(h, w, target, loss_fn, with_entropy=True, chunk_tokens=4)
        else:
            lp, ent = fused_linear_logprobs(h, w, target, with_entropy=True, chunk_tokens=4, chunk_vocab=7)
            loss, _ = loss_fn(lp, ent)
        loss.backward()
        grads.append((loss.detach(), h.grad, w.grad))
    for x, y, name in zip(grads[0], grads[1], ("loss", "grad hidden", "grad weight")):
        assert_close(x, y, torch.float32, name)


def test_only_one_input_needs_grad_and_no_entropy():
    hidden, weight, target, gen = _case((9,), 16, 21, torch.float32, seed=5)
    a = torch.randn(9, generator=gen)

    def loss_fn(lp, ent):
        assert ent is None
        return (torch.exp(lp) * a).sum(), None

    ref_h, ref_w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp, _ = linear_logprobs_reference(ref_h, ref_w, target)
    loss_fn(lp, None)[0].backward()
    h = hidden.clone().requires_grad_()
    fused_linear_loss(h, weight, target, loss_fn, chunk_tokens=2)[0].backward()
    _assert_sum_close(h.grad, ref_h.grad, torch.float32, "grad hidden, weight frozen")
    w = weight.clone().requires_grad_()
    fused_linear_loss(hidden, w, target, loss_fn, chunk_tokens=4)[0].backward()
    _assert_sum_close(w.grad, ref_w.grad, torch.float32, "grad weight, hidden constant")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulate_into_main_grad_and_tied_embedding(dtype):
    """Gradient-accumulation fusion over two micro-batches into fp32 main_grad, scaled by the upstream
    gradient; with a weight shared by an embedding lookup (``zero_out_wgrad``) the placeholder is zeros and
    autograd adds the lookup's gradient to it, which Megatron's DDP hook then adds into main_grad."""
    hidden, weight, target, gen = _case((11,), 16, 27, dtype, seed=8)
    hidden2, _, target2, _ = _case((11,), 16, 27, dtype, seed=9)
    tokens = torch.randint(0, 27, (6,), generator=gen)
    emb_grad = torch.randn(6, 16, generator=gen)
    a = torch.randn(11, generator=gen)
    gs = (torch.tensor(0.75), torch.tensor(2.0))

    def loss_fn(lp, ent):
        return (torch.exp(lp) * a + lp).sum(), None

    ref_w = weight.double().requires_grad_()
    for hh, tt, g in ((hidden, target, gs[0]), (hidden2, target2, gs[1])):
        lp, _ = linear_logprobs_reference(hh, ref_w, tt, logits_dtype=dtype)
        (loss_fn(lp, None)[0] * g.double()).backward()
    lookup_ref = torch.zeros(27, 16, dtype=torch.float64).index_add_(0, tokens, emb_grad.double())

    initial = torch.randn(weight.shape)
    w = torch.nn.Parameter(weight.clone())
    w.main_grad = initial.clone()
    w.grad_added_to_main_grad = False
    w.zero_out_wgrad = True
    for hh, tt, g in ((hidden, target, gs[0]), (hidden2, target2, gs[1])):
        emb = torch.nn.functional.embedding(tokens, w)  # the tied embedding's lookup
        loss, _ = fused_linear_loss(hh, w, tt, loss_fn, chunk_tokens=4, accumulate_into_main_grad=True)
        torch.autograd.backward([loss, emb], [g, emb_grad.to(dtype)])
        assert w.grad_added_to_main_grad is True
        # Megatron's DDP hook with zero_out_wgrad: the whole .grad (placeholder zeros + lookup) into main_grad.
        w.main_grad.add_(w.grad)
        w.grad = None
    expected = ref_w.grad + 2 * lookup_ref
    _assert_sum_close(w.main_grad - initial, expected, dtype, f"main_grad increment ({dtype})")


@pytest.mark.parametrize("main_grad_dtype", [None, torch.float32, torch.bfloat16])
def test_weight_gradient_summed_in_weights_dtype(monkeypatch, main_grad_dtype):
    """Above WEIGHT_GRAD_FP32_BYTES (V = 151936 at H = 4096) the weight gradient is summed over row chunks in
    weight's dtype; backward then scales it in place (no new buffer) or adds it into main_grad (fp32, or
    weight's dtype). The hidden gradient is always scaled in place: the op's own buffer is returned."""
    import mp_grpo.ops.fused_linear_loss as op

    monkeypatch.setattr(op, "WEIGHT_GRAD_FP32_BYTES", 0)
    dtype = torch.bfloat16
    hidden, weight, target, gen = _case((3, 6), 16, 31, dtype, seed=21)
    a, b = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    g = torch.tensor(1.75)
    loss_fn = _nonlinear_loss(a, b)
    ref_h, ref_w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp, ent = linear_logprobs_reference(ref_h, ref_w, target, logits_dtype=dtype)
    (loss_fn(lp, ent)[0] * g.double()).backward()

    h, w = hidden.clone().requires_grad_(), torch.nn.Parameter(weight.clone())
    initial = None
    if main_grad_dtype is not None:
        initial = torch.randn(weight.shape, generator=gen).to(main_grad_dtype)
        w.main_grad = initial.clone()
        w.grad_added_to_main_grad = False
    loss, _ = fused_linear_loss(h, w, target, loss_fn, with_entropy=True, chunk_tokens=5,
                                accumulate_into_main_grad=main_grad_dtype is not None)
    loss.backward(g)
    tag = f"(weight-dtype buffer, main_grad {main_grad_dtype})"
    _assert_sum_close(h.grad, ref_h.grad, dtype, f"grad hidden {tag}")
    if main_grad_dtype is None:
        assert w.grad.dtype == dtype
        _assert_sum_close(w.grad, ref_w.grad, dtype, f"grad weight {tag}")
    else:
        assert w.main_grad.dtype == main_grad_dtype and w.grad.eq(0).all()
        # main_grad holds O(1) values: its increment is compared on the increment's scale, at the tolerance of
        # the coarser of the two roundings (the bf16 buffer, or a bf16 main_grad).
        increment = w.main_grad.double() - initial.double()
        _assert_sum_close(increment, ref_w.grad, dtype, f"main_grad increment {tag}")


def test_empty_batch_has_zero_gradients():
    """No rows: the loss of empty log-probs, zero gradients (the weight-gradient buffer is zero-filled only here)."""
    weight = torch.randn(11, 8, requires_grad=True)
    hidden = torch.randn(0, 8, requires_grad=True)
    loss, _ = fused_linear_loss(hidden, weight, torch.zeros(0, dtype=torch.int64), lambda lp, ent: (lp.sum(), None))
    loss.backward(torch.tensor(3.0))
    assert loss.item() == 0.0 and hidden.grad.shape == (0, 8)
    assert weight.grad.shape == weight.shape and weight.grad.eq(0).all()


def test_placeholder_is_allocated_once():
    from mp_grpo.ops.output_chunks import main_grad_placeholder

    w = torch.nn.Parameter(torch.randn(7, 4))
    w.grad_added_to_main_grad = False
    p1, p2 = main_grad_placeholder(w, torch.float32), main_grad_placeholder(w, torch.float32)
    assert p1.shape == w.shape and p1.eq(0).all() and w.grad_added_to_main_grad is True
    assert p1.data_ptr() == p2.data_ptr() and p1.stride() == (0, 0), "one zero element, expanded"
    # AccumulateGrad materializes it as .grad (dense strides, zeros); the cached element stays zero.
    h = torch.randn(3, 4, requires_grad=True)
    loss, _ = fused_linear_loss(h, w, torch.tensor([1, 2, 3]), lambda lp, ent: (lp.sum(), None),
                                accumulate_into_main_grad=False)
    loss.backward()
    w.grad_added_to_main_grad = False
    w.main_grad = torch.zeros(7, 4)
    w.grad = None
    loss, _ = fused_linear_loss(h, w, torch.tensor([1, 2, 3]), lambda lp, ent: (lp.sum(), None),
                                accumulate_into_main_grad=True)
    emb = torch.nn.functional.embedding(torch.tensor([0, 0]), w)
    torch.autograd.backward([loss, emb], [torch.tensor(1.0), torch.ones(2, 4)])
    assert w.grad[0].eq(2).all() and w.grad[1:].eq(0).all(), "placeholder zeros + the lookup's gradient"
    assert main_grad_placeholder(w, torch.float32).eq(0).all(), "the cached zero was written into"


def test_bad_loss_fn():
    hidden, weight, target, _ = _case((4,), 8, 10, torch.float32, seed=1)
    with pytest.raises(TypeError, match="loss_fn"):
        fused_linear_loss(hidden, weight, target, "not callable")
    with pytest.raises(TypeError, match="loss_fn"):
        fused_linear_loss(hidden, weight, target, lambda lp, ent: (lp, None))  # not 0-dim


@pytest.mark.parametrize("feature", ["ppo_dual_delta", "cispo_tis_normalized", "sapo_entropy_kl"])
def test_grpo_loss_matches_objective_reference(feature):
    """GRPOLoss (its one definition of the per-token maths) as loss_fn: the step objective's gradient
    w.r.t. the hidden states and the weight equals the float64 reference's, for token-separable configs."""
    from tests.loss.helpers import FEATURE_CONFIGS
    from mp_grpo.loss.separable import token_separable

    cfg = load_config(None, FEATURE_CONFIGS[feature] + ["aggregation.mode=seq_mean_token_mean"])
    assert token_separable(cfg)
    B, T, H, V = 3, 5, 16, 23
    data = make_batch(21, [5, 3, 4], T, dtype=torch.float32)
    hidden, weight, target, _ = _case((B, T), H, V, torch.float32, seed=4)
    target = torch.where(data["loss_mask"], target.clamp(min=0), torch.full_like(target, -100))
    loss = GRPOLoss(cfg, backend=LossBackend.TORCH)
    extra = {k: data[k] for k in ("rollout_logprobs", "ref_logprobs")}
    # The step's account is decided before the step (as MegatronGRPO does): the loss must never decide it
    # from a partially filled micro-batch (the top-entropy threshold would read the unfilled rows).
    with torch.no_grad():
        _, ent_before = linear_logprobs_reference(hidden.double(), weight.double(), target)
    batch = GlobalBatch.from_rollouts(cfg, [data["loss_mask"]], old_logprobs=[data["old_logprobs"]],
                                      rollout_logprobs=[data["rollout_logprobs"]], entropies=[ent_before.float()])

    def loss_fn(lp, ent):
        return loss(lp, data["old_logprobs"], data["advantages"], data["loss_mask"], entropy=ent, batch=batch, **extra)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    share, metrics = fused_linear_loss(h, w, target, loss_fn, with_entropy=True, chunk_tokens=4)
    share.backward()

    ref_h, ref_w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp, ent = linear_logprobs_reference(ref_h, ref_w, target)
    objective = grpo_objective_reference(cfg, lp, data["old_logprobs"], data["advantages"], data["loss_mask"],
                                         entropy=ent, **extra)
    objective.backward()
    assert_close(share, objective, torch.float32, f"share ({feature})")
    assert "loss" in metrics
    _assert_sum_close(h.grad, ref_h.grad, torch.float32, f"grad hidden ({feature})")
    _assert_sum_close(w.grad, ref_w.grad, torch.float32, f"grad weight ({feature})")


def test_default_plan_at_benchmark_size():
    """N = 16384, H = 4096, bf16: the forward chunk stays within its budget (7 chunks at V = 151936, one at 18992)."""
    from mp_grpo.ops.output_chunks import plan_chunks
    from mp_grpo.ops.fused_linear_loss import LOSS_LOGITS_CHUNK_BYTES

    for v, chunks in ((151936, 7), (18992, 1)):
        plan = plan_chunks(16384, 4096, v, torch.bfloat16, logits_chunk_bytes=LOSS_LOGITS_CHUNK_BYTES)
        assert plan.forward_rows * v * 2 <= LOSS_LOGITS_CHUNK_BYTES
        assert -(-16384 // plan.forward_rows) == chunks, plan
