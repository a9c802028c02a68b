"""Models: the package's small GPT (presets tiny..medium), used for pretraining demos and tests.

    from tpu_helpers.models import GPT, gpt_config
    model = GPT(gpt_config("tiny", vocab_size=256, block_size=64))
"""

from tpu_helpers.models.gpt import GPT, PRESETS, GPTConfig, flops_per_token, gpt_config, sample_text

__all__ = ["GPT", "PRESETS", "GPTConfig", "flops_per_token", "gpt_config", "sample_text"]
