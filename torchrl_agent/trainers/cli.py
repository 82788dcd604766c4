"""The ``torchrl-agent`` console script.

``torchrl-agent train [hydra overrides...]`` trains (default experiment: ``quickstart``) and prints,
as its last line, one JSON object summarising the run. It is a Hydra application: ``-m`` sweeps
(``torchrl-agent train -m seed=0,1 algorithm=grpo,gigpo``) run one run per combination, each in
``<hydra.sweep.dir>/<job number>``, on Hydra's launchers (joblib, submitit), and print the sweep's
summary last. ``torchrl-agent eval [overrides...]`` runs a
policy (``eval.checkpoint=``, ``model.path=``, or ``eval.endpoint=`` for an OpenAI-compatible
server) on the environment's evaluation panel and prints its success, overall and per task type. Overrides are Hydra's:
``torchrl-agent train algorithm=gigpo env.num_groups=8 iterations=20``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

__all__ = ["SweepSummary", "compose_config", "config_dir", "main"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: a sweep's job writes its record (overrides, exit code, summary) here, in its Hydra job folder
SWEEP_RECORD = "job.json"
logger = logging.getLogger(__name__)
SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def config_dir() -> Path:
    """The Hydra config folder: ``$TORCHRL_AGENT_CONFIGS`` when set, else the configs shipped inside
    the package (``torchrl_agent/configs``). A folder of your own composes on top of it through
    Hydra's search path: ``hydra.searchpath=[file:///path/to/my_configs]``."""
    path = Path(os.environ.get("TORCHRL_AGENT_CONFIGS") or SHIPPED_CONFIGS)
    if not (path / "config.yaml").exists():
        raise FileNotFoundError(f"no config.yaml in {path}; set TORCHRL_AGENT_CONFIGS to the configs folder")
    return path


def _register_schema() -> None:
    """Store :class:`TrainConfig` as ``train_schema`` in Hydra's ConfigStore, once per process
    (storing it again warns in Hydra 1.4 and raises in 1.5)."""
    from hydra.core.config_store import ConfigStore

    from torchrl_agent.trainers.config import TrainConfig

    store = ConfigStore.instance()
    if "train_schema.yaml" not in store.list("/"):
        store.store(name="train_schema", node=TrainConfig)


def compose_config(overrides: list[str] | None = None):
    """Compose and validate the run config; returns a :class:`TrainConfig` instance."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from torchrl_agent.trainers.config import TrainConfig

    _register_schema()
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
    keeps the reason, "could not be converted to Integer", in its cause), with the credentials of
    any URL in it replaced by ``***`` (a parse error quotes the override, an endpoint's key with it)."""
    from torchrl_agent.modules.http_policy import redact_credentials

    parts, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = " ".join(str(err).split())
        if text and text not in parts and "$VALUE" not in text:  # omegaconf's unformatted copy
            parts.append(text)
        err = err.__cause__ or err.__context__
    return redact_credentials(": ".join(parts))


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


USAGE = """usage: torchrl-agent {train,eval,config} [overrides ...]

  train [-m] [overrides ...]   train (default experiment: quickstart); a Hydra application: -m runs a
                               sweep (seed=0,1 algorithm=grpo,gigpo), one run directory per job;
                               --cfg job, --info and --help are Hydra's
  eval [overrides ...]         run a policy on the evaluation panel
  config [overrides ...]       print the composed config
"""

