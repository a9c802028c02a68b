"""Recipes: whole jobs built on the trainer, one shape each (a typed config and a job object, `recipes.base`).

    from tpu_helpers.recipes.pretrain import Pretrain, train_gpt        # the package GPT on text
    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig   # a Hugging Face causal LM: LoRA, full, distill
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig               # the same model trained from rewards (GRPO)
    from tpu_helpers.recipes.preference import Preference, PreferenceConfig  # ... from preference pairs (DPO, ORPO)

Modules: `base` (what every recipe shares), `pretrain` (the quickstart and platform notebooks, `multichip`, the
CLI), `hf_job` (what every Hugging Face recipe shares: model, tokenizer, LoRA, records, plan, samples, exports) and
its siblings `finetune` (notebooks/finetune_llm.ipynb), `grpo` (notebooks/grpo_llm.ipynb) and `preference`
(notebooks/preference_llm.ipynb), each config holding only its own fields; `xla_loops` (a deliberately bad loop next to the fixed one, for notebooks/xla_debugging.ipynb).
Recipes sit above the trainer, the algorithms and the memory plans they combine, and below `launch`, which runs
them.
"""
