"""What the tuning panel offers and how it words things: slice sizes, the notebooks' configurations, text helpers.

- :func:`slice_sizes` -- the chip counts that exist for a chip (TPU slices 1, 4, 8, 16, ...; GPUs 1, 2, 4, 8 and
  whole 8-GPU hosts), so the panel never plans for 3 chips of a v5e;
- :func:`sharding_options` / :func:`check_panel_sharding` / :func:`keep_sharding` -- the SHARDING values a slice
  takes ("data", "fsdp", DxF meshes; on a TPU pod fsdp stays within one host, as the trainer requires);
- :data:`NOTEBOOK_PRESETS` / :func:`preset_settings` -- the configurations the real notebooks run, read from the
  platform targets (``tpu_helpers.platform.targets``) so the panel and the notebooks cannot drift apart;
- :func:`chips_text`, :func:`duration_text`, :func:`cost_text`, :func:`precision_warning` -- wording.
"""

from __future__ import annotations

from typing import Any

from tpu_helpers.core.hardware import HardwareSpec
from tpu_helpers.core.sharding import ShardingError, check_hosts, check_sharding, mesh_shape
from tpu_helpers.platform.targets import TARGETS

# Smallest slice and the largest the panel lists, per TPU generation (chips, not cores: a v4-8 is 4 chips).
_TPU_RANGE = {"TPU v5e": (1, 256), "TPU v6e": (1, 256), "TPU v4": (4, 4096), "TPU v5p": (4, 8192),
              "TPU v2": (4, 256), "TPU v3": (4, 1024), "TPU7x": (4, 8192)}


def slice_sizes(spec: HardwareSpec) -> tuple[int, ...]:
    """Chip counts one can rent of ``spec``: powers of two from the smallest slice (TPU), or 1, 2, 4, 8 GPUs and
    then whole hosts of ``chips_per_host`` (GPU); the CPU is one "chip"."""
    if spec.kind == "cpu":
        return (1,)
    if spec.kind == "tpu":
        low, high = _TPU_RANGE.get(spec.name, (1, 256))
        sizes, n = [], low
        while n <= high:
            sizes.append(n)
            n *= 2 if n > 1 else 4  # v5e / v6e: 1, then 4, 8, 16, ... (there is no v5e-2)
        return tuple(sizes)
    per_host = max(1, spec.chips_per_host)
    small = [n for n in (1, 2, 4, 8) if n <= per_host]
    return tuple(small + [per_host * k for k in (2, 4, 8, 16, 32, 64, 128)])


def check_chips(chips: int, spec: HardwareSpec) -> None:
    sizes = slice_sizes(spec)
    if chips not in sizes:
        shown = ", ".join(map(str, sizes[:6])) + (", ..." if len(sizes) > 6 else "")
        raise ValueError(f"chips={chips} is not a size {spec.name} comes in; choose one of {shown}")


def nearest_slice(chips: int, spec: HardwareSpec) -> int:
    """The existing slice size closest to ``chips`` (ties go to the smaller one)."""
    return min(slice_sizes(spec), key=lambda n: (abs(n - chips), n))


def max_fsdp(spec: HardwareSpec, chips: int) -> int:
    """The most chips one model copy may be sharded over: all of them, except on a TPU pod, where the trainer keeps
    fsdp within one host (``tpu_helpers.core.sharding.check_hosts``)."""
    if spec.kind == "tpu":
        return min(chips, max(1, spec.chips_per_host))
    return chips


