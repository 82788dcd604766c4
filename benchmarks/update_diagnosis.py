"""Which optimizer step of an update moves the policy, and which tokens it moves (issue: learning
without cliffs).

Runs the quick start (or any experiment, ``--set``) on ``--seeds`` and records every optimizer step
of every update: its epoch and mini-batch, the gradient norm before clipping, how far AdamW moved the
weights (the root-mean-square step over the learning rate: 1 means every weight moved by a full
``lr``), the KL from the sampling policy to the current one on the mini-batch's response tokens before
and after the step (``approx_kl``, k3; of whole responses, their mean log-ratio: ``response_kl``, k1),
the step's own KL (before -> after the step), that KL per kind of token (the answer format's tags, the
action, the end of sequence), the distribution of the ratio ``pi / pi_old`` after the step and the
share of rows with a non-zero advantage. Training itself is
:class:`~torchrl_agent.trainers.Trainer`'s, unchanged (this subclass only measures).

Writes ``--out/seed<k>.json`` (the run's metrics per iteration and every step) and prints one JSON
object as its last line: per seed, the final held-out success, the lowest ``action_valid`` after the
warm start, the largest per-step KL and where it happened, and the run's worst step in full.

    python benchmarks/update_diagnosis.py --seeds 5150 7021 [--set algorithm.max_kl=null] [--jobs 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from torchrl_agent.envs.workers import die_with_parent  # noqa: E402
from torchrl_agent.objectives.clip_loss import kl_estimate  # noqa: E402
from torchrl_agent.trainers.cli import compose_config  # noqa: E402
from torchrl_agent.trainers.trainer import Trainer  # noqa: E402
from torchrl_agent.trainers.update import Updater  # noqa: E402

FORMAT_MARKS = ("<", ">", "think", "action")


def token_kinds(tokenizer, token_ids: torch.Tensor) -> list[str]:
    """``format`` (a piece of the ``<think>``/``<action>`` tags), ``eos`` or ``action``, per token."""
    kinds = []
    for t in token_ids.tolist():
        text = tokenizer.decode([t])
        if t == tokenizer.eos_token_id or t == tokenizer.pad_token_id:
            kinds.append("eos")
        elif any(m in text for m in FORMAT_MARKS):
            kinds.append("format")
        else:
            kinds.append("action")
    return kinds


class DiagnosedUpdater(Updater):
    """The trainer's :class:`Updater` (its optimizer too) measuring each optimizer step (module docstring)."""

    def __init__(self, updater: Updater, tokenizer):
        super().__init__(updater.cfg, updater.model, updater.loss, updater.scorer)
        self.optimizer, self.tokenizer = updater.optimizer, tokenizer  # the optimizer the checkpoints save
        self.steps: list[dict] = []
        self._micro: list[tuple] = []
        self._step_in_update = 0
        loss_inputs = self.scorer.loss_inputs

        def captured(rows, idx, active=True):
            batch = loss_inputs(rows, idx, active)
            if torch.is_grad_enabled():  # the training forward of a mini-batch (not the KL budget's check)
                self._micro.append((rows, list(idx), active, batch["log_prob"].detach(),
                                    batch["mask"], batch["old_log_prob"], batch["advantage"]))
            return batch

        self.scorer.loss_inputs = captured

    def update(self, rows, iteration):
        self._step_in_update = 0
        self._steps_per_epoch = -(-rows.batch_size[0] // self.cfg.algorithm.minibatch_size)
        return super().update(rows, iteration)

    def optimizer_step(self, iteration):
        params = self.trained_parameters()
        before = [p.detach().clone() for p in params]
        grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        norm, skipped = super().optimizer_step(iteration)
        micro, self._micro = self._micro, []
        if skipped:
            return norm, skipped
        lr = self.optimizer.param_groups[0]["lr"]
        delta = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(params, before)])
        record = {"iteration": iteration, "step": self._step_in_update,
                  "epoch": self._step_in_update // self._steps_per_epoch,
                  "minibatch": self._step_in_update % self._steps_per_epoch,
                  "grad_norm": grad_norm, "update_rms_over_lr": float(delta.square().mean().sqrt() / lr),
                  "update_max_over_lr": float(delta.abs().max() / lr)}
        pre, post, old_lp, kinds, adv, rows_kl = [], [], [], [], [], []
        with torch.no_grad():
            for rows, idx, *_, log_prob, mask, old_log_prob, advantage in micro:
                with self.scorer.autocast():
                    after = self.scorer.actor(rows[idx])["log_prob"]
                tokens = rows[idx].get(("tokens", "response"), as_padded_tensor=True)
                for r in range(len(idx)):
                    m = mask[r]
                    pre.append(log_prob[r][m].float())
                    post.append(after[r][: m.shape[0]][m].float())
                    old_lp.append(old_log_prob[r][m].float())
                    rows_kl.append((float((old_lp[-1] - pre[-1]).sum()), float((old_lp[-1] - post[-1]).sum())))
                    kinds += token_kinds(self.tokenizer, tokens[r][: int(m.sum())])
                    adv.append(float(advantage[r].abs().max()))
        pre, post, old_lp = torch.cat(pre), torch.cat(post), torch.cat(old_lp)
        record.update(
            tokens=len(kinds), rows=len(adv), rows_nonzero_advantage=sum(a > 0 for a in adv) / max(1, len(adv)),
            approx_kl_before=float(kl_estimate(old_lp, pre).mean()),
            approx_kl_after=float(kl_estimate(old_lp, post).mean()),
            step_kl=float(kl_estimate(pre, post).mean()),
            response_kl_before=sum(b for b, _ in rows_kl) / max(1, len(rows_kl)),  # per response, k1 (the trainer's)
            response_kl_after=sum(a for _, a in rows_kl) / max(1, len(rows_kl)))
        ratio = (post - old_lp).exp()
        q = torch.quantile(ratio, torch.tensor([0.01, 0.5, 0.99]))
        record.update(ratio_p01=float(q[0]), ratio_p50=float(q[1]), ratio_p99=float(q[2]),
                      ratio_max=float(ratio.max()), ratio_min=float(ratio.min()))
        step_kl = kl_estimate(pre, post)
        for kind in ("format", "action", "eos"):
            sel = torch.tensor([k == kind for k in kinds])
            record[f"step_kl_{kind}"] = float(step_kl[sel].mean()) if sel.any() else None
            record[f"p_after_{kind}"] = float(post[sel].exp().mean()) if sel.any() else None
        self.steps.append(record)
        self._step_in_update += 1
        return norm, skipped


