"""scripts/bench_loss.py's trust-region rows on the CPU (the GPU run is the lead's): each new config's inputs (the
top-K CSR included) run through eager and fused (the Triton interpreter) and pass the script's own check against eager
before timing, on a small step; ``--configs`` refuses an unknown name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import bench_loss  # noqa: E402

TRUST_REGION_CONFIGS = [name for name in bench_loss.CONFIGS if "trust region" in name]


@pytest.mark.parametrize("name", TRUST_REGION_CONFIGS)
def test_trust_region_rows_pass_the_check_against_eager(name: str) -> None:
    from mp_grpo.loss import GlobalBatch

    cfg = bench_loss.CONFIGS[name]
    layout = "packed" if "KL" in name else "padded"
    x = bench_loss.make_inputs(layout, device="cpu", n_tokens=64 * 2)
    batch = GlobalBatch.from_rollouts(cfg, [x.mask], old_logprobs=[x.old], rollout_logprobs=[x.rollout],
                                      entropies=[x.entropy], layouts=[x.layout])
    assert bench_loss.check_against_eager(cfg, x, batch, bench_loss.make_loss(cfg, "fused")) <= bench_loss.MAX_REL_DIFF


def test_unknown_config_is_refused(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_loss.py", "--configs", "no such config"])
    with pytest.raises(SystemExit) as exit_:
        bench_loss.main()
    assert exit_.value.code == 2 and "--configs: unknown ['no such config']" in capsys.readouterr().err
