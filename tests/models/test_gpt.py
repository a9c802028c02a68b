"""Tests for tpu_helpers.models.gpt: shapes, init, causality, training signal, checkpointing, FLOPs, sampling."""

from __future__ import annotations

import math

import pytest
import torch

from tpu_helpers.models.gpt import (
    GPT,
    PRESETS,
    GPTConfig,
    default_checkpoint_fn,
    flops_per_token,
    generate,
    gpt_config,
    sample_text,
)


@pytest.fixture(autouse=True)
def _threads():
    # The CI box has 2 shared cores; more threads only add contention for models this small.
    old = torch.get_num_threads()
    torch.set_num_threads(min(old, 2))
    yield
    torch.set_num_threads(old)


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(gpt_config("tiny", **overrides))


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


# --- config ---------------------------------------------------------------------------------------------


def test_config_defaults_are_valid():
    cfg = GPTConfig()
    assert (cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd) == (256, 256, 4, 4, 128)
    assert cfg.head_dim == 32 and cfg.tie_weights and not cfg.bias


def test_config_rejects_indivisible_heads():
    with pytest.raises(ValueError, match=r"n_embd \(130\).*n_head \(4\)"):
        GPTConfig(n_embd=130, n_head=4)


@pytest.mark.parametrize("field", ["vocab_size", "block_size", "n_layer", "n_head", "n_embd"])
def test_config_rejects_sizes_below_one(field):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**{field: 0})


@pytest.mark.parametrize("dropout", [-0.1, 1.0, 1.5])
def test_config_rejects_bad_dropout(dropout):
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=dropout)


def test_gpt_config_overrides_and_errors():
    cfg = gpt_config("tiny", vocab_size=100, dropout=0.1)
    assert cfg.vocab_size == 100 and cfg.dropout == 0.1 and cfg.n_layer == PRESETS["tiny"].n_layer
    assert PRESETS["tiny"].vocab_size == 256, "overrides must not mutate the preset"
    with pytest.raises(ValueError, match=r"unknown preset 'huge'.*'medium'.*'mini'.*'small'.*'tiny'"):
        gpt_config("huge")
    with pytest.raises(ValueError, match=r"unknown GPTConfig field\(s\) \['n_layers'\]"):
        gpt_config("tiny", n_layers=3)
    with pytest.raises(ValueError, match=r"n_embd \(64\).*n_head \(3\)"):
        gpt_config("tiny", n_head=3)


def test_preset_shapes():
    tiny, small, medium = PRESETS["tiny"], PRESETS["small"], PRESETS["medium"]
    assert (tiny.n_layer, tiny.n_head, tiny.n_embd, tiny.block_size) == (2, 2, 64, 64)
    assert (small.n_layer, small.n_head, small.n_embd, small.block_size) == (12, 12, 768, 1024)
    assert (medium.n_layer, medium.n_head, medium.n_embd) == (24, 16, 1024)


# --- parameters -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [("tiny", 50e3, 300e3), ("mini", 9e6, 12e6), ("small", 120e6, 128e6), ("medium", 340e6, 365e6)],
)
def test_preset_param_counts(preset, low, high):
    with torch.device("meta"):  # no memory for the big ones
        model = GPT(PRESETS[preset])
    assert low <= model.num_params() <= high
    wpe = PRESETS[preset].block_size * PRESETS[preset].n_embd
    assert model.num_params(exclude_embeddings=False) == model.num_params() + wpe


def test_small_matches_gpt2_small():
    with torch.device("meta"):
        model = GPT(PRESETS["small"])
    # nanoGPT's GPT-2 small (vocab 50304, no bias) is 124.37M with position embeddings.
    assert model.num_params(exclude_embeddings=False) == 124_373_760


def test_weight_tying_shares_storage():
    model = tiny_model()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    untied = tiny_model(tie_weights=False)
    assert untied.lm_head.weight.data_ptr() != untied.transformer.wte.weight.data_ptr()
    cfg = untied.config
    # Untied, the lm head is an extra matrix; the token lookup table stays out of the default count.
    assert untied.num_params() == model.num_params()
    extra = cfg.vocab_size * cfg.n_embd
    assert untied.num_params(exclude_embeddings=False) == model.num_params(False) + extra


def test_residual_projection_init_is_scaled():
    torch.manual_seed(0)
    model = GPT(gpt_config("mini"))
    std_proj = model.transformer.h[0].mlp.c_proj.weight.std().item()
    std_fc = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert std_fc == pytest.approx(0.02, rel=0.05)
    assert std_proj == pytest.approx(0.02 / math.sqrt(2 * 6), rel=0.05)


# --- forward --------------------------------------------------------------------------------------------


def test_forward_shapes_and_no_loss_without_targets():
    model = tiny_model()
    idx = torch.randint(0, 256, (3, 17))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, 256) and loss is None


