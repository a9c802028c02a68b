"""The offline tiny model and tokenizer, loading through from_pretrained, generation, LoRA wrapping and exports."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support import XLA_BACKEND
from tpu_helpers.config import ConfigError
from tpu_helpers.models import hf, lora
from tpu_helpers.models.hf_tiny import build_tiny_model, tiny_model_dir


def test_tiny_model_loads_through_the_auto_classes_with_a_chat_template(tiny_lm_dir):
    model, tok = hf.load_causal_lm(str(tiny_lm_dir))
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert tok.chat_template and tok.pad_token_id is not None and tok.eos_token == "<|im_end|>"
    assert len(tok) == model.config.vocab_size
    # Tied embedding and head, as in Qwen2.5-0.5B.
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert json.loads((tiny_lm_dir / "config.json").read_text())["model_type"] == "qwen2"
    # Digits are one token each, so an answer such as "17" is two tokens.
    assert tok("17", add_special_tokens=False)["input_ids"] == tok("1 7".replace(" ", ""),
                                                                   add_special_tokens=False)["input_ids"]
    assert len(tok("17", add_special_tokens=False)["input_ids"]) == 2


def test_the_build_is_deterministic(tmp_path, tiny_lm_dir):
    again = tiny_model_dir(tmp_path)
    assert again.name == tiny_lm_dir.name
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (tiny_lm_dir / name).read_bytes(), name
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]  # built in a temp dir, renamed


def test_bad_model_inputs_name_the_value(tmp_path, tiny_lm_dir):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"MODEL='.*' is a local path without a config.json"):
        hf.resolve_model_source(str(tmp_path))
    model, _ = hf.load_causal_lm(str(tiny_lm_dir))
    with pytest.raises(ConfigError, match=r"SEQ_LEN=1000 exceeds the model's context of 256"):
        hf.check_seq_len(model, 1000)
    with pytest.raises(ConfigError, match=r"LORA_TARGETS names \['qkv'\].*'q_proj'"):
        lora.add_lora(model, targets="q_proj,qkv")


def test_teacher_with_another_vocabulary_is_refused(tiny_lm_dir):
    from tpu_helpers.algorithms.distill import check_same_vocab

    model, tok = hf.load_causal_lm(str(tiny_lm_dir))
    other = build_tiny_model(tok, vocab_size=600)
    with pytest.raises(ConfigError, match=r"TEACHER='big' has a vocabulary of 600 tokens and MODEL='the student' 512"):
        check_same_vocab(model, other, "big")


def test_adapter_and_merged_exports_reload_with_plain_transformers_and_peft(tmp_path, tiny_lm_dir):
    from peft import PeftModel

    model, tok = hf.load_causal_lm(str(tiny_lm_dir))
    model = lora.add_lora(model, r=4, targets="q_proj,v_proj,down_proj")
    with torch.no_grad():  # a trained-looking adapter (B starts at zero, which would make the test vacuous)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids = tok("What letter comes after k?", return_tensors="pt")["input_ids"]
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    adapter = lora.export_adapter(model, tmp_path / "adapter")
    merged = lora.export_merged(model, tok, tmp_path / "merged", base_source=str(tiny_lm_dir))
    assert sorted(p.name for p in adapter.iterdir()) == ["README.md", "adapter_config.json",
                                                          "adapter_model.safetensors"]
    assert (adapter / "adapter_model.safetensors").stat().st_size < 0.2 * (merged / "model.safetensors").stat().st_size
    base = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    reloaded = PeftModel.from_pretrained(base, adapter).eval()
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        got_adapter = reloaded(input_ids=ids).logits
        got_merged = plain(input_ids=ids).logits
    # Stated tolerance: float32 merge of W + B@A*scale reorders sums, 1e-5 absolute on logits of order 1.
    torch.testing.assert_close(got_adapter, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_merged, want, atol=1e-4, rtol=1e-4)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval()  # from_pretrained above modified `base`
    with torch.no_grad():
        assert not torch.allclose(got_merged, fresh(input_ids=ids).logits, atol=1e-3)  # the adapter changed it


@pytest.mark.xla
def test_tied_embedding_and_head_stay_tied_after_the_move_to_xla_under_peft(tiny_lm_dir):
    model, _ = hf.load_causal_lm(str(tiny_lm_dir))
    model = XLA_BACKEND.move_model(lora.add_lora(model, r=4))
    base = model.get_base_model()
    head, emb = base.get_output_embeddings().weight, base.get_input_embeddings().weight
    # Module.to() would give the head a Parameter of its own on XLA: twice the memory, and a full fine-tune would
    # train two diverging copies.
    assert head is emb and head.device.type == "xla"


def test_generation_stops_at_the_generation_configs_extra_stop_token(tiny_lm_dir):
    # Gemma 2/3 instruct end a turn with <end_of_turn>, listed in generation_config.eos_token_id beside EOS: with the
    # tokenizer's EOS alone as a stop token, answers would run past the end of the turn.
    from tpu_helpers.algorithms.grpo import GRPOSettings
    from tpu_helpers.algorithms.rewards import resolve_rewards
    from tpu_helpers.algorithms.rollouts import score_completions

    model, tok = hf.load_causal_lm(str(tiny_lm_dir))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # varied answers (the tiny model's own weights repeat a token)
    from tpu_helpers.models.generation import generate_ids, left_pad

    prompts = ["a b c", "hello there"]
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in prompts]
    p = left_pad(enc, max(map(len, enc)), tok.pad_token_id)
    ids = generate_ids(model, p.ids, p.mask, max_new_tokens=6, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id).ids[0].tolist()
    free = hf.generate(model, tok, prompts, device="cpu", max_new_tokens=6)
    assert tok.eos_token_id not in ids[:3] and free[0] == tok.decode(ids, skip_special_tokens=True)
    stop = ids[2]  # the third token of the first answer: taken as the end of turn
    assert stop not in ids[:2]
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    got = hf.generate(model, tok, prompts, device="cpu", max_new_tokens=6)
    assert got[0] == tok.decode(ids[:2], skip_special_tokens=True) != free[0]
    stops = hf.eos_ids(tok, model)
    assert stops == [tok.eos_token_id, stop] and hf.eos_ids(tok) == [tok.eos_token_id]
    # GRPO's scoring (texts and lengths) ends completions there too when given the model's stop tokens.
    rows = [ids[:2] + [stop, ids[0], ids[1]], [ids[0]] * 5]
    records = [{"prompt": q, "answer": "1"} for q in prompts]
    scored = score_completions(tok, resolve_rewards("length"), records, rows, GRPOSettings(max_new_tokens=5), stops)
    assert scored["completion_tokens"] == [3, 5] and scored["completions"][0] == got[0]
