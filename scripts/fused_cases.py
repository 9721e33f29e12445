"""The rows of scripts/bench_fused.py: inputs, the implementations as (forward, forward+backward) closures, their
log-prob functions for the precision columns, and the row keys (``--only`` / ``--skip``). Single GPU: :func:`cases`;
tensor parallel, on one rank's shard: :func:`tp_impls`. ``--dry-run`` sets :data:`DEVICE` and
:data:`CCE_IMPL_OVERRIDE`."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cce_anchor
from fused_report import BARE, CCE, FP32, FUSED, GSPO, LIGER, WITH_LOSS
from mp_grpo.config.precision import LogitDtype
from mp_grpo.ops.token_ids import CapturedSupport, TokenIds
from mp_grpo.ops.batch_major_linear import batch_major_linear
from mp_grpo.ops.fused_linear_logprobs import fused_linear_logprobs
from mp_grpo.ops.fused_linear_loss import fused_linear_loss
from mp_grpo.ops.output_chunks import plan_chunks
from mp_grpo.ops.vocab_parallel_logprobs import vocab_parallel_logprobs

DEVICE = "cuda"
"""Where the rows run; ``--dry-run``: the CPU (a check of the script, not a benchmark)."""
CCE_IMPL_OVERRIDE: str | None = None
"""``--dry-run``: cut-cross-entropy's ``torch_compile`` impl in place of its Triton ones (which need CUDA)."""
ROWS_PER_SEQUENCE = 2048
"""The loss rows see the N tokens as padded rows of this length (N = 16384: 8 sequences)."""
SUPPORT_IDS = 512
"""Ids of every token's captured support in the replay row (prime-rl's cap on the engine's support, #3431): the
worst case of that cap on every token."""
TOP_K_IDS = 20
"""The engine's top-K ids a token in the top-K row (K = 20: TRL's DPPO default)."""


def engine_ids(t: torch.Tensor, v: int, size: int, seed: int) -> torch.Tensor:
    """``[N, size]`` int64: ``size`` distinct ids a token, its target among them, spread over the vocabulary (the target
    plus one set of distinct offsets mod V), each row increasing."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    size = min(size, v)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=DEVICE),
                         torch.randperm(v - 1, device=DEVICE, generator=gen)[:size - 1] + 1])
    return ((t.unsqueeze(1) + offsets.unsqueeze(0)) % v).sort(dim=1).values


def csr_of(ids: torch.Tensor, kind=TokenIds):
    """A dense ``[N, size]`` id table as a CSR (``size`` ids a token)."""
    n, size = ids.shape
    return kind(torch.arange(n + 1, device=ids.device) * size, ids.reshape(-1).contiguous())


def make_inputs(n: int, hidden_size: int, v: int, seed: int = 0, weight_std: float = 0.02):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    h = (torch.randn(n, hidden_size, device=DEVICE, generator=gen) * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, hidden_size, device=DEVICE, generator=gen) * weight_std).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device=DEVICE, generator=gen)
    g = torch.randn(n, device=DEVICE, generator=gen)
    return h, w, t, g


def _closures(params, f, *grads, forward_without_grad: bool = True):
    """(forward-only closure, forward+backward closure) for f() returning a tensor or a tuple."""

    def fwd():
        with torch.set_grad_enabled(not forward_without_grad):
            f()

    def fwd_bwd():
        for p in params:
            p.grad = None
        out = f()
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, grads[: len(outs)])

    return fwd, fwd_bwd


def grpo_loss_fn(n: int, objective: str = "ppo_clip"):
    """A GRPOLoss (token-level PPO clip by default, or GSPO) on N tokens as padded rows, with its GlobalBatch:
    ``loss_fn(logprobs [N], entropy) -> (share, metrics)`` as MegatronGRPO binds it (old log-probs given)."""
    from mp_grpo.config.loss import LossConfig, Objective, PolicyConfig
    from mp_grpo.loss import GlobalBatch, GRPOLoss

    rows = max(n // ROWS_PER_SEQUENCE, 1)
    shape = (rows, n // rows)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    mask = torch.ones(shape, device=DEVICE, dtype=torch.bool)
    adv = torch.randn(rows, device=DEVICE, generator=gen)
    cfg = LossConfig(policy=PolicyConfig(objective=Objective(objective)))
    loss = GRPOLoss(cfg)
    batch = GlobalBatch.from_masks([mask])

    def loss_fn(lp, ent):
        # On-policy (old = current, ratio 1: no token clipped): every row has a nonzero gradient, like the bare
        # matmul's random one. (bf16 GEMMs run faster on data with many zero rows: a half-clipped batch made the
        # loss rows up to 10 % faster than the bare matmul in a first run.)
        return loss(lp.view(shape), None, adv, mask, entropy=None if ent is None else ent.view(shape), batch=batch)

    return loss_fn


# ----------------------------------------------------------------------------- the cases
def cce_module(key: str):
    """The cut-cross-entropy copy of row ``key``: the installed PyPI release for ``cce``, else the repository's."""
    return cce_anchor.load("installed" if key == "cce" else "repository")


