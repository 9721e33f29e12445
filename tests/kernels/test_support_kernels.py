"""The captured-support and top-K-ids kernels (``mp_grpo/kernels/logprob_support.py``, ``logprob_at_ids.py``) compile
for an H100 / H200 (sm_90) on a machine without a GPU: bf16 and fp32 logits, with and without entropy (its gradient and
the loss's upstream scale), the gradient narrowed (fp32 logits, a bf16 gradient), the top-K gather with a sampling
filter's threshold or a support, at the block sizes ``kernels/launch_config.py`` picks on a GPU.

The compilation runs in a subprocess with ``TRITON_INTERPRET=0`` (this file is its script; see ``sm90.py``).
"""

from __future__ import annotations

import itertools

from tests.kernels.sm90 import Sm90Compiler, needs_nvidia_backend, run_compile_script


@needs_nvidia_backend
def test_support_kernels_compile_for_sm90() -> None:
    assert "compiled 17 kernels" in run_compile_script(__file__)


def _compile_all() -> None:
    from mp_grpo.kernels.launch_config import logprob_launch_config
    from mp_grpo.kernels.logprob_at_ids import logprob_at_ids_kernel, logprob_gather_ids_kernel
    from mp_grpo.kernels.logprob_support import (
        logprob_support_grad_kernel,
        logprob_support_scatter_kernel,
        logprob_support_stats_kernel,
    )

    cfg = logprob_launch_config(151936)
    support = Sm90Compiler(num_warps=cfg.support_warps)
    ids = Sm90Compiler(num_warps=cfg.ids_warps)
    for logits, with_entropy in itertools.product(("*bf16", "*fp32"), (False, True)):
        support.compile(logprob_support_stats_kernel, dict(
            x_ptr=logits, target_ptr="*i64", indptr_ptr="*i64", ids_ptr="*i64", stats_ptr="*fp32",
            has_support_ptr="*i8", csr_row_start="i32", row_start="i32", nnz="i32", V_local="i32", vocab_start="i32",
            stride_x_row="i64", stride_stats_row="i32", inv_temperature="fp32",
        ), dict(HAS_ENTROPY=with_entropy, BLOCK_K=cfg.support_block_k))
        grads = ["*bf16"]  # bf16 logits' gradient, or fp32 logits' narrowed one
        for grad in grads:
            support.compile(logprob_support_grad_kernel, dict(
                x_ptr=logits, values_ptr=grad, target_ptr="*i64", indptr_ptr="*i64", ids_ptr="*i64",
                row_max_ptr="*fp32", log_sum_ptr="*fp32", complement_ptr="*fp32", centered_ptr="*fp32",
                entropy_ptr="*fp32", grad_logprob_ptr="*fp32", grad_entropy_ptr="*fp32", grad_scale_ptr="*fp32",
                csr_row_start="i32", nnz="i32", V_local="i32", vocab_start="i32", ignore_index="i32",
                stride_x_row="i64", inv_temperature="fp32",
            ), dict(HAS_ENTROPY_GRAD=with_entropy, HAS_GRAD_SCALE=with_entropy, BLOCK_K=cfg.support_block_k))
            if with_entropy:
                support.compile(logprob_support_scatter_kernel, dict(
                    values_ptr=grad, grad_x_ptr=grad, indptr_ptr="*i64", ids_ptr="*i64", csr_row_start="i32",
                    nnz="i32", V_local="i32", vocab_start="i32", stride_grad_x_row="i64",
                ), dict(BLOCK_K=cfg.support_block_k))
        for has_threshold, has_support in (((False, False), (True, False), (False, True)) if with_entropy else ()):
            ids.compile(logprob_gather_ids_kernel, dict(
                x_ptr=logits, indptr_ptr="*i64", ids_ptr="*i64", payload_ptr="*fp32", threshold_ptr="*fp32",
                support_indptr_ptr="*i64", support_ids_ptr="*i64", csr_row_start="i32", nnz="i32",
                support_nnz="i32", V_local="i32", vocab_start="i32", stride_x_row="i64",
            ), dict(HAS_THRESHOLD=has_threshold, HAS_SUPPORT=has_support, BLOCK_K=cfg.ids_block_k,
                    BLOCK_S=cfg.ids_block_s))
    ids.compile(logprob_at_ids_kernel, dict(
        stats_ptr="*fp32", target_ptr="*i64", payload_ptr="*fp32", indptr_ptr="*i64", ids_ptr="*i64",
        out_ptr="*fp32", N="i32", TP="i32", V_local="i32", ignore_index="i32", csr_row_start="i32", nnz="i32",
        stride_stats_rank="i32", stride_stats_row="i32", stride_payload_rank="i32", inv_temperature="fp32",
    ), dict(BLOCK_K=cfg.ids_block_k))
    print(f"compiled {support.count + ids.count} kernels for sm_90")


if __name__ == "__main__":
    _compile_all()
