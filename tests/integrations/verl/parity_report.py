"""The figures of docs/integrations.md ("Measured parity"): every case of cases.py through verl's ``ppo_loss``,
verl's own loss mode against mp_grpo's, one micro-batch and two, as a markdown table.

    python -m tests.integrations.verl.parity_report     (in an environment with verl, e.g. CI's .venv-verl)
"""

from __future__ import annotations

import torch

from tests.integrations.verl.cases import CASES, register_test_configs
from tests.integrations.verl.test_policy_loss import LENGTHS, R, SPLITS, _both


def _diffs(verl_out, ours_out) -> tuple[float, float, bool]:
    (v_loss, _, v_glp, v_gent), (o_loss, _, o_glp, o_gent) = verl_out, ours_out
    rel = (o_loss - v_loss).abs().item() / max(abs(v_loss.item()), 1e-30)
    grad = max((o_glp - v_glp).abs().max().item(), (o_gent - v_gent).abs().max().item())
    return rel, grad, torch.equal(o_glp, v_glp) and torch.equal(o_gent, v_gent)


def main() -> None:
    import verl  # noqa: F401

    register_test_configs()
    print("| verl loss mode (config) | mp_grpo loss mode | rollout_is_weights | loss: max rel. diff | "
          "gradient: max abs. diff | gradient bit-equal |")
    print("|---|---|---|---|---|---|")
    for name, case in CASES.items():
        rows = []
        for seed_shift, splits in ((0, (slice(None),)), (1, SPLITS)):
            batch = __import__("tests.integrations.verl.helpers", fromlist=["x"]).make_verl_batch(
                sum(map(ord, name)) + seed_shift, LENGTHS, R)
            for rows_slice in splits:
                rows.append(_diffs(*_both(case, batch.rows(rows_slice), tokens=int(batch.mask.sum()),
                                          sequences=len(LENGTHS))))
        rel = max(r[0] for r in rows)
        grad = max(r[1] for r in rows)
        exact = all(r[2] for r in rows)
        verl_args = ", ".join(f"{k}={v}" for k, v in {**case.verl, **case.shared}.items())
        print(f"| {verl_args} | `{case.ours}` | {case.weights or '—'} | {rel:.1e} | {grad:.1e} | "
              f"{'yes' if exact else 'no'} |")


if __name__ == "__main__":
    main()
