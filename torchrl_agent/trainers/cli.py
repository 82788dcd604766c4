"""The ``torchrl-agent`` console script.

``torchrl-agent train [hydra overrides...]`` trains (default experiment: ``quickstart``) and prints,
as its last line, one JSON object summarising the run. ``torchrl-agent eval [overrides...]`` runs a
policy (``eval.checkpoint=``, ``model.path=``, or ``eval.endpoint=`` for an OpenAI-compatible
server) on the environment's evaluation panel and prints its success, overall and per task type. Overrides are Hydra's:
``torchrl-agent train algorithm=gigpo env.num_groups=8 iterations=20``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

__all__ = ["compose_config", "config_dir", "main"]


def config_dir() -> Path:
    """The Hydra config folder: ``$TORCHRL_AGENT_CONFIGS`` or the repository's ``configs/``."""
    path = Path(os.environ.get("TORCHRL_AGENT_CONFIGS", Path(__file__).resolve().parents[2] / "configs"))
    if not (path / "config.yaml").exists():
        raise FileNotFoundError(f"no config.yaml in {path}; set TORCHRL_AGENT_CONFIGS to the configs folder")
    return path


def compose_config(overrides: list[str] | None = None):
    """Compose and validate the run config; returns a :class:`TrainConfig` instance."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from torchrl_agent.trainers.config import TrainConfig

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides or []))
    _check_keys(OmegaConf.to_container(cfg), TrainConfig)
    train_config = OmegaConf.to_object(cfg)
    from torchrl_agent.trainers.validate import validate_config

    validate_config(train_config)
    return train_config


def _reason(err: BaseException) -> str:
    """The error's message followed by its causes' (Hydra's "Error merging override iterations=abc"
    keeps the reason, "could not be converted to Integer", in its cause)."""
    parts, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = " ".join(str(err).split())
        if text and text not in parts and "$VALUE" not in text:  # omegaconf's unformatted copy
            parts.append(text)
        err = err.__cause__ or err.__context__
    return ": ".join(parts)


def _check_keys(node: dict, schema, prefix: str = "") -> None:
    """Reject keys that the typed schema does not have (``+key=...`` overrides get past Hydra's check)."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in node.items():
        if key not in fields:
            raise KeyError(f"unknown config key '{prefix}{key}'; {schema.__name__} has: {', '.join(fields)}")
        sub = fields[key].default_factory if fields[key].default_factory is not dataclasses.MISSING else None
        if isinstance(value, dict) and dataclasses.is_dataclass(sub):
            _check_keys(value, sub, f"{prefix}{key}.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrl-agent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["train", "eval", "config"],
                        help="train: run training; eval: run a policy on the evaluation panel; config: print the config")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. algorithm=gigpo iterations=10")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        cfg = compose_config(args.overrides)
    except Exception as err:  # hydra/omegaconf errors name the bad key
        print(f"torchrl-agent: invalid config: {_reason(err)}", file=sys.stderr)
        return 2
    if args.command == "config":
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        return 0
    if args.command == "eval":
        from torchrl_agent.trainers.evaluate import evaluate_policy

        try:
            result = evaluate_policy(cfg)
        except (ValueError, KeyError, FileNotFoundError) as err:
            print(f"torchrl-agent: invalid config: {err}", file=sys.stderr)
            return 2
        print(json.dumps(result), flush=True)
        if result.get("interrupted"):
            return 130
        return 1 if result.get("failed_episodes") and result["failed_episodes"] >= result["episodes"] else 0
    from torchrl_agent.trainers.run_dir import RunInterrupted
    from torchrl_agent.trainers.trainer import Trainer

    try:
        trainer = Trainer(cfg)
    except (ValueError, KeyError, FileNotFoundError) as err:
        print(f"torchrl-agent: invalid config: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("torchrl-agent: interrupted while starting; nothing was trained", file=sys.stderr)
        return 130
    from torchrl_agent.trainers.trainer import CheckpointError, TrainingDivergedError

    try:
        summary = trainer.train()
    except RunInterrupted as err:  # SIGINT / SIGTERM: stopped at the end of an iteration, with a checkpoint
        print(f"torchrl-agent: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once
        print(f"torchrl-agent: interrupted; continue from the last checkpoint with resume=auto "
              f"run_dir={trainer.run_dir}", file=sys.stderr)
        return 130
    except (CheckpointError, TrainingDivergedError) as err:  # metrics.jsonl is complete, checkpoints finite
        print(f"torchrl-agent: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a full disk, a lost mount: what was written is intact
        print(f"torchrl-agent: the run stopped ({err}); fix it (free space), then continue with resume=auto "
              f"run_dir={trainer.run_dir}", file=sys.stderr)
        return 1
    if summary:  # ranks > 0 under torchrun return {}
        print(json.dumps(summary), flush=True)
    if summary.get("checkpoint_error"):  # trained and evaluated, but the final checkpoint is not on disk
        print(f"torchrl-agent: {summary['checkpoint_error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
