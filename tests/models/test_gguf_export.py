"""The GGUF export (models/gguf_export.py, EXPORT_GGUF): a fine-tuning job's merged model as a .gguf file that
transformers' GGUF reader loads back answering as the merged model does (f16: the same greedy tokens; q8_0 and bf16: on
most prompts), each family the writer maps, the tokenizer's vocabulary, merges and chat template in the file, and the bad
inputs refused when the config or the job is built, before training."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tests.models.families import SIZES, family_tokenizer, random_model
from tpu_helpers.config import ConfigError, config_from_parameters
from tpu_helpers.core.extras import MissingExtra
from tpu_helpers.data.sft import prompts_and_answers
from tpu_helpers.models import gguf_export
from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig

gguf = pytest.importorskip("gguf")


def _load(path):
    """The model transformers' GGUF reader builds from `path`, in float32."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def _greedy(model, prompts: list[torch.Tensor], n: int = 8) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                               min_new_tokens=n, pad_token_id=0)[0, ids.shape[1]:].tolist() for ids in prompts]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(job, paths) of a short LoRA fine-tuning of the tiny Qwen2 whose export writes model-f16.gguf. Its adapters'
    B matrices are then drawn at random (as tests/models/families.py's random_lora): a few steps leave the tiny
    model answering one token over and over, which would make the token-for-token comparisons vacuous."""
    out = tmp_path_factory.mktemp("gguf")
    job = Finetune(FinetuneConfig(device="cpu", steps=4, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=2,
                                  eval_every=4, eval_batches=1, log_every=4, save_every=4, max_records=200,
                                  out_dir=str(out / "run"), xla_checks="off", export_gguf="f16"), progress=False)
    job.train()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in job.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    return job, job.export(weights="last")


def _prompts(job) -> list[torch.Tensor]:
    chats, _ = prompts_and_answers(job.held_out[:10], job.tokenizer)
    texts = [job.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    return [job.tokenizer(t, return_tensors="pt", add_special_tokens=False).input_ids for t in texts]


def test_the_f16_gguf_answers_with_the_merged_exports_greedy_tokens(exported):
    job, paths = exported
    assert paths["gguf"] == str(Path(job.config.out_dir) / "model-f16.gguf")
    merged = transformers.AutoModelForCausalLM.from_pretrained(paths["merged"], dtype=torch.float32).eval()
    gguf_model = _load(Path(paths["gguf"]))
    prompts = _prompts(job)
    want = _greedy(merged, prompts)
    assert len({tuple(w) for w in want}) > 1, want  # answers that differ: the comparison can fail
    assert _greedy(gguf_model, prompts) == want
    # The LoRA training is in the file: the untrained base answers otherwise.
    base = transformers.AutoModelForCausalLM.from_pretrained(job.source, dtype=torch.float32).eval()
    assert _greedy(base, prompts) != want


@pytest.mark.parametrize("kind, matrices, share", [("q8_0", "Q8_0", 0.6), ("bf16", "BF16", 1.01)])
def test_the_q8_0_and_bf16_files_agree_with_the_merged_export_on_most_prompts(exported, tmp_path, kind, matrices,
                                                                               share):
    job, paths = exported
    path = gguf_export.write_gguf(paths["merged"], tmp_path / gguf_export.file_name(kind), kind)
    assert path.stat().st_size < share * Path(paths["gguf"]).stat().st_size  # q8_0: about half of f16
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert kinds["blk.0.attn_q.weight"] == matrices and kinds["blk.0.attn_norm.weight"] == "F32", kinds
    merged = transformers.AutoModelForCausalLM.from_pretrained(paths["merged"], dtype=torch.float32).eval()
    prompts = _prompts(job)
    same = sum(a == b for a, b in zip(_greedy(_load(path), prompts), _greedy(merged, prompts), strict=True))
    assert same >= 0.7 * len(prompts), same


def test_the_gguf_holds_the_tokenizer_and_its_chat_template(exported):
    job, paths = exported
    reader = gguf.GGUFReader(paths["gguf"])
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    tok = job.tokenizer
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    assert field("tokenizer.ggml.tokens") == [t for t, _ in vocab]
    # transformers loads the tiny tokenizer as Qwen2's, with Qwen2's split: the export's tokenizer.json says so.
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "qwen2"
    assert field("tokenizer.ggml.eos_token_id") == tok.eos_token_id
    # The tiny tokenizer adds neither BOS nor EOS: the file says so (llama.cpp would guess otherwise).
    assert (field("tokenizer.ggml.add_bos_token"), field("tokenizer.ggml.add_eos_token")) == (False, False)
    assert field("tokenizer.chat_template") == tok.chat_template
    assert len(field("tokenizer.ggml.merges")) > 100
    # transformers' reader rebuilds the tokenizer from the file: the same ids.
    path = Path(paths["gguf"])
    back = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "<|im_start|>user\nWhat is 128 plus 77? Answer in words.<|im_end|>\n"
    assert back(text).input_ids == tok(text).input_ids


# Each family the writer maps, at toy size, with the values transformers' GGUF reader assumes where the file does
# not say (it takes Qwen3's head_dim, Gemma's query_pre_attn_scalar and Gemma 3's layer pattern from its config
# defaults, the released models' values, and reads no sliding window for Mistral or Phi-3).
READER_CONFIGS = {
    "llama": ("llama3", lambda **kw: transformers.LlamaConfig(tie_word_embeddings=True, **SIZES, **kw)),
    "mistral": ("mistral", lambda **kw: transformers.MistralConfig(sliding_window=None, **SIZES, **kw)),
    "qwen2": ("qwen2", lambda **kw: transformers.Qwen2Config(tie_word_embeddings=True, **SIZES, **kw)),
    "qwen3": ("qwen3", lambda **kw: transformers.Qwen3Config(head_dim=128, tie_word_embeddings=True, **SIZES, **kw)),
    "gemma2": ("gemma2", lambda **kw: transformers.Gemma2Config(head_dim=8, query_pre_attn_scalar=256,
                                                                sliding_window=6, **SIZES, **kw)),
    "gemma3_text": ("gemma3", lambda **kw: transformers.Gemma3TextConfig(head_dim=8, query_pre_attn_scalar=256,
                                                                         sliding_window=6, **SIZES, **kw)),
    "phi3": ("phi3", lambda **kw: transformers.Phi3Config(sliding_window=None, **SIZES, **kw)),
}


def test_the_family_table_is_the_one_tested():
    assert set(READER_CONFIGS) == set(gguf_export.FAMILIES)


@pytest.mark.parametrize("model_type", sorted(READER_CONFIGS))
def test_each_family_round_trips_through_transformers_gguf_reader(model_type, tiny_lm_dir, tmp_path):
    family, make = READER_CONFIGS[model_type]
    tok = family_tokenizer(family, tiny_lm_dir)
    tok.pad_token = tok.pad_token or tok.eos_token
    model = random_model(make(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id))
    assert model.config.model_type == model_type
    with torch.no_grad():  # norms away from their init, so Gemma's stored 1 + w is checked
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    path = gguf_export.write_gguf(tmp_path / "m", tmp_path / "m.gguf", "f16", name="tiny")
    back = _load(path)
    with torch.no_grad():  # the file's matrices are f16 and its vectors f32: so are the reference's now
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(p.half().float())
    ids = tok(["What is 12 plus 7? Say it in words, please.", "Hi there, who are you?"], padding=True,
              return_tensors="pt")
    with torch.no_grad():  # the prompts' own positions (padding's logits mean nothing)
        want, got = (m(**ids).logits[ids.attention_mask.bool()] for m in (model, back))
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)


def test_llama3_rope_scaling_writes_the_rope_factors_llama_cpp_reads(tiny_lm_dir, tmp_path):
    tok = family_tokenizer("llama3", tiny_lm_dir)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    config = transformers.LlamaConfig(rope_scaling=scaling, vocab_size=len(tok), **SIZES)
    random_model(config).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    reader = gguf.GGUFReader(str(gguf_export.write_gguf(tmp_path / "m", tmp_path / "m.gguf", "f16")))
    factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data
    head = SIZES["hidden_size"] // SIZES["num_attention_heads"]
    assert len(factors) == head // 2 and factors[0] == 1.0 and factors[-1] == 8.0  # fast ones kept, slow ones / 8


def test_a_bad_export_gguf_is_refused_naming_the_allowed_types():
    with pytest.raises(ConfigError, match=r"^EXPORT_GGUF='q4_k' is not one of \('f16', 'bf16', 'q8_0'\)$"):
        config_from_parameters({"EXPORT_GGUF": "q4_k"}, base=FinetuneConfig())
    with pytest.raises(ConfigError, match=r"export_gguf='f16' is written from the merged model: it needs "
                                          r"export_merged=True"):
        FinetuneConfig(export_gguf="f16", export_merged=False)
    from tpu_helpers.recipes.grpo import GRPOConfig
    from tpu_helpers.recipes.preference import PreferenceConfig

    for base in (FinetuneConfig(), GRPOConfig(), PreferenceConfig()):  # every Hugging Face job has it
        assert config_from_parameters({"EXPORT_GGUF": "q8_0"}, base=base).export_gguf == "q8_0"


def test_a_family_the_writer_cannot_map_is_refused_when_the_job_is_built(tmp_path):
    model = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(model)  # its config is all it reads
    config = FinetuneConfig(model=str(model), export_gguf="f16", device="cpu", out_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^EXPORT_GGUF: a 'gpt2' model is not one the GGUF export writes; it writes "
                                          r"gemma2, gemma3_text, llama, mistral, phi3, qwen2, qwen3 "):
        Finetune(config, progress=False)
    Finetune(config.replace(export_gguf=None), progress=False)  # no EXPORT_GGUF: nothing to refuse
    yarn = transformers.Qwen2Config(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32768})
    with pytest.raises(ConfigError, match=r"qwen2 with rope scaling 'yarn' is not written by the GGUF export"):
        gguf_export.check_exportable(yarn)


def test_without_the_gguf_package_the_job_names_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf then raises ImportError, as where it is absent
    with pytest.raises(MissingExtra, match=r"^EXPORT_GGUF \(the GGUF export, tpu_helpers.models.gguf_export\) needs the "
                                           r"'gguf' extra \(gguf\); not installed here: gguf\. Install it with: pip "
                                           r"install \"tpu_helpers\[gguf\]\""):
        Finetune(FinetuneConfig(export_gguf="f16", device="cpu", out_dir=str(tmp_path)), progress=False)


def _byte_fallback_tokenizer():
    """A tiny tokenizer in the form Llama 2's, Mistral's, Gemma's and Phi-3's tokenizer.json take: BPE over "▁"-joined
    words with byte fallback (<unk>, <s>, </s>, then the 256 byte tokens, then the learned ones) that starts every
    text with <s>, trained on the package's offline text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors, trainers

    from tpu_helpers.models.hf_tiny import _training_text

    words = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.normalizer = words
    learner.train_from_iterator(_training_text(), trainers.BpeTrainer(vocab_size=300))
    learned = learner.get_vocab()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for token, _ in sorted(learned.items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(learner.to_str())["model"]["merges"]]
    spm = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    spm.normalizer = words
    spm.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    spm.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    spm.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=spm, bos_token="<s>", eos_token="</s>",
                                               unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    return tok, merges


def test_a_byte_fallback_tokenizer_is_written_as_llama_cpps_sentencepiece_vocabulary(tmp_path):
    tok, merges = _byte_fallback_tokenizer()
    config = transformers.MistralConfig(vocab_size=len(tok), sliding_window=None, **SIZES)
    random_model(config).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    path = gguf_export.write_gguf(tmp_path / "m", tmp_path / "m.gguf", "q8_0")
    fields = gguf.GGUFReader(str(path)).fields
    field = lambda key: fields[key].contents()  # noqa: E731
    assert (field("tokenizer.ggml.model"), field("tokenizer.ggml.add_space_prefix")) == ("llama", True)
    assert (field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.add_bos_token")) == (1, True)
    assert field("tokenizer.ggml.add_eos_token") is False
    types, scores, tokens = field("tokenizer.ggml.token_type"), field("tokenizer.ggml.scores"), \
        field("tokenizer.ggml.tokens")
    assert types[:3] == [gguf.TokenType.CONTROL] * 3 and set(types[3:259]) == {gguf.TokenType.BYTE}
    assert set(types[259:]) == {gguf.TokenType.NORMAL}
    # A merge's result scores by its rank (llama.cpp merges the best-scoring pair first): the first merge scores 0.
    first, second = ("".join(m) for m in merges[:2])
    assert (scores[tokens.index(first)], scores[tokens.index(second)]) == (0.0, -1.0)
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    mine = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    # (Text that starts with a space is left out: transformers' rebuild prefixes it its own way, llama.cpp as above.)
    for text in ["What is 12 plus 7?", "Hello there, general Kenobi. ünïcödé ✓", "two  spaces\nand a line"]:
        assert back(text).input_ids == mine(text).input_ids, text


def test_a_split_llama_cpp_has_no_name_for_is_written_as_default_with_a_warning(tiny_lm_dir, tmp_path):
    import shutil

    model = shutil.copytree(tiny_lm_dir, tmp_path / "m")
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\w+|\\s+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.warns(UserWarning, match=r"splits text in a way this export does not name for llama.cpp"):
        path = gguf_export.write_gguf(model, tmp_path / "m.gguf", "f16")
    assert gguf.GGUFReader(str(path)).fields["tokenizer.ggml.pre"].contents() == "default"
