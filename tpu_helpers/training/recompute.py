"""GRADIENT_CHECKPOINTING for any model the loop trains: turn it on through the model's own hook, with the
backend's checkpoint function (torch_xla's on XLA, torch.utils.checkpoint elsewhere).

    set_gradient_checkpointing(model, backend.checkpoint_fn())     # what Trainer does when the backend does not
                                                                    # checkpoint whole blocks itself (FSDPv2)

The package's GPT has `set_gradient_checkpointing(fn)`; a Hugging Face model (peft-wrapped or not) has
`_set_gradient_checkpointing(enable, fn)`. Anything else is refused by name. Here, beside the loop, rather than with
the Hugging Face loading code: the loop serves every model, and need not import the models it may train.
"""

from __future__ import annotations

from typing import Any

import torch

from tpu_helpers.config import ConfigError


def set_gradient_checkpointing(model: torch.nn.Module, checkpoint_fn: Any) -> None:
    """Turn on checkpointing with the backend's function (torch_xla's on XLA) through the model's own hook."""
    if hasattr(model, "set_gradient_checkpointing"):  # the package's GPT
        model.set_gradient_checkpointing(checkpoint_fn)
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "_set_gradient_checkpointing"):
        raise ConfigError(f"gradient_checkpointing=True but {type(base).__name__} has no set_gradient_checkpointing(fn) "
                          "nor a Hugging Face gradient-checkpointing hook; add one (see tpu_helpers.models.gpt.GPT) "
                          "or turn it off")
    base._set_gradient_checkpointing(True, checkpoint_fn)
    base.config.use_cache = False
    # Reentrant checkpoints (torch_xla's) give no gradient to weights inside a block whose inputs need none, as
    # under LoRA with frozen embeddings: make the embedding output require grad (what HF does for peft).
    if hasattr(base, "enable_input_require_grads"):
        base.enable_input_require_grads()
