"""Platform targets: a named preset of notebook parameters and environment variables per platform.

    python -m tpu_helpers run notebooks/colab_tpu.ipynb --target colab-v6e-1
    python -m tpu_helpers targets          # lists them

`platform.auto_target()` picks one for this machine. The batch runner (`launch.runner`)
applies them, and the tuning panel (`panel.options`) reads the notebooks' configurations from them, so the two
cannot drift apart: hence this module sits below both, needing only `backend.runtime_env`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpu_helpers.backend import runtime_env


@dataclass(frozen=True)
class Target:
    description: str
    params: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    # Parameters for one notebook (by file stem) on top of the generic ones, e.g. the fine-tuning notebook's model.
    notebooks: dict[str, dict[str, Any]] = field(default_factory=dict)

    def params_for(self, notebook: str, declared: Any) -> dict[str, Any]:
        """The target's parameters that `notebook` declares (generic first, then its own)."""
        merged = {**self.params, **self.notebooks.get(notebook, {})}
        return {k: v for k, v in merged.items() if k in declared}


# Small enough for a CPU in minutes; DATASET "embedded" needs no network. GLOBAL_BATCH is the TPU VM notebook's.
_CPU_DEMO = {"PRESET": "tiny", "STEPS": 300, "BATCH_SIZE": 32, "GLOBAL_BATCH": 32, "SEQ_LEN": 64, "EVAL_EVERY": 50,
             "LOG_EVERY": 10, "WARMUP_STEPS": 30, "LR": 3e-3, "DATASET": "embedded", "MAX_CHARS": 2_000_000,
             "FALLBACK": False}
# GPT-2 small (124M) at 1024 tokens in bf16: about 0.7 GB of activations per sequence over its 12 layers, plus 2 GB of
# weights and AdamW state, so 8 sequences fit a 16 GB v5e chip and 16 a 32 GB v6e chip.
_TPU = {"DEVICE": "tpu", "PRESET": "small", "STEPS": 2000, "SEQ_LEN": 1024, "FALLBACK": False}

# The fine-tuning notebook: the offline tiny model and generated task on CPU and XLA:CPU; Qwen2.5-0.5B-Instruct with
# LoRA on one TPU chip or GPU (bf16 base 1 GB, adapters and their AdamW state a few MB, activations at 512 tokens with
# checkpointing well under 16 GB), full fine-tuning over the 8 chips of a v5e-8.
_FT_CPU = {"MODEL": "tiny", "DATASET": "instructions", "METHOD": "lora", "STEPS": 200, "BATCH_SIZE": 16,
           "SEQ_LEN": 48, "LR": 3e-3, "EVAL_EVERY": 50, "WARMUP_STEPS": 20, "TEACHER": None}
_FT_QWEN = {"MODEL": "Qwen/Qwen2.5-0.5B-Instruct", "SEQ_LEN": 512, "STEPS": 500, "LR": 2e-4, "WARMUP_STEPS": 20,
            "EVAL_EVERY": 100}
_FT = {
    "cpu": _FT_CPU, "xla-cpu": _FT_CPU, "xla-cpu-8": _FT_CPU,
    "gpu": {**_FT_QWEN, "METHOD": "lora", "BATCH_SIZE": 8, "GRAD_ACCUM": 2},
    "colab-v5e-1": {**_FT_QWEN, "METHOD": "lora", "BATCH_SIZE": 8, "GRAD_ACCUM": 2, "GRADIENT_CHECKPOINTING": True},
    "colab-v6e-1": {**_FT_QWEN, "METHOD": "lora", "BATCH_SIZE": 16, "GRADIENT_CHECKPOINTING": True},
    "tpuvm-v5e-8": {**_FT_QWEN, "METHOD": "full", "BATCH_SIZE": 8, "GRADIENT_CHECKPOINTING": True},
    "kaggle-v5e-8": {**_FT_QWEN, "METHOD": "full", "BATCH_SIZE": 8, "GRADIENT_CHECKPOINTING": True,
                     "OUT_DIR": "/kaggle/working/runs/finetune"},
}

# The GRPO notebook: the offline tiny model (a brief SFT, then generated sums) on CPU and XLA:CPU; on a TPU chip or
# GPU Qwen2.5-0.5B-Instruct with LoRA on GSM8K (answers in <answer> tags), 8 answers per prompt, bf16, checkpointing.
_GRPO_CPU = {"MODEL": "tiny", "START_FROM": "sft", "DATASET": "sums", "REWARDS": "answer", "STEPS": 200,
             "BATCH_SIZE": 8, "NUM_GENERATIONS": 8, "MAX_PROMPT_LEN": 32, "MAX_NEW_TOKENS": 4, "LR": 5e-3,
             "WARMUP_STEPS": 10}
