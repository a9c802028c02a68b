"""The 4-bit base of QLoRA (models/quant4.py): NF4 and int4 against torchao's reference on the same inputs, loading
tensor by tensor from the safetensors shards, LoRA (peft) on top with merge/unmerge, strict LoRA SFT and GRPO runs
on XLA:CPU, the merged export, and bad settings."""

from __future__ import annotations

import json

import pytest
import torch

from tpu_helpers.config import ConfigError, config_from_parameters
from tpu_helpers.models import hf, lora, quant4

IDS = torch.tensor([[1, 87, 85, 269, 201, 400, 3, 77], [5, 6, 7, 8, 9, 10, 11, 12]])
# The QLoRA paper's NormalFloat-4 values (arXiv:2305.14314, appendix E; bitsandbytes' table to float32).
PAPER_NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
             1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_codes_and_scales_equal_torchaos_to_the_bit(dtype):
    try:  # torchao 0.16 (the dev set's); 0.18 (the latest stack's) moved it under quantization
        from torchao.dtypes.nf4tensor import get_block_absmax, to_nf4
    except ImportError:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import get_block_absmax, to_nf4

    w = (torch.randn(128, 256) * torch.rand(128, 1) * 3).to(dtype)
    w[0, :64] = 0.0  # an all-zero group: torchao divides by a zero absmax too (NaN -> code 0); so must we
    ref = to_nf4(w, 64, 256)
    packed, scales = quant4.quantize(w, quant4.FORMATS["nf4"], 64)
    assert packed.dtype == torch.uint8 and packed.shape == (128, 128)
    assert torch.equal(packed.reshape(-1), ref.quantized_data)
    assert torch.equal(scales.reshape(-1), get_block_absmax(w.reshape(-1), 64).float())
    assert torch.equal(ref.nf4, torch.tensor(quant4.NF4_TABLE, dtype=dtype))
    torch.testing.assert_close(torch.tensor(quant4.NF4_TABLE), torch.tensor(PAPER_NF4), rtol=0, atol=5e-5)
    # Dequantized: torchao's values (its scales double-quantized to int8, ours exact) up to that scale error.
    got = quant4.dequantize(packed, scales, quant4.code_table(quant4.FORMATS["nf4"]))
    want = ref.get_original_weight().float()
    assert (got[1:] - want[1:]).abs().max() <= 0.01 * w.float().abs().max()


def test_int4_round_trip_is_torchaos_symmetric_groupwise_int4():
    from torchao.quantization.quant_primitives import (
        MappingType,
        choose_qparams_affine,
        dequantize_affine,
        quantize_affine,
    )

    w = torch.randn(64, 96) * torch.rand(64, 1)
    block = (1, 32)
    scale, zero = choose_qparams_affine(w, MappingType.SYMMETRIC, block, torch.int8, -8, 7)
    q = quantize_affine(w, block, scale, zero, torch.int8, -8, 7)
    packed, scales = quant4.quantize(w, quant4.FORMATS["int4"], 32)
    codes = quant4.unpack_codes(packed)
    assert torch.equal(codes - 8, q.long()) and torch.equal(scales, scale.reshape(64, 3))
    assert torch.equal(quant4.dequantize(packed, scales, quant4.code_table(quant4.FORMATS["int4"])),
                       dequantize_affine(q, block, scale, zero, torch.int8, -8, 7))