def cce_impl(key: str) -> str:
    return CCE_IMPL_OVERRIDE or ("cce_exact" if key == "cce_exact" else "cce")


def logprob_fns() -> dict:
    """key -> ``lp(h, w, t, group) -> [rows] log-probs`` for the rows whose precision is measured (the others' is
    theirs: main_grad, 512 MiB chunks and the loss objectives change no log-prob)."""

    def fused_op(dtype):
        return lambda h, w, t, group: fused_linear_logprobs(h, w, t, tp_group=group, logit_dtype=dtype)

    def loss_op(dtype):
        def lp(h, w, t, group):
            fn = lambda x, ent: (x.sum(), x.detach().clone())  # noqa: E731
            return fused_linear_loss(h, w, t, fn, tp_group=group, logit_dtype=dtype)[1]

        return lp

    def logits_op(dtype):
        def lp(h, w, t, group):
            z = batch_major_linear(h.unsqueeze(1), w, logit_dtype=dtype)
            return vocab_parallel_logprobs(z, t.unsqueeze(1), tp_group=group).squeeze(1)

        return lp

    def cce(key):
        return lambda h, w, t, group: cce_anchor.logprobs(cce_module(key), h, w, t, cce_impl(key), group)

    return {
        "logits": logits_op(LogitDtype.BF16), "logits_fp32": logits_op(LogitDtype.FP32),
        "loss": loss_op(LogitDtype.BF16), "loss_fp32": loss_op(LogitDtype.FP32),
        "per_token": fused_op(LogitDtype.BF16), "per_token_fp32": fused_op(LogitDtype.FP32),
        "cce": cce("cce"), "cce_repo": cce("cce_repo"), "cce_exact": cce("cce_exact"),
    }


