"""The model families users fine-tune on TPUs (tests/models/families.py: Llama 3, Qwen2.5, Qwen3, Gemma 2, Gemma 3,
Mistral, Phi-3), each a tiny random model with its family's tokenizer, chat template and stop tokens: the cached
generation (models/generation.py, hf.generate) answers as transformers' own greedy `generate` does, token for token,
and stops at the tokenizer's EOS and at generation_config's end of turn; chats are formatted through the family's
template; LoRA "all-linear" wraps the family's projections; a LoRA SFT job and a GRPO job train on XLA:CPU without
recompiling after warm-up; the merged export reloads with plain transformers. A model the generation cannot serve
is refused with its model type named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.models.families import ATTENTION, FAMILIES, FINE_TUNED, WINDOW, build_family
from tests.support import XLA_BACKEND
from tpu_helpers.config import ConfigError
from tpu_helpers.core.callbacks import Callback
from tpu_helpers.data.sft import instruction_records, prompts_and_answers
from tpu_helpers.models import decode, generation, hf, lora
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


# ---- the families ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, tiny_lm_dir):
    """name -> the family's tiny model directory (tests/models/families.py), built once per module."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_family(name, tmp_path_factory.mktemp(name), tiny_lm_dir)
        return built[name]

    return get


def _chats() -> list[list[dict]]:
    """Chat prompts of different lengths: held-out questions of the generated set, a greeting, a two-turn chat."""
    prompts, _ = prompts_and_answers(instruction_records(split="test")[:3])
    return prompts + [[{"role": "user", "content": "Hi there, who are you?"}],
                      [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"},
                       {"role": "user", "content": "And 4 plus 4?"}]]


def _left_padded(tok, chats) -> Any:
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in hf.prompt_texts(tok, chats)]
    lengths = sorted(map(len, enc))
    # Every prompt is longer than any sliding window, and the rows get different amounts of left padding.
    assert lengths[0] > WINDOW and len(set(lengths)) >= 3, lengths
    return left_pad(enc, lengths[-1], tok.pad_token_id)


def _transformers_greedy(model, p, n: int, stops: list[int], pad: int) -> torch.Tensor:
    """transformers' own greedy generate (its caches and masks), its new tokens padded to `n` columns."""
    out = model.generate(input_ids=p.ids, attention_mask=p.mask, do_sample=False, max_new_tokens=n,
                         eos_token_id=stops, pad_token_id=pad)[:, p.ids.shape[1]:]
    return torch.cat([out, torch.full((out.shape[0], n - out.shape[1]), pad, dtype=out.dtype)], 1)


NEW = 12  # new tokens: prompt + answer is 15-55 tokens against windows of 6


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_cached_generation_answers_as_transformers_generate(name, family_dir, monkeypatch):
    model, tok = hf.load_causal_lm(str(family_dir(name)))
    chats = _chats()
    p = _left_padded(tok, chats)
    stops = hf.eos_ids(tok, model)
    want = _transformers_greedy(model.eval(), p, NEW, stops, tok.pad_token_id)
    assert len(set(want.flatten().tolist())) > 10  # varied answers, not one token repeated
    got = generate_ids(model, p.ids, p.mask, max_new_tokens=NEW, eos_token_id=stops, pad_token_id=tok.pad_token_id)
    assert torch.equal(got.ids, want), (got.ids, want)
    # hf.generate (the fine-tuning samples): the chat template, the encoding, a bucketed cache, the texts.
    texts = hf.generate(model, tok, chats, device="cpu", max_new_tokens=NEW)
    assert texts == hf.completion_texts(tok, want.tolist(), stops)
    if decode.sliding_window(model) is not None:  # the window is a mask here: without it other answers
        monkeypatch.setattr(generation, "sliding_window", lambda model: None)
        unwindowed = generate_ids(model, p.ids, p.mask, max_new_tokens=NEW, eos_token_id=stops,
                                  pad_token_id=tok.pad_token_id)
        assert not torch.equal(unwindowed.ids, want)


