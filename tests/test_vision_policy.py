"""The VLM engine and scorer on the tiny VLM: prompts with the frame, generation log-probs that the
scorer recomputes, gradients into the vision tower, image rows through the step collector."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensordict import NonTensorStack, TensorDict, lazy_stack
from torchrl.envs import Compose, TransformedEnv

from torchrl_agent.collectors import StepCollector
from torchrl_agent.envs import make_env
from torchrl_agent.envs.transforms import ActionProjection, PromptTransform, WindowMemory
from torchrl_agent.envs.transforms.projection import project_action
from torchrl_agent.modules import ResponseLogProbs, VisionPolicy, VisionResponseLogProbs
from torchrl_agent.modules.vision import VISION_PLACEHOLDER, expand_image, image_inputs, placeholder_token_ids


@pytest.fixture(scope="module")
def vl():
    from torchrl_agent.models import build_tiny_vl, load_tiny_vl

    model, processor = load_tiny_vl(build_tiny_vl(seed=0))
    return model.eval(), processor


def image_request(processor, n, seed=0):
    """``n`` Sokoban frames with chat prompts of different lengths (left padding in the batch)."""
    td = make_env("sokoban", num_groups=n, group_size=1, seed=seed, modality="image").reset()
    prompts = [processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Push the box. " * (i + 1) + td["observation"][i]}],
        tokenize=False, add_generation_prompt=True) for i in range(n)]
    return TensorDict({"text": {"prompt": NonTensorStack(*prompts)}, "pixels": td["pixels"]}, [n])


def test_expand_image_places_the_current_frame_only():
    pad = "<|image_pad|>"
    assert expand_image("a <image> b", 3) == f"a <|vision_start|>{pad * 3}<|vision_end|> b"
    # a memory's earlier placeholders stay text: the last one is the current frame
    assert expand_image("old <image> now <image>", 2) == f"old <image> now <|vision_start|>{pad * 2}<|vision_end|>"
    assert expand_image(f"x {VISION_PLACEHOLDER}", 1) == f"x {VISION_PLACEHOLDER}"  # a processor template's form
    for prompt in ("no image here", f"{VISION_PLACEHOLDER}{VISION_PLACEHOLDER}"):
        with pytest.raises(ValueError, match="one image placeholder"):
            expand_image(prompt, 4)


def test_generation_log_probs_equal_the_scorer_and_the_image_counts(vl):
    model, processor = vl
    policy = VisionPolicy(model, processor, max_new_tokens=10, temperature=1.0)  # the reference's bounds
    torch.manual_seed(0)
    td = policy(image_request(processor, 3))
    image_id = model.config.image_token_id
    assert td["image_tokens"].tolist() == [[81]] * 3  # 96x96 -> 256x256 -> 252x252: 18x18 patches, 2x2 merged
    for i in range(3):
        expected = processor.tokenizer(expand_image(td[i]["text", "prompt"], 81), add_special_tokens=False)
        assert td[i]["tokens", "prompt"].tolist() == expected["input_ids"]
        assert int((td[i]["tokens", "prompt"] == image_id).sum()) == 81
        assert len(td[i]["log_probs", "response"]) == len(td[i]["tokens", "response"]) > 0
    rows = lazy_stack(list(td.unbind(0)))
    scorer = VisionResponseLogProbs(model, processor)
    with torch.no_grad():
        scored = scorer(rows.clone())
    sampled = rows.get(("log_probs", "response"), as_padded_tensor=True)
    torch.testing.assert_close(scored["log_prob"], sampled * scored["mask"], atol=1e-5, rtol=0)
    # the frame reaches the log-probs: other frames, other values
    blank = rows.clone()
    blank["pixels"] = torch.zeros_like(rows["pixels"])
    with torch.no_grad():
        other = scorer(blank)["log_prob"]
    assert (other - scored["log_prob"]).abs().max() > 1e-3
    # the text scorer refuses image rows (it would read the pads as text), the VLM's text rows score there
    with pytest.raises(ValueError, match="VisionResponseLogProbs"), torch.no_grad():
        ResponseLogProbs(model, processor.tokenizer.pad_token_id)(rows.clone())
    # frames that give another image token count than the prompt holds are refused
    with pytest.raises(ValueError, match="image tokens"), torch.no_grad():
        VisionResponseLogProbs(model, processor, min_pixels=0)(rows.clone())


def test_scorer_equals_the_models_own_forward(vl):
    model, processor = vl
    frame = make_env("numberline", modality="image", seed=1).reset()["pixels"][0]
    vision = image_inputs(processor, [frame], min_pixels=0)  # 300x300 -> 308x308: 22x22 patches, 121 tokens
    prompt = processor.tokenizer.apply_chat_template([{"role": "user", "content": "Where? <image>"}], tokenize=False,
                                                     add_generation_prompt=True)
    prompt_ids = processor.tokenizer(expand_image(prompt, 121), add_special_tokens=False)["input_ids"]
    response = processor.tokenizer("<think>x</think><action>+</action>", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + response])
    with torch.no_grad():  # transformers' own path: it derives the M-RoPE positions itself
        logits = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(), **vision).logits
        logits[..., placeholder_token_ids(model.config)] = float("-inf")  # never sampled, probability 0
        own = F.log_softmax(logits[0, len(prompt_ids) - 1:-1], -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        row = TensorDict({"tokens": {"prompt": torch.tensor(prompt_ids), "response": torch.tensor(response)},
                          "pixels": frame})
        scored = VisionResponseLogProbs(model, processor, min_pixels=0)(lazy_stack([row]))
    torch.testing.assert_close(scored["log_prob"][0], own, atol=1e-5, rtol=0)


def test_scorer_gradients_reach_the_vision_tower_and_the_language_model(vl):
    model, processor = vl
    torch.manual_seed(1)
    rows = lazy_stack(list(VisionPolicy(model, processor, max_new_tokens=6, min_pixels=0)(
        image_request(processor, 2, seed=4)).unbind(0)))
    model.zero_grad()
    out = VisionResponseLogProbs(model, processor, min_pixels=0)(rows)
    (out["log_prob"] * out["mask"]).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad()
    for prefix in ("model.visual.patch_embed.", "model.visual.blocks.0.", "model.visual.merger.",
                   "model.language_model.layers.0.", "model.language_model.layers.1.", "model.language_model.embed_tokens."):
        mine = [g for name, g in grads.items() if name.startswith(prefix)]
        assert mine and all(g is not None and torch.isfinite(g).all() for g in mine), prefix
        assert sum(float(g.abs().sum()) for g in mine) > 0, prefix


def test_image_episodes_through_the_step_collector(vl):
    model, processor = vl
    tokenizer = processor.tokenizer

    def collect():
        env = TransformedEnv(make_env("sokoban", num_groups=2, group_size=1, max_steps=2, modality="image"),
                             Compose(WindowMemory(2), PromptTransform(tokenizer, "sokoban"), ActionProjection()))
        policy = VisionPolicy(model, processor, max_new_tokens=8, min_pixels=0)
        return StepCollector(env, policy, seed=0).collect()

    rows = collect()
    n = rows.batch_size[0]
    assert n == 4  # 2 episodes of 2 steps (the random model never solves the room)
    assert rows["pixels"].shape == (n, 96, 96, 3) and rows["pixels"].dtype == torch.uint8
    assert rows["image_tokens"].reshape(-1).tolist() == [9] * n  # raw 96x96 frames: 6x6 patches, 2x2 merged
    assert rows["prompt_tokens"].reshape(-1).tolist() == [len(p) for p in rows.get(("tokens", "prompt"), as_list=True)]
    for row in rows.unbind(0):
        # the history's earlier <image> placeholders stay text; the current frame is the one image
        assert row["text", "prompt"].count("<image>") == min(int(row["step_count"]), 2) + 1  # WindowMemory(2)
        assert int((row["tokens", "prompt"] == tokenizer.convert_tokens_to_ids("<|vision_start|>")).sum()) == 1
        # the env's projection parsed the VLM's response
        assert (row["action"], bool(row["action_valid"])) == project_action(row["text", "response"])
    with torch.no_grad():
        scored = VisionResponseLogProbs(model, processor, min_pixels=0)(rows.clone())
    sampled = rows.get(("log_probs", "response"), as_padded_tensor=True)
    torch.testing.assert_close(scored["log_prob"], sampled * scored["mask"], atol=1e-5, rtol=0)
    again = collect()  # deterministic for a seed
    first, second = (r.get(("tokens", "response"), as_list=True) for r in (rows, again))
    assert len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second))


def test_model_tiny_vl_config_loads_the_vlm(vl, tiny_path):
    from torchrl_agent.models import is_vision_model, load_model, load_processor, model_path
    from torchrl_agent.trainers.cli import compose_config

    cfg = compose_config(["experiment=smoke", "model=tiny-vl"]).model  # quickstart sets tiny-large itself
    path = model_path(cfg)
    assert is_vision_model(path) and not is_vision_model(tiny_path)
    model, tokenizer = load_model(cfg)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration" and tokenizer.pad_token == "<|endoftext|>"
    reference = vl[0].state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())  # the same seed-0 weights
    assert type(load_processor(path).image_processor).__name__ == "Qwen2VLImageProcessorPil"


def test_format_warm_start_on_image_prompts_gives_valid_actions():
    """The trainer's supervised format warm start with a VLM's actor (VisionResponseLogProbs):
    expert_rows with its processor puts the image's tokens in each prompt and the frame in the row;
    the random tiny VLM writes no valid Sokoban action from the frames, the warm-started one does."""
    from torchrl_agent.envs.factory import build_env
    from torchrl_agent.models import build_tiny_vl, load_tiny_vl
    from torchrl_agent.trainers.cli import compose_config
    from torchrl_agent.trainers.warm_start import expert_rows, warm_start

    model, processor = load_tiny_vl(build_tiny_vl(seed=0))  # a copy of its own: it is trained here
    cfg = compose_config(["experiment=smoke", "model=tiny-vl", "env=sokoban", "+env.kwargs.modality=image",
                          "env.num_groups=4", "env.group_size=1", "env.max_steps=3", "memory=none", "seed=0",
                          "warm_start.think=", "warm_start.steps=60", "warm_start.episodes=8",
                          "warm_start.batch_size=8", "warm_start.lr=3e-3"])
    cfg.env.template = "Sokoban. {observation}\nMoves: {admissible_actions}"  # short prompts: a fast test
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's steps are faster on one thread, and the same on any machine
    try:
        rows = expert_rows(cfg, processor.tokenizer, episodes=8, processor=processor, min_pixels=0)
        assert rows["pixels"].shape[1:] == (96, 96, 3)
        assert all(int((p == model.config.image_token_id).sum()) == 9 for p in rows["tokens", "prompt"])

        def valid() -> float:
            model.eval()
            env = build_env(cfg, processor.tokenizer)
            policy = VisionPolicy(model, processor, max_new_tokens=16, min_pixels=0, temperature=0)
            return StepCollector(env, policy, seed=0).collect()["action_valid"].float().mean().item()

        assert valid() == 0.0
        model.train()
        summary = warm_start(cfg, processor.tokenizer, VisionResponseLogProbs(model, processor, min_pixels=0))
        assert summary["warm_start_rows"] == rows.batch_size[0] and summary["warm_start_loss"] < 0.5
        assert valid() == 1.0
    finally:
        torch.set_num_threads(threads)


def test_a_response_never_holds_an_image_placeholder_and_still_scores():
    """An untrained VLM put mass on ``<|image_pad|>``: a sampled one in a response made the row's
    sequence hold one pad more than its frame gives, and scoring it crashed a learning run
    (``the rows' prompts hold [.., 20, ..] image tokens, their frames give [.., 19, ..]``). The engine
    never samples the placeholders and the scorer gives them probability 0: here the head favours
    them above every other token, and the rows still score to the engine's log-probs."""
    from torchrl_agent.models import build_tiny_vl, load_tiny_vl

    model, processor = load_tiny_vl(build_tiny_vl(seed=0))
    model.eval()
    placeholders = placeholder_token_ids(model.config)
    assert model.config.image_token_id in placeholders and len(placeholders) == 4
    with torch.no_grad():  # the placeholders' head rows: the hidden state's direction, scaled (greedy picks them)
        model.lm_head.weight[placeholders] = model.lm_head.weight[placeholders] * 0 + 5.0
    request = image_request(processor, 4, seed=2)
    unsuppressed = VisionPolicy(model, processor, max_new_tokens=8, min_pixels=0, temperature=0.0)
    unsuppressed.suppress_token_ids = []  # what the engine did before
    drawn = unsuppressed(request.clone()).get(("tokens", "response"), as_list=True)
    assert any(bool(torch.isin(r, torch.tensor(placeholders)).any()) for r in drawn)  # the fault is caused here
    for temperature in (0.0, 1.0):
        torch.manual_seed(3)
        td = VisionPolicy(model, processor, max_new_tokens=8, min_pixels=0, temperature=temperature)(request.clone())
        rows = lazy_stack(list(td.unbind(0)))
        for response in rows.get(("tokens", "response"), as_list=True):
            assert len(response) and not torch.isin(response, torch.tensor(placeholders)).any()
        with torch.no_grad():
            scored = VisionResponseLogProbs(model, processor, min_pixels=0)(rows.clone())
        if temperature:
            sampled = rows.get(("log_probs", "response"), as_padded_tensor=True)
            torch.testing.assert_close(scored["log_prob"], sampled * scored["mask"], atol=1e-5, rtol=0)
        assert torch.isfinite(scored["entropy"]).all() and torch.isfinite(scored["log_prob"]).all()