#: the outcome of the last ``train`` in this process: its exit code, a run's exception to re-raise
_OUTCOME: dict = {}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ + "\n" + USAGE)
        return 0 if argv else 2
    command, overrides = argv[0], argv[1:]
    if command not in ("train", "eval", "config"):
        print(f"torchrl-agent: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if command == "train":
        return _train(overrides)
    try:
        cfg = compose_config(overrides)
    except Exception as err:  # hydra/omegaconf errors name the bad key
        print(f"torchrl-agent: invalid config: {_reason(err)}", file=sys.stderr)
        return 2
    if command == "config":
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        return 0
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


def _train(args: list[str]) -> int:
    """``torchrl-agent train``: Hydra's application (``-m``, launchers, sweepers, ``--cfg``), after
    checking the config of every run it will start (a broken one exits 2, naming the key, before any
    run starts)."""
    import hydra
    from hydra._internal.utils import get_args_parser

    parsed = get_args_parser().parse_args(args)
    if not (parsed.help or parsed.hydra_help or parsed.cfg or parsed.info or parsed.shell_completion):
        try:
            for job in _jobs(parsed.overrides, parsed.multirun):
                compose_config(job)
        except Exception as err:
            print(f"torchrl-agent: invalid config: {_reason(err)}", file=sys.stderr)
            return 2
    _register_schema()
    _OUTCOME.clear()
    app = hydra.main(config_path=str(config_dir()), config_name="config", version_base=None)(_train_job)
    argv = sys.argv
    sys.argv = [argv[0] if argv else "torchrl-agent", *args]
    try:
        app()
    except SystemExit as err:  # Hydra's own errors (printed) and --help
        return err.code if isinstance(err.code, int) else 1
    finally:
        sys.argv = argv
    if "error" in _OUTCOME:  # a single run raised: as before Hydra, the exception leaves main()
        raise _OUTCOME["error"]
    return _OUTCOME.get("code", 0)


def _jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The overrides of every run: one list, or one per combination of a sweep (``seed=0,1``).
    In a sweep, a job without its own ``run_dir`` is checked with a stand-in (Hydra names its folder)."""
    if not multirun:
        return [list(overrides)]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    try:
        (jobs,) = BasicSweeper.split_arguments(parsed, None)
    except HydraException:  # a sweep only another sweeper understands (interval(...)): checked per job
        return []
    dirs = [next((o.split("=", 1)[1] for o in job if o.startswith("run_dir=")), None) for job in jobs]
    named = [d for d in dirs if d is not None]
    if len(named) != len(set(named)):
        raise ValueError("run_dir: several runs of the sweep would share one run_dir; a sweep's runs get "
                         "<hydra.sweep.dir>/<job number>: set hydra.sweep.dir= instead")
    return [job if d is not None else [*job, f"run_dir=sweep/{i}"] for i, (job, d) in enumerate(zip(jobs, dirs))]


def _train_job(cfg) -> int:
    """One run (a Hydra job): train, print the summary as the last line, write ``config.yaml`` and
    ``summary.json`` into the run directory. In a sweep (``-m``) the run directory is the job's
    folder, ``<hydra.sweep.dir>/<job number>``, unless the job sets ``run_dir``; an error fails
    only that job (its ``summary.json`` holds it)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from torchrl_agent.trainers.config import TrainConfig

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)  # a launcher's worker process
    hydra_cfg = HydraConfig.get()
    sweep = hydra_cfg.mode == RunMode.MULTIRUN
    overrides = list(hydra_cfg.overrides.task)
    record: dict = {"job": hydra_cfg.job.num if sweep else 0, "overrides": overrides}
    try:
        _check_keys(OmegaConf.to_container(cfg), TrainConfig)
        train_config = OmegaConf.to_object(cfg)
        if sweep and not any(o.startswith("run_dir=") for o in overrides):
            train_config.run_dir = hydra_cfg.runtime.output_dir
        from torchrl_agent.trainers.validate import validate_config

        validate_config(train_config)
        code, summary = _train_run(train_config)
        record.update(exit_code=code, **summary)
    except Exception as err:
        if not sweep:
            _OUTCOME["error"] = err
            return 1
        logger.exception("job %d (%s) failed", hydra_cfg.job.num, " ".join(overrides))
        code = 1
        record.update(exit_code=code, error=f"{type(err).__name__}: {err}")
    if sweep:
        out = Path(hydra_cfg.runtime.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / SWEEP_RECORD).write_text(json.dumps(record) + "\n")
    _OUTCOME["code"] = code
    return code



