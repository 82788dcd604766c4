"""Who gets the advantage: the valid and the invalid answers of one collected batch (issue 36).

Collects the first training batch of an experiment (``--set``: its overrides; after its warm start,
if it has one) with the trainer's own collector, scorer and advantage, then recomputes the advantages of the same rows under other
settings: the reward of an unparseable answer (``--invalid-rewards``), ``algorithm.gamma``
(``--gammas``) and the estimator (``--algorithms``). At iteration 0 the sampled answers do not depend
on any of them, so every variant reads the same answers. An invalid row's reward is replaced by the
variant's; this is the env's own rule only where an invalid answer is a no-op paid
``invalid_reward`` (NumberLine, the Gym Cards games).

For each variant: the valid and the invalid rows' mean advantage and how many are positive. With
``--update``, one update of the trainer as configured follows, and each kind of row's mean token
log-prob and entropy before and after it tell which answers the update made likelier.

Prints one JSON object as its last line; ``matches_trainer`` checks the recomputation: the variant
of the run's own settings reproduces the trainer's advantages.

    python benchmarks/advantage_split.py --set experiment=learning_pretrained env.num_groups=2 env.group_size=4 \
        algorithm.lr=5e-5 rollout.temperature=0.7 --invalid-rewards 0 -1 --gammas 0 0.95 --algorithms gigpo grpo --update
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from torchrl_agent.trainers.builders import build_advantage  # noqa: E402
from torchrl_agent.trainers.cli import compose_config  # noqa: E402
from torchrl_agent.trainers.trainer import Trainer  # noqa: E402


def row_advantage(rows, key) -> torch.Tensor:
    """``[N]``: each row's advantage (the first response token's, where it is per token)."""
    adv = rows.get(key)
    return (adv.reshape(adv.shape[0], -1)[:, 0] if adv.dim() > 1 else adv).float()


def split(values: torch.Tensor, valid: torch.Tensor) -> dict:
    """Mean and positive count of ``values`` over the valid and the invalid rows."""
    out = {}
    for name, sel in (("valid", valid), ("invalid", ~valid)):
        v = values[sel]
        out[name] = {"rows": int(sel.sum()), "mean": round(float(v.mean()), 4) if len(v) else None,
                     "positive": int((v > 0).sum())}
    return out


@torch.no_grad()
def token_means(trainer: Trainer, rows, batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N]`` each: every row's mean response-token log-prob and entropy under the current policy."""
    log_prob, entropy = [], []
    for start in range(0, rows.shape[0], batch):
        with trainer.scorer.autocast():
            out = trainer.scorer.actor(rows[list(range(start, min(start + batch, rows.shape[0])))])
        mask = out["mask"].float()
        log_prob.append((out["log_prob"].float() * mask).sum(-1) / mask.sum(-1))
        entropy.append((out["entropy"].float() * mask).sum(-1) / mask.sum(-1))
    return torch.cat(log_prob), torch.cat(entropy)


def variant_advantage(overrides: list[str], rows, valid, invalid_reward, gamma, algorithm, key) -> torch.Tensor:
    """The rows' advantages under the run's config with another estimator, ``gamma`` and invalid reward."""
    cfg = compose_config([*overrides, f"algorithm={algorithm}", f"algorithm.gamma={gamma}"])
    variant = rows.clone()
    if invalid_reward is not None:
        reward = variant["reward"].clone()
        reward[~valid.reshape(reward.shape)] = invalid_reward
        variant["reward"] = reward
    return row_advantage(build_advantage(cfg)(variant), key)


def measure(args, run_dir: str) -> dict:
    """The JSON object of the module docstring, for the parsed ``args``; the run writes into ``run_dir``."""
    overrides = [*args.set, "iterations=1", "eval_every=0"]
    cfg = compose_config([*overrides, f"run_dir={run_dir}"])
    trainer = Trainer(cfg)
    try:
        trainer._start({})  # the run's start as train() makes it: the warm start where the config has one
        t0 = time.perf_counter()
        rows, collected = trainer.collect_rows()
        collect_s = time.perf_counter() - t0
        if rows is None:
            raise RuntimeError(f"every episode of the batch faulted, nothing to split: {collected}")
        key = trainer.loss.tensor_keys.advantage
        valid = rows["action_valid"].reshape(-1).bool()
        own = row_advantage(rows, key)
        result: dict = {"set": args.set, "rows": int(rows.shape[0]), "valid_rows": int(valid.sum()),
                        "success": collected.get("success"), "collect_s": round(collect_s, 1),
                        "valid_rewards": [float(r) for r in rows["reward"].reshape(-1)[valid]],
                        "trainer": split(own, valid)}
        again = variant_advantage(overrides, rows, valid, None, cfg.algorithm.gamma, cfg.algorithm.name, key)
        result["matches_trainer"] = bool(torch.allclose(again, own, atol=1e-5))
        variants = []
        for inv in args.invalid_rewards or [None]:
            for gamma in args.gammas or [cfg.algorithm.gamma]:
                for algorithm in args.algorithms or [cfg.algorithm.name]:
                    adv = variant_advantage(overrides, rows, valid, inv, gamma, algorithm, key)
                    variants.append({"invalid_reward": inv, "gamma": gamma, "algorithm": algorithm, **split(adv, valid)})
        result["variants"] = variants
        if args.update:
            log_prob, entropy = token_means(trainer, rows)
            t0 = time.perf_counter()
            metrics = trainer.update(rows)
            update_s = time.perf_counter() - t0
            log_prob_after, entropy_after = token_means(trainer, rows)
            result["update"] = {
                "update_s": round(update_s, 1),
                **{k: metrics[k] for k in ("approx_kl", "update_kl", "kl_ref", "kl_step_halvings", "update_kl_halvings")
                   if k in metrics},
                "token_log_prob_before": split(log_prob, valid), "token_log_prob_change": split(log_prob_after - log_prob, valid),
                "entropy_before": split(entropy, valid), "entropy_after": split(entropy_after, valid)}
        return result
    finally:
        trainer.close()  # engines and worker processes, the run folder's lock


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", nargs="*", default=[], help="the experiment's overrides (key=value ...)")
    p.add_argument("--invalid-rewards", nargs="*", type=float, default=[],
                   help="rewards of an unparseable answer to compare (none: the collected rewards only)")
    p.add_argument("--gammas", nargs="*", type=float, default=[])
    p.add_argument("--algorithms", nargs="*", default=[])
    p.add_argument("--update", action="store_true", help="then one update, and each kind of row's log-prob before/after")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="advantage_split_") as run_dir:  # the run's folder, removed after
        result = measure(args, run_dir)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
