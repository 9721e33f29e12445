"""The fused GRPO loss kernels (mp_grpo/kernels/grpo_loss_*.py) compile for an H100 / H200 (sm_90) on a machine
without a GPU: Triton's real compiler (to PTX and, with the ptxas shipped in the triton wheel, to a cubin), not
the interpreter the CPU suite runs them in — the interpreter accepts code the compiler rejects (types that
differ between branches, globals that are not ``tl.constexpr``, …). Every feature config of the loss tests,
padded and packed, float32 and float64, log-probs in bfloat16; the token, backward and finalize kernels.

The compilation runs in a subprocess with ``TRITON_INTERPRET=0`` (this file is its script; see ``sm90.py``).
"""

from __future__ import annotations

import itertools

from tests.kernels.sm90 import Sm90Compiler, needs_nvidia_backend, run_compile_script


@needs_nvidia_backend
def test_kernels_compile_for_sm90() -> None:
    assert "compiled" in run_compile_script(__file__)


def _compile_all() -> None:
    import triton.language as tl

    from mp_grpo.config import load_config
    from mp_grpo.kernels.grpo_loss_backward import grpo_loss_backward_kernel
    from mp_grpo.kernels.grpo_loss_combine import grpo_loss_combine_kernel
    from mp_grpo.kernels.grpo_loss_constants import CONSTANTS_KEY
    from mp_grpo.kernels.grpo_loss_finalize import grpo_loss_finalize_kernel
    from mp_grpo.kernels.grpo_loss_token import grpo_loss_token_kernel
    from mp_grpo.ops.grpo_loss_plan import InputsKey, build_plan
    from tests.loss.helpers import AGGREGATIONS, DIVERGENCE_FEATURES, FEATURE_CONFIGS

    compiler = Sm90Compiler()
    compile_kernel = compiler.compile

    sizes = dict(N="i32", T="i32", S="i32", search_steps="i32")
    stats = dict(stats_ptr="*fp32", target_ptr="*i64", TP="i32", V_global="i32", ignore_index="i32",
                 stride_stats_rank="i32", stride_stats_row="i32", inv_temperature="fp32")
    # every feature config; the binary KL trust region with M2PO (on the log-prob statistics: the on_logits path) and
    # the per-token (top-K) divergence with M2PO's clip quadrants, each compiled once
    topk = ["trust_region.mode=topk_tv", "trust_region.direction=symmetric", "trust_region.delta_high=0.1",
            "m2po.bound=0.04", "m2po.scope=clip_quadrants"]
    divergence = [(name, overrides) for name, overrides in DIVERGENCE_FEATURES.items()]
    for i, (feature, overrides) in enumerate([*FEATURE_CONFIGS.items(), *divergence, ("topk_m2po_quadrants", topk)]):
        aggregation = list(AGGREGATIONS)[i % len(AGGREGATIONS)]
        cfg = load_config(None, overrides + AGGREGATIONS[aggregation])
        packed = i % 2 == 1
        compute, ptr = (tl.float64, "*fp64") if i % 4 == 3 else (tl.float32, "*fp32")
        lp = "*bf16" if i % 4 == 2 else ptr
        plan = build_plan(cfg, InputsKey(packed=packed, has_old=True, has_rollout=True, has_ref=True, has_entropy=True,
                                         advantages_per_token=i % 3 == 0))
        # GRPOLoss on log-probs, and (fp32 compute) on the log-prob op's statistics (GRPOLoss.on_logits).
        from_stats_cases = (False, True) if compute == tl.float32 else (False,)
        if feature in DIVERGENCE_FEATURES:
            from_stats_cases = (True,) if compute == tl.float32 else (False,)
        elif feature not in FEATURE_CONFIGS:
            from_stats_cases = (False,)
        for from_stats in from_stats_cases:
            tokens = dict(lp_ptr=lp, old_ptr=ptr, rollout_ptr="*fp32", adv_ptr=ptr, mask_ptr="*i1",
                          cu_ptr="*i32" if packed else lp, params_ptr="*fp64", **sizes, **stats)
            if plan.num_cols:
                compile_kernel(grpo_loss_token_kernel, dict(tokens, ref_ptr=ptr, ent_ptr=lp, seq_sums_ptr="*fp64"),
                               dict(plan.token_flags, FROM_STATS=from_stats, COMPUTE=compute, BLOCK=1024))
            compile_kernel(grpo_loss_combine_kernel, dict(
                tokens, ref_ptr=ptr, ent_ptr=lp, row_out_ptr="*fp32", errors_ptr="*i64", seq_sums_ptr="*fp64",
                seq_grad_ptr="*fp64", tokens_ptr="*fp64", sequences_ptr="*fp64", weight_mean_ptr="*fp64",
                threshold_ptr="*fp64", skip_ptr="*i1", grad_lp_ptr=ptr, grad_ent_ptr=ptr, seq_factor_ptr=ptr,
                partial_ptr="*fp64", div_ptr="*fp64", m2po_threshold_ptr="*fp64",
            ), dict(plan.combine_flags, FROM_STATS=from_stats, OWNS_SEQUENCES=i % 3 != 1, COMPUTE=compute,
                    BLOCK=256, CONSTANTS_KEY=CONSTANTS_KEY))
    for seq_grad, scaled, packed in itertools.product([False, True], [False, True], [False, True]):
        compile_kernel(grpo_loss_backward_kernel, dict(
            grad_out_ptr="*fp32", grad_lp_fwd_ptr="*fp32", grad_ent_fwd_ptr="*fp32", seq_grad_ptr="*fp64",
            seq_factor_ptr="*fp32", cu_ptr="*i64", grad_lp_ptr="*bf16", grad_ent_ptr="*fp32", **sizes,
        ), dict(PACKED=packed, ENTROPY_GRAD=packed, ENTROPY_16BIT=scaled and packed, SEQ_GRAD=seq_grad, SEQ_GRAD_SCALED=scaled, COMPUTE=tl.float32,
                BLOCK=1024))
    for skip, loss, fold, packed in ((False, "*fp32", False, False), (True, "*fp64", True, True),
                                     (False, "*fp32", True, False)):
        compile_kernel(grpo_loss_finalize_kernel, dict(
            partial_ptr="*fp64", micro_batches_ptr="*fp64", skip_ptr="*i1", loss_ptr=loss, pairs_ptr="*fp64",
            extremes_ptr="*fp64", nonfinite_errors_ptr="*i64", grad_lp_ptr=loss, seq_grad_ptr="*fp64",
            seq_factor_ptr=loss, cu_ptr="*i64", P="i32", **sizes,
        ), dict(HAS_SKIP=skip, FOLD_SEQ_GRAD=fold, PACKED=packed, COLS=64, BLOCK_P=64, BLOCK=1024,
                CONSTANTS_KEY=CONSTANTS_KEY))
    print(f"compiled {compiler.count} kernels for sm_90")


if __name__ == "__main__":
    _compile_all()