def _swap_tokens(model, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """Swap the embedding and output rows of each (a, b): the model then reads a as it read b and says a where it
    said b. Returns the id map that turns the old model's inputs into the new one's."""
    weights = {id(w): w for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)}
    mapping = torch.arange(model.get_input_embeddings().weight.shape[0])
    with torch.no_grad():
        for a, b in pairs:
            for w in weights.values():  # a tied head is the embedding: swapped once
                w[[a, b]] = w[[b, a]]
            mapping[a], mapping[b] = b, a
    return mapping


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_generation_stops_at_the_tokenizers_eos_and_at_each_generation_config_stop(name, family_dir):
    fam = FAMILIES[name]
    model, tok = hf.load_causal_lm(str(family_dir(name)))
    model.eval()
    stops = hf.eos_ids(tok, model)
    family_stops = tok.convert_tokens_to_ids(list(fam.stops))
    assert stops == list(dict.fromkeys([tok.eos_token_id, *family_stops]))  # the tokenizer's EOS first
    p = _left_padded(tok, _chats())
    free = generate_ids(model, p.ids, p.mask, max_new_tokens=NEW, eos_token_id=None,
                        pad_token_id=tok.pad_token_id).ids.tolist()
    # Each stop token in a row of its own, said where that row said a token X before: X and the stop swap places
    # in the vocabulary, so the model says the stop exactly there (and reads the stop as it read X).
    plan, taken = [], set(stops)
    for stop in stops:
        row, step = next((r, s) for r in range(len(free)) if r not in {row for row, *_ in plan}
                         for s in range(2, NEW - 2) if free[r][s] not in taken and not set(free[r][:s + 1]) & taken)
        plan.append((row, step, stop, free[row][step]))
        taken.add(free[row][step])
    assert all(not set(free[row][:step]) & taken for row, step, _, _ in plan)  # no row stops before its place
    mapping = _swap_tokens(model, [(stop, said) for _, _, stop, said in plan])
    ids = mapping[p.ids]
    got = generate_ids(model, ids, p.mask, max_new_tokens=NEW, eos_token_id=stops, pad_token_id=tok.pad_token_id)
    for row, step, stop, _ in plan:
        assert got.ids[row, :step].tolist() == free[row][:step] and got.ids[row, step] == stop, (row, got.ids[row])
        assert got.mask[row].tolist() == [1] * (step + 1) + [0] * (NEW - step - 1)
        assert (got.ids[row, step + 1:] == tok.pad_token_id).all()
    assert torch.equal(got.ids, _transformers_greedy(model, type(p)(ids, p.mask), NEW, stops, tok.pad_token_id))
    texts = hf.completion_texts(tok, got.ids.tolist(), stops)
    assert [texts[row] for row, *_ in plan] == [tok.decode(free[row][:step], skip_special_tokens=True)
                                                for row, step, _, _ in plan]


PROMPTS = {  # "What is 2 plus 3?" as each family's template writes it, ready for the answer
    "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 plus 3?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "qwen2": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2 plus 3?"
             "<|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n",
    "gemma2": "<bos><start_of_turn>user\nWhat is 2 plus 3?<end_of_turn>\n<start_of_turn>model\n",
    "mistral": "<s>[INST] What is 2 plus 3? [/INST]",
    "phi3": "<|user|>\nWhat is 2 plus 3?<|end|>\n<|assistant|>\n",
}
PROMPTS["qwen2-sliding"], PROMPTS["gemma3"] = PROMPTS["qwen2"], PROMPTS["gemma2"]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_prompts_and_sft_rows_go_through_the_familys_chat_template(name, family_dir):
    from tpu_helpers.data.rl import prompt_text
    from tpu_helpers.data.sft import encode_record

    fam = FAMILIES[name]
    tok = transformers.AutoTokenizer.from_pretrained(family_dir(name))
    question = "What is 2 plus 3?"
    assert hf.prompt_texts(tok, [[{"role": "user", "content": question}]]) == [PROMPTS[name]]  # samples
    assert prompt_text(tok, question) == PROMPTS[name]  # GRPO's prompts
    ids, labels = encode_record(tok, {"prompt": question, "response": "5"})  # an SFT row
    trained = [t for t, label in zip(ids, labels, strict=True) if label != -100]
    assert tok.decode(trained) == fam.trained.format("5")  # the answer and the family's end of turn
    assert tok.decode(ids[:len(ids) - len(trained)]) == PROMPTS[name]
    # The family's markers are single tokens, as in its real vocabulary.
    pieces = tok.convert_ids_to_tokens(ids)
    assert {s for s in fam.specials if s in PROMPTS[name] + fam.trained} <= set(pieces)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_all_linear_lora_wraps_every_projection_of_the_family_but_the_head(name, family_dir):
    from peft.tuners.lora import LoraLayer

    fam = FAMILIES[name]
    model, _ = hf.load_causal_lm(str(family_dir(name)))
    assert set(lora.linear_names(model)) == {*fam.lora, "lm_head"}
    if not set(ATTENTION) <= set(fam.lora):  # Phi-3's fused qkv_proj: the default targets name what it has
        with pytest.raises(ConfigError, match=r"LORA_TARGETS names \['q_proj', 'k_proj', 'v_proj'\], not linear "
                                              r"layers of Phi3ForCausalLM; its linear layers are .*'qkv_proj'"):
            lora.add_lora(model, targets="q_proj,k_proj,v_proj,o_proj")
    wrapped = [n for n, m in lora.add_lora(model, r=2, targets="all-linear").named_modules()
               if isinstance(m, LoraLayer)]
    layers = model.config.num_hidden_layers
    assert sorted({n.rsplit(".", 1)[-1] for n in wrapped}) == sorted(fam.lora) and len(wrapped) == layers * len(fam.lora)


