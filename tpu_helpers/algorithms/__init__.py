"""Training algorithms on the package's loop (`training.Trainer`): what is optimised, apart from how a run runs.

    from tpu_helpers.algorithms.sft import CausalLMTrainer                          # supervised fine-tuning
    from tpu_helpers.algorithms.distill import DistillSettings, DistillTrainer      # a live teacher, or
    from tpu_helpers.algorithms.distill import CachedDistillTrainer, open_teacher_cache   # its cached top-k
    from tpu_helpers.algorithms.grpo import GRPOSettings, GRPOTrainer               # reinforcement from rewards
    from tpu_helpers.algorithms.grpo_loss import LOSS_TYPES, policy_terms           # its loss variants, by name
    from tpu_helpers.algorithms.rewards import resolve_rewards                      # GRPO's reward functions
    from tpu_helpers.algorithms.preference import PreferenceTrainer                 # DPO and ORPO from pairs

Each algorithm's settings are one dataclass (`DistillSettings`, `GRPOSettings`, `PreferenceSettings`), checked and
its choices parsed once when built, that its trainer takes whole; its fields are the recipe config's notebook
parameters (`config.settings_fields`). Each trainer's `train_step` is its algorithm's step; the loop's
infrastructure (checkpoints, resume, signals, divergence, logging) is `tpu_helpers.training`'s, the same for all.
"""
