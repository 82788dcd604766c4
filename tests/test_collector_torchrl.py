"""StepCollector as a TorchRL collector: the standard loop with a ReplayBuffer and a postproc,
an iterator that ends, set_seed, shutdown, update_policy_weights_ through weight-sync schemes."""

from __future__ import annotations

import pytest
import torch
from torchrl.collectors import BaseCollector
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.weight_update import NoWeightSyncScheme

from tests.test_collector import ExpertOrJunk, expert_text, make
from torchrl_agent.collectors import EngineReloadScheme, StepCollector
from torchrl_agent.modules import TransformersPolicy
from torchrl_agent.objectives import GiGPOAdvantage


def junk_or_expert(prompt):
    return expert_text(prompt) if "Position: 0" not in prompt else "junk"


def test_is_a_torchrl_collector_and_the_standard_loop_ends(tokenizer):
    rb = ReplayBuffer(storage=LazyStackStorage(10_000), batch_size=8)
    collector = StepCollector(make(tokenizer, 2, 2, max_steps=5), ExpertOrJunk(tokenizer, junk_or_expert), seed=1,
                              total_frames=20, replay_buffer=rb, postproc=GiGPOAdvantage())
    assert isinstance(collector, BaseCollector)
    yielded = [batch for batch in collector]  # the standard loop: ends on its own
    assert all(batch is None for batch in yielded)  # a replay buffer is filled, nothing yielded
    frames = collector.stats()["frames"]
    assert frames >= 20 and len(rb) == frames  # stops at the end of the batch reaching total_frames
    assert len(yielded) == collector.stats()["batches"] == collector.batches
    sample = rb.sample()
    assert "advantage" in sample.keys() and sample["advantage"].shape[0] == 8  # the postproc ran
    assert collector.stats["env_steps"] > 0  # the last batch's figures, as the project's Trainer reads them
    collector.shutdown()


def test_iterator_without_buffer_yields_batches_and_set_seed_replays(tokenizer):
    def run(collector):
        return [[str(a) for a in rows["action"]] for rows in collector]

    env = make(tokenizer, 1, 3, max_steps=4)
    collector = StepCollector(env, ExpertOrJunk(tokenizer, junk_or_expert), seed=3, total_batches=2)
    first = run(collector)
    assert len(first) == 2 == len(collector)
    assert collector.set_seed(3) == 3
    assert run(collector) == first  # the same episodes again
    other = StepCollector(make(tokenizer, 1, 3, max_steps=4), ExpertOrJunk(tokenizer, junk_or_expert), seed=3,
                          total_batches=2)
    assert run(other) == first
    collector.shutdown()
    assert env.is_closed


class RecordingPolicy(ExpertOrJunk):
    """A scripted engine holding its own weights: records what update_weights receives."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, expert_text)
        self.received = []

    def update_weights(self, state_dict):
        self.received.append(state_dict)


def test_update_policy_weights_goes_through_the_weight_sync_scheme(tiny_model, tokenizer):
    engine = RecordingPolicy(tokenizer)
    collector = StepCollector(make(tokenizer, 1, 1), engine, seed=0)
    assert isinstance(collector._weight_sync_schemes["policy"], EngineReloadScheme)
    collector.update_policy_weights_(tiny_model)  # a module, a state dict or a TensorDict
    collector.update_policy_weights_(tiny_model.state_dict())
    from tensordict import TensorDict

    collector.update_policy_weights_(TensorDict.from_module(tiny_model))
    assert len(engine.received) == 3
    names = set(tiny_model.state_dict())
    for received in engine.received:
        assert names <= set(received)  # TensorDict.from_module adds non-persistent buffers (rotary)
        assert torch.equal(received["lm_head.weight"], tiny_model.state_dict()["lm_head.weight"])
    with pytest.raises(ValueError, match="trained weights"):
        collector.update_policy_weights_()
    # the transformers engine shares the trainer's model: TorchRL's no-op scheme
    shared = StepCollector(make(tokenizer, 1, 1), TransformersPolicy(tiny_model, tokenizer, max_new_tokens=4))
    assert isinstance(shared._weight_sync_schemes["policy"], NoWeightSyncScheme)
    shared.update_policy_weights_(tiny_model.state_dict())


def test_shards_replay_the_single_process_episodes_and_ids(tokenizer):
    """The layout the multi-process collector gives its shards: groups 0-1 and 2 of 3, two batches."""
    from torchrl_agent.collectors.step_collector import ShardLayout

    def rows_of(collector, batches=2):
        out = []
        for _ in range(batches):
            for row in collector.collect().unbind(0):
                out.append((int(row["group_id"]), int(row["traj_id"]), int(row["step_count"]), row["observation"],
                            row["action"]))
        return sorted(out)

    policy = ExpertOrJunk(tokenizer, junk_or_expert)
    single = rows_of(StepCollector(make(tokenizer, 3, 2, max_steps=5), policy, seed=4))
    shards = []
    for offset, groups in ((0, 2), (2, 1)):
        collector = StepCollector(make(tokenizer, groups, 2, max_steps=5), policy, seed=4)
        collector.layout = ShardLayout(3, 6, offset, offset * 2)
        shards += rows_of(collector)
    assert sorted(shards) == single
    assert len({r[3] for r in single if r[2] == 0}) > 1  # the groups really start from different games


def test_torchrl_grpo_trainer_drives_the_collector(tokenizer):
    """TorchRL's own GRPOTrainer loop: it iterates the collector, samples the replay buffer the
    collector fills (advantages from the postproc) and steps the optimiser."""
    from tensordict import TensorDict
    from torchrl.trainers.algorithms.grpo import GRPOTrainer

    rb = ReplayBuffer(storage=LazyStackStorage(1000), batch_size=4)
    collector = StepCollector(make(tokenizer, 1, 2, max_steps=3), ExpertOrJunk(tokenizer, junk_or_expert), seed=0,
                              total_frames=6, replay_buffer=rb, postproc=GiGPOAdvantage())
    weight = torch.nn.Parameter(torch.zeros(()))

    class Loss(torch.nn.Module):  # reads the sampled rows' advantages; pulls the weight towards 1
        def forward(self, td):
            return TensorDict({"loss_objective": (weight - 1) ** 2 + 0 * td["advantage"].float().sum()})

    trainer = GRPOTrainer(collector=collector, total_frames=6, loss_module=Loss(), replay_buffer=rb,
                          optimizer=torch.optim.SGD([weight], lr=0.1), optim_steps_per_batch=1,
                          weight_sync_sender=None, progress_bar=False, log_rewards=False)
    trainer.train()
    assert collector.stats()["frames"] >= 6 and len(rb) == collector.stats()["frames"]
    assert 0 < float(weight) < 1  # the optimiser stepped on the sampled rows
