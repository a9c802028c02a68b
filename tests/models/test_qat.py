"""QAT (models/qat.py): torchao's fake quantization against the stated formula, on XLA:CPU against the CPU, bad
settings, and the exports (the quantized weights through transformers' torchao integration, the merged bf16 model)."""

from __future__ import annotations

import pytest
import torch

from tests.support import XLA_BACKEND
from tpu_helpers.config import ConfigError
from tpu_helpers.models import hf, lora, qat

IDS = torch.tensor([[1, 87, 85, 269, 201, 400, 3, 77], [5, 6, 7, 8, 9, 10, 11, 12]])


def _reference(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Symmetric per-group fake quantization as the module docstring states it, in plain torch."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    g = w.reshape(w.shape[0], -1, group)
    scale = (g.abs().amax(-1, keepdim=True) / ((qmax - qmin) / 2)).clamp(min=torch.finfo(w.dtype).eps)
    return (torch.clamp(torch.round(g * (1.0 / scale)), qmin, qmax) * scale).reshape(w.shape)


def _tiny(tiny_lm_dir, scheme=None, group=32, r=0):
    model, tok = hf.load_causal_lm(str(tiny_lm_dir))
    if scheme:
        qat.add_fake_quant(model, scheme, group)
    if r:
        torch.manual_seed(1)
        model = lora.add_lora(model, r=r, targets="q_proj,v_proj,down_proj")
        with torch.no_grad():  # adapters that do something (peft starts lora_B at zero)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    return model, tok


@pytest.mark.parametrize("scheme,bits", [("int4", 4), ("int8", 8)])
def test_fake_quantized_forward_is_torchaos_and_the_stated_formula(tiny_lm_dir, scheme, bits):
    model, _ = _tiny(tiny_lm_dir, scheme)
    layer = model.model.layers[1].mlp.down_proj  # 256 inputs: 8 groups of 32
    assert type(layer).__name__ == "FakeQuantizedLinear" and type(model.lm_head).__name__ == "Linear"
    x = torch.randn(4, 256)
    want = torch.nn.functional.linear(x, _reference(layer.weight.detach(), bits, 32))
    # Tolerance: float32 rounding of the same operations in another order (1e-6 of outputs of size ~1).
    torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-6)
    # The weight takes 2^bits values per group at most, and the straight-through gradient reaches it.
    fq = layer.weight_fake_quantizer(layer.weight.detach())
    assert max(len(torch.unique(g)) for g in fq.reshape(-1, 32)) <= 2 ** bits
    layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


@pytest.mark.xla
def test_fake_quantized_lora_model_on_xla_equals_the_cpu_with_one_graph_and_no_fallback(tiny_lm_dir):
    cpu, _ = _tiny(tiny_lm_dir, "int4", r=4)
    dev, _ = _tiny(tiny_lm_dir, "int4", r=4)
    b = XLA_BACKEND
    dev = b.move_model(dev)
    want = cpu(input_ids=IDS).logits
    want.float().square().mean().backward()
    counts = []
    for _ in range(3):  # the same graph every time: compiled in the first pass only
        for p in dev.parameters():
            p.grad = None
        out = dev(input_ids=IDS.to(b.device)).logits
        out.float().square().mean().backward()
        b.sync()
        counts.append(b.metrics())
    assert counts[2]["compilations"] == counts[0]["compilations"], counts
    assert counts[2]["cpu_fallback_ops"] == {}, counts[2]["cpu_fallback_ops"]
    torch.testing.assert_close(out.cpu(), want.detach(), rtol=1e-5, atol=1e-5)
    grads = {n: p.grad for n, p in cpu.named_parameters() if p.requires_grad}
    for n, p in dev.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad.cpu(), grads[n], rtol=1e-4, atol=1e-6)


def test_bad_qat_settings_name_the_value(tiny_lm_dir):
    model, _ = hf.load_causal_lm(str(tiny_lm_dir))
    with pytest.raises(ConfigError, match=r"QAT='int3' is not one of \('int4', 'int8'\)"):
        qat.add_fake_quant(model, "int3", 32)
    with pytest.raises(ConfigError, match=r"QAT_GROUP_SIZE=64 does not divide the input width of gate_proj \(96\).*"
                                          r"use a divisor of 32"):
        qat.add_fake_quant(model, "int4", 64)
    with pytest.raises(ConfigError, match=r"QAT_GROUP_SIZE=1 must be an integer >= 2"):
        qat.add_fake_quant(model, "int4", 1)
    assert not qat.is_fake_quantized(model)  # a refused setting changed nothing


@pytest.mark.parametrize("r", [4, 0])
def test_exports_reproduce_the_qat_model(tmp_path, tiny_lm_dir, r):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, tok = _tiny(tiny_lm_dir, "int4", r=r)
    with torch.no_grad():
        want = model(input_ids=IDS).logits
    quantized = qat.export_quantized(model, tok, tmp_path / "quantized", "int4", 32)
    merged = lora.export_merged(model, tok, tmp_path / "merged", base_source=str(tiny_lm_dir),
                                dtype=torch.bfloat16, **({"base_state": qat.fake_quantized_state(model)} if r else
                                                         {"state": qat.fake_quantized_state(model)}))
    q = AutoModelForCausalLM.from_pretrained(quantized)
    assert type(q.model.layers[0].mlp.down_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    if r:  # the adapter on top of the quantized base, as it was trained
        q = PeftModel.from_pretrained(q, lora.export_adapter(model, tmp_path / "adapter"))
    m = AutoModelForCausalLM.from_pretrained(merged)
    assert m.dtype == torch.bfloat16 and not qat.is_fake_quantized(m)
    with torch.no_grad():
        torch.testing.assert_close(q(input_ids=IDS).logits, want, rtol=1e-4, atol=1e-4)
        # bf16 weights: about 3 significant digits.
        torch.testing.assert_close(m(input_ids=IDS).logits.float(), want, rtol=0.05, atol=0.05)
    # The quantized file is smaller: int8-stored values (int4 range) and one scale per 32 weights.
    assert (quantized / "model.safetensors").stat().st_size < 0.6 * (tiny_lm_dir / "model.safetensors").stat().st_size
