"""One process of a 2-process torchrun (tests/algorithms/test_grpo_ddp.py): GRPO under data parallelism (DDP over
gloo on the CPU), single-turn and on agent episodes. Writes <DIR>/result-<rank>.json: each job's outcome, its
history's rewards and losses, and a digest of the trained weights (the processes must end with the same ones).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/scripts/grpo_ddp.py DIR TOOL_MODEL_DIR
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

from tests.algorithms.test_grpo_episodes import _scripted_parse
from tpu_helpers.agents import ChatFormat
from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

base, tool_model, rank = Path(sys.argv[1]), sys.argv[2], int(os.environ["RANK"])


def run(name: str, **overrides) -> dict:
    cfg = dict(device="cpu", sharding="data", start_from=None, steps=2, batch_size=2, num_generations=2,
               max_prompt_len=24, max_new_tokens=3, lr=1e-2, warmup_steps=1, log_every=1, save_every=2,
               out_dir=str(base / name), max_records=16, lora_r=4)
    try:
        job = GRPO(GRPOConfig(**{**cfg, **overrides}), progress=False)
        if job.config.agentic:
            job.rollouts.runner.stop_ids = [t for t in range(len(job.tokenizer)) if t % 3 == 0]
        start = [p.detach().clone() for p in job.trainer.raw_model.parameters() if p.requires_grad]
        job.train()
        trained = [p.detach() for p in job.trainer.raw_model.parameters() if p.requires_grad]
        moved = sum(float((a - b).abs().sum()) for a, b in zip(trained, start, strict=True))
        weights = sum(float(p.double().sum()) for p in trained)
        return {"outcome": "ok", "loss": [r["loss"] for r in job.history.train], "weights": weights, "moved": moved,
                "turns": [r.get("turns") for r in job.history.train], "world": job.backend.loader_rank_and_world}
    except Exception as err:  # noqa: BLE001 - what each process saw is the result
        return {"outcome": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}


ChatFormat.parse = _scripted_parse  # as tests/algorithms/test_grpo_episodes.py scripts it
torch.manual_seed(0)
result = {"rank": rank, "single": run("single", rewards="tests.algorithms.test_grpo:odd_first_character"),
          "agent": run("agent", model=tool_model, max_prompt_len=96, max_new_tokens=6, tool_tokens=24, max_turns=2,
                       dataset="multiply", tools="tpu_helpers.agents.examples:multiply",
                       rewards="tests.algorithms.test_grpo_episodes:odd_turns")}
(base / f"result-{rank}.json").write_text(json.dumps(result))
