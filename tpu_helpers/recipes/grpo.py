"""The GRPO recipe behind notebooks/grpo_llm.ipynb: memory plan -> start model -> prompts -> samples -> GRPO -> export.

    job = GRPO(config_from_parameters(globals(), base=GRPOConfig()))   # MODEL, START_FROM, DATASET, REWARDS, ...
    print(job.plan().summary())          # policy, reference, KV cache for B x G sequences, logits: before loading
    before = job.samples()               # held-out prompts: sampled completions and their rewards
    report = job.train()                 # algorithms.grpo.GRPOTrainer on the package Trainer
    after = job.samples(); job.plot(); paths = job.export()   # reward, length, KL, loss; adapter + merged model
    job.save_results(before=before, after=after, paths=paths)    # results.json, loss.png and grpo.png (that figure)

A sibling of fine-tuning on the shared Hugging Face job (`recipes.hf_job`: MODEL, METHOD "lora" or "full", LORA_*,
checkpoints, exports). What GRPO adds: the algorithm's settings (`algorithms.grpo.GRPOSettings`, whose fields are
this config's: NUM_GENERATIONS, KL_BETA, LOSS_TYPE, ...), START_FROM (None, "sft": a brief fine-tuning here first,
an adapter, a model directory or a fine-tuning run's OUT_DIR), DATASET of prompts with answers (`data.rl`),
REWARDS (`algorithms.rewards`) and MAX_PROMPT_LEN. BATCH_SIZE counts prompts per chip and step, each bringing
NUM_GENERATIONS rows. Every parameter, and the method: docs/jobs/grpo.md and docs/algorithms/grpo.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch

from tpu_helpers.agents import Agent, ChatFormat, examples, load_environment, load_tools
from tpu_helpers.algorithms.episodes import EpisodeRunner, answer_rewards, episode_prompts, final_text
from tpu_helpers.algorithms.grpo import GRPOSettings, GRPOTrainer, score_completions
from tpu_helpers.algorithms.rewards import (
    BUILTIN,
    DEFAULT_FORMAT,
    resolve_reward,
    resolve_rewards,
    reward_names,
)
from tpu_helpers.config import ConfigError, settings_fields, settings_from
from tpu_helpers.core.extras import require_extra
from tpu_helpers.data.loaders import fixed_batches
from tpu_helpers.data.rl import SUMS, build_prompt_dataset, load_prompt_records
from tpu_helpers.memory.grpo_plan import grpo_estimate
from tpu_helpers.models import hf, lora
from tpu_helpers.models.generation import check_generation_support, generate_ids
from tpu_helpers.models.hf import eos_ids
from tpu_helpers.models.turns import TurnShape
from tpu_helpers.recipes.hf_job import HFJob, HFJobConfig, JobData
from tpu_helpers.training.results import panels_figure

# As fine-tuning does: without transformers/peft the notebook stops at its first cell, naming the extra.
require_extra("hf", "GRPO (tpu_helpers.recipes.grpo)")

SFT = "sft"
SFT_DEMONSTRATIONS = 256  # START_FROM "sft" in agent mode: the example environment's demonstrations fine-tuned on
GRPO_FIGURE = "grpo.png"  # what save_results writes besides loss.png: the reward, completion length, KL and loss
CURVES = (("reward", "mean reward"), ("completion_tokens", "completion tokens"), ("kl", "KL to the reference"),
          ("loss", "loss"))
AGENT_CURVES = (("turns", "turns per episode"), ("tool_success", "tool-call success rate"))
# The offline example environments' rows (agents.examples), as DATASET names in agent mode.
EXAMPLE_ROWS = {"lockers": examples.locker_rows, "hunt": examples.hunt_rows, "guessing": examples.guessing_rows,
                "multiply": examples.multiply_rows}
EXAMPLE_DEMOS = {"lockers": examples.locker_demonstrations, "hunt": examples.hunt_demonstrations,
                 "guessing": examples.guessing_demonstrations, "multiply": examples.multiply_demonstrations}


def curves_figure(curves: dict[str, list], *, pyplot: bool = False):
    """Mean reward, completion tokens, KL and loss against step, from `GRPO.curves()` (or results.json's "curves"),
    and for agents the turns per episode and the tool-call success rate. `pyplot=True`: a pyplot figure (a notebook
    shows it); otherwise a standalone Figure pyplot does not track (for files: nothing to close)."""
    panels = CURVES + tuple(p for p in AGENT_CURVES if any(v is not None for v in curves.get(p[0]) or ()))
    return panels_figure(curves, panels, width=14 if len(panels) == len(CURVES) else 20, pyplot=pyplot)


@dataclass
@settings_fields(GRPOSettings)  # NUM_GENERATIONS, MAX_NEW_TOKENS, TEMPERATURE, KL_BETA, LOSS_TYPE, ...: declared there
class GRPOConfig(HFJobConfig):
    """`HFJobConfig` plus GRPO's settings, each a notebook parameter of the same UPPER_CASE name: the fields of
    `algorithms.grpo.GRPOSettings` (built from them once, `config.grpo`, as the trainer takes them) and the
    recipe's own below. BATCH_SIZE is prompts per chip and step; SEQ_LEN follows from MAX_PROMPT_LEN +
    MAX_NEW_TOKENS."""

    dataset: str = SUMS  # "sums" (generated, offline), a local .jsonl/.json/.csv/.parquet, or a hub name
    start_from: str | None = SFT  # None | "sft" (brief SFT here first) | adapter dir | model dir | fine-tuning OUT_DIR
    sft_steps: int = 150  # START_FROM "sft": fine-tuning steps (the instruction task; agents: the demonstrations)
    system_prompt: str | None = None
    rewards: str = "answer"  # comma-separated built-in names (answer, format, number, length, overlong) or paths
    format_pattern: str = DEFAULT_FORMAT  # the regex of the "format" reward
    max_prompt_len: int = 32
    batch_size: int = 8
    steps: int = 200
    lr: float = 2e-3
    warmup_steps: int = 10
    log_every: int = 10
    save_every: int = 100
    out_dir: str = "runs/grpo"
    # Agents (docs/guides/agents.md): with ENVIRONMENT or TOOLS each row is an episode of tool calls, each turn at
    # most MAX_NEW_TOKENS tokens, and REWARDS score it (built-in names: its final answer's text; import paths:
    # TRL-style reward functions; empty: the environment's get_reward).
    environment: str | None = None  # module:Class or path/to/file.py:Class, one instance per episode (TRL's)
    tools: str | None = None  # comma-separated module:function or path/to/file.py:function tools
    max_turns: int = 2  # rounds of tool calls per episode (TRL's max_tool_calling_iterations)
    tool_tokens: int = 48  # tokens of tool text between two turns; more ends the episode (cut)
    mask_truncated: bool = False  # an episode cut by its budget adds no loss (TRL's mask_truncated_completions)
    tool_timeout: float = 30.0  # seconds a tool call may take before it becomes an error message

    recipe: ClassVar[str] = "GRPO"

    @property
    def agentic(self) -> bool:
        """Whether rows are agent episodes (ENVIRONMENT or TOOLS given)."""
        return bool(self.environment or self.tools)

    @property
    def turn_shape(self) -> TurnShape | None:
        """An episode's budget in agent mode (None otherwise)."""
        return TurnShape(self.max_new_tokens, self.tool_tokens, self.max_turns) if self.agentic else None

    @property
    def completion_tokens(self) -> int:
        """The columns after the prompt: MAX_NEW_TOKENS, or an episode's whole width in agent mode."""
        return self.turn_shape.width if self.agentic else self.max_new_tokens

    def __post_init__(self) -> None:
        if self.agentic:
            self.turn_shape  # noqa: B018 (checks MAX_TURNS, TOOL_TOKENS)
            if not (isinstance(self.tool_timeout, (int, float)) and self.tool_timeout > 0):
                raise ConfigError(f"TOOL_TIMEOUT={self.tool_timeout!r} must be a number of seconds > 0")
        if isinstance(self.max_prompt_len, int) and isinstance(self.max_new_tokens, int):
            self.seq_len = self.max_prompt_len + self.completion_tokens
        super().__post_init__()
        self.grpo = settings_from(self, GRPOSettings)  # checked and parsed once; the trainer takes it whole
        self.grpo.check_split(self.batch_size, self.grad_accum)
        for name in ("max_prompt_len", "sft_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be >= 1")
        if self.start_from not in (None, SFT) and not Path(self.start_from).expanduser().is_dir():
            raise ConfigError(f"START_FROM={self.start_from!r} is not {SFT!r}, None, nor a directory (a PEFT adapter, "
                              "a save_pretrained model, or a fine-tuning run's OUT_DIR)")
        if self.agentic:
            agent_rewards(self.rewards, self.format_pattern)  # an unknown name fails here
            load_tools(self.tools) if self.tools else None
            load_environment(self.environment) if self.environment else None
        else:
            resolve_rewards(self.rewards, format_pattern=self.format_pattern)  # an unknown name fails here


def agent_rewards(rewards: str | None, format_pattern: str) -> dict:
    """REWARDS in agent mode: built-in names score the final answer's text (`algorithms.episodes.answer_rewards`),
    import paths are TRL-style reward functions called as they are; empty: none (the environment's get_reward)."""
    if not rewards or not str(rewards).strip():
        return {}
    out: dict = {}
    for item in reward_names(rewards):
        name, fn = resolve_reward(item, format_pattern=format_pattern)
        if name in out:
            raise ConfigError(f"REWARDS names {name!r} twice")
        out.update(answer_rewards({name: fn}) if name in BUILTIN or name == "format" else {name: fn})
    return out


def check_context(config: Any, max_prompt_len: int, max_new_tokens: int) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_prompt_len + max_new_tokens > limit:
        raise ConfigError(f"MAX_PROMPT_LEN={max_prompt_len} + MAX_NEW_TOKENS={max_new_tokens} = "
                          f"{max_prompt_len + max_new_tokens} exceeds the model's context of {limit} tokens "
                          "(config.max_position_embeddings)")


class GRPO(HFJob):
    """One GRPO job; its parts load on first use (see the module docstring)."""

    config_class = GRPOConfig
    config: GRPOConfig
    plan_what = "GRPO"

    @property
    def source(self) -> str:
        """The model GRPO starts from (and exports merge into): MODEL, or what START_FROM makes of it."""
        return self.start_source

    # ---- 1. memory plan -------------------------------------------------------------------------------------------
    def model_config(self) -> Any:
        config = super().model_config()
        check_context(config, self.config.max_prompt_len, self.config.completion_tokens)
        return config

    def estimate(self, model_config: Any, model: torch.nn.Module):
        """One chip's memory for generating B x G answers and the optimizer step over them."""
        cfg = self.config
        kwargs = dict(self.plan_options(), num_generations=cfg.num_generations, max_prompt_len=cfg.max_prompt_len,
                      max_new_tokens=cfg.completion_tokens, kl_beta=cfg.kl_beta)
        return lambda prompts: grpo_estimate(model_config, prompts, model=model, **kwargs)

    # ---- 2. the start model and the policy ------------------------------------------------------------------------
    @cached_property
    def start_source(self) -> str:
        """The directory (or hub name) of the model GRPO starts from, made on first use (see START_FROM)."""
        cfg = self.config
        if cfg.start_from is None:
            return self.model_source
        if cfg.start_from == SFT:
            return self._warm_start()
        path = Path(cfg.start_from).expanduser()
        for candidate in (path / "merged", path):
            if (candidate / "config.json").is_file():
                return str(candidate)
        adapter = path / "adapter" if (path / "adapter" / "adapter_config.json").is_file() else path
        if not (adapter / "adapter_config.json").is_file():
            raise ConfigError(f"START_FROM={cfg.start_from!r} holds no config.json (a model), no adapter_config.json "
                              "(a PEFT adapter) and no merged/ or adapter/ export of a fine-tuning run")
        return self._merge_adapter(adapter)

    def _merge_adapter(self, adapter: Path) -> str:
        """MODEL with the adapter merged in, saved once under OUT_DIR/start (the base of a fresh adapter)."""
        from peft import PeftModel

        target = Path(self.config.out_dir) / "start"
        if not (target / "config.json").is_file():
            base, tokenizer = hf.load_causal_lm(self.model_source, attn_implementation=self.config.attn_implementation)
            merged = PeftModel.from_pretrained(base, adapter)
            lora.export_merged(merged, tokenizer, target, base_source=self.model_source)
        return str(target)

    def _warm_start(self) -> str:
        """START_FROM "sft": MODEL fine-tuned (every weight) on the generated instruction task for SFT_STEPS steps
        in OUT_DIR/sft, its merged export reused when it exists."""
        from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig  # only for this warm start

        cfg = self.config
        out = Path(cfg.out_dir) / SFT
        if (out / "merged" / "config.json").is_file():
            return str(out / "merged")
        if cfg.agentic:
            return self._warm_start_on_demonstrations(out)
        sft = FinetuneConfig(model=cfg.model, dataset="instructions", method="full", steps=cfg.sft_steps,
                             batch_size=16, seq_len=48, lr=3e-3, warmup_steps=min(20, cfg.sft_steps // 5),
                             eval_every=cfg.sft_steps, log_every=max(1, cfg.sft_steps // 10), save_every=cfg.sft_steps,
                             out_dir=str(out), device=cfg.device, precision=cfg.precision, sharding=cfg.sharding,
                             xla_checks=cfg.xla_checks, seed=cfg.seed, max_records=2000, export_merged=True)
        job = Finetune(sft, backend=self.backend, progress=self.progress)
        job.train()
        return job.export()["merged"]

    def _warm_start_on_demonstrations(self, out: Path) -> str:
        """START_FROM "sft" in agent mode: MODEL fine-tuned with LoRA (merged after) for SFT_STEPS steps on the
        example environment's demonstrations (`agents.examples`: its own tool results, the prompts the episodes
        render), written to OUT_DIR/sft/demonstrations.jsonl; another seed than the GRPO rows', so SFT and RL see
        other episodes."""
        from tpu_helpers.core.atomic_io import atomic_write_text
        from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig

        cfg = self.config
        if cfg.dataset not in EXAMPLE_DEMOS:
            raise ConfigError(f"START_FROM={SFT!r} with an environment fine-tunes on an example environment's "
                              f"demonstrations (DATASET one of {sorted(EXAMPLE_DEMOS)}), not DATASET="
                              f"{cfg.dataset!r}: fine-tune on your own tool conversations with notebooks/"
                              "finetune_llm.ipynb (TRL's SFT form) and give its OUT_DIR as START_FROM")
        demos = EXAMPLE_DEMOS[cfg.dataset](SFT_DEMONSTRATIONS, seed=cfg.seed + 1)
        path = out / "demonstrations.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, "".join(json.dumps(d) + "\n" for d in demos))
        # Rows as long as the longest demonstration (a multiple of 8), within the episode budget: padding costs as
        # much as tokens in a forward. MODEL's tokenizer: the job's own loads the start model, this one's output.
        from transformers import AutoTokenizer

        from tpu_helpers.data.sft import encode_tool_conversation

        tok = AutoTokenizer.from_pretrained(self.model_source)
        longest = max(len(encode_tool_conversation(tok, d["messages"], d["tools"])[0]) for d in demos)
        seq_len = min(-(-longest // 8) * 8, cfg.max_prompt_len + cfg.completion_tokens)
        sft = FinetuneConfig(model=cfg.model, dataset=str(path), method="lora", lora_r=16, lora_alpha=32,
                             steps=cfg.sft_steps, batch_size=8, seq_len=seq_len,
                             lr=2e-3, warmup_steps=min(5, cfg.sft_steps // 5), eval_every=cfg.sft_steps,
                             log_every=max(1, cfg.sft_steps // 10), save_every=cfg.sft_steps, out_dir=str(out),
                             device=cfg.device, precision=cfg.precision, sharding=cfg.sharding,
                             xla_checks=cfg.xla_checks, seed=cfg.seed, export_merged=True)
        job = Finetune(sft, backend=self.backend, progress=self.progress)
        job.train()
        return job.export()["merged"]

    def prepare_model(self, model: torch.nn.Module) -> None:
        check_context(model.config, self.config.max_prompt_len, self.config.completion_tokens)
        check_generation_support(model)  # every step generates: an unserved model is refused as it loads

    @cached_property
    def reference(self) -> torch.nn.Module | None:
        """The frozen copy of the start model that full fine-tuning's KL term needs (None under LoRA)."""
        cfg = self.config
        if cfg.uses_lora or cfg.kl_beta == 0:
            return None
        return self.load(self.source, frozen=True)[0]

    # ---- 3. prompts -----------------------------------------------------------------------------------------------
    def load_data(self) -> JobData:
        """Prompts of DATASET left-padded to MAX_PROMPT_LEN (stats: kept and skipped), no validation rows, and the
        held-out prompts with answers (the generated sums' test split)."""
        cfg = self.config
        if cfg.agentic:
            return self._load_episodes()
        records = self.read_records(load_prompt_records)
        data, stats = build_prompt_dataset(self.tokenizer, records, max_prompt_len=cfg.max_prompt_len,
                                           prompt_field=cfg.prompt_field, answer_field=cfg.answer_field,
                                           system_prompt=cfg.system_prompt)
        held = load_prompt_records(SUMS, split="test") if cfg.dataset == SUMS else records[:64]
        return JobData(data, None, stats, held, records)

    def _load_episodes(self) -> JobData:
        """Agent mode: DATASET's rows (an example environment's name, or any source of rows with what reset needs),
        each rendered as its episode's prompt to be kept or left out by MAX_PROMPT_LEN, and the held-out rows."""
        cfg = self.config
        if cfg.dataset in EXAMPLE_ROWS:
            make = EXAMPLE_ROWS[cfg.dataset]
            records = make(cfg.max_records or 2000, seed=cfg.seed, split="train")
            held = make(64, seed=cfg.seed, split="test")
        else:
            records = self.read_records(load_prompt_records)
            held = records[:64]
        data, stats = episode_prompts(self.episode_runner, records, max_prompt_len=cfg.max_prompt_len)
        return JobData(data, None, stats, held, records)

    @cached_property
    def rewards(self) -> dict:
        if self.config.agentic:
            return agent_rewards(self.config.rewards, self.config.format_pattern)
        return resolve_rewards(self.config.rewards, format_pattern=self.config.format_pattern)

    @cached_property
    def episode_runner(self) -> EpisodeRunner | None:
        """Agent mode's episodes: the tools and environment loaded, the model's chat format, the turn shape."""
        cfg = self.config
        if not cfg.agentic:
            return None
        agent = Agent(tools=load_tools(cfg.tools) if cfg.tools else (),
                      environment_factory=load_environment(cfg.environment) if cfg.environment else None,
                      reward_funcs=self.rewards, timeout_s=cfg.tool_timeout)
        tok = self.tokenizer
        return EpisodeRunner(agent, ChatFormat(tok), cfg.turn_shape, prompt_tokens=cfg.max_prompt_len,
                             stop_ids=eos_ids(tok), pad_token_id=tok.pad_token_id, mask_truncated=cfg.mask_truncated)

    # ---- 4. samples -----------------------------------------------------------------------------------------------
    def samples(self, n: int | None = None) -> dict:
        """Held-out prompts answered with the run's sampling (a fixed stream) in the training step's shapes (on XLA
        the generation graphs training compiled): mean reward, mean completion tokens, each reward's mean, rows,
        graphs compiled."""
        cfg, b = self.config, self.backend
        records = self.held_out if n is None else self.held_out[:n]
        if cfg.agentic:
            return self._episode_samples(records)
        held, _ = build_prompt_dataset(self.tokenizer, records, max_prompt_len=cfg.max_prompt_len,
                                       prompt_field=cfg.prompt_field, answer_field=cfg.answer_field,
                                       system_prompt=cfg.system_prompt)
        rows = cfg.grpo.rows(cfg.batch_size) * max(1, b.num_replicas // b.world_size)  # the rollout's shape
        model = self._model_on_device()
        before = b.metrics().get("compilations", 0)
        tokens: list[list[int]] = []
        stop = eos_ids(self.tokenizer, model)  # the tokenizer's EOS and the model's end of turn
        for idx, real in fixed_batches(len(held), rows):
            # A fixed stream per batch and process (the rank: data-parallel processes must not share one).
            key = torch.tensor([cfg.seed, -1 - idx[0], b.rank], dtype=torch.long).to(b.device)
            with b.autocast():
                gen = generate_ids(model, held.input_ids[idx].to(b.device), held.attention_mask[idx].to(b.device),
                                   max_new_tokens=cfg.max_new_tokens, eos_token_id=stop,
                                   pad_token_id=self.tokenizer.pad_token_id, sampling=cfg.grpo.sampling, seed=key,
                                   sync=b.sync, replay=b.compile_step, loop=b.compile_loop)
            tokens += b.to_cpu(gen.ids).tolist()[:real]
        kept = [records[i] for i in held.index.tolist()]
        scored = score_completions(self.tokenizer, self.rewards, kept, tokens, cfg.grpo, stop)
        total = scored["total"]
        table = [{"prompt": p if isinstance(p, str) else p[-1]["content"], "answer": r.get(cfg.answer_field),
                  "completion": c, "reward": t}
                 for p, r, c, t in zip(scored["prompts"], kept, scored["completions"], total, strict=True)]
        lengths = scored["completion_tokens"]
        return {"reward": sum(total) / len(total), "completion_tokens": sum(lengths) / len(lengths),
                "rewards": {k: sum(v) / len(v) for k, v in scored["rewards"].items()}, "rows": table,
                "compilations": b.metrics().get("compilations", 0) - before}

    def _episode_samples(self, records: list[dict]) -> dict:
        """Held-out episodes in the training step's shapes: mean reward, turns, tool calls and their success, each
        reward's mean, the rows (prompt, transcript, final answer, reward), the episodes' messages after the prompt
        ("completions", as reward functions and metrics such as `note_following` take them) and graphs compiled."""
        cfg, b = self.config, self.backend
        runner = self.episode_runner
        rows = cfg.grpo.rows(cfg.batch_size) * max(1, b.num_replicas // b.world_size)
        model = self._model_on_device()
        before = b.metrics().get("compilations", 0)
        episodes, figures = [], []
        for idx, real in fixed_batches(len(records), rows):
            key = torch.tensor([cfg.seed, -1 - idx[0], b.rank], dtype=torch.long).to(b.device)
            with b.autocast():
                batch = runner.run(model, [records[i] for i in idx], backend=b, sampling=cfg.grpo.sampling, seed=key)
            episodes += batch.episodes[:real]
            figures.append((real, batch.figures))
        total, values = runner.score(episodes)
        table = [{"prompt": e.prompt[-1]["content"], "answer": e.row.get(cfg.answer_field),
                  "completion": final_text(e.completion), "transcript": transcript(e.completion), "reward": t}
                 for e, t in zip(episodes, total, strict=True)]
        mean = {k: sum(r * f[k] for r, f in figures) / len(records) for k in ("turns", "tool_calls", "truncated")}
        calls = sum(e.stats.calls for e in episodes)
        success = 1.0 - sum(e.stats.failed for e in episodes) / calls if calls else float("nan")
        return {"reward": sum(total) / len(total), **mean, "tool_success": success,
                "rewards": {k: sum(v) / len(v) for k, v in values.items()}, "rows": table,
                "completions": [e.completion for e in episodes],
                "compilations": b.metrics().get("compilations", 0) - before}

    @staticmethod
    def compare(before: dict, after: dict, n: int | None = None) -> list[dict]:
        """The same held-out prompts' completions and rewards before and after training, side by side."""
        rows = [{"prompt": b["prompt"], "answer": b["answer"], "before": b["completion"], "after": a["completion"],
                 "reward": f"{b['reward']:g} -> {a['reward']:g}"}
                for b, a in zip(before["rows"], after["rows"], strict=True)]
        return rows if n is None else rows[:n]

    # ---- 5. training ----------------------------------------------------------------------------------------------
    def run_identity(self) -> dict:
        cfg = self.config
        agent = {"environment": cfg.environment, "tools": cfg.tools, "max_turns": cfg.max_turns,
                 "tool_tokens": cfg.tool_tokens} if cfg.agentic else {}
        return {**super().run_identity(), "start_from": str(cfg.start_from), "rewards": cfg.rewards,
                "num_generations": cfg.num_generations, "max_prompt_len": cfg.max_prompt_len,
                "max_new_tokens": cfg.max_new_tokens, **agent}

    def make_trainer(self) -> GRPOTrainer:
        return GRPOTrainer(self.model, self.train_data, tokenizer=self.tokenizer, records=self.records,
                           rewards=self.rewards, settings=self.config.grpo, ref_model=self.reference,
                           episodes=self.episode_runner, **self.trainer_options())

    # ---- 6. results -----------------------------------------------------------------------------------------------
    def curves(self) -> dict[str, list]:
        """Per log step: step, reward, completion length, KL and loss (from the run's history)."""
        rows = self.history.train
        keys = ("step", "reward", "completion_tokens", "kl", "loss") + \
            (tuple(k for k, _ in AGENT_CURVES) if self.config.agentic else ())
        return {k: [r.get(k) for r in rows] for k in keys}

    def plot(self):
        """Reward, completion length, KL and loss against step (a pyplot figure, shown in a notebook); the same
        figure `save_results` writes as `grpo.png`."""
        return curves_figure(self.curves(), pyplot=True)

    def figures(self) -> dict[str, Any]:
        """`loss.png` (the generic loss and throughput curves) and `grpo.png`, the notebook's reward, completion
        length, KL and loss figure, both drawn from the run's history: what a headless run leaves to look at."""
        return {**super().figures(), GRPO_FIGURE: curves_figure(self.curves())}

    def tracked_results(self, results: dict) -> dict:
        """The held-out completions before and after as tables, and their mean rewards (agents: also the turns per
        episode and the tool-call success), for the trackers."""
        tracked = super().tracked_results(results)
        for when, value in (results.get("reward") or {}).items():
            if value is not None:
                tracked["values"][f"samples/reward_{when}"] = value
        for key, _ in AGENT_CURVES:  # agent mode: the held-out turns per episode and tool-call success rate
            for when, value in (results.get(key) or {}).items():
                if value is not None:
                    tracked["values"][f"samples/{key}_{when}"] = value
        return tracked

    def results(self, *, before: dict | None = None, after: dict | None = None, **extra: Any) -> dict:
        reward = {"before": before["reward"] if before else None, "after": after["reward"] if after else None}
        if self.config.agentic:  # turns and tool-call success, before -> after (None: no tool call made)
            for key, _ in AGENT_CURVES:
                extra.setdefault(key, {w: s[key] if s and s[key] == s[key] else None
                                       for w, s in (("before", before), ("after", after))})
        return super().results(before=before, after=after, reward=reward, curves=self.curves(),
                               data=self.data_stats, generation_seconds=sum(self.trainer.rollout_seconds), **extra)


def transcript(completion: list[dict]) -> str:
    """An episode's messages after the prompt as readable lines: the model's text and tool calls, the tool results."""
    import json

    lines = []
    for m in completion:
        if m.get("role") == "assistant":
            text = str(m.get("content") or "").strip()
            calls = [c.get("function", c) for c in m.get("tool_calls") or ()]
            lines += [f"assistant: {text}"] if text else []
            lines += [f"call {c.get('name')}({json.dumps(c.get('arguments'))})" for c in calls]
        else:
            lines.append(f"{m.get('role')} {m.get('name') or ''}: {m.get('content')}".replace("  ", " "))
    return "\n".join(lines)
