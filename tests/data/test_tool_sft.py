"""SFT on tool-calling conversations (data/sft.py): TRL's SFT form (`messages` with assistant `tool_calls` and `tool`
messages, `tools` as schemas or a JSON string) is encoded by `agents.ChatFormat.render`, the ids an RL episode
gathers, with labels on the assistant's own tokens only: on SmolLM2's real template (the Hermes fallback) and on
Qwen2.5's native tool template; compared with TRL 1.16's SFTTrainer tokenization; read from JSONL and Parquet;
trained end to end by the fine-tuning recipe, whose export GRPO's START_FROM takes; bad records are named."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.agents.test_chat import SCHEMAS, multiply  # noqa: F401 (the same tool as the chat tests)
from tests.models.families import family_tokenizer
from tpu_helpers.agents import ChatFormat
from tpu_helpers.config import ConfigError
from tpu_helpers.data.sft import (
    build_sft_datasets,
    chat_format,
    encode_record,
    load_records,
    prompts_and_answers,
    tokenize_records,
)

ctu = pytest.importorskip("trl.chat_template_utils")


PLAIN = {"messages": [{"role": "user", "content": "2 + 3 ="}, {"role": "assistant", "content": "5"}]}
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'


def trl_record(*, tools_as_string: bool = True, arguments_as_string: bool = True) -> dict:
    """A record as TRL's tool-calling data sets write it: the call's turn without content, arguments and tools as
    JSON strings."""
    arguments = {"a": 3, "b": 4}
    return {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3 times 4?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "multiply", "arguments": json.dumps(arguments) if arguments_as_string else arguments}}]},
        {"role": "tool", "name": "multiply", "content": "12"},
        {"role": "assistant", "content": "It is 12."}],
        "tools": json.dumps(SCHEMAS) if tools_as_string else SCHEMAS}


def normalised(record: dict) -> list[dict]:
    """The record's messages as an episode holds them (parsed calls: arguments a dict, content "")."""
    messages = copy.deepcopy(record["messages"])
    messages[2] = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]}
    return messages


def trained_runs(tok, ids: list[int], labels: list[int]) -> list[str]:
    """The text of each run of consecutive trained tokens."""
    runs, run = [], []
    for i, lab in zip(ids, labels, strict=True):
        if lab != -100:
            assert lab == i
            run.append(i)
        elif run:
            runs.append(tok.decode(run))
            run = []
    if run:
        runs.append(tok.decode(run))
    return runs


def smollm2_tokenizer():
    from tpu_helpers.models import smollm2

    target = smollm2.default_cache_dir() / smollm2.DIR_NAME
    if not smollm2.is_complete(target):
        pytest.skip("SmolLM2 is not built in the package cache (models/smollm2.py)")
    return AutoTokenizer.from_pretrained(target)


def qwen25_tokenizer(tiny_lm_dir, template: str = "qwen2_5.jinja"):
    tok = family_tokenizer("qwen2", tiny_lm_dir)
    tok.chat_template = (ctu._CHAT_TEMPLATES_DIR / template).read_text()
    return tok


@pytest.mark.parametrize("which", ["smollm2-fallback", "qwen2.5-native"])
def test_labels_are_the_assistant_turns_and_ids_are_chatformats_render(which, tiny_lm_dir):
    tok = smollm2_tokenizer() if which == "smollm2-fallback" else qwen25_tokenizer(tiny_lm_dir)
    fmt = ChatFormat(tok)
    assert fmt.native == (which == "qwen2.5-native")
    for record in (trl_record(), trl_record(tools_as_string=False, arguments_as_string=False)):
        ids, labels = encode_record(tok, record)
        rendered = fmt.render(normalised(record), SCHEMAS)
        assert ids == rendered.ids  # SFT and RL render the same way
        assert labels == [t if k else -100 for t, k in zip(rendered.ids, rendered.mask, strict=True)]
        # The call's turn and the final answer, each up to its end-of-turn token; no system, user or tool text.
        assert trained_runs(tok, ids, labels) == [CALL + "<|im_end|>", "It is 12.<|im_end|>"]
        text = tok.decode(ids)
        assert "Be brief." in text and '"name": "multiply", "description": "Multiply two integers."' in text
        assert "<tool_response>\n12\n</tool_response>" in text


def test_the_tiny_models_template_and_a_record_without_tools_use_the_fallback(tiny_lm_dir):
    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    record = trl_record()
    del record["tools"]  # tool calls and tool messages alone make a tool conversation
    ids, labels = encode_record(tok, record)
    assert ids == ChatFormat(tok).render(normalised(record)).ids
    assert trained_runs(tok, ids, labels) == [CALL + "<|im_end|>", "It is 12.<|im_end|>"]
    assert "<tools>" not in tok.decode(ids)


def test_plain_chat_records_keep_their_encoding(tiny_lm_dir):
    # The plain encoding trains the template's newline after <|im_end|> too; tool conversations follow the episode.
    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    plain = PLAIN
    with_nones = {"messages": [{**m, "tool_calls": None, "name": None} for m in plain["messages"]], "tools": None}
    ids, labels = encode_record(tok, plain)
    assert trained_runs(tok, ids, labels) == ["5<|im_end|>\n"]
    assert encode_record(tok, with_nones) == (ids, labels)  # an Arrow table's empty tool columns change nothing


