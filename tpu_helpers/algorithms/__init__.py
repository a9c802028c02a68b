"""Training algorithms on the package's loop (`training.Trainer`): what is optimised, apart from how a run runs.

    from tpu_helpers.algorithms.sft import CausalLMTrainer                          # supervised fine-tuning
    from tpu_helpers.algorithms.distill import DistillSettings, DistillTrainer      # a live teacher, or
    from tpu_helpers.algorithms.distill import CachedDistillTrainer, open_teacher_cache   # its cached top-k
    from tpu_helpers.algorithms.grpo import GRPOSettings, GRPOTrainer               # reinforcement from rewards
    from tpu_helpers.algorithms.grpo_loss import LOSS_TYPES, policy_terms           # its loss variants, by name
    from tpu_helpers.algorithms.rewards import resolve_rewards                      # GRPO's reward functions

Each algorithm's settings are one object, checked once when it is built (`DistillSettings`, `GRPOSettings`), that
its trainer takes whole; the recipes (`tpu_helpers.recipes`) build them from notebook parameters. The loop's
infrastructure (checkpoints, resume, signals, divergence, tracking) is `tpu_helpers.training`'s, the same for all.
"""
