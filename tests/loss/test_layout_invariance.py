"""The gradient convention under torchrun/gloo: however one step is split, the per-token gradients equal
those of a single GRPOLoss call on the whole batch (float64, 1e-6 relative).

Splits: (1 rank, 4 micro-batches), (2 ranks, 2), (4 ranks, 1); context parallel CP=2 × DP=2 with padded
rows and with packed (THD) segments, each sequence cut into Megatron's 2·CP chunks; tensor parallel
TP=2 × DP=2 with log-probs from ``vocab_parallel_logprobs`` on vocabulary shards. Every aggregation mode,
uneven lengths (each micro-batch padded to its own length, inf/NaN in the padding), an empty sequence, an
empty micro-batch and a rank with zero valid tokens, and the step-level features (top-entropy quantile,
IS-weight normalization, mismatch skip on both sides of its threshold, M2PO's threshold gathered over the group), and the torch-only options
(VESPO's per-sequence weight, GSPO-token, the sequence-level KL bias correction, separate KL / entropy
aggregation, the bonus on the step's top-entropy tokens; ``TORCH_ONLY_FEATURES``; VAPO's NLL on positive examples
over the step's count of their tokens). The fused Triton path (under the
interpreter) runs the data- and context-parallel splits on a subset of the configs, against the torch path's
single call.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import torchrun, worker_main

# Rows 4 and 5 are empty: with 4 ranks, rank 2 has no valid token; with 2 ranks × 2 micro-batches, rank 1's
# first micro-batch is empty; with 4 micro-batches, the third is.
LENGTHS = [5, 3, 6, 1, 0, 0, 4, 2]
T = 8
RTOL, ATOL = 1e-6, 1e-12
# The configs the fused backend runs here (the interpreter is slow): every sequence-level quantity under
# context parallelism — the gspo / gmpo gradient through the sequence mean, sequence / geometric IS ratios,
# OPSM, seq-mean aggregation — and every step-level one.
TRITON_CONFIGS = {
    "gspo_seq_is_geo_reject/seq_mean_token_mean", "gmpo/seq_mean_token_sum", "reinforce_opsm_skip/token_mean",
    "ppo_seq_reject_kl_st/seq_mean_token_sum_norm", "sapo_entropy_kl/seq_mean_token_mean",
    "cispo_tis_normalized/token_mean", "skip_just_above/seq_mean_token_sum",
}


def _configs(backend: str):
    from mp_grpo.config import load_config
    from mp_grpo.loss.mismatch import k3
    from tests.loss.helpers import AGGREGATIONS, DIVERGENCE_FEATURES, FEATURE_CONFIGS, TORCH_ONLY_FEATURES, make_batch

    # Mismatch skip on both sides of the step's global k3: the decision must be global, not per rank.
    batch = make_batch(0, LENGTHS, T)
    valid = batch["loss_mask"]
    d = torch.where(valid, batch["old_logprobs"] - batch["rollout_logprobs"], torch.zeros(()))
    global_k3 = float(torch.where(valid, k3(d), torch.zeros(())).sum() / valid.sum())
    features = dict(FEATURE_CONFIGS)
    features["skip_just_below"] = [f"mismatch.skip_threshold={global_k3 * 0.98}", "kl.coef=0.1"]
    features["skip_just_above"] = [f"mismatch.skip_threshold={global_k3 * 1.02}", "kl.coef=0.1"]
    if backend == "torch":
        features.update(TORCH_ONLY_FEATURES)
        features["vapo_nll"] = ["nll.positive_coef=0.3", "kl.coef=0.05"]  # the step's positive-token count
    for feature, feature_overrides in features.items():
        for aggregation, agg_overrides in AGGREGATIONS.items():
            name = f"{feature}/{aggregation}"
            if backend == "torch" or name in TRITON_CONFIGS:
                yield name, load_config(None, feature_overrides + agg_overrides)
    if backend == "torch":  # M2PO's step-level gather over the group (a GlobalBatch pass: the backend does not matter)
        for feature, feature_overrides in DIVERGENCE_FEATURES.items():
            yield f"{feature}/token_mean", load_config(None, feature_overrides)


def _call(cfg, data, rows, cols, *, backend="torch", batch=None, layout=None, lp=None, ent=None, index=None):
    """One GRPOLoss call on data[rows, cols] (or on gathered positions ``index``); returns loss, leaves, metrics."""
    from mp_grpo.loss import GRPOLoss, LossBackend

    def take(x):
        return x[rows][:, cols] if index is None else x.reshape(-1)[index]

    lp = take(data["logprobs"]).clone().requires_grad_() if lp is None else lp
    ent = take(data["entropy"]).clone().requires_grad_() if ent is None else ent
    adv = data["advantages"][rows] if index is None else data["advantages"]
    vapo = {}
    if cfg.nll.positive_coef != 0.0:  # positive examples per sequence; with a batch, the step's count of their tokens
        vapo["positive"] = adv > 0
        vapo["positive_tokens"] = None if batch is None else data["positive_tokens"]
    loss, metrics = GRPOLoss(cfg, backend=LossBackend(backend))(
        lp, take(data["old_logprobs"]), adv, take(data["loss_mask"]), rollout_logprobs=take(data["rollout_logprobs"]),
        ref_logprobs=take(data["ref_logprobs"]), entropy=ent, batch=batch, layout=layout, **vapo,
    )
    return loss, lp, ent, metrics


def _data() -> dict[str, torch.Tensor]:
    """The step's batch, and the step's count of valid tokens of positive examples (what
    ``GlobalBatch.from_masks`` of the positive tokens' masks gives over the whole group, for ``nll.positive_coef``)."""
    from tests.loss.helpers import make_batch

    data = make_batch(0, LENGTHS, T)
    positive = data["loss_mask"] & (data["advantages"] > 0).unsqueeze(1)
    data["positive_tokens"] = positive.sum().to(torch.float64)
    return data


def _grad(x):
    return torch.zeros_like(x) if x.grad is None else x.grad


def _single(cfg, data):
    from mp_grpo.loss import reduce_metrics

    loss, lp, ent, metrics = _call(cfg, data, slice(None), slice(None))
    loss.backward()
    return loss.detach(), _grad(lp), _grad(ent), reduce_metrics([metrics])


def _check_metrics(name, got, want):
    assert got.keys() == want.keys(), (name, sorted(got), sorted(want))
    for k in want:
        if want[k] != want[k]:  # NaN: no count anywhere
            assert got[k] != got[k], (name, k)
        else:
            assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), (name, k, got[k], want[k])