# ---- fine-tuning on XLA:CPU and the merged export ------------------------------------------------------------------
class _Compilations(Callback):
    """The XLA compilations of each step of a run (host-side counters)."""

    def on_fit_start(self, trainer):
        self.last, self.steps = trainer.backend.metrics()["compilations"], []

    def on_step_end(self, trainer):
        now = trainer.backend.metrics()["compilations"]
        self.steps.append(now - self.last)
        self.last = now


@pytest.mark.xla
@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla not installed")
@pytest.mark.parametrize("name", FINE_TUNED)
def test_lora_sft_and_grpo_train_on_xla_without_recompiling_and_the_merged_export_reloads(name, family_dir,
                                                                                           tmp_path, monkeypatch):
    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

    # Batches made in this process: a job's loader workers outlive its run (MpDeviceLoader's thread keeps their
    # iterator, blocked on its full queue) and each took up to 5 s to join when collected (~20 s per family here).
    monkeypatch.setattr(type(XLA_BACKEND), "loader_options", property(lambda self: {"num_workers": 0,
                                                                                     "pin_memory": False}))
    source = str(family_dir(name))
    # The smallest shapes that hold every family's prompts (the chat templates differ in length), 3 steps: the
    # first compiles the step, the second again with the optimizer's state, the third nothing (xla_checks="strict"
    # raises at a compilation or an undeclared host read after those two).
    common = dict(model=source, device="xla", xla_checks="strict", method="lora", lora_r=2, steps=3, log_every=3,
                  eval_every=3, save_every=3, eval_batches=1, warmup_steps=1, lr=1e-2, seed=0)
    sft_steps, grpo_steps = _Compilations(), _Compilations()
    sft = Finetune(FinetuneConfig(lora_targets="all-linear", batch_size=2, seq_len=48, max_records=40,
                                  out_dir=str(tmp_path / "sft"), **common),
                   backend=XLA_BACKEND, progress=False, callbacks=[sft_steps])
    sft.train()
    assert sft.data_stats["dropped"] == 0 and sft_steps.steps[2] == 0, (sft.data_stats, sft_steps.steps)
    # GRPO without the KL term (no reference pass: one graph fewer), one prompt and two answers of two tokens: a
    # prefill and a decode graph in the first step's rollout, none in the next ones. Adapters on the two
    # projections every family names alike (all-linear above: ~40% more compile time, ~6 s per family here).
    grpo = GRPO(GRPOConfig(lora_targets="o_proj,down_proj", start_from=None, batch_size=1, num_generations=2,
                           max_prompt_len=48, max_new_tokens=2, kl_beta=0.0, max_records=4,
                           rewards="tests.algorithms.test_grpo:odd_first_character", out_dir=str(tmp_path / "grpo"),
                           **common),
                backend=XLA_BACKEND, progress=False, callbacks=[grpo_steps])
    grpo.train()
    assert grpo.data_stats["too_long"] == 0 and grpo_steps.steps[2] == 0, (grpo.data_stats, grpo_steps.steps)
    assert grpo.rollouts.stop_ids == hf.eos_ids(grpo.tokenizer, grpo.model)  # the family's stops end the answers
    print(f"{name} on XLA:CPU, compilations per step: LoRA SFT {sft_steps.steps}, GRPO {grpo_steps.steps}")

    # The merged export: plain transformers reloads it, with the family's tokenizer and stop tokens, and it computes
    # what the trained model computes.
    merged = sft.export(weights="last")["merged"]
    tok = sft.tokenizer
    ids = torch.tensor([tok(hf.prompt_texts(tok, _chats()[:1])[0] + "5", add_special_tokens=False)["input_ids"]])
    trained = sft.trainer.model.to("cpu").eval()  # off the device: no graph to compile for this forward
    plain = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        want, got, before = (m(input_ids=ids).logits for m in (trained, plain, base))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # fp32 merge of W + B @ A * scale
    assert not torch.allclose(got, before, atol=1e-2)  # three steps moved the adapters
    assert transformers.GenerationConfig.from_pretrained(merged).eos_token_id == \
        tok.convert_tokens_to_ids(list(FAMILIES[name].stops))
    assert transformers.AutoTokenizer.from_pretrained(merged).chat_template == FAMILIES[name].template