def cases(n: int, hidden_size: int, v: int):
    """name -> builder returning (fwd, fwd_bwd); builders import optional libraries lazily."""

    def bare():
        h, w, _, _ = make_inputs(n, hidden_size, v)
        grad_logits = torch.randn(n, v, device=DEVICE, dtype=torch.bfloat16)
        return _closures((h, w), lambda: h @ w.t(), grad_logits)

    def logits_path(dtype: LogitDtype):
        def build():
            h, w, t, g = make_inputs(n, hidden_size, v)
            h1 = h.detach().unsqueeze(1).requires_grad_()  # [S, B = 1, H]: the output layer of the Megatron path

            def f():
                z = batch_major_linear(h1, w, logit_dtype=dtype)
                return vocab_parallel_logprobs(z, t.unsqueeze(1), inplace_backward=True, check_inputs=False)

            return _closures((h1, w), f, g.unsqueeze(1))

        return build

    def logits_path_loss():
        h, w, t, _ = make_inputs(n, hidden_size, v)
        loss_fn = grpo_loss_fn(n)

        def f():
            lp = vocab_parallel_logprobs(h @ w.t(), t, inplace_backward=True, check_inputs=False)
            return loss_fn(lp, None)[0]

        return _closures((h, w), f, torch.ones((), device=DEVICE))

    def with_loss(main_grad: bool, chunk_tokens: int | None = None, dtype: LogitDtype = LogitDtype.BF16):
        def build():
            h, w, t, _ = make_inputs(n, hidden_size, v)
            if main_grad:
                w.main_grad = torch.zeros(w.shape, device=DEVICE, dtype=torch.float32)
                w.grad_added_to_main_grad = False
            loss_fn = grpo_loss_fn(n)
            f = lambda: fused_linear_loss(  # noqa: E731
                h, w, t, loss_fn, check_inputs=False, accumulate_into_main_grad=main_grad, chunk_tokens=chunk_tokens,
                logit_dtype=dtype,
            )[0]
            return _closures((h, w), f, torch.ones((), device=DEVICE), forward_without_grad=False)

        return build

    def replay(kind: str):
        """fused_linear_loss + GRPOLoss with each token's captured support (SUPPORT_IDS ids), or with the trainer's
        log-probs at the engine's top-K ids taken in its forward (TOP_K_IDS a token; the loss reads no top-K term:
        the row measures the ops' part)."""
        def build():
            h, w, t, _ = make_inputs(n, hidden_size, v)
            grpo = grpo_loss_fn(n)
            if kind == "support":
                extra, loss_fn = dict(captured_support=csr_of(engine_ids(t, v, SUPPORT_IDS, 11), CapturedSupport)), grpo
            else:
                extra = dict(top_k_ids=csr_of(engine_ids(t, v, TOP_K_IDS, 12)))
                loss_fn = lambda lp, ent, top_k: grpo(lp, ent)  # noqa: E731
            f = lambda: fused_linear_loss(h, w, t, loss_fn, check_inputs=False, **extra)[0]  # noqa: E731
            return _closures((h, w), f, torch.ones((), device=DEVICE), forward_without_grad=False)

        return build

    def per_token_loss(objective: str):
        def build():
            h, w, t, _ = make_inputs(n, hidden_size, v)
            loss_fn = grpo_loss_fn(n, objective)
            f = lambda: loss_fn(fused_linear_logprobs(h, w, t, check_inputs=False), None)[0]  # noqa: E731
            return _closures((h, w), f, torch.ones((), device=DEVICE))

        return build

    def fused(with_entropy: bool, main_grad: bool, dtype: LogitDtype = LogitDtype.BF16):
        def build():
            h, w, t, g = make_inputs(n, hidden_size, v)
            g2 = torch.randn_like(g)
            if main_grad:
                w.main_grad = torch.zeros(w.shape, device=DEVICE, dtype=torch.float32)
                w.grad_added_to_main_grad = False  # as Megatron's DDP sets it
            f = lambda: fused_linear_logprobs(  # noqa: E731
                h, w, t, with_entropy=with_entropy, check_inputs=False, accumulate_into_main_grad=main_grad,
                logit_dtype=dtype,
            )
            return _closures((h, w), f, g, g2)

        return build

    def cce(key: str):
        def build():
            module = cce_module(key)
            cce_anchor.check_available(module, cce_impl(key), 1)
            h, w, t, g = make_inputs(n, hidden_size, v)
            return _closures((h, w), lambda: cce_anchor.logprobs(module, h, w, t, cce_impl(key)), g)

        return build

    def liger():
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        b = 8
        length = n // b
        h, w, t, _ = make_inputs(n, hidden_size, v)
        h = h.detach().view(b, length, hidden_size).requires_grad_()
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        mask = torch.ones(b, length, device=DEVICE, dtype=torch.int64)
        adv = torch.randn(b, device=DEVICE, generator=gen)
        old = -torch.rand(b, length, device=DEVICE, generator=gen) * 5
        loss = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, chunk_size=1, loss_type="dapo")
        f = lambda: loss(h, w, t.view(b, length), mask, adv, old_per_token_logps=old)[0]  # noqa: E731
        # Its forward computes the gradients too (chunked, with torch.func): timed as called in training.
        return _closures((h, w), f, torch.ones((), device=DEVICE), forward_without_grad=False)

    return {
        "bare": (BARE, bare),
        "logits": ("mp_grpo logits path: matmul + vocab_parallel_logprobs", logits_path(LogitDtype.BF16)),
        "logits_fp32": (f"mp_grpo logits path: matmul + vocab_parallel_logprobs{FP32}", logits_path(LogitDtype.FP32)),
        "logits_loss": ("mp_grpo logits path + GRPOLoss", logits_path_loss),
        "loss": (WITH_LOSS, with_loss(False)),
        "loss_fp32": (f"{WITH_LOSS}{FP32}", with_loss(False, dtype=LogitDtype.FP32)),
        "loss_main_grad": (f"{WITH_LOSS}, into fp32 main_grad", with_loss(True)),
        "loss_512": (f"{WITH_LOSS}, 512 MiB chunks",
                     with_loss(False, plan_chunks(n, hidden_size, v, torch.bfloat16).forward_rows)),
        "loss_support": (f"{WITH_LOSS}, captured support of {SUPPORT_IDS} ids a token", replay("support")),
        "loss_top_k": (f"{WITH_LOSS}, the trainer's log-probs at K = {TOP_K_IDS} top-K ids", replay("top_k")),
        "per_token": (FUSED, fused(False, False)),
        "per_token_fp32": (f"{FUSED}{FP32}", fused(False, False, LogitDtype.FP32)),
        "per_token_main_grad": (f"{FUSED} into fp32 main_grad", fused(False, True)),
        "per_token_loss": (f"{FUSED} + GRPOLoss (recompute path)", per_token_loss("ppo_clip")),
        "gspo": (GSPO, per_token_loss("gspo")),
        "cce": (f"{CCE}, PyPI release, impl=cce", cce("cce")),
        "cce_repo": (f"{CCE}, repository, impl=cce", cce("cce_repo")),
        "cce_exact": (f"{CCE}, repository, impl=cce_exact", cce("cce_exact")),
        "liger": (LIGER, liger),
    }