_GRPO_QWEN = {"MODEL": "Qwen/Qwen2.5-0.5B-Instruct", "START_FROM": None, "DATASET": "openai/gsm8k:main",
              "PROMPT_FIELD": "question", "ANSWER_FIELD": "answer", "REWARDS": "answer,format",
              "SYSTEM_PROMPT": "Think step by step, then give the final number inside <answer> </answer>.",
              "NUM_GENERATIONS": 8, "MAX_PROMPT_LEN": 256, "MAX_NEW_TOKENS": 256, "LR": 5e-5, "WARMUP_STEPS": 10,
              "STEPS": 500, "METHOD": "lora", "GRADIENT_CHECKPOINTING": True}
_GRPO = {
    "cpu": _GRPO_CPU, "xla-cpu": _GRPO_CPU, "xla-cpu-8": _GRPO_CPU,
    "gpu": {**_GRPO_QWEN, "BATCH_SIZE": 8},
    "colab-v5e-1": {**_GRPO_QWEN, "BATCH_SIZE": 4},
    "colab-v6e-1": {**_GRPO_QWEN, "BATCH_SIZE": 8, "MAX_NEW_TOKENS": 512},
    "tpuvm-v5e-8": {**_GRPO_QWEN, "BATCH_SIZE": 4},
    "kaggle-v5e-8": {**_GRPO_QWEN, "BATCH_SIZE": 4, "OUT_DIR": "/kaggle/working/runs/grpo"},
}

# The agents notebook (GRPO on tool-calling episodes of the offline Lockers environment): on CPU and XLA:CPU the offline
# SmolLM2-135M-Instruct (the tiny Qwen2's 256 positions cannot hold the tool schemas), few short episodes; on a TPU
# chip or GPU Qwen2.5-0.5B-Instruct (its own tool-calling template) with LoRA, longer turns, checkpointing. The example
# DATASET brings its environment or tools and reward (agents.examples.EXAMPLES), so `-p DATASET mul3` alone switches
# to the sandboxed python tool.
_AGENT_ENV = {"DATASET": "lockers", "START_FROM": None, "METHOD": "lora"}
# The offline SmolLM2 never calls a tool untrained, so GRPO would earn no reward: a brief LoRA SFT on the Lockers
# demonstrations first, then the settings tests/real proves on the CPU (docs/jobs/agents.md, "On the real model").
_AGENT_CPU = {**_AGENT_ENV, "MODEL": "smollm2-135m", "START_FROM": "sft", "SFT_STEPS": 4, "MAX_PROMPT_LEN": 256,
              "MAX_NEW_TOKENS": 40, "TOOL_TOKENS": 32, "MAX_TURNS": 1, "BATCH_SIZE": 1, "NUM_GENERATIONS": 8,
              "STEPS": 6, "LR": 1e-3, "WARMUP_STEPS": 1, "KL_BETA": 0.0, "LOG_EVERY": 1, "SAVE_EVERY": 6,
              "NUM_SAMPLES": 24}
_AGENT_QWEN = {**_AGENT_ENV, "MODEL": "Qwen/Qwen2.5-0.5B-Instruct", "MAX_PROMPT_LEN": 512, "MAX_NEW_TOKENS": 64,
                "TOOL_TOKENS": 32, "MAX_TURNS": 2, "NUM_GENERATIONS": 8, "STEPS": 300, "LR": 1e-4, "WARMUP_STEPS": 10,
                "LOG_EVERY": 10, "SAVE_EVERY": 100, "NUM_SAMPLES": 64, "GRADIENT_CHECKPOINTING": True}
_AGENT = {
    "cpu": _AGENT_CPU, "xla-cpu": _AGENT_CPU, "xla-cpu-8": _AGENT_CPU,
    "gpu": {**_AGENT_QWEN, "BATCH_SIZE": 8},
    "colab-v5e-1": {**_AGENT_QWEN, "BATCH_SIZE": 4},
    "colab-v6e-1": {**_AGENT_QWEN, "BATCH_SIZE": 8},
    "tpuvm-v5e-8": {**_AGENT_QWEN, "BATCH_SIZE": 4},
    "kaggle-v5e-8": {**_AGENT_QWEN, "BATCH_SIZE": 4, "OUT_DIR": "/kaggle/working/runs/agents"},
}