def test_chatformat_is_made_once_per_tokenizer_and_template(tiny_lm_dir):
    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    fmt = chat_format(tok)
    assert chat_format(tok) is fmt
    tok.chat_template = ctu.qwen2_5_chat_template
    assert chat_format(tok) is not fmt and chat_format(tok).native


def test_the_same_ids_and_text_as_trl_and_labels_inside_trls(tiny_lm_dir, tmp_path):
    """TRL 1.16: `apply_chat_template` renders the same text on a native template, and SFTTrainer's tokenization
    with assistant_only_loss (Qwen2.5's training template, with {% generation %}) gives the same ids; its labels
    are ours plus the template's whitespace around each turn (the newline after the generation prompt's
    'assistant' and after <|im_end|>), which the model never writes in an episode."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM
    from trl.data_utils import apply_chat_template

    assert trl.__version__.startswith("1.16")
    record = trl_record()
    for template in ("qwen2_5.jinja", "qwen2_5_training.jinja"):
        tok = qwen25_tokenizer(tiny_lm_dir, template)
        ids, labels = encode_record(tok, record)
        text = apply_chat_template({"messages": normalised(record)}, tok, tools=SCHEMAS)["text"]
        assert tok.decode(ids) == text
    trainer = trl.SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_lm_dir), processing_class=tok,
        args=trl.SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, max_length=None, report_to=[],
                           use_cpu=True),
        train_dataset=datasets.Dataset.from_list([{"messages": normalised(record), "tools": record["tools"]}]))
    row = trainer.train_dataset[0]
    assert row["input_ids"] == ids
    extra = [i for i, (ours, theirs) in enumerate(zip(labels, row["labels"], strict=True)) if ours != theirs]
    assert all(labels[i] == -100 and tok.decode([row["labels"][i]]).strip() == "" for i in extra) and extra
    assert trained_runs(tok, row["input_ids"], row["labels"]) == [
        "\n" + CALL + "<|im_end|>\n", "\nIt is 12.<|im_end|>\n"]


def test_what_trl_does_with_a_template_without_tools():
    """SmolLM2's ChatML renders no tools: TRL's apply_chat_template silently drops the schemas and the call (the
    assistant turn is empty), and SFTTrainer's assistant_only_loss refuses the template (no {% generation %}, no
    training template for it). Here the Hermes fallback renders both, as the RL episode does."""
    from trl.data_utils import apply_chat_template

    tok = smollm2_tokenizer()
    record = trl_record()
    text = apply_chat_template({"messages": normalised(record)}, tok, tools=SCHEMAS)["text"]
    assert "multiply" not in text and "<|im_start|>assistant\n<|im_end|>" in text
    with pytest.raises(ValueError, match="not training-compatible"):
        ctu.get_training_chat_template(tok)
    ids, _ = encode_record(tok, record)
    assert CALL in tok.decode(ids) and "<tools>" in tok.decode(ids)


def test_jsonl_and_parquet_with_tools_as_a_string_column(tmp_path, tiny_lm_dir):
    import datasets

    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    plain = PLAIN
    records = [trl_record(arguments_as_string=False), trl_record(), plain]
    jsonl = tmp_path / "tools.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records))
    parquet = tmp_path / "tools.parquet"
    datasets.Dataset.from_list(records[1:]).to_parquet(str(parquet))  # Arrow: tools a string column
    want = [encode_record(tok, r) for r in records]
    assert [encode_record(tok, r) for r in load_records(str(jsonl))] == want
    assert [encode_record(tok, r) for r in load_records(str(parquet))] == want[1:]
    data, stats = tokenize_records(tok, load_records(str(parquet)), seq_len=700)
    assert stats["truncated"] == 0 and len(data) == 2


def test_held_out_prompts_of_tool_conversations_are_the_episodes_prompt(tiny_lm_dir):
    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    record = trl_record()
    (prompt,), (answer,) = prompts_and_answers([record], tok)
    fmt = ChatFormat(tok)
    assert tok(prompt, add_special_tokens=False)["input_ids"] == fmt.prompt_ids(normalised(record)[:4], SCHEMAS)
    assert answer == "It is 12."
    with pytest.raises(ConfigError, match=r"record 0 is a tool conversation.*pass tokenizer="):
        prompts_and_answers([record])


def _multiply_records(n: int) -> list[dict]:
    out = []
    for k in range(n):  # distinct conversations: a held-out one has no twin in training
        a, b = k % 10, k // 10
        out.append({"messages": [
            {"role": "user", "content": f"What is {a} times {b}?"},
            {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                "name": "multiply", "arguments": json.dumps({"a": a, "b": b})}}]},
            {"role": "tool", "name": "multiply", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]})
    return out


def test_the_finetune_recipe_trains_on_tool_records_and_grpo_starts_from_its_run(tmp_path):
    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

    data = tmp_path / "tools.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _multiply_records(200)))

    def finetune(out: Path, **overrides) -> Finetune:
        settings = dict(device="cpu", dataset=str(data), method="full", steps=20, batch_size=8, seq_len=128, lr=3e-3,
                        warmup_steps=2, eval_every=10, eval_batches=2, log_every=2, save_every=20, out_dir=str(out),
                        xla_checks="off", max_new_tokens=8)
        return Finetune(FinetuneConfig(**{**settings, **overrides}), progress=False)

    job = finetune(tmp_path / "sft")
    assert job.plan().summary()  # the memory plan reads the config alone
    assert job.data_stats["truncated"] == 0 and job.data_stats["dropped"] == 0
    report = job.train()
    losses = [r["loss"] for r in job.history.train]
    assert losses[-1] < 0.7 * losses[0] and report.final_val_loss < report.first_val_loss, losses
    samples = job.samples(n=2)  # held-out prompts: the rendered conversations up to their last answer
    assert len(samples["rows"]) == 2 and samples["rows"][0]["prompt"].endswith("<|im_start|>assistant\n")
    paths = job.export()
    # START_FROM: a fine-tuning run's OUT_DIR, its merged export taken as it is ...
    grpo = GRPO(GRPOConfig(device="cpu", start_from=str(tmp_path / "sft"), out_dir=str(tmp_path / "grpo")),
                progress=False)
    assert grpo.start_source == paths["merged"]
    # ... or, a LoRA run exported without the merged model, its adapter merged into MODEL once.
    lora_job = finetune(tmp_path / "lora", method="lora", steps=2, save_every=2, eval_every=2)
    lora_job.train()
    assert set(lora_job.export(merged=False)) == {"adapter"}
    grpo = GRPO(GRPOConfig(device="cpu", start_from=str(tmp_path / "lora"), out_dir=str(tmp_path / "grpo2")),
                progress=False)
    assert grpo.start_source == str(tmp_path / "grpo2" / "start")
    assert (tmp_path / "grpo2" / "start" / "config.json").is_file()


GOOD = trl_record()


def bad(path: tuple, value) -> dict:
    record = copy.deepcopy(GOOD)
    node = record
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return record


@pytest.mark.parametrize("record, match", [
    (bad(("messages", 3, "content"), KeyError),
     r"record 1 messages\[3\] \(tool\) has no content: a tool message carries the tool's result as 'content'"),
    (bad(("messages", 3, "content"), None), r"record 1 messages\[3\] \(tool\) has no content"),
    (bad(("messages", 2, "tool_calls", 0, "function", "name"), KeyError),
     r"record 1 messages\[2\] tool_calls\[0\] is .*not a tool call: each needs a function name and arguments"),
    (bad(("messages", 2, "tool_calls", 0, "function", "arguments"), "{a: 3"),
     r"record 1 messages\[2\] tool_calls\[0\] is .*arguments that are a JSON object"),
    (bad(("messages", 2, "tool_calls", 0, "function", "arguments"), "[3, 4]"), r"tool_calls\[0\] is .*JSON object"),
    (bad(("messages", 2, "tool_calls", 0), "multiply(3, 4)"), r"tool_calls\[0\] is 'multiply\(3, 4\)', not a tool"),
    (bad(("messages", 2, "tool_calls"), {"name": "multiply"}),
     r"messages\[2\] \(assistant\) has tool_calls=.*only an assistant message carries tool calls, as a list"),
    (bad(("messages", 1, "tool_calls"), [{"function": {"name": "multiply"}}]),
     r"messages\[1\] \(user\) has tool_calls="),
    (bad(("tools",), {"type": "function", "function": {"name": "multiply"}}),
     r"record 1 field 'tools' is .*not a list of tool schemas \(each a dict with a function name\)"),
    (bad(("tools",), ["multiply"]), r"field 'tools' is \"\['multiply'\]\", not a list of tool schemas"),
    (bad(("tools",), "[{"), r"record 1 field 'tools' is a string that is not JSON"),
], ids=["tool-no-content", "tool-none-content", "call-no-name", "arguments-not-json", "arguments-not-object",
        "call-a-string", "tool_calls-not-a-list", "tool_calls-on-user", "tools-a-dict", "tools-of-names",
        "tools-bad-json"])
def test_bad_tool_records_name_the_record_and_what_is_allowed(record, match, tiny_lm_dir):
    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    with pytest.raises(ConfigError, match=match) as err:
        build_sft_datasets(tok, [GOOD, record, GOOD], seq_len=700)
    assert "Accepted: {\"messages\": [...], \"tools\": [JSON schemas]}" in str(err.value)


def test_a_template_chatformat_refuses_names_the_record(tiny_lm_dir):
    # Qwen3's own template drops an earlier answer's think block once a later turn follows: not prefix-preserving.
    tok = family_tokenizer("qwen3", tiny_lm_dir)
    with pytest.raises(ConfigError, match=r"^record 2: the chat template is not prefix-preserving"):
        tokenize_records(tok, [PLAIN, PLAIN, trl_record()], seq_len=700)