# ----------------------------------------------------------------------------- worker cases
def case_data_parallel(backend: str) -> None:
    """(1 rank, 4 micro-batches), (2 ranks, 2), (4 ranks, 1) against one call on the whole batch."""
    from mp_grpo.loss import GlobalBatch, reduce_metrics

    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    data = _data()
    for name, cfg in _configs(backend):
        loss_1, g_lp_1, g_ent_1, metrics_1 = _single(cfg, data)
        for dp, group in ((1, None), (2, pairs[rank // 2]), (4, dist.group.WORLD)):
            dp_rank = 0 if group is None else dist.get_rank(group)
            mbs = 4 // dp
            per_rank = len(LENGTHS) // dp
            chunks = []
            for m in range(mbs):
                r0 = dp_rank * per_rank + m * (per_rank // mbs)
                rows = slice(r0, r0 + per_rank // mbs)
                width = max(LENGTHS[rows]) + 1  # each micro-batch padded to its own length
                chunks.append((rows, slice(0, width)))
            gb = GlobalBatch.from_rollouts(
                cfg, [data["loss_mask"][r][:, c] for r, c in chunks],
                old_logprobs=[data["old_logprobs"][r][:, c] for r, c in chunks],
                rollout_logprobs=[data["rollout_logprobs"][r][:, c] for r, c in chunks],
                entropies=[data["entropy"][r][:, c] for r, c in chunks], group=group, step=7,
            )
            gb.check_step(7)
            total = torch.zeros((), dtype=torch.float64)
            metrics = []
            for rows, cols in chunks:
                loss, lp, ent, m = _call(cfg, data, rows, cols, backend=backend, batch=gb)
                loss.backward()
                total = total + loss.detach()
                metrics.append(m)
                where = f"{name} dp={dp} rank={rank} rows={rows}"
                torch.testing.assert_close(_grad(lp), g_lp_1[rows][:, cols], rtol=RTOL, atol=ATOL, msg=where)
                torch.testing.assert_close(_grad(ent), g_ent_1[rows][:, cols], rtol=RTOL, atol=ATOL, msg=where)
            if group is not None:
                dist.all_reduce(total, group=group)
            torch.testing.assert_close(total, loss_1, rtol=1e-9, atol=1e-12, msg=f"{name} dp={dp} sum of shares")
            _check_metrics(f"{name} dp={dp}", reduce_metrics(metrics, group), metrics_1)


def _cp_positions(length: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Megatron's load-balanced CP split: chunks cp_rank and 2·cp−1−cp_rank of 2·cp equal chunks."""
    chunk = length // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat([first, second])


def case_context_parallel(backend: str) -> None:
    """CP = 2 × DP = 2 (ranks {0,1} and {2,3} share sequences), padded rows and packed segments; and CP = 2
    alone with ``batch=None`` (the call with its CP peer is the whole step)."""
    from mp_grpo.loss import GlobalBatch, PackedSequences, PaddedSequences, reduce_metrics

    rank = dist.get_rank()
    cp, cp_rank, dp_rank = 2, rank % 2, rank // 2
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_group = cp_groups[dp_rank]
    data = _data()
    rows_of_rank = [slice(dp_rank * 4, dp_rank * 4 + 2), slice(dp_rank * 4 + 2, dp_rank * 4 + 4)]  # 2 micro-batches
    for name, cfg in _configs(backend):
        loss_1, g_lp_1, g_ent_1, metrics_1 = _single(cfg, data)
        # --- padded rows: every row cut into 2·CP chunks along T ---
        layout = PaddedSequences(cp_group)
        cols = _cp_positions(T, cp, cp_rank)
        gb = GlobalBatch.from_rollouts(
            cfg, [data["loss_mask"][r][:, cols] for r in rows_of_rank],
            old_logprobs=[data["old_logprobs"][r][:, cols] for r in rows_of_rank],
            rollout_logprobs=[data["rollout_logprobs"][r][:, cols] for r in rows_of_rank],
            entropies=[data["entropy"][r][:, cols] for r in rows_of_rank],
            group=dist.group.WORLD, layouts=[layout, layout],
        )
        metrics = []
        for rows in rows_of_rank:
            loss, lp, ent, m = _call(cfg, data, rows, cols, backend=backend, batch=gb, layout=layout)
            loss.backward()
            metrics.append(m)
            where = f"{name} CP padded rank={rank} rows={rows}"
            torch.testing.assert_close(_grad(lp), g_lp_1[rows][:, cols], rtol=RTOL, atol=ATOL, msg=where)
            torch.testing.assert_close(_grad(ent), g_ent_1[rows][:, cols], rtol=RTOL, atol=ATOL, msg=where)
        _check_metrics(f"{name} CP padded", reduce_metrics(metrics, dist.group.WORLD), metrics_1)

        # --- batch=None under CP: one call on all rows, its CP pair is the whole step ---
        loss, lp, ent, _ = _call(cfg, data, slice(None), cols, backend=backend, layout=layout)
        loss.backward()
        where = f"{name} CP single call rank={rank}"
        torch.testing.assert_close(_grad(lp), g_lp_1[:, cols], rtol=RTOL, atol=ATOL, msg=where)
        torch.testing.assert_close(_grad(ent), g_ent_1[:, cols], rtol=RTOL, atol=ATOL, msg=where)

        # --- packed: each row a segment padded to a multiple of 2·CP, each segment cut into 2·CP chunks ---
        packed_calls = []
        for rows in rows_of_rank:
            flat_index, local_bounds = [], [0]
            for b in range(rows.start, rows.stop):
                seg = 2 * cp * max(1, -(-LENGTHS[b] // (2 * cp)))
                flat_index.append(b * T + _cp_positions(seg, cp, cp_rank))
                local_bounds.append(local_bounds[-1] + seg // cp)
            packed_calls.append((rows, torch.cat(flat_index), PackedSequences(torch.tensor(local_bounds), cp_group)))
        gb = GlobalBatch.from_rollouts(
            cfg, [data["loss_mask"].reshape(-1)[i] for _, i, _ in packed_calls],
            old_logprobs=[data["old_logprobs"].reshape(-1)[i] for _, i, _ in packed_calls],
            rollout_logprobs=[data["rollout_logprobs"].reshape(-1)[i] for _, i, _ in packed_calls],
            entropies=[data["entropy"].reshape(-1)[i] for _, i, _ in packed_calls],
            group=dist.group.WORLD, layouts=[lay for _, _, lay in packed_calls],
        )
        metrics = []
        for rows, index, lay in packed_calls:
            sub = dict(data, advantages=data["advantages"][rows])
            loss, lp, ent, m = _call(cfg, sub, None, None, backend=backend, batch=gb, layout=lay, index=index)
            loss.backward()
            metrics.append(m)
            where = f"{name} CP packed rank={rank} rows={rows}"
            torch.testing.assert_close(_grad(lp), g_lp_1.reshape(-1)[index], rtol=RTOL, atol=ATOL, msg=where)
            torch.testing.assert_close(_grad(ent), g_ent_1.reshape(-1)[index], rtol=RTOL, atol=ATOL, msg=where)
        _check_metrics(f"{name} CP packed", reduce_metrics(metrics, dist.group.WORLD), metrics_1)


def case_tensor_parallel() -> None:
    """TP = 2 × DP = 2: log-probs and entropy from vocabulary shards with vocab_parallel_logprobs."""
    from mp_grpo import vocab_parallel_logprobs
    from mp_grpo.config import load_config
    from mp_grpo.loss import GlobalBatch, GRPOLoss
    from tests.loss.helpers import make_batch
    from tests.tolerances import tolerance

    rank = dist.get_rank()
    tp_rank, dp_rank = rank % 2, rank // 2
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    vocab = 2 * 24
    data = make_batch(0, LENGTHS, T)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(len(LENGTHS), T, vocab, generator=gen) * 2
    target = torch.randint(0, vocab, (len(LENGTHS), T), generator=gen)
    shard = slice(tp_rank * vocab // 2, (tp_rank + 1) * vocab // 2)
    configs = {
        "ppo/token_mean": [],
        "gspo/seq_mean_token_mean": ["policy.objective=gspo", "aggregation.mode=seq_mean_token_mean"],
        # 21 valid tokens: the 0.67 quantile falls between two entropies, so fp32 noise cannot flip a token.
        "entropy/seq_mean_token_sum": ["entropy.top_quantile=0.33", "entropy.bonus_coef=0.05", "kl.coef=0.1",
                                       "aggregation.mode=seq_mean_token_sum"],
    }
    for name, overrides in configs.items():
        cfg = load_config(None, overrides)

        def run(logits_part, rows, tp, batch):
            leaf = logits_part.clone().requires_grad_()
            lp32, ent32 = vocab_parallel_logprobs(leaf, target[rows], tp_group=tp, with_entropy=True)
            lp, ent = lp32.double(), ent32.double()
            lp.retain_grad()
            ent.retain_grad()
            loss, _ = GRPOLoss(cfg)(lp, data["old_logprobs"][rows], data["advantages"][rows], data["loss_mask"][rows],
                                    rollout_logprobs=data["rollout_logprobs"][rows],
                                    ref_logprobs=data["ref_logprobs"][rows], entropy=ent, batch=batch)
            loss.backward()
            return leaf.grad, _grad(lp), _grad(ent), ent.detach()

        full = slice(None)
        g_logits_1, g_lp_1, g_ent_1, ent_1 = run(logits, full, None, None)
        rows_mb = [slice(dp_rank * 4, dp_rank * 4 + 2), slice(dp_rank * 4 + 2, dp_rank * 4 + 4)]
        ent_start = [ent_1[r] for r in rows_mb]  # the step-start entropies (the old-log-prob pass)
        gb = GlobalBatch.from_rollouts(cfg, [data["loss_mask"][r] for r in rows_mb], entropies=ent_start, group=dp_group)
        for rows in rows_mb:
            g_logits, g_lp, g_ent, _ = run(logits[rows][..., shard], rows, tp_group, gb)
            where = f"{name} TP rank={rank} rows={rows}"
            torch.testing.assert_close(g_lp, g_lp_1[rows], rtol=RTOL, atol=ATOL, msg=where)
            torch.testing.assert_close(g_ent, g_ent_1[rows], rtol=RTOL, atol=ATOL, msg=where)
            # The log-prob kernel is fp32: its gradient matches at the fp32 tolerance.
            torch.testing.assert_close(g_logits, g_logits_1[rows][..., shard], **tolerance(torch.float32), msg=where)


# ----------------------------------------------------------------------------- pytest entry points
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", ["case_data_parallel", "case_context_parallel"])
def test_layout_invariance(case: str, backend: str) -> None:
    torchrun(__file__, case, nproc=4, backend=backend)


def test_tensor_parallel_invariance() -> None:
    # One backend: the fused loss never sees tensor parallelism (TP ranks hold copies of the same tokens).
    torchrun(__file__, "case_tensor_parallel", nproc=4)


if __name__ == "__main__":
    worker_main({
        "case_data_parallel": case_data_parallel,
        "case_context_parallel": case_context_parallel,
        "case_tensor_parallel": case_tensor_parallel,
    })