class DiagnosedTrainer(Trainer):
    """:class:`Trainer` whose update is a :class:`DiagnosedUpdater`; ``steps``: its measurements."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.updater = DiagnosedUpdater(self.updater, self.tokenizer)
        self.steps = self.updater.steps


def run_seed(seed: int, args) -> dict:
    torch.set_num_threads(1)
    run_dir = os.path.join(args.out, f"seed{seed}")
    cfg = compose_config([f"seed={seed}", "progress=false", f"run_dir={run_dir}", *args.set])
    t0 = time.perf_counter()
    trainer = DiagnosedTrainer(cfg)
    summary = trainer.train()
    history = [{k: h.get(k) for k in ("iteration", "success", "action_valid", "approx_kl", "approx_kl_max",
                                      "response_kl_max", "kl_step_halvings", "kl_steps_undone", "update_steps", "eval_success")}
               for h in trainer.history]
    worst = max(trainer.steps, key=lambda s: s["step_kl"], default=None)
    valid = [h["action_valid"] for h in history if h["action_valid"] is not None and h["iteration"] > 0]
    out = {"seed": seed, "final": summary.get("eval_success_last"), "eval_curve": summary.get("eval_curve"),
           "min_action_valid": min(valid, default=None),
           "approx_kl_max": max((h["approx_kl_max"] or 0.0 for h in history), default=None),
           "wall_s": round(time.perf_counter() - t0, 1), "worst_step": worst, "history": history,
           "steps": trainer.steps}
    with open(os.path.join(args.out, f"seed{seed}.json"), "w") as f:
        json.dump(out, f)
    print(f"seed {seed}: final {out['final']}, min action_valid {out['min_action_valid']}, "
          f"approx_kl_max {out['approx_kl_max']}, {out['wall_s']} s", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", nargs="+", type=int, required=True)
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every run")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="runs/update_diagnosis")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context, initializer=die_with_parent,
                                                initargs=(os.getpid(),)) as pool:
        runs = list(pool.map(run_seed, args.seeds, [args] * len(args.seeds)))
    print(json.dumps({"benchmark": "update_diagnosis", "overrides": args.set, "runs": [
        {k: r[k] for k in ("seed", "final", "min_action_valid", "approx_kl_max", "wall_s", "worst_step")}
        for r in runs]}))


if __name__ == "__main__":
    main()
