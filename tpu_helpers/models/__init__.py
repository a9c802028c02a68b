"""Models: the package's GPT, Hugging Face causal LMs, and what the recipes do to a model (adapters, quantization,
chunked losses, generation).

    from tpu_helpers.models import GPT, gpt_config
    model = GPT(gpt_config("tiny", vocab_size=256, block_size=64))
    from tpu_helpers.models.hf import load_causal_lm   # the others from their modules

- gpt: the small GPT (presets tiny..medium) for pretraining and tests; its names are the ones imported here;
- hf: a Hugging Face causal LM and its tokenizer; hf_tiny and smollm2: the offline models built locally;
- lora (peft adapters and exports), qat (quantization-aware training), quant4 (QLoRA's 4-bit base);
- lm_head: losses over the output head in chunks; generation, sampling and replay: fixed-shape generation with a
  key/value cache, token choice, and the replayed prefill and device loop that keep it off the host.
"""

from tpu_helpers.models.gpt import GPT, PRESETS, GPTConfig, flops_per_token, gpt_config, sample_text

__all__ = ["GPT", "PRESETS", "GPTConfig", "flops_per_token", "gpt_config", "sample_text"]
