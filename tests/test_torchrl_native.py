"""The text environments inside TorchRL's own batched environments (SerialEnv, ParallelEnv)."""

from __future__ import annotations

import pytest
from torchrl.envs import ParallelEnv, SerialEnv

from torchrl_agent.envs import make_env


def numberline():
    return make_env("numberline", num_groups=1, group_size=2, max_steps=3)


@pytest.mark.parametrize("batched", [SerialEnv, ParallelEnv])
def test_text_env_runs_in_torchrl_batched_envs(batched):
    env = batched(2, numberline)
    try:
        td = env.reset()  # ParallelEnv used to fail here: KeyError 'action' (no action at reset)
        assert td.batch_size == (2, 2) and [list(a) for a in td["action"]] == [["", ""], ["", ""]]
        td["action"] = [["+", "-"], ["-", "+"]]
        out = env.step(td)
        assert out["next", "step_count"].reshape(-1).tolist() == [1, 1, 1, 1]
        rollout = env.rollout(3)  # random actions from the action spec
        assert rollout.batch_size == (2, 2, 3) and "action" in rollout.keys()
        assert rollout["next", "done"][..., -1, :].all()  # max_steps=3: every episode ends at step 3
    finally:
        env.close()