def test_causal_masking():
    model = tiny_model().eval()
    idx = torch.randint(0, 256, (2, 32))
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_loss_at_init_is_log_vocab():
    model = tiny_model()
    idx = torch.randint(0, 256, (8, 64))
    _, loss = model(idx, torch.randint(0, 256, (8, 64)))
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(math.log(256), abs=0.1)


def test_loss_is_fp32_under_bf16_autocast():
    model = tiny_model()
    idx = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32


def test_sequence_longer_than_block_size_raises():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"sequence length 65 exceeds block_size 64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_overfits_a_single_batch():
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    x, y = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(50):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses[::10]


# --- gradient checkpointing ------------------------------------------------------------------------------


def _loss_and_grads(model: GPT, x: torch.Tensor, y: torch.Tensor):
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gradient_checkpointing_matches_and_is_used():
    model = tiny_model().train()
    x = torch.randint(0, 256, (2, 32))
    y = torch.randint(0, 256, (2, 32))
    ref_loss, ref_grads = _loss_and_grads(model, x, y)

    calls = []
    inner = default_checkpoint_fn()

    def counting(block, h):
        calls.append(block)
        return inner(block, h)

    model.set_gradient_checkpointing(counting)
    assert model.gradient_checkpointing
    loss, grads = _loss_and_grads(model, x, y)
    assert calls == list(model.transformer.h)
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], msg=name)

    # Nothing to save without a backward pass: eval and no_grad may skip it.
    calls.clear()
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    assert calls == []

    model.train()
    model.set_gradient_checkpointing(None)
    model(x, y)
    assert calls == [] and not model.gradient_checkpointing


def test_gradient_checkpointing_rejects_non_callable():
    with pytest.raises(TypeError, match="callable"):
        tiny_model().set_gradient_checkpointing("yes")


# --- FLOPs ----------------------------------------------------------------------------------------------


def test_flops_per_token_by_hand():
    cfg = GPTConfig(vocab_size=100, block_size=32, n_layer=2, n_head=2, n_embd=16)
    # Per layer: two LayerNorm weights (2*16) + qkv (16*48) + attn proj (16*16) + MLP (2*16*64) = 3104.
    # Plus the final LayerNorm (16) and the tied lm head (100*16); position embeddings excluded.
    n = 2 * 3104 + 16 + 1600
    assert n == 7824
    assert flops_per_token(cfg) == 6 * n + 12 * 2 * 2 * 8 * 32
    assert flops_per_token(cfg, seq_len=16) == 6 * n + 12 * 2 * 2 * 8 * 16
    assert GPT(cfg).num_params() == n


@pytest.mark.parametrize(
    "overrides", [{}, {"bias": True}, {"tie_weights": False}, {"bias": True, "tie_weights": False}]
)
def test_flops_n_matches_num_params(overrides):
    cfg = gpt_config("tiny", **overrides)
    model = GPT(cfg)
    attn = 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.block_size
    assert flops_per_token(cfg) == 6 * model.num_params() + attn


def test_flops_per_token_gpt2_small_scale():
    # hardware.md quotes about 8.6e8 FLOPs/token for a 124M GPT at T=1024.
    assert flops_per_token(PRESETS["small"]) == pytest.approx(8.6e8, rel=0.02)


# --- generation -----------------------------------------------------------------------------------------


def test_generate_length_and_crop():
    model = tiny_model().train()
    idx = torch.randint(0, 256, (2, 5))
    out = generate(model, idx, max_new_tokens=70, top_k=10)  # runs past block_size 64: must crop
    assert out.shape == (2, 75) and out.dtype == torch.long
    assert torch.equal(out[:, :5], idx)
    assert int(out.min()) >= 0 and int(out.max()) < 256
    assert model.training, "generate must restore the model's mode"


def test_generate_greedy_matches_unpadded_forward():
    # generate pads the window on the right; causality must make that invisible.
    model = tiny_model().eval()
    idx = torch.randint(0, 256, (1, 7))
    out = generate(model, idx, max_new_tokens=12, temperature=0)
    ref = idx
    with torch.no_grad():
        for _ in range(12):
            logits, _ = model(ref)
            ref = torch.cat([ref, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)


def test_sample_text_is_deterministic_for_a_seed():
    model = tiny_model()
    tok = ByteTokenizer()
    rng_before = torch.get_rng_state()
    a = sample_text(model, tok, prompt="Hello", max_new_tokens=20, seed=3)
    b = sample_text(model, tok, prompt="Hello", max_new_tokens=20, seed=3)
    c = sample_text(model, tok, prompt="Hello", max_new_tokens=20, seed=4, temperature=2.0, top_k=None)
    assert a == b and a.startswith("Hello")
    assert a != c
    assert torch.equal(torch.get_rng_state(), rng_before), "sampling must not touch the global RNG"


def test_sample_text_rejects_empty_prompt():
    with pytest.raises(ValueError, match="no tokens"):
        sample_text(tiny_model(), ByteTokenizer(), prompt="")