def test_streamed_load_equals_quantizing_the_loaded_model_and_takes_peft_lora(tmp_path, tiny_lm_dir):
    from transformers import AutoModelForCausalLM

    # Sharded on purpose: the index and several files, read one tensor at a time.
    AutoModelForCausalLM.from_pretrained(tiny_lm_dir).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    streamed = quant4.load_quantized_lm(str(tmp_path / "sharded"), "nf4", 32, attn_implementation=hf.DEFAULT_ATTN)
    whole = quant4.quantize_model(hf.load_causal_lm(str(tiny_lm_dir))[0], "nf4", 32)
    a, b = streamed.state_dict(), whole.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(p.is_meta for p in streamed.parameters())
    assert type(streamed.model.layers[0].mlp.down_proj) is quant4.Linear4bit and type(streamed.lm_head) is torch.nn.Linear
    assert streamed.lm_head.weight is streamed.model.embed_tokens.weight  # the tie survives
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=IDS).logits, whole(input_ids=IDS).logits)

    model = lora.add_lora(streamed, r=4, targets="all-linear")
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    assert isinstance(layer.base_layer, quant4.Linear4bit) and layer.lora_A["default"].weight.dtype == torch.float32
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if "lora_" in n}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
        before = model(input_ids=IDS).logits
        with model.disable_adapter():
            no_adapter = model(input_ids=IDS).logits
        base = layer.base_layer.dequantize().clone()
        model.merge_adapter()  # dequantize, add B @ A * scale, quantize again (lossy, as peft's 4-bit merge)
        merged = model(input_ids=IDS).logits
        delta = layer.get_delta_weight("default")
        assert (layer.base_layer.dequantize() - base - delta).abs().max() <= layer.base_layer.weight_scale.max()
        model.unmerge_adapter()
        assert not layer.merged and (layer.base_layer.dequantize() - base).abs().max() > 0  # requantized twice
    # The merged base computes what base + adapter did, up to the requantization: far nearer than the base alone.
    assert (merged - before).abs().mean() < 0.5 * (no_adapter - before).abs().mean()


def test_the_merged_export_is_the_dequantized_base_plus_the_adapter(tmp_path, tiny_lm_dir):
    from transformers import AutoModelForCausalLM

    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig

    job = Finetune(FinetuneConfig(device="cpu", quantize_base="int4", quantize_group_size=32, lora_r=4,
                                  lora_targets="q_proj,v_proj,down_proj", steps=1, max_records=64, seq_len=32,
                                  out_dir=str(tmp_path / "run")), progress=False)
    model = job.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
        want = model(input_ids=IDS).logits
    # In fp32, through the same merge: the logits of the dequantized base + adapter.
    fp32 = lora.export_merged(model, job.tokenizer, tmp_path / "fp32", base_source=job.source,
                              base_state=quant4.dequantized_state(model))
    reloaded = AutoModelForCausalLM.from_pretrained(fp32)
    assert not quant4.is_quantized(reloaded)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, want, rtol=1e-4, atol=1e-4)
    # The job's export: the adapter, and the merged model in bf16, those weights rounded.
    paths = job.export(tmp_path / "out", weights="last")
    merged = AutoModelForCausalLM.from_pretrained(paths["merged"])
    assert merged.dtype == torch.bfloat16
    ref = reloaded.state_dict()
    assert all(torch.equal(v, ref[k].to(torch.bfloat16)) for k, v in merged.state_dict().items())
    assert json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())["r"] == 4
    # The adapter on the 4-bit base loaded again: the trained model itself.
    from peft import PeftModel

    again = PeftModel.from_pretrained(quant4.load_quantized_lm(job.source, "int4", 32, attn_implementation="eager"),
                                      paths["adapter"])
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.xla
def test_strict_xla_lora_sft_on_a_4bit_base_compiles_once_with_no_fallback(tmp_path):
    from tests.support import XLA_BACKEND
    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig

    cfg = FinetuneConfig(device="xla", quantize_base="nf4", quantize_group_size=32, steps=8, batch_size=8,
                         seq_len=32, lr=3e-3, warmup_steps=2, eval_every=4, eval_batches=2, log_every=4, save_every=4,
                         out_dir=str(tmp_path / "run"), xla_checks="strict", max_records=400, grad_accum=2)
    job = Finetune(cfg, backend=XLA_BACKEND, progress=False)
    report = job.train()  # xla_checks="strict": a recompile, a host read or a CPU fallback after warm-up raises
    losses = [r["loss"] for r in job.history.train]
    assert losses[-1] < losses[0] and report.final_val_loss < report.first_val_loss
    assert report.xla["compilations"] <= 3 and report.xla["cpu_fallback_ops"] == {}, report.xla
    layer = job.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert type(layer) is quant4.Linear4bit and layer.weight.dtype == torch.uint8


