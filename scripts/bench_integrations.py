"""The framework integrations' loss on one GPU, side by side with each framework's own path (bf16 logits).

    python scripts/bench_integrations.py --megatron-lm-src CHECKOUT --out DIR [--batch 4 --seq 2048 --vocab 151936]

One micro-batch of ``[B, S]`` tokens, ``V``-wide bf16 logits (a leaf standing for the model's output), 70 % of
the positions trained on, old / reference / inference log-probs near the current ones. Each path's objective and
d/dlogits against a float64 reference (log_softmax of the float64 logits, then mp_grpo's loss on log-probs):

- **Megatron-LM**: its ``selective_log_softmax`` on the logits (``runtime_gather_output=True``: the whole
  vocabulary; bf16 log_softmax row by row) and ``calculate_grpo_loss`` — both taken from its source — then the
  ``--calculate-per-token-loss`` normalization Σ(loss·mask) / Σ mask; arguments: clip 0.2 / 0.28, β = 0.05,
  entropy weight 0.01, IS correction truncated at 2.
- **mp_grpo megatron_rl**: ``GRPOForwardStep.from_args`` (the same loss) — ``pre_step`` then ``loss_func`` on the
  logits (entropy term SAMPLED_TOKEN: log-prob kernel, then GRPOLoss); and the same with entropy weight 0, where
  ``GRPOLoss.on_logits`` takes the fused path (the loss's backward inside the log-prob backward kernel).
- **NeMo-RL log-prob input** (its TP = 1 path written out: fp32 log_softmax of the logits, gather) + MPGRPOLossFn
  (LOGPROB), against **MPGRPOLossFn (LOGIT)** on the same logits: preset ``nemo_rl_grpo``.

Times: median of CUDA-event-timed forward+backward calls (``scripts/measure.py``); memory: peak beyond the inputs.
Writes ``integrations.json``, ``integrations.md`` and ``integrations.png`` to ``--out``
(``--replot integrations.json`` redraws the plot from a result file, no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mp_grpo.integrations.megatron_rl import GRPOForwardStep, RLMicroBatch  # noqa: E402
from mp_grpo.integrations.nemo_rl import InputType, MPGRPOLossFn  # noqa: E402
from mp_grpo.megatron.groups import ParallelGroups  # noqa: E402
from mp_grpo.megatron.scaling import MegatronScaling  # noqa: E402
from scripts.measure import GiB, extra_peak_bytes, median_ms  # noqa: E402
from tests.integrations.megatron_rl.helpers import megatron_lm_functions  # noqa: E402

ARGS = SimpleNamespace(grpo_clamp_eps_lower=0.2, grpo_clamp_eps_upper=0.28, grpo_kl_beta=0.05,
                       grpo_entropy_term_weight=0.01, rl_inference_logprobs_is_correction=True,
                       rl_importance_sampling_truncation_coef=2.0)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).abs().max() / ref.abs().max())


def plot(result_file: Path) -> Path:
    """Time and extra memory of each path, pairs side by side (framework's own path, then mp_grpo's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(result_file.read_text())
    names, res = list(data["results"]), data["results"]
    colors = ["tab:gray" if not n.startswith("mp_grpo") else "tab:blue" for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "ms", "forward + backward (ms)"), (axes[1], "extra_peak_GiB", "extra peak memory (GiB)")):
        ax.barh(names, [res[n][key] for n in names], color=colors)
        ax.invert_yaxis()
        ax.set_xlabel(label)
    m = data["meta"]
    fig.suptitle(f"Loss from bf16 logits, {m['device']}, B={m['B']} S={m['S']} V={m['V']} (gray: the framework's own path)")
    fig.tight_layout()
    out = result_file.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replot", type=Path, help="redraw the plot of an integrations.json and exit")
    parser.add_argument("--megatron-lm-src", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--smoke", action="store_true", help="CPU, no timing: check the script runs (tiny sizes)")
    opts = parser.parse_args()
    if opts.replot is not None:
        print(plot(opts.replot))
        return
    if opts.megatron_lm_src is None or opts.out is None:
        parser.error("--megatron-lm-src and --out are required (or --replot)")
    fns = megatron_lm_functions(opts.megatron_lm_src / "megatron" / "rl" / "rl_utils.py",
                                ("selective_log_softmax", "calculate_grpo_loss"))
    B, S, V = opts.batch, opts.seq, opts.vocab
    dev = torch.device("cpu" if opts.smoke else "cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(B, S, V, device=dev, generator=gen) * 2).to(torch.bfloat16)
    tokens = torch.randint(0, V, (B, S), device=dev, generator=gen)
    mask = torch.rand(B, S - 1, device=dev, generator=gen) < 0.7
    with torch.no_grad():
        exact = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    noise = lambda scale: torch.randn(B, S - 1, device=dev, generator=gen) * scale  # noqa: E731
    old, ref = exact + noise(0.05), exact + noise(0.3)
    inference = old + noise(0.1)
    adv = torch.randn(B, device=dev, generator=gen)
    mb = RLMicroBatch(tokens, torch.arange(S, device=dev).expand(B, S), adv, mask.float(), old, ref, inference)
    results: dict[str, dict] = {}

    # --- the float64 reference of Megatron-LM's loss ---
    step = GRPOForwardStep.from_args(ARGS, groups=ParallelGroups())
    stored = step.pre_step([mb], step=0)
    x = stored.inputs[0]
    full = logits.double().requires_grad_()
    lp = torch.log_softmax(full, -1).gather(-1, x.target.clamp(min=0)[..., None]).squeeze(-1)
    lp = torch.where(x.target >= 0, lp, torch.zeros((), dtype=torch.float64, device=dev))
    ref_obj, _ = step.loss_on_logprobs(lp, x, stored.batch)
    ref_obj.backward()
    ref_grad = full.grad
    del full, lp
    torch.cuda.empty_cache()

    def record(name, fwd):
        leaf = logits.clone().requires_grad_()

        def fwd_bwd():
            leaf.grad = None
            fwd(leaf).backward()

        value = fwd(leaf)
        value.backward()
        results[name] = {"objective_rel_err": abs(value.item() - ref_obj.item()) / abs(ref_obj.item()),
                         "grad_rel_err": rel_err(leaf.grad, ref_grad),
                         "ms": float("nan") if opts.smoke else median_ms(fwd_bwd),
                         "extra_peak_GiB": float("nan") if opts.smoke else extra_peak_bytes(fwd_bwd) / GiB}
        print(name, json.dumps(results[name]), flush=True)

    # --- Megatron-LM: gathered logits, its log-softmax and loss, per-token normalization ---
    def theirs(z):
        lp = fns["selective_log_softmax"](z[:, :-1, :], tokens[:, 1:])
        loss, *_ = fns["calculate_grpo_loss"](
            current_logprobs=lp, old_logprobs=old, ref_logprobs=ref, advantages=adv, clamp_eps_lower=0.2,
            clamp_eps_upper=0.28, kl_beta=0.05, entropy_weight=0.01, inference_logprobs=inference,
            is_truncation_coef=2.0)
        return (loss * mask).sum() / mask.sum()

    record("megatron_lm", theirs)
    per_token = MegatronScaling(calculate_per_token_loss=True, num_microbatches=1, dp_size=1)
    G = stored.batch.valid_tokens
    record("mp_grpo_megatron_rl", lambda z: step.loss_func(x, stored.batch, per_token, z)[0] / G)

    # --- entropy weight 0: the fused path, against Megatron-LM with the same arguments ---
    no_ent = SimpleNamespace(**{**vars(ARGS), "grpo_entropy_term_weight": 0.0})
    step0 = GRPOForwardStep.from_args(no_ent, groups=ParallelGroups())
    stored0 = step0.pre_step([mb], step=0)
    full = logits.double().requires_grad_()
    lp = torch.log_softmax(full, -1).gather(-1, x.target.clamp(min=0)[..., None]).squeeze(-1)
    lp = torch.where(x.target >= 0, lp, torch.zeros((), dtype=torch.float64, device=dev))
    ref_obj, _ = step0.loss_on_logprobs(lp, stored0.inputs[0], stored0.batch)
    ref_obj.backward()
    ref_grad = full.grad
    del full, lp
    torch.cuda.empty_cache()

    def theirs0(z):
        lp = fns["selective_log_softmax"](z[:, :-1, :], tokens[:, 1:])
        loss, *_ = fns["calculate_grpo_loss"](
            current_logprobs=lp, old_logprobs=old, ref_logprobs=ref, advantages=adv, clamp_eps_lower=0.2,
            clamp_eps_upper=0.28, kl_beta=0.05, entropy_weight=0.0, inference_logprobs=inference,
            is_truncation_coef=2.0)
        return (loss * mask).sum() / mask.sum()

    record("megatron_lm_no_entropy", theirs0)
    record("mp_grpo_megatron_rl_no_entropy_fused",
           lambda z: step0.loss_func(stored0.inputs[0], stored0.batch, per_token, z)[0] / stored0.batch.valid_tokens)

    # --- NeMo-RL: its log-prob input (fp32 log_softmax, gather) vs the logit input, preset nemo_rl_grpo ---
    data = {"input_ids": tokens, "token_mask": torch.cat([torch.zeros(B, 1, device=dev), mask.float()], 1),
            "sample_mask": torch.ones(B, device=dev), "advantages": adv[:, None].expand(B, S).contiguous(),
            "prev_logprobs": torch.cat([old[:, :1], old], 1), "generation_logprobs": torch.cat([inference[:, :1], inference], 1),
            "reference_policy_logprobs": torch.cat([ref[:, :1], ref], 1)}
    seqs, toks = torch.tensor(float(B), device=dev), mask.sum().float()
    nemo_lp = MPGRPOLossFn("nemo_rl_grpo")
    nemo_logit = MPGRPOLossFn("nemo_rl_grpo", input_type=InputType.LOGIT, groups=ParallelGroups())
    full = logits.double().requires_grad_()
    lp = torch.log_softmax(full[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    ref_obj, _ = nemo_lp(data=data, global_valid_seqs=seqs, global_valid_toks=toks, next_token_logprobs=lp)
    ref_obj.backward()
    ref_grad = full.grad
    del full, lp
    torch.cuda.empty_cache()

    def nemo_logprob_input(z):
        lp = torch.log_softmax(z[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return nemo_lp(data=data, global_valid_seqs=seqs, global_valid_toks=toks, next_token_logprobs=lp)[0]

    record("nemo_rl_logprob_input", nemo_logprob_input)
    record("mp_grpo_nemo_rl_logit_input",
           lambda z: nemo_logit(data=data, global_valid_seqs=seqs, global_valid_toks=toks, logits=z)[0])

    meta = {"device": "cpu (smoke)" if opts.smoke else torch.cuda.get_device_name(), "B": B, "S": S, "V": V, "dtype": "bfloat16",
            "torch": torch.__version__}
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "integrations.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [f"# Integrations on one GPU ({meta['device']}, B={B}, S={S}, V={V}, bf16 logits)", "",
             "| path | ms fwd+bwd | extra peak GiB | objective rel. err | grad rel. err |", "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['ms']:.2f} | {r['extra_peak_GiB']:.2f} | {r['objective_rel_err']:.1e} | "
                     f"{r['grad_rel_err']:.1e} |")
    (opts.out / "integrations.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(opts.out / "integrations.json")


if __name__ == "__main__":
    main()
