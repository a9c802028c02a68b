"""Model families and the cached generation (models/generation.py): a model it cannot serve is refused with its
model type named."""

from __future__ import annotations

import pytest
import torch
import transformers

from tpu_helpers.config import ConfigError
from tpu_helpers.models.generation import generate_ids, left_pad

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


# ---- a model the generation cannot serve ----------------------------------------------------------------------------
def _mamba():  # a recurrent state instead of a key/value cache
    return transformers.MambaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, state_size=4)


def _llama4():  # chunked attention: neither full nor a sliding window
    return transformers.Llama4TextConfig(intermediate_size_mlp=64, head_dim=8, attention_chunk_size=2,
                                         num_local_experts=2, **SMALL)


def _lfm2():  # short convolutions between the attention layers
    return transformers.Lfm2Config(layer_types=["conv", "full_attention"], **SMALL)


@pytest.mark.parametrize("make, model_type, why", [
    (_mamba, "mamba", r"keeps a recurrent state, not a key/value cache"),
    (_llama4, "llama4_text", r"has layers of type \['chunked_attention'\]"),
    (_lfm2, "lfm2", r"has layers of type \['conv'\]"),
], ids=["mamba", "llama4", "lfm2"])
def test_a_model_the_cached_generation_cannot_serve_is_refused_by_its_model_type(make, model_type, why):
    # Mamba and LFM2 failed deep inside transformers ("Cannot get conv state for non linear attention layer 0 of type
    # StaticLayer"), and Llama 4's chunked attention ran with a plain causal mask: other tokens than HF's, silently.
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make(), attn_implementation="eager").eval()
    p = left_pad([[5, 6, 7], [8, 9]], 3, 0)
    message = (rf"{type(model).__name__} \(model_type {model_type!r}\) {why}: the cached generation "
               r"\(models/generation.py\) serves decoder-only models whose layers all attend through a key/value "
               r"cache, full or sliding-window \(e.g. llama, qwen2, qwen3, gemma2, gemma3_text, mistral, phi3\)")
    with pytest.raises(ConfigError, match=message):
        generate_ids(model, p.ids, p.mask, max_new_tokens=2, eos_token_id=None, pad_token_id=0)


def test_an_encoder_decoder_is_refused_by_its_model_type():
    # T5 failed with "The size of tensor a (3) must match the size of tensor b (7)"; AutoModelForCausalLM refuses it
    # by itself, but a model loaded otherwise reaches the generation.
    config = transformers.T5Config(vocab_size=97, d_model=32, num_layers=1, num_heads=2, d_kv=8, d_ff=64)
    model = transformers.T5ForConditionalGeneration(config).eval()
    p = left_pad([[5, 6, 7]], 3, 0)
    with pytest.raises(ConfigError, match=r"T5ForConditionalGeneration \(model_type 't5'\) is an encoder-decoder: "
                                          r"the cached generation"):
        generate_ids(model, p.ids, p.mask, max_new_tokens=2, eos_token_id=None, pad_token_id=0)


def test_grpo_refuses_such_a_model_when_it_loads_before_any_step(tmp_path, tiny_lm_dir):
    # GRPO's rollouts generate in every step: the recipe says so when it loads the model, not at the first rollout.
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

    tok = transformers.AutoTokenizer.from_pretrained(tiny_lm_dir)
    config = transformers.MambaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, state_size=4,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mamba")
    tok.save_pretrained(tmp_path / "mamba")
    job = GRPO(GRPOConfig(model=str(tmp_path / "mamba"), start_from=None, device="cpu", lora_targets="all-linear",
                          out_dir=str(tmp_path / "run")), progress=False)
    with pytest.raises(ConfigError, match=r"MambaForCausalLM \(model_type 'mamba'\) keeps a recurrent state"):
        _ = job.model