def _train_run(cfg) -> tuple[int, dict]:
    """Train one config: (exit code, summary). 2: invalid config, 1: training stopped (diverged, a
    checkpoint that cannot be written, a full disk), 130/143/129: stopped by SIGINT/SIGTERM/SIGHUP with a
    checkpoint (continue with ``resume=auto``), 0: done."""
    from omegaconf import OmegaConf

    from torchrl_agent.envs.data_files import DataFileError
    from torchrl_agent.trainers.run_dir import RunInterrupted
    from torchrl_agent.trainers.trainer import CheckpointError, Trainer, TrainingDivergedError

    try:
        trainer = Trainer(cfg)
    except (ValueError, KeyError, FileNotFoundError) as err:
        print(f"torchrl-agent: invalid config: {err}", file=sys.stderr)
        return 2, {"error": f"invalid config: {err}"}
    except KeyboardInterrupt:
        print("torchrl-agent: interrupted while starting; nothing was trained", file=sys.stderr)
        return 130, {"error": "interrupted while starting"}
    if int(os.environ.get("RANK", "0")) == 0:
        OmegaConf.save(OmegaConf.structured(cfg), trainer.run_dir / "config.yaml")
    resume = f"continue with resume=auto run_dir={trainer.run_dir}"
    try:
        summary = trainer.train()
    except RunInterrupted as err:  # SIGINT / SIGTERM / SIGHUP: stopped at the end of an iteration, with a checkpoint
        print(f"torchrl-agent: {err}", file=sys.stderr)
        return err.exit_code, {"run_dir": str(trainer.run_dir), "error": str(err)}
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once
        print(f"torchrl-agent: interrupted; {resume} (from the last checkpoint)", file=sys.stderr)
        return 130, {"run_dir": str(trainer.run_dir), "error": "interrupted"}
    except (CheckpointError, TrainingDivergedError) as err:  # metrics.jsonl is complete, checkpoints finite
        print(f"torchrl-agent: {err}", file=sys.stderr)
        return 1, {"run_dir": str(trainer.run_dir), "error": str(err)}
    except DataFileError as err:  # a bad evaluation data file, read when the first evaluation builds its env
        print(f"torchrl-agent: invalid config: {err}", file=sys.stderr)
        return 2, {"run_dir": str(trainer.run_dir), "error": f"invalid config: {err}"}
    except FileNotFoundError as err:  # a data file read at the first evaluation (the eval split): not a disk fault
        print(f"torchrl-agent: invalid config: {err}", file=sys.stderr)
        return 2, {"run_dir": str(trainer.run_dir), "error": f"invalid config: {err}"}
    except OSError as err:  # a full disk, a lost mount: what was written is intact
        print(f"torchrl-agent: the run stopped ({err}); fix it (free space), then {resume}", file=sys.stderr)
        return 1, {"run_dir": str(trainer.run_dir), "error": str(err)}
    if summary:  # ranks > 0 under torchrun return {}
        (trainer.run_dir / "summary.json").write_text(json.dumps(summary) + "\n")
        print(json.dumps(summary), flush=True)
    if summary.get("checkpoint_error"):  # trained and evaluated, but the final checkpoint is not on disk
        print(f"torchrl-agent: {summary['checkpoint_error']}", file=sys.stderr)
        return 1, summary
    return 0, summary


class SweepSummary(Callback):
    """Hydra callback (``hydra.callbacks`` in ``config.yaml``): at the end of a sweep, gathers every
    job's record (``<job folder>/job.json``: its overrides, exit code and run summary) into
    ``<hydra.sweep.dir>/sweep_summary.json`` and prints it as one JSON line, the last one."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        runs = sorted((json.loads(p.read_text()) for p in sweep_dir.rglob(SWEEP_RECORD)), key=lambda r: r["job"])
        failed = [r["job"] for r in runs if r.get("exit_code") != 0]
        summary = {"sweep_dir": str(sweep_dir), "jobs": len(runs), "failed": failed, "runs": runs}
        (sweep_dir / "sweep_summary.json").write_text(json.dumps(summary) + "\n")
        for r in runs:
            logger.info("job %d %s: %s", r["job"], " ".join(r["overrides"]),
                        r.get("error") or {k: r.get(k) for k in ("eval_success_last", "run_dir")})
        print(json.dumps(summary), flush=True)
        _OUTCOME["code"] = 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