_PREF_CPU = {"MODEL": "tiny", "DATASET": "instructions", "ALGORITHM": "dpo", "METHOD": "lora", "STEPS": 100,
             "BATCH_SIZE": 8, "SEQ_LEN": 32, "LR": 5e-3, "WARMUP_STEPS": 10}
# DPO of the instruct model on UltraFeedback's preference pairs: LoRA, so the reference costs no second copy.
_PREF_QWEN = {"MODEL": "Qwen/Qwen2.5-0.5B-Instruct", "DATASET": "HuggingFaceH4/ultrafeedback_binarized",
              "DATASET_SPLIT": "train_prefs", "MAX_RECORDS": 20000, "ALGORITHM": "dpo", "BETA": 0.1, "METHOD": "lora",
              "SEQ_LEN": 512, "STEPS": 500, "LR": 5e-5, "WARMUP_STEPS": 20, "GRADIENT_CHECKPOINTING": True,
              "MAX_NEW_TOKENS": 64}
_PREF = {
    "cpu": _PREF_CPU, "xla-cpu": _PREF_CPU, "xla-cpu-8": _PREF_CPU,
    "gpu": {**_PREF_QWEN, "BATCH_SIZE": 4, "GRAD_ACCUM": 4},
    "colab-v5e-1": {**_PREF_QWEN, "BATCH_SIZE": 2, "GRAD_ACCUM": 8},
    "colab-v6e-1": {**_PREF_QWEN, "BATCH_SIZE": 4, "GRAD_ACCUM": 4},
    "tpuvm-v5e-8": {**_PREF_QWEN, "BATCH_SIZE": 2, "GRAD_ACCUM": 2},
    "kaggle-v5e-8": {**_PREF_QWEN, "BATCH_SIZE": 2, "GRAD_ACCUM": 2, "OUT_DIR": "/kaggle/working/runs/preference"},
}

TARGETS: dict[str, Target] = {
    "local": Target("the notebook's own defaults, on whatever device it detects"),
    "cpu": Target("CPU: a tiny GPT that trains in a few minutes", {"DEVICE": "cpu", **_CPU_DEMO}),
    "xla-cpu": Target("the TPU code path on one XLA:CPU device, tiny sizes",
                      {"DEVICE": "xla", **_CPU_DEMO}, runtime_env.xla_cpu_env(devices=1)),
    "xla-cpu-8": Target("the TPU VM code path on 8 simulated XLA:CPU devices (SPMD), tiny sizes",
                        {"DEVICE": "xla", **_CPU_DEMO}, runtime_env.xla_cpu_env(devices=8)),
    "gpu": Target("one CUDA GPU (bf16, or fp16 + GradScaler)", {"DEVICE": "cuda", "PRESET": "small", "STEPS": 2000,
                                                                "BATCH_SIZE": 16, "SEQ_LEN": 1024}),
    "colab-v5e-1": Target("Colab TPU v5e-1 (16 GB HBM), bf16", {**_TPU, "BATCH_SIZE": 8}),
    "colab-v6e-1": Target("Colab TPU v6e-1 (32 GB HBM), bf16", {**_TPU, "BATCH_SIZE": 16}),
    "tpuvm-v5e-8": Target("TPU VM v5e-8: 8 chips driven by SPMD from one process, global batch 64 (8 per chip)",
                          {**_TPU, "GLOBAL_BATCH": 64, "BATCH_SIZE": 8, "MODE": "spmd"}),
    # Kaggle's free TPU v5e-8: the same chips as a TPU VM; only /kaggle/working is kept with the notebook's output.
    "kaggle-v5e-8": Target("Kaggle TPU v5e-8 (the tpuvm_v5e8 notebook, SPMD, global batch 64), out_dir under "
                           "/kaggle/working", {**_TPU, "GLOBAL_BATCH": 64, "BATCH_SIZE": 8, "MODE": "spmd",
                                              "OUT_DIR": "/kaggle/working/runs/tpuvm_v5e8"}),
}
for _name, _params in _FT.items():
    TARGETS[_name].notebooks["finetune_llm"] = _params
for _name, _params in _GRPO.items():
    TARGETS[_name].notebooks["grpo_llm"] = _params
for _name, _params in _PREF.items():
    TARGETS[_name].notebooks["preference_llm"] = _params
for _name, _params in _AGENT.items():
    TARGETS[_name].notebooks["agents_llm"] = _params
