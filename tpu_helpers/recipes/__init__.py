"""Recipes: whole jobs built on the trainer, one shape each (a typed config and a job object, `recipes.base`).

    from tpu_helpers.recipes.pretrain import Pretrain, train_gpt        # the package GPT on text
    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig   # a Hugging Face causal LM: LoRA, full, distill

Modules: `base` (what every recipe shares), `pretrain` (the quickstart and platform notebooks, `multichip`, the
CLI), `finetune` (notebooks/finetune_llm.ipynb), `xla_demo` (a deliberately bad loop next to the fixed one, for
notebooks/xla_debugging.ipynb). Recipes sit above the trainer and the memory plans they combine, and below
`launch`, which runs them.
"""
