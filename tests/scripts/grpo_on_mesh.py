"""A GRPO run (the recipe, its tiny offline model with LoRA) on an 8-device SPMD mesh (CPU_NUM_DEVICES=8, the
caller's) placed for the JSON argument's "sharding" (data, fsdp) with xla_checks="strict": a recompilation or an
undeclared host read after the warm-up raises. Prints the rewards, losses, compilations, the detector's problems,
whether the rollouts' decode ran as a device loop, and the report's device time per step. For
tests/algorithms/test_grpo.py. With "agent" (the tiny model's directory with a tool template: test_grpo_episodes.py's
tool_tiny_dir) the run is on agent episodes, scripted as tests/algorithms/test_grpo_episodes.py scripts them."""

import tempfile

from tests.support import print_result, script_args
from tpu_helpers.backend import get_backend
from tpu_helpers.models import replay
from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

args = script_args()
agent = {}
if args.get("agent"):
    from tests.algorithms.test_grpo_episodes import TOOLS, _scripted_parse
    from tpu_helpers.agents import ChatFormat

    ChatFormat.parse = _scripted_parse
    agent = dict(steps=4, model=args["agent"], max_prompt_len=96, tool_tokens=24, max_turns=2, dataset="multiply",
                 tools=TOOLS, rewards="tests.algorithms.test_grpo_episodes:odd_turns")
b = get_backend("xla", spmd=True, compile_cache_dir=None)
cfg = GRPOConfig(**{**dict(device="xla", sharding=args["sharding"], start_from=None, steps=6, batch_size=8,
                           num_generations=2, max_prompt_len=24, max_new_tokens=6, lr=1e-2, warmup_steps=1,
                           log_every=1, save_every=100, out_dir=tempfile.mkdtemp(), xla_checks="strict",
                           max_records=64, lora_r=4, seed=0), **agent})
job = GRPO(cfg, backend=b, progress=False)
if agent:  # the tiny model never writes its end of turn: a third of the vocabulary ends a turn
    job.rollouts.runner.stop_ids = [t for t in range(len(job.tokenizer)) if t % 3 == 0]
report = job.train()
print_result({"losses": [r["loss"] for r in job.history.train], "rewards": [r["reward"] for r in job.history.train],
              "compilations": report.xla["compilations"], "problems": report.xla["problems"],
              "looped": [type(kept.get("loop")).__name__ for kept in replay._KEPT.values()],
              "replicas": b.num_replicas, "device_ms": report.timing["device_ms"],
              "turns": [r.get("turns") for r in job.history.train]})
