"""Agent episodes per second and the host's time per turn: the package's multi-turn rollout (models/turns.py: one
cache continued turn by turn, fixed shapes) against the same episodes with Hugging Face `generate` re-run over the
whole conversation every turn (what TRL 1.16's tool loop does), on the CPU and on XLA:CPU.

    PYTHONPATH=. python benchmarks/agent_episodes.py                       # SmolLM2-135M-Instruct, lockers
    PYTHONPATH=. python benchmarks/agent_episodes.py --devices cpu,xla --batches 3 --rows 16
    PYTHONPATH=. python benchmarks/agent_episodes.py --group 1                 # 8 rows, one episode each
    PYTHONPATH=. python benchmarks/agent_episodes.py --smoke               # CI: the tiny model, toy sizes

The episodes: the offline Lockers environment (agents.examples), `--rows` episodes a batch in GRPO's groups of
`--group` episodes of one row (the package runs a group's prompt pass once, `EpisodeRunner.run(group=)`; the
`generate` side runs each conversation on its own, as TRL does), the prompts rendered with the tool schemas
through the model's template, sampled at temperature 1 with MAX_TURNS rounds of tool calls, TURN_TOKENS tokens per
turn and TOOL_TOKENS of tool text. An untrained model rarely writes a well-formed call, so the calls are scripted
here: a row's first `sum(prompt ids) % 3` turns count as calls to `open_locker`, the next as its answer (the rest of
the episode, the tool run, the template's tool text, the cache and the turns are real). The rule reads the row, not
the sampled tokens, so both sides run the same turns (a turn that runs out of tokens still ends its episode on
either side). Each device runs in its own process (PJRT_DEVICE=CPU for XLA:CPU).
Printed per side and device: episodes per second over the batches after the first, and per second of the main
thread's CPU time (on the CPU the arithmetic of one thread: the figure a busy machine does not skew; on XLA the
host's own work, XLA:CPU computing on threads of its own), the mean turns per episode, the
host's seconds per turn (parsing, tools, the tool text's tokens), and on XLA the graphs compiled by the first batch
and by the later ones (0: nothing compiles after the first episode of a shape).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _scripted(chat):
    """The parse both sides use: a row's first `sum(prompt ids) % 3` turns call open_locker, its next one answers
    with the turn's text. Keyed by the row's prompt list (`prefix`, one object a row; `parse.reset()` before each
    batch), not by the sampled tokens: both sides then run the same turns, whatever each samples."""
    from tpu_helpers.agents import Parsed

    turns_of: dict[int, int] = {}

    def parse(ids, *, prefix=None, tools=None, locker="red"):
        turn = turns_of.get(id(prefix), 0)
        turns_of[id(prefix)] = turn + 1
        if turn < sum(prefix) % 3:
            return Parsed({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "open_locker", "arguments": {"name": locker}}}]})
        return Parsed({"role": "assistant", "content": chat.tokenizer.decode(list(ids), skip_special_tokens=True)})

    parse.reset = turns_of.clear
    return parse


def _setup(args, device):
    import torch

    from tpu_helpers.agents import Agent, ChatFormat
    from tpu_helpers.agents.examples import Lockers, locker_reward, locker_rows
    from tpu_helpers.algorithms.episodes import EpisodeRunner
    from tpu_helpers.backend import backend_for
    from tpu_helpers.config import TrainConfig
    from tpu_helpers.models import hf
    from tpu_helpers.models.turns import TurnShape

    torch.manual_seed(0)
    model, tok = hf.load_causal_lm(args.model)
    b = backend_for(TrainConfig(device=device))
    model = b.move_model(model.eval())
    chat = ChatFormat(tok)
    agent = Agent(environment_factory=Lockers, reward_funcs=[locker_reward])
    shape = TurnShape(args.turn_tokens, args.tool_tokens, args.max_turns)
    runner = EpisodeRunner(agent, chat, shape, prompt_tokens=args.prompt_tokens, stop_ids=hf.eos_ids(tok, model),
                           pad_token_id=tok.pad_token_id)
    chat.parse = _scripted(chat)
    if args.stop_every:  # the tiny model never writes its end of turn: a share of the vocabulary ends a turn
        runner.stop_ids = [t for t in range(len(tok)) if t % args.stop_every == 0]
    if args.rows % args.group:
        raise SystemExit(f"--rows {args.rows} must be a multiple of --group {args.group}")
    rows = [r for r in locker_rows(args.rows // args.group * args.batches, seed=0) for _ in range(args.group)]
    return torch, model, tok, b, chat, runner, rows


def _hf_sampling(temperature: float) -> dict:
    """`generate`'s arguments for the package's Sampling(temperature): plain sampling, or greedy at 0."""
    if temperature == 0:
        return {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def _hf_episodes(torch, model, tok, chat, runner, rows, args) -> tuple[list[int], float]:
    """The same episodes with `generate` over each row's whole conversation every turn (no cache kept between
    turns), the same parse, tools and tool text: (turns per episode, host seconds outside generate)."""
    episodes = [runner.agent.start(r) for r in rows]
    convo = [chat.prompt_ids(e.prompt, tools=e.schemas) for e in episodes]
    prompts = [list(c) for c in convo]  # the rows' keys in the scripted parse, as the runner passes them
    active, turns, host = [True] * len(rows), [0] * len(rows), 0.0
    stop = set(runner.stop_ids)
    for k in range(runner.shape.answers):
        live = [i for i in range(len(rows)) if active[i]]
        if not live:
            break
        width = max(len(convo[i]) for i in live)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(convo[i])) + convo[i] for i in live])
        mask = torch.tensor([[0] * (width - len(convo[i])) + [1] * len(convo[i]) for i in live])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=runner.shape.turn_tokens,
                                 **_hf_sampling(args.temperature), eos_token_id=list(stop),
                                 pad_token_id=tok.pad_token_id)[:, width:].tolist()
        t0 = time.perf_counter()
        for i, row in zip(live, out, strict=True):
            turns[i] += 1
            own = row[:next((j + 1 for j, t in enumerate(row) if t in stop), len(row))]
            convo[i] += own
            if own[-1] not in stop:  # the turn ran out of tokens: the episode ends unparsed, as in the runner
                active[i] = False
                continue
            parsed = chat.parse(own, prefix=prompts[i])
            if not parsed.message.get("tool_calls") or k == runner.shape.max_turns:
                active[i] = False
                continue
            episodes[i].answer(parsed.message)
            more = chat.continuation_ids(episodes[i].messages, tools=episodes[i].schemas)
            convo[i] += more
        host += time.perf_counter() - t0
    return turns, host


def child(args) -> None:
    torch, model, tok, b, chat, runner, rows = _setup(args, args.child)
    from tpu_helpers.models.generation import Sampling

    out = {}
    for side in args.sides.split(","):
        if side == "hf" and args.child != "cpu":
            continue
        times, cpu, turns, host_turn, compiles = [], [], [], [], []
        for k in range(args.batches):
            batch_rows = rows[k * args.rows:(k + 1) * args.rows]
            before = b.metrics().get("compilations", 0)
            chat.parse.reset()
            t0, c0 = time.perf_counter(), time.thread_time()
            if side == "package":
                seed = torch.tensor([0, k], dtype=torch.long).to(b.device)
                batch = runner.run(model, batch_rows, backend=b, sampling=Sampling(args.temperature), seed=seed,
                                   group=args.group)
                b.to_cpu(batch.own)
                turns += batch.turns
                host_turn.append(batch.figures["host_s_per_turn"])
            else:
                used, host = _hf_episodes(torch, model, tok, chat, runner, batch_rows, args)
                turns += used
                host_turn.append(host / max(used))
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            compiles.append(b.metrics().get("compilations", 0) - before)
        later, later_cpu = times[1:] or times, cpu[1:] or cpu
        out[side] = {"episodes_per_s": args.rows * len(later) / sum(later),
                     "episodes_per_cpu_s": args.rows * len(later_cpu) / sum(later_cpu), "turns": sum(turns) / len(turns),
                     "host_s_per_turn": sum(host_turn) / len(host_turn), "compiles_first": compiles[0],
                     "compiles_later": sum(compiles[1:])}
    print("RESULT " + json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--devices", default="cpu")
    p.add_argument("--sides", default="package,hf")
    p.add_argument("--rows", type=int, default=8, help="episodes per batch")
    p.add_argument("--group", type=int, default=8, help="episodes per row (GRPO's group)")
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--turn-tokens", type=int, default=40)
    p.add_argument("--tool-tokens", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="0: greedy on both sides, so that they end the same turns (sampled, a turn that runs out of "
                        "tokens differs by chance and a second turn costs a whole decode)")
    p.add_argument("--stop-every", type=int, default=0, help="tokens id %% N == 0 end a turn (the tiny model)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--child", default=None)
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.smoke:  # the tiny model, its tokenizer given a brief native tool template (the fallback's ~580 tokens)
        sys.path.insert(0, str(ROOT))
        import atexit
        import shutil
        import tempfile

        from tests.algorithms.test_grpo_episodes import tool_tiny_copy
        from tpu_helpers.models.hf_tiny import tiny_model_dir

        tiny = Path(tempfile.mkdtemp(prefix="agent_episodes_"))
        atexit.register(shutil.rmtree, tiny, ignore_errors=True)
        args.model = tool_tiny_copy(tiny_model_dir(), tiny / "model")
        args.devices, args.rows, args.batches, args.group = "cpu,xla", 2, 2, 2
        args.prompt_tokens, args.turn_tokens, args.tool_tokens, args.stop_every = 128, 4, 24, 3
    print(f"{args.model}: {args.rows} Lockers episodes per batch ({args.group} per row), {args.batches} batches, "
          f"up to {args.max_turns} rounds of tool calls, {args.turn_tokens} tokens per turn, {args.tool_tokens} of "
          f"tool text, prompts {args.prompt_tokens} tokens")
    print(f"{'device':8} {'side':8} {'episodes/s':>10} {'per CPU s':>9} {'turns':>6} {'host s/turn':>11} "
          f"{'compiles':>12}")
    for device in args.devices.split(","):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if device == "xla":
            env["PJRT_DEVICE"] = "CPU"
        cmd = [sys.executable, __file__, "--child", device, *sys.argv[1:]]
        if args.smoke:
            cmd += ["--model", args.model, "--rows", "2", "--group", "2", "--batches", "2",
                    "--prompt-tokens", "128", "--turn-tokens", "4", "--tool-tokens", "24", "--stop-every", "3"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            print(f"{device}: failed ({proc.returncode})\n{proc.stderr[-3000:]}")
            sys.exit(1)
        for side, r in json.loads(line[7:]).items():
            compiles = f"{r['compiles_first']} then {r['compiles_later']}" if device == "xla" else "-"
            print(f"{device:8} {side:8} {r['episodes_per_s']:10.3f} {r['episodes_per_cpu_s']:9.3f} {r['turns']:6.2f} {r['host_s_per_turn']:11.4f} "
                  f"{compiles:>12}")


if __name__ == "__main__":
    main()
