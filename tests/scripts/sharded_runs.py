"""Train each run of the JSON argument's "runs" with the package's Trainer on XLA, in this process (SPMD or not, as
"spmd" says), and print per-step losses and what the backend says about the sharding of every parameter and
optimizer-state tensor (tests/training/test_sharding.py).

    python tests/scripts/sharded_runs.py '{"spmd": true, "runs": [{"model": "gpt", "sharding": "fsdp", ...}]}'

A run's "model" is "gpt" (the package's), "hf" (a tiny Qwen2 from a config) or "lora" (that with peft LoRA);
"stop_at" interrupts it after that step (it saves and returns, as on a SIGTERM); the other keys are TrainConfig's.
"dump": a directory the compiler's HLO goes to (set XLA_FLAGS to it), to count the opt-barriers of checkpointing.
"""

from __future__ import annotations

import glob
import os

import torch

from tests.support import StopAt, print_result, script_args
from tpu_helpers.backend import get_backend
from tpu_helpers.config import TrainConfig
from tpu_helpers.core.callbacks import Callback
from tpu_helpers.data import build_datasets
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.models.lora import adapter_state_dict
from tpu_helpers.training.trainer import Trainer


class Compiles(Callback):  # compilations up to the end of each step
    def __init__(self) -> None:
        self.at: dict[int, int] = {}

    def on_step_end(self, trainer) -> None:
        self.at[trainer.step] = trainer.backend.metrics()["compilations"]


def hf_model(lora: bool) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation="eager")
    model = Qwen2ForCausalLM(cfg)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def hf_loss(output, targets):
    return torch.nn.functional.cross_entropy(output.logits.float().view(-1, output.logits.size(-1)), targets.view(-1))


def new_barriers(dump: str | None, seen: set) -> tuple[int, set]:
    """opt-barriers in the HLO of the programs compiled since `seen` (torch_xla's checkpointing adds them)."""
    files = set(glob.glob(os.path.join(dump or "/nonexistent", "*before_optimizations.txt")))
    return sum(open(f).read().count(" opt-barrier(") for f in files - seen), files


def main() -> None:
    args = script_args()
    out, seen = [], set()
    backend = get_backend("xla", spmd=args["spmd"])
    train, _, tok = build_datasets("embedded", "byte", block_size=32, max_chars=200_000)
    for run in args["runs"]:
        kind = run.pop("model")
        stop = [StopAt(run.pop("stop_at"))] if "stop_at" in run else []
        cfg = TrainConfig(device="xla", preset="tiny", seq_len=32, lr=3e-3, warmup_steps=1, eval_every=1000,
                          log_every=1, save_every=1000, max_chars=200_000, **run)
        torch.manual_seed(cfg.seed)
        if kind == "gpt":
            model, loss_fn = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32)), None
        else:
            model, loss_fn = hf_model(kind == "lora"), hf_loss
        compiles = Compiles()
        t = Trainer(model, train, None, config=cfg, backend=backend, loss_fn=loss_fn, progress=False,
                    callbacks=[compiles, *stop])
        report = t.fit()
        barriers, seen = new_barriers(args.get("dump"), seen)
        params = list(t.model.parameters())
        states = [v for s in t.optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.device.type == "xla"]
        full = sum(p.numel() * p.element_size() for p in params)
        out.append({
            "losses": [r["loss"] for r in t.history.train],
            "mesh": list(backend.mesh_shape),
            "unsharded_params": [n for n, p in t.model.named_parameters() if p.dim() and not backend.sharding_spec(p)],
            "unsharded_states": sum(1 for v in states if v.dim() and not backend.sharding_spec(v)),
            "n_states": len(states),
            # A replayed AdamW keeps its step counts on the device (capturable); torch's lazy one on the host.
            "steps_on_device": [isinstance(s.get("step"), torch.Tensor) and s["step"].device.type == "xla"
                                for s in t.optimizer.state.values()],
            "param_ratio": sum(backend.device_bytes(p) for p in params) / full,
            "state_ratio": sum(backend.device_bytes(v) for v in states) / max(1, sum(v.numel() * 4 for v in states)),
            "compiles": compiles.at,
            "trainable": sorted(n for n, p in t.raw_model.named_parameters() if p.requires_grad)[:2],
            "resumed_from": report.resumed_from,
            "compiles_end": t.backend.metrics()["compilations"],  # after the final save
            "steps": [r["step"] for r in t.history.train],
            "opt_barriers": barriers,
            "minibatch": bool(getattr(backend._input_sharding, "minibatch", False)) if backend.mesh is not None
            else None,
        })
        if kind == "lora":
            from peft import get_peft_model_state_dict

            out[-1]["adapter_keys"] = sorted(adapter_state_dict(t.raw_model))
            out[-1]["peft_alone_keys"] = len(get_peft_model_state_dict(t.raw_model))
    print_result(out)


if __name__ == "__main__":
    main()
