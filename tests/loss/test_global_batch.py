"""GlobalBatch (mp_grpo/loss/global_batch.py): counts, step-level quantities, wrong-step protection, errors.

Multi-rank construction (one all-reduce over DP, the CP pre-reduction, the entropy gather) runs in
test_layout_invariance.py."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config import LossConfig, load_config
from mp_grpo.loss import GlobalBatch, GRPOLoss, PackedSequences, StaleGlobalBatchError
from mp_grpo.loss.mismatch import k3
from mp_grpo.ops.checks import check_errors, deferred_checks
from tests.loss.helpers import make_batch

LENGTHS = [4, 0, 2, 5]


def _parts(batch, name):
    return [batch[name][:2, :5], batch[name][2:, :]]


def test_counts_from_masks() -> None:
    batch = make_batch(0, LENGTHS, 6)
    gb = GlobalBatch.from_masks(_parts(batch, "loss_mask"))
    assert gb.valid_tokens.item() == 11 and gb.valid_sequences.item() == 3 and gb.all_sequences.item() == 4
    assert gb.num_micro_batches.item() == 2
    assert gb.sequences(True).item() == 4 and gb.sequences(False).item() == 3
    assert gb.micro_batch_shapes == ((2, 5), (2, 6)) and gb.config is None and gb.skip is None
    assert gb.skip_step() is False


def test_counts_with_packed_layout() -> None:
    mask = torch.tensor([1, 1, 0, 0, 1, 1, 1, 1, 1])  # segments [0,2) [2,4) [4,7); positions 7, 8 outside
    gb = GlobalBatch.from_masks([mask], layouts=[PackedSequences(torch.tensor([0, 2, 4, 7]))])
    assert gb.valid_tokens.item() == 5 and gb.valid_sequences.item() == 2 and gb.all_sequences.item() == 3


def test_step_level_quantities() -> None:
    batch = make_batch(1, LENGTHS, 6)
    valid = batch["loss_mask"]
    cfg = load_config(None, ["rollout_correction.weight_level=token", "rollout_correction.weight_max=1.05",
                             "rollout_correction.normalize_weights=true", "entropy.top_quantile=0.25",
                             "mismatch.skip_threshold=0.001"])
    gb = GlobalBatch.from_rollouts(cfg, _parts(batch, "loss_mask"), old_logprobs=_parts(batch, "old_logprobs"),
                                   rollout_logprobs=_parts(batch, "rollout_logprobs"),
                                   entropies=_parts(batch, "entropy"), step=3)
    d = (batch["old_logprobs"] - batch["rollout_logprobs"])[valid]
    torch.testing.assert_close(gb.weight_mean, d.exp().clamp(max=1.05).mean())
    torch.testing.assert_close(gb.mismatch_k3, k3(d).mean())
    assert gb.skip.item() == (k3(d).mean() > 0.001).item() and gb.skip_step() == gb.skip.item()
    torch.testing.assert_close(gb.entropy_threshold, torch.quantile(batch["entropy"][valid], 0.75))
    gb.check_step(3)
    with pytest.raises(StaleGlobalBatchError, match="step 3, not to step 4"):
        gb.check_step(4)


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_sequence_level_weight_mean(level: str) -> None:
    batch = make_batch(2, LENGTHS, 6)
    cfg = load_config(None, [f"rollout_correction.weight_level={level}", "rollout_correction.weight_max=1.2",
                             "rollout_correction.normalize_weights=true"])
    gb = GlobalBatch.from_rollouts(cfg, _parts(batch, "loss_mask"), old_logprobs=_parts(batch, "old_logprobs"),
                                   rollout_logprobs=_parts(batch, "rollout_logprobs"))
    weights = []
    for b, n in enumerate(LENGTHS):
        if n:
            d = (batch["old_logprobs"][b] - batch["rollout_logprobs"][b])[:n]
            weights.append((d.sum() if level == "sequence" else d.mean()).exp().clamp(max=1.2))
    torch.testing.assert_close(gb.weight_mean, torch.stack(weights).mean())


def test_loss_rejects_a_batch_of_another_step_or_config() -> None:
    batch = make_batch(3, LENGTHS, 6)
    gb = GlobalBatch.from_masks(_parts(batch, "loss_mask"))
    loss_fn = GRPOLoss(LossConfig())
    args = (batch["logprobs"], batch["old_logprobs"], batch["advantages"], batch["loss_mask"])
    with pytest.raises(StaleGlobalBatchError, match="another step"):
        loss_fn(*args, batch=gb)  # [4, 6] is not one of its micro-batches
    with pytest.raises(StaleGlobalBatchError, match="from_rollouts"):
        GRPOLoss(load_config(None, ["entropy.top_quantile=0.5"]))(
            batch["logprobs"][:2, :5], None, batch["advantages"][:2], batch["loss_mask"][:2, :5],
            entropy=batch["entropy"][:2, :5], batch=gb)
    cfg = load_config(None, ["entropy.top_quantile=0.5"])
    built = GlobalBatch.from_rollouts(cfg, _parts(batch, "loss_mask"), entropies=_parts(batch, "entropy"))
    other = load_config(None, ["entropy.top_quantile=0.4"])
    with pytest.raises(StaleGlobalBatchError, match="different LossConfig"):
        GRPOLoss(other)(batch["logprobs"][:2, :5], None, batch["advantages"][:2], batch["loss_mask"][:2, :5],
                        entropy=batch["entropy"][:2, :5], batch=built)
    with pytest.raises(StaleGlobalBatchError, match="without a step id"):
        built.check_step(0)
    with pytest.raises(TypeError, match="batch"):
        loss_fn(*args, batch=object())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"masks": []}, ValueError, "at least one"),
        ({"masks": torch.ones(2, 3)}, TypeError, "masks must be a list"),
        ({"masks": [[1, 0]]}, TypeError, r"masks\[0\]"),
        ({"masks": [torch.ones(4)]}, ValueError, r"masks\[0\] must be \[B, T\]"),
        ({"layouts": [None, None]}, ValueError, "layouts"),
        ({"layouts": ["padded"]}, TypeError, r"layouts\[0\]"),
        ({"step": "7"}, TypeError, "step"),
    ],
)
def test_from_masks_errors(kwargs, error, match) -> None:
    args = {"masks": [torch.ones(2, 3)]} | kwargs
    with pytest.raises(error, match=match):
        GlobalBatch.from_masks(args.pop("masks"), **args)


def test_from_rollouts_errors() -> None:
    masks = [torch.ones(2, 3)]
    norm = load_config(None, ["rollout_correction.weight_level=token", "rollout_correction.normalize_weights=true"])
    with pytest.raises(ValueError, match="old_logprobs must be given.*normalize_weights"):
        GlobalBatch.from_rollouts(norm, masks, rollout_logprobs=[torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="rollout_logprobs must be given.*skip_threshold"):
        GlobalBatch.from_rollouts(load_config(None, ["mismatch.skip_threshold=0.1"]), masks,
                                  old_logprobs=[torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="entropies must be given"):
        GlobalBatch.from_rollouts(load_config(None, ["entropy.top_quantile=0.2"]), masks)
    with pytest.raises(ValueError, match=r"old_logprobs\[0\] has shape \(2, 4\)"):
        GlobalBatch.from_rollouts(norm, masks, old_logprobs=[torch.zeros(2, 4)], rollout_logprobs=[torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="old_logprobs has 2 tensors"):
        GlobalBatch.from_rollouts(norm, masks, old_logprobs=[torch.zeros(2, 3)] * 2,
                                  rollout_logprobs=[torch.zeros(2, 3)])
    with pytest.raises(TypeError, match=r"old_logprobs\[0\] must be a floating-point"):
        GlobalBatch.from_rollouts(norm, masks, old_logprobs=[torch.zeros(2, 3, dtype=torch.int64)],
                                  rollout_logprobs=[torch.zeros(2, 3)])
    with pytest.raises(TypeError, match="config"):
        GlobalBatch.from_rollouts({}, masks)  # type: ignore[arg-type]


def test_loss_rejects_masks_the_batch_was_not_built_from() -> None:
    """Identity, not shape: masks of another step with the same shapes, and a mask changed in place, are refused."""
    batch = make_batch(4, LENGTHS, 6, garbage=False)  # its values are read under the other step's masks too
    other = make_batch(5, [3, 1, 2, 5], 6)  # another step: same shapes, other masks
    gb = GlobalBatch.from_masks(_parts(other, "loss_mask"))
    loss_fn = GRPOLoss(LossConfig())
    part = {k: v[:2] if v.dim() == 1 else v[:2, :5] for k, v in batch.items()}
    with pytest.raises(StaleGlobalBatchError, match="another tensor"):
        loss_fn(part["logprobs"], part["old_logprobs"], part["advantages"], part["loss_mask"], batch=gb)
    # A copy of one of its masks (equal content, another tensor) is accepted; on a GPU the comparison is deferred.
    loss_fn(part["logprobs"], part["old_logprobs"], part["advantages"], other["loss_mask"][:2, :5].clone(), batch=gb)
    with deferred_checks():
        loss_fn(part["logprobs"], part["old_logprobs"], part["advantages"], part["loss_mask"], batch=gb)
    with pytest.raises(StaleGlobalBatchError, match="another tensor"):
        check_errors()
    check_errors()  # the ledger is cleared once raised
    # The masks it was built from — the same tensors, or views taken the same way — are accepted.
    own = GlobalBatch.from_masks(_parts(batch, "loss_mask"))
    loss, _ = loss_fn(part["logprobs"], part["old_logprobs"], part["advantages"], batch["loss_mask"][:2, :5], batch=own)
    assert torch.isfinite(loss)
    # A mask modified in place after the batch was built: its counts are stale.
    batch["loss_mask"][3, 0] = ~batch["loss_mask"][3, 0]
    with pytest.raises(StaleGlobalBatchError, match="modified in place"):
        loss_fn(batch["logprobs"][2:], batch["old_logprobs"][2:], batch["advantages"][2:], batch["loss_mask"][2:],
                batch=own)


def test_step_level_sums_leave_out_nonfinite_inputs() -> None:
    """A NaN / ±inf old or rollout log-prob (entropy) at a valid position is never summed into the weight mean, the
    k3 mean or the entropy quantile (GRPOLoss drops that position; nonfinite.skip_step skips the step)."""
    batch = make_batch(2, LENGTHS, 6)
    valid = batch["loss_mask"]
    old, rollout, ent = batch["old_logprobs"].clone(), batch["rollout_logprobs"].clone(), batch["entropy"].clone()
    rollout[0, 1], old[2, 0], ent[3, 2] = float("nan"), float("inf"), float("nan")
    cfg = load_config(None, ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0",
                             "rollout_correction.normalize_weights=true", "entropy.top_quantile=0.5",
                             "mismatch.skip_threshold=0.5"])
    gb = GlobalBatch.from_rollouts(cfg, [valid], old_logprobs=[old], rollout_logprobs=[rollout], entropies=[ent])
    summed = valid & torch.isfinite(old) & torch.isfinite(rollout)
    d = (old - rollout)[summed]
    torch.testing.assert_close(gb.weight_mean, d.exp().clamp(max=2.0).mean())
    torch.testing.assert_close(gb.mismatch_k3, k3(d).sum() / valid.sum())
    torch.testing.assert_close(gb.entropy_threshold, torch.quantile(ent[valid & torch.isfinite(ent)], 0.5))
    assert gb.valid_tokens.item() == valid.sum().item()


@pytest.mark.parametrize("name", ["old_logprobs", "rollout_logprobs", "ref_logprobs", "advantages",
                                  "token advantages", "entropies"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "+inf", "-inf"])
def test_nonfinite_skip_step(name: str, value: float) -> None:
    """nonfinite.skip_step: a non-finite input given to from_rollouts at a valid position skips the step (the count
    of such positions in ``nonfinite_inputs``); at a masked position it counts nothing."""
    per_token = name == "token advantages"
    batch = make_batch(3, LENGTHS, 6, per_token_advantages=per_token)
    cfg = load_config(None, ["nonfinite.skip_step=true", "kl.coef=0.1", "entropy.top_quantile=0.5"])
    valid = batch["loss_mask"]
    inputs = dict(old_logprobs=batch["old_logprobs"], rollout_logprobs=batch["rollout_logprobs"],
                  ref_logprobs=batch["ref_logprobs"], advantages=batch["advantages"], entropies=batch["entropy"])

    def build(**changed):
        given = {k: [v.clone()] for k, v in {**inputs, **changed}.items()}
        return GlobalBatch.from_rollouts(cfg, [valid], **given)

    clean = build()
    assert clean.skip.item() is False and clean.nonfinite_inputs.item() == 0 and clean.skip_step() is False
    key = "advantages" if per_token else name
    bad = inputs[key].clone()
    if name == "advantages":  # per sequence: every valid token of sequence 0
        bad[0] = value
        expected = LENGTHS[0]
    else:
        bad[0, 1] = value
        expected = 1
    gb = build(**{key: bad})
    assert gb.skip.item() is True and gb.nonfinite_inputs.item() == expected and gb.skip_step() is True
    if name != "advantages":
        masked = inputs[key].clone()
        masked[1, 0] = value  # row 1 has no valid token
        assert build(**{key: masked}).skip.item() is False
    with pytest.raises(StaleGlobalBatchError, match="nonfinite.skip_step"):
        GRPOLoss(cfg)(batch["logprobs"], batch["old_logprobs"], batch["advantages"], valid,
                      rollout_logprobs=batch["rollout_logprobs"], ref_logprobs=batch["ref_logprobs"],
                      entropy=batch["entropy"], batch=GlobalBatch.from_masks([valid]))