CASE_KEYS = ("bare", "logits", "logits_fp32", "logits_loss", "loss", "loss_fp32", "loss_main_grad", "loss_512",
             "loss_support", "loss_top_k",
             "per_token", "per_token_fp32", "per_token_main_grad", "per_token_loss", "gspo", "cce", "cce_repo",
             "cce_exact", "liger")
"""The rows' keys for ``--only`` / ``--skip``, in table order."""
BASELINE = {"logits_fp32": "logits", "loss_fp32": "loss", "per_token_fp32": "per_token"}
"""An fp32 row's bf16 counterpart (its prediction's base)."""


def selected(key: str, v: int, only: list[str] | None, skip: list[str] | None) -> bool:
    """``KEY`` selects a row at every V, ``KEY@V`` at one (e.g. ``--skip liger@151936``)."""
    def hit(patterns):
        return any(p == key or p == f"{key}@{v}" for p in patterns)

    return (only is None or hit(only)) and not (skip and hit(skip))


TP_IMPLS = ("bare", "per_token", "per_token_fp32", "loss", "loss_fp32", "cce_repo", "cce_exact")
"""The side-by-side rows under TP (keys of ``cases``; each on this rank's shard)."""


def tp_impls(h, w, t, g, group, n: int) -> dict:
    """key -> (name, builder of (fwd, fwd_bwd)) on this rank's shard ``w``."""
    names = cases(n, h.shape[1], w.shape[0])

    def fused(dtype):
        def build():
            f = lambda: fused_linear_logprobs(h, w, t, tp_group=group, check_inputs=False, logit_dtype=dtype)  # noqa: E731
            return _closures((h, w), f, g)

        return build

    def loss(dtype):
        def build():
            loss_fn = grpo_loss_fn(n)
            f = lambda: fused_linear_loss(h, w, t, loss_fn, tp_group=group, check_inputs=False,  # noqa: E731
                                          logit_dtype=dtype)[0]
            return _closures((h, w), f, torch.ones((), device=DEVICE), forward_without_grad=False)

        return build

    def bare():
        grad_logits = torch.randn(n, w.shape[0], device=DEVICE, dtype=torch.bfloat16)
        return _closures((h, w), lambda: h @ w.t(), grad_logits)

    def cce(key):
        def build():
            module = cce_module(key)
            cce_anchor.check_available(module, cce_impl(key), dist.get_world_size(group))
            return _closures((h, w), lambda: cce_anchor.logprobs(module, h, w, t, cce_impl(key), group), g)

        return build

    builders = {"bare": bare, "per_token": fused(LogitDtype.BF16), "per_token_fp32": fused(LogitDtype.FP32),
                "loss": loss(LogitDtype.BF16), "loss_fp32": loss(LogitDtype.FP32), "cce_repo": cce("cce_repo"),
                "cce_exact": cce("cce_exact")}
    return {key: (names[key][0], builders[key]) for key in TP_IMPLS}
