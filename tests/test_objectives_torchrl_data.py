"""The objectives on TorchRL's own LLM data layouts, configured with ``set_keys`` only.

TorchRL's LLM wrappers store per-token entries as ragged lazy stacks (``("log_probs", "response")``,
one tensor of its own length per row) and per-step scalars as ``("next", "reward")`` ``[B, 1, 1]``.
Each test compares against the dense path (padded ``[N, T]`` tensors, ``[N, 1]`` rows, a mask)
computed by hand on the same numbers.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from torchrl_agent.objectives import ClipPolicyLoss, GiGPOAdvantage, GRPOAdvantage

LENGTHS = [3, 5, 2, 4, 1, 5]
GROUP = [0, 0, 0, 1, 1, 1]
REWARD = [1.0, 0.0, 0.5, 0.0, 0.0, 1.0]
ANCHOR = [7, 8, 7, 9, 9, 9]


def _rows(lengths, old, cur, ref, adv=None):
    """A lazy stack of rows shaped like TorchRL's LLM data (ragged ``("log_probs", ...)``)."""
    rows = []
    for i in range(len(lengths)):
        row = {"log_probs": {"response": old[i]}, "cur": cur[i], "ref": {"response": ref[i]},
               "next": {"reward": torch.tensor([[REWARD[i]]])}, "group": torch.tensor(GROUP[i]),
               "traj": torch.tensor(i), "step": torch.tensor([0]), "anchor_hash": torch.tensor(ANCHOR[i])}
        if adv is not None:
            row["adv"] = adv[i].reshape(1, 1)
        rows.append(TensorDict(row, batch_size=[]))
    return lazy_stack(rows)


def _pad(xs, width):
    return torch.stack([torch.nn.functional.pad(x.detach(), (0, width - x.shape[0])) for x in xs])


def _dense_rows():
    n = len(LENGTHS)
    return TensorDict(reward=torch.tensor(REWARD)[:, None], group_id=torch.tensor(GROUP), traj_id=torch.arange(n),
                      step_count=torch.zeros(n, 1, dtype=torch.long), anchor=torch.tensor(ANCHOR), batch_size=[n])


def _set_row_keys(module):
    module.set_keys(reward=("next", "reward"), group_id="group", traj_id="traj", step_count="step",
                    anchor="anchor_hash", advantage="adv")
    return module


@pytest.mark.parametrize("cls", [GRPOAdvantage, GiGPOAdvantage])
def test_advantage_reads_next_reward_b11(cls):
    g = torch.Generator().manual_seed(0)
    lp = [torch.randn(n, generator=g) for n in LENGTHS]
    td = _rows(LENGTHS, lp, lp, lp)
    assert td.get(("next", "reward")).shape == (len(LENGTHS), 1, 1)
    out = _set_row_keys(cls())(td)
    expected = cls()(_dense_rows()).get("advantage")
    got = out.get("adv")
    assert got.shape == (len(LENGTHS), 1)  # the documented [N, 1]
    torch.testing.assert_close(got.reshape(-1), expected.reshape(-1))
    assert expected.abs().sum() > 0


def test_advantage_multi_dim_batch_is_flattened():
    """A ``[B, T]`` tensordict is read as its ``B * T`` rows; ``advantage`` comes back ``[B, T, 1]``."""
    dense = _dense_rows()
    expected = GiGPOAdvantage()(dense.clone()).get("advantage")
    td = dense.reshape(2, 3)
    td.set("reward", td.get("reward").unsqueeze(-1))  # [B, T, 1, 1], TorchRL-style trailing dims
    out = GiGPOAdvantage()(td).get("advantage")
    assert out.shape == (2, 3, 1)
    torch.testing.assert_close(out.reshape(-1), expected.reshape(-1))


@pytest.mark.parametrize("ratio", ["token", "sequence"])
def test_clip_loss_on_ragged_lazy_stack(ratio):
    g = torch.Generator().manual_seed(1)
    old = [torch.randn(n, generator=g) - 2.0 for n in LENGTHS]
    cur_leaf = [(o + 0.3 * torch.randn(n, generator=g)).requires_grad_() for o, n in zip(old, LENGTHS)]
    ref = [o + 0.1 * torch.randn(n, generator=g) for o, n in zip(old, LENGTHS)]
    ent = [torch.rand(n, generator=g) for n in LENGTHS]
    adv = torch.tensor([1.0, -0.5, 0.2, -1.0, 0.7, 0.3])
    td = _rows(LENGTHS, old, cur_leaf, ref, adv)
    for i, e in enumerate(ent):
        td.tensordicts[i].set("ent", e)
    assert td.get("adv").shape == (6, 1, 1)
    with pytest.raises(RuntimeError):
        td.get(("log_probs", "response"))  # really ragged

    loss = ClipPolicyLoss(ratio=ratio, kl_coef=0.05, entropy_coef=0.01, eps_high=0.28)
    loss.set_keys(log_prob="cur", old_log_prob=("log_probs", "response"), ref_log_prob=("ref", "response"),
                  entropy="ent", advantage="adv", mask=("masks", "response"))  # no mask key: from lengths
    out = loss(td)
    total = out["loss_objective"] + out["loss_kl"] + out["loss_entropy"]
    total.backward()
    grads = [c.grad.clone() for c in cur_leaf]

    width = max(LENGTHS)
    cur_dense = _pad(cur_leaf, width).requires_grad_()
    mask = torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]
    dense = TensorDict(log_prob=cur_dense, old_log_prob=_pad(old, width), ref_log_prob=_pad(ref, width),
                       entropy=_pad(ent, width), mask=mask, advantage=adv[:, None], batch_size=[6])
    ref_out = ClipPolicyLoss(ratio=ratio, kl_coef=0.05, entropy_coef=0.01, eps_high=0.28)(dense)
    for key in ("loss_objective", "loss_kl", "loss_entropy", "clip_fraction", "kl", "ratio_mean"):
        torch.testing.assert_close(out[key].detach(), ref_out[key].detach())
    (ref_out["loss_objective"] + ref_out["loss_kl"] + ref_out["loss_entropy"]).backward()
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(grads[i], cur_dense.grad[i, :n])
        assert cur_dense.grad[i, n:].abs().sum() == 0
    assert out["clip_fraction"] > 0 or ratio == "sequence"