@pytest.mark.xla
def test_strict_xla_grpo_step_on_a_4bit_base(tmp_path):
    from tests.support import XLA_BACKEND
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

    cfg = GRPOConfig(device="xla", start_from=None, quantize_base="int4", quantize_group_size=32, steps=3,
                     batch_size=2, num_generations=2, max_prompt_len=24, max_new_tokens=3, lr=1e-2, warmup_steps=1,
                     log_every=1, save_every=3, out_dir=str(tmp_path / "run"), xla_checks="strict", max_records=32,
                     lora_r=4)
    job = GRPO(cfg, backend=XLA_BACKEND, progress=False)
    report = job.train()
    assert report.xla["problems"] == [] and report.xla["cpu_fallback_ops"] == {}, report.xla
    assert job.history.train[0]["kl"] == 0.0  # the reference is the same 4-bit base with the adapter off
    assert quant4.is_quantized(job.model)


def test_bad_4bit_settings_name_the_value(tmp_path, tiny_lm_dir):
    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig
    from tpu_helpers.recipes.grpo import GRPOConfig

    with pytest.raises(ConfigError, match=r"QUANTIZE_BASE='nf4' \(QLoRA\) .* needs METHOD='lora', not 'full'"):
        config_from_parameters({"QUANTIZE_BASE": "nf4", "METHOD": "full"}, base=FinetuneConfig())
    with pytest.raises(ConfigError, match=r"QUANTIZE_BASE='nf4' \(QLoRA\) .* needs METHOD='lora', not 'full'"):
        config_from_parameters({"QUANTIZE_BASE": "nf4", "METHOD": "full", "START_FROM": None}, base=GRPOConfig())
    with pytest.raises(ConfigError, match=r"QUANTIZE_BASE='fp4' is not one of \('nf4', 'int4'\)"):
        config_from_parameters({"QUANTIZE_BASE": "fp4"}, base=FinetuneConfig())
    with pytest.raises(ConfigError, match=r"QUANTIZE_GROUP_SIZE=33 must be an even integer >= 2"):
        config_from_parameters({"QUANTIZE_BASE": "nf4", "QUANTIZE_GROUP_SIZE": 33}, base=FinetuneConfig())
    with pytest.raises(ConfigError, match=r"QAT='int4' and QUANTIZE_BASE='int4': choose one"):
        config_from_parameters({"QUANTIZE_BASE": "int4", "QAT": "int4"}, base=FinetuneConfig())
    with pytest.raises(ConfigError, match=r"QUANTIZE_BASE='nf4' with SHARDING='fsdp'"):
        config_from_parameters({"QUANTIZE_BASE": "nf4", "SHARDING": "fsdp"}, base=FinetuneConfig())
    # The default group of 64 does not fit the tiny model's 96-wide layers: named, with what would.
    job = Finetune(FinetuneConfig(device="cpu", quantize_base="nf4", out_dir=str(tmp_path / "run")), progress=False)
    with pytest.raises(ConfigError, match=r"QUANTIZE_GROUP_SIZE=64 does not divide the input width of q_proj, k_proj, "
                                          r"v_proj, o_proj, gate_proj, up_proj \(96\); use an even divisor of 32"):
        _ = job.model
    (tmp_path / "config.json").write_text((tiny_lm_dir / "config.json").read_text())  # a config, no weights
    with pytest.raises(ConfigError, match=r"MODEL=.* has no safetensors weights"):
        quant4.load_quantized_lm(str(tmp_path), "nf4", 32)
