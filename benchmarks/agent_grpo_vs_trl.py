"""Agent GRPO steps on the same environment, model and sizes through this package (the GRPO recipe's agent mode) and
through TRL 1.16's `GRPOTrainer(environment_factory=...)`, on the CPU, each side in its own process.

    PYTHONPATH=. python benchmarks/agent_grpo_vs_trl.py --model OUT_DIR/sft/merged   # a tool-calling start model
    PYTHONPATH=. python benchmarks/agent_grpo_vs_trl.py --smoke                      # CI: the tiny model, toy sizes

The job: the offline Lockers environment (`agents.examples`) and its reward, 2 prompts x 8 episodes a step, one
round of tool calls, LoRA r=16 on every linear layer, lr 1e-3, no KL term, temperature 1. The package gives each
turn 40 tokens and the tool text 32 (an episode of 112 columns); TRL gets the same 112 tokens as its completion
budget. What the TRL side needs: its tool loop refuses a chat template that cannot render a tool conversation
(SmolLM2's ChatML: "The provided chat template does not support tool calling"), so both sides run on a copy of the
model with the Qwen2.5 template TRL ships (trl/chat_templates/qwen2_5.jinja), the Hermes form the package's
fallback renders for such templates. A model that never calls the tool gives neither side a second turn: start
from one that does, such as the merged export of the recipe's START_FROM="sft" warm start (OUT_DIR/sft/merged).
On XLA TRL cannot run (benchmarks/grpo_vs_trl.py says where it stops).

Printed per side: seconds per step after the first, generation seconds per step, the mean reward and tool calls per
episode over the steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = dict(batch_size=2, num_generations=8, turn_tokens=40, tool_tokens=32, max_turns=1, prompt_tokens=240, lr=1e-3,
           lora_r=16, lora_alpha=32, steps=3)
# --smoke: the tiny model (its positions raised to hold the tool schemas), one prompt x 2 episodes, 2 steps.
SMOKE_JOB = dict(batch_size=1, num_generations=2, turn_tokens=4, tool_tokens=48, prompt_tokens=640, steps=2)
ENV = "tpu_helpers.agents.examples:Lockers"
REWARD = "tpu_helpers.agents.examples:locker_reward"


def _timed(owner, name: str, seconds: list) -> None:
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds.append((time.perf_counter(), time.perf_counter() - t0))
    setattr(owner, name, wrapper)


def _qwen_template() -> str:
    from importlib.resources import files

    return (files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()


def start_copy(source: str, target: Path, template: str | None, positions: int | None = None) -> str:
    """A copy of the model directory `source` whose tokenizer renders chats with `template` (None: its own), and
    for the tiny model `positions` positions."""
    shutil.copytree(source, target)
    if template is not None:
        config = json.loads((target / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (target / "tokenizer_config.json").write_text(json.dumps(config))
        (target / "chat_template.jinja").unlink(missing_ok=True)
    if positions:
        model = json.loads((target / "config.json").read_text())
        model["max_position_embeddings"] = positions
        (target / "config.json").write_text(json.dumps(model))
    return str(target)


def run_package(args) -> dict:
    from tpu_helpers.algorithms import rollouts
    from tpu_helpers.core.callbacks import Callback
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

    stamps: list[float] = []
    gen: list[tuple[float, float]] = []
    _timed(rollouts.EpisodeRollouts, "sample", gen)

    class Clock(Callback):
        def on_step_end(self, trainer):
            stamps.append(time.perf_counter())

    cfg = GRPOConfig(model=args.start, start_from=None, dataset="lockers", environment=ENV, rewards=REWARD,
                     max_prompt_len=JOB["prompt_tokens"], max_new_tokens=JOB["turn_tokens"],
                     tool_tokens=JOB["tool_tokens"], max_turns=JOB["max_turns"], batch_size=JOB["batch_size"],
                     num_generations=JOB["num_generations"], steps=JOB["steps"], lr=JOB["lr"], warmup_steps=0,
                     kl_beta=0.0, lora_r=JOB["lora_r"], lora_alpha=JOB["lora_alpha"], log_every=1,
                     save_every=JOB["steps"], device="cpu", precision="fp32", resume="force_new",
                     out_dir=str(Path(args.out) / "package"), export_merged=False)
    job = GRPO(cfg, progress=False, callbacks=[Clock()])
    job.train()
    rows = job.history.train
    return _summary(stamps, gen, [r["reward"] for r in rows], [r.get("tool_calls", 0.0) for r in rows])


def run_trl(args) -> dict:
    import datasets
    import torch
    import transformers
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tpu_helpers.agents.examples import Lockers, locker_reward, locker_rows

    stamps: list[float] = []
    gen: list[tuple[float, float]] = []
    _timed(transformers.GenerationMixin, "generate", gen)
    rewards: list[float] = []
    calls: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                calls.append(float(logs.get("tools/call_frequency", 0.0)))

    tok = AutoTokenizer.from_pretrained(args.start)
    tok.chat_template = _qwen_template()  # TRL picks its parser by this exact text (the saved copy may differ)
    model = AutoModelForCausalLM.from_pretrained(args.start, attn_implementation="eager", dtype=torch.float32)
    rows = JOB["batch_size"] * JOB["num_generations"]
    budget = (JOB["max_turns"] + 1) * JOB["turn_tokens"] + JOB["max_turns"] * JOB["tool_tokens"]
    targs = GRPOConfig(output_dir=str(Path(args.out) / "trl"), max_steps=JOB["steps"], per_device_train_batch_size=rows,
                       num_generations=JOB["num_generations"], max_completion_length=budget,
                       max_tool_calling_iterations=JOB["max_turns"], temperature=1.0, top_k=0, top_p=1.0, beta=0.0,
                       learning_rate=JOB["lr"], warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[],
                       use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0, disable_tqdm=True, seed=0)
    lora = LoraConfig(r=JOB["lora_r"], lora_alpha=JOB["lora_alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    data = datasets.Dataset.from_list(locker_rows(64, seed=0))
    trainer = GRPOTrainer(model=model, reward_funcs=[locker_reward], args=targs, train_dataset=data,
                          processing_class=tok, environment_factory=Lockers, peft_config=lora, callbacks=[Clock()])
    trainer.train()
    return _summary(stamps, gen, rewards, calls)


def _summary(stamps: list[float], gen: list[tuple[float, float]], rewards: list[float], calls: list[float]) -> dict:
    """Seconds per step and generation seconds per step, both over the steps after the first."""
    steady = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    later = sum(s for end, s in gen if stamps and end > stamps[0])
    n = max(1, len(steady))
    return {"step_s": sum(steady) / n if steady else None, "generate_s": later / n if steady else None,
            "reward": sum(rewards) / max(1, len(rewards)), "tool_calls": sum(calls) / max(1, len(calls)),
            "steps": len(stamps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a model name or directory (a tool-calling one)")
    parser.add_argument("--sides", default="package,trl")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per side (default: torch's)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", choices=["package", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--start", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        JOB.update(SMOKE_JOB)
    if args.steps:
        JOB["steps"] = args.steps
    if args.child:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps((run_trl if args.child == "trl" else run_package)(args)))
        return
    from tpu_helpers.models.hf import TINY, resolve_model_source

    out = Path(args.out or tempfile.mkdtemp(prefix="agent_grpo_vs_trl_"))
    args.out = str(out)
    model = TINY if args.smoke else args.model
    print(f"{model}: Lockers, {JOB['steps']} steps of {JOB['batch_size']} prompts x {JOB['num_generations']} "
          f"episodes, {JOB['max_turns']} round(s) of tool calls, {JOB['turn_tokens']} tokens per turn, "
          f"{JOB['tool_tokens']} of tool text; output in {out}", flush=True)
    has_trl = importlib.util.find_spec("trl") is not None
    if not has_trl:
        print("trl: skipped (trl is not installed in this interpreter)")
        args.sides = ",".join(s for s in args.sides.split(",") if s != "trl")
    start = start_copy(resolve_model_source(model), out / "start", _qwen_template() if has_trl else None,
                       1024 if args.smoke else None)
    # accelerate takes a process that can import torch_xla for an XLA one, even with use_cpu: off on both sides.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "USE_TORCH_XLA": "0", "TRL_EXPERIMENTAL_SILENCE": "1"}
    print(f"{'side':8} {'s/step':>8} {'generate s/step':>16} {'reward':>7} {'tool calls':>10}")
    for side in args.sides.split(","):
        cmd = [sys.executable, __file__, "--child", side, "--start", start, "--out", str(out)]
        cmd += (["--smoke"] if args.smoke else []) + (["--steps", str(args.steps)] if args.steps else [])
        cmd += ["--threads", str(args.threads)] if args.threads else []
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{side}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            sys.exit(1)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{side:8} {r['step_s']:8.2f} {r['generate_s']:16.2f} {r['reward']:7.3f} {r['tool_calls']:10.3f}",
              flush=True)


if __name__ == "__main__":
    main()