def check_panel_sharding(sharding: Any, chips: int, spec: HardwareSpec) -> tuple[str, int]:
    """(normalised SHARDING, fsdp size) for ``chips`` of ``spec``, or a ShardingError (a ValueError) naming it."""
    value = check_sharding(sharding)
    if spec.kind != "tpu" and value not in ("data", "fsdp"):
        raise ShardingError(f"sharding={value!r}: a DxF mesh needs an XLA SPMD run (a TPU); on {spec.name} use "
                            "'data' or 'fsdp'")
    _, fsdp = mesh_shape(value, chips)
    if spec.kind == "tpu":
        check_hosts(fsdp, chips, max(1, chips // max(1, spec.chips_per_host)))
    return value, fsdp


def widest_sharding(spec: HardwareSpec, chips: int) -> str:
    """The SHARDING that spreads the model over the most chips allowed: "fsdp", or "DxF" with F one TPU host."""
    most = max_fsdp(spec, chips)
    return "fsdp" if most == chips else f"{chips // most}x{most}"


def sharding_options(spec: HardwareSpec, chips: int) -> list[str]:
    """The SHARDING values valid on ``chips`` of ``spec``: "data", "fsdp" and the DxF meshes (TPU only)."""
    out = ["data"]
    for value in ["fsdp"] + ([f"{chips // f}x{f}" for f in range(2, chips) if chips % f == 0]
                             if spec.kind == "tpu" else []):
        try:
            check_panel_sharding(value, chips, spec)
        except ShardingError:
            continue
        out.append(value)
    return out


def keep_sharding(sharding: str, chips: int, spec: HardwareSpec) -> str:
    """``sharding`` if still valid on ``chips`` of ``spec``, else the nearest valid one: the same fsdp size with the
    data size adjusted, then the widest fsdp, then "data" (what the panel does when the slice changes)."""
    try:
        value = check_sharding(sharding)
    except ShardingError:
        return "data"
    candidates = [value]
    if "x" in value:  # a DxF mesh: keep its fsdp size F
        fsdp = int(value.split("x")[1])
        if fsdp > 1 and chips % fsdp == 0:
            candidates.append("fsdp" if fsdp == chips else f"{chips // fsdp}x{fsdp}")
    if value != "data":
        candidates.append(widest_sharding(spec, chips))
    for candidate in [*candidates, "data"]:
        try:
            return check_panel_sharding(candidate, chips, spec)[0]
        except ShardingError:
            continue
    return "data"


# name shown -> (platform target, catalog hardware, chips, precision). The target supplies the model, sequence
# length, batch, global batch and run length exactly as the notebooks run them.
NOTEBOOK_PRESETS: dict[str, tuple[str, str, int, str]] = {
    "quickstart (CPU)": ("cpu", "cpu", 1, "fp32"),
    "Colab TPU v5e-1": ("colab-v5e-1", "v5e", 1, "bf16"),
    "Colab TPU v6e-1": ("colab-v6e-1", "v6e", 1, "bf16"),
    "TPU VM v5e-8": ("tpuvm-v5e-8", "v5e", 8, "bf16"),
    "TPU VM v5e-8, SHARDING fsdp": ("tpuvm-v5e-8", "v5e", 8, "bf16"),
    # The fine-tuning notebook's offline model: sizes read from its Hugging Face config (see hf_model_settings).
    "fine-tune tiny Qwen2 (CPU)": ("cpu", "cpu", 1, "fp32"),
}
# Presets whose model is a Hugging Face config: (notebook, the MODEL it gets from the target).
_HF_PRESETS = {"fine-tune tiny Qwen2 (CPU)": "finetune_llm"}
# Presets that run their target's notebook with another SHARDING (the v5e-8 notebook's parameter).
_SHARDING_PRESETS = {"TPU VM v5e-8, SHARDING fsdp": "fsdp"}


def hf_model_settings(model: Any) -> dict:
    """Panel model sizes from a Hugging Face causal LM's config: a hub name, a local directory or "tiny" (the
    package's offline model), read with AutoConfig (config.json only, no weights are downloaded), or a config
    object (e.g. ``Qwen2Config(...)``) or a dict with its ``model_type``.

    The panel's estimate is the decoder formula of the package GPT (a 4x MLP) at these sizes, with the parameters,
    gradients and optimizer state scaled to the model's real parameter count and one decoder layer's real size as
    the FSDP unit (both counted on the meta device, nothing allocated). Activations are about 25% low for SwiGLU
    models such as Qwen2 and Llama (their MLP is wider); `tpu_helpers.memory.hf_plan` is the fine-tuning
    notebook's exact plan."""
    from transformers import AutoConfig, PretrainedConfig

    from tpu_helpers.backend.units import block_params
    from tpu_helpers.memory.hf_plan import meta_model
    from tpu_helpers.models.hf import resolve_model_source

    if isinstance(model, PretrainedConfig):
        cfg = model
    elif isinstance(model, dict):
        if "model_type" not in model:
            raise ValueError(f"a config dict needs its 'model_type' (e.g. 'qwen2'); got keys {sorted(model)}")
        cfg = AutoConfig.for_model(**model)
    else:
        cfg = AutoConfig.from_pretrained(resolve_model_source(model))
    meta = meta_model(cfg)
    return {"preset": "small", "n_layer": cfg.num_hidden_layers, "n_head": cfg.num_attention_heads,
            "n_embd": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "model_params": sum(p.numel() for p in meta.parameters()), "block_params": block_params(meta)}


# Panel settings that describe a model other than the chosen GPT preset (None: the preset's own).
GPT_SIZES = {"n_layer": None, "n_head": None, "n_embd": None, "vocab_size": None, "model_params": None,
             "block_params": None}


def preset_settings(name: str) -> dict:
    """Panel settings for one of :data:`NOTEBOOK_PRESETS` (a global batch when the notebook asks for one)."""
    if name not in NOTEBOOK_PRESETS:
        raise ValueError(f"unknown notebook preset {name!r}; choose one of {list(NOTEBOOK_PRESETS)}")
    target, hardware, chips, precision = NOTEBOOK_PRESETS[name]
    p = TARGETS[target].params
    settings = {"preset": p["PRESET"], "seq_len": p["SEQ_LEN"], "batch_size": p["BATCH_SIZE"], "hardware": hardware,
                "chips": chips, "precision": precision, "pure_bf16": False, "steps": p["STEPS"],
                "gradient_checkpointing": False,
                "sharding": _SHARDING_PRESETS.get(name, p.get("SHARDING", "data")), **GPT_SIZES}
    if name in _HF_PRESETS:
        p = {**p, **TARGETS[target].notebooks[_HF_PRESETS[name]]}
        settings.update(hf_model_settings(p["MODEL"]), seq_len=p["SEQ_LEN"], batch_size=p["BATCH_SIZE"],
                        steps=p["STEPS"])
    if "GLOBAL_BATCH" in p and p.get("MODE") == "spmd":
        settings["global_batch"] = p["GLOBAL_BATCH"]
    else:
        settings.update(global_batch=None, grad_accum=1)
    return settings


def split_batch(samples_per_chip: int, limit: int) -> tuple[int, int]:
    """Largest micro-batch <= ``limit`` dividing ``samples_per_chip``, and the grad_accum that keeps the total."""
    b = next(b for b in range(min(limit, samples_per_chip), 0, -1) if samples_per_chip % b == 0)
    return b, samples_per_chip // b


def chips_text(n: int) -> str:
    return f"{n} chip" if n == 1 else f"{n} chips"


def duration_text(seconds: float) -> str:
    """Readable at every scale: ``5.1 µs``, ``0.8 ms``, ``2.35 s``, ``42 s``, ``17 min``, ``5.2 h``, ``3.1 days``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def cost_text(cost: float | None, spec: HardwareSpec, chips: int) -> str:
    if cost is None:
        return f"cost: no catalog price for {spec.name}"
    shown = f"${cost:,.2f}" if cost >= 0.01 else "under $0.01"
    return f"ESTIMATED cost: {shown} for the run ({chips_text(chips)} at the catalog's on-demand price)"


def precision_warning(precision: str, spec: HardwareSpec) -> str | None:
    if precision == "bf16" and not spec.bf16_supported:
        return (f"{spec.name} has no bf16: train in fp16 there (autocast with a GradScaler, about the memory of bf16 "
                f"autocast shown here) or in fp32")
    return None
