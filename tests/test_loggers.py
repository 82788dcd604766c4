"""A run's metrics (``trainers/loggers.py``): strict JSON lines, non-finite values written as null
and counted."""

from __future__ import annotations

import json
import logging


def test_non_finite_metrics_are_written_as_null_and_counted(tmp_path, caplog):
    from torch.utils.tensorboard import SummaryWriter

    from torchrl_agent.trainers.loggers import MetricsLog

    log = MetricsLog(None, tmp_path)
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as log.file, caplog.at_level(logging.WARNING):
        log.writer = SummaryWriter(str(tmp_path / "tb"))
        log.log({"iteration": 0, "loss": float("nan"), "grad_norm": float("inf"), "success": 0.5})
        log.writer.close()

    def strict(constant):
        raise ValueError(f"non-strict JSON constant {constant}")

    record = json.loads(path.read_text(), parse_constant=strict)
    assert record == {"iteration": 0, "loss": None, "grad_norm": None, "success": 0.5, "nonfinite_metrics": 2}
    assert log.nonfinite_metrics == 2 and "grad_norm" in caplog.text