def test_clip_loss_out_keys_and_buffers():
    loss = ClipPolicyLoss(kl_coef=0.02, entropy_coef=0.003)
    assert {"loss_objective", "loss_kl", "loss_entropy"} <= set(loss.out_keys)
    buffers = dict(loss.named_buffers())
    assert float(buffers["kl_coef"]) == pytest.approx(0.02) and float(buffers["entropy_coef"]) == pytest.approx(0.003)
    assert "kl_coef" in loss.state_dict()


@pytest.mark.parametrize("shape", [(4,), (4, 1), (4, 1, 1), (4, 3), (4, 3, 1)])
def test_advantage_shapes_broadcast_the_same(shape):
    g = torch.Generator().manual_seed(2)
    old = torch.randn(4, 3, generator=g)
    cur = old + 0.2 * torch.randn(4, 3, generator=g)
    base = torch.tensor([1.0, -1.0, 0.5, -0.25])
    adv = base.reshape(4, 1).expand(4, 3).reshape(shape) if shape[1:2] == (3,) else base.reshape(shape)
    td = TensorDict(log_prob=cur, old_log_prob=old, advantage=adv, batch_size=[4])  # no mask: all tokens
    out = ClipPolicyLoss(kl_coef=0.0)(td)
    expected = ClipPolicyLoss(kl_coef=0.0)(TensorDict(log_prob=cur, old_log_prob=old, advantage=base[:, None],
                                                       mask=torch.ones(4, 3, dtype=torch.bool), batch_size=[4]))
    torch.testing.assert_close(out["loss_objective"], expected["loss_objective"])


def test_torchrl_transformers_wrapper_output(monkeypatch):
    """The real output of TorchRL's ``TransformersWrapper`` (tiny bundled model) into GRPO and the loss."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from torchrl.modules.llm import TransformersWrapper
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchrl_agent.models import build_tiny_model

    path = build_tiny_model()
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    wrapper = TransformersWrapper(model, tokenizer=tok, input_mode="text", generate=True, return_log_probs=True,
                                  generate_kwargs={"max_new_tokens": 5, "do_sample": True})
    torch.manual_seed(0)
    prompts = ["go north", "look", "take key from table", "open door"]
    td = wrapper(TensorDict(text=TensorDict(prompt=prompts), batch_size=(4,)).to_lazystack(0))
    old_rows = td.get(("log_probs", "response"), as_list=True)
    # the environment's part: ``("next", "reward")`` [B, 1, 1], groups of 2
    td.set(("next", "reward"), torch.tensor([1.0, 0.0, 0.0, 1.0]).reshape(4, 1, 1))
    td.set("group", torch.tensor([0, 0, 1, 1]))
    td.set("traj", torch.arange(4))
    adv_module = GRPOAdvantage()
    adv_module.set_keys(reward=("next", "reward"), group_id="group", traj_id="traj")
    td = adv_module(td)
    adv = td.get("advantage").reshape(-1)
    torch.testing.assert_close(adv, GRPOAdvantage()(TensorDict(
        reward=torch.tensor([1.0, 0.0, 0.0, 1.0]), group_id=torch.tensor([0, 0, 1, 1]), traj_id=torch.arange(4),
        batch_size=[4])).get("advantage").reshape(-1))

    # current policy: the same log-probs shifted per row (a stand-in for one optimiser step)
    shift = torch.tensor([0.3, -0.3, 0.1, 0.0])
    for i, sub in enumerate(td.tensordicts):
        sub.set("cur", old_rows[i] + shift[i])
    loss = ClipPolicyLoss(kl_coef=0.0, entropy_coef=0.0)
    loss.set_keys(log_prob="cur", old_log_prob=("log_probs", "response"), mask=("masks", "response"))
    out = loss(td)
    width = max(r.shape[0] for r in old_rows)
    old = _pad(old_rows, width)
    lengths = torch.tensor([r.shape[0] for r in old_rows])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    expected = ClipPolicyLoss(kl_coef=0.0, entropy_coef=0.0)(TensorDict(
        log_prob=old + shift[:, None], old_log_prob=old, mask=mask, advantage=adv[:, None], batch_size=[4]))
    torch.testing.assert_close(out["loss_objective"], expected["loss_objective"])
    assert out["clip_fraction"] > 0  # rows 0 and 1 (ratios e^{+-0.3}, A > 0 / A < 0) are clipped
