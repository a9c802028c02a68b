"""The GRPO recipe behind notebooks/grpo_llm.ipynb: memory plan -> start model -> prompts -> samples -> GRPO -> export.

    job = GRPO(config_from_parameters(globals(), base=GRPOConfig()))   # MODEL, START_FROM, DATASET, REWARDS, ...
    print(job.plan().summary())          # policy, reference, KV cache for B x G sequences, logits: before loading
    before = job.samples()               # held-out prompts: sampled completions and their rewards
    report = job.train()                 # algorithms.grpo.GRPOTrainer on the package Trainer
    after = job.samples(); job.plot(); paths = job.export()   # reward, length, KL, loss; adapter + merged model
    job.save_results(before=before, after=after, paths=paths)    # results.json, loss.png and grpo.png (that figure)

A sibling of fine-tuning on the shared Hugging Face job (`recipes.hf_job`: MODEL, METHOD, LORA_*, checkpoints,
exports). What GRPO adds: the algorithm's settings (`algorithms.grpo.GRPOSettings`, whose fields are this config's:
NUM_GENERATIONS, KL_BETA, LOSS_TYPE, ...), START_FROM (None, "sft": a brief fine-tuning here first, an adapter, a
model directory or a fine-tuning run's OUT_DIR), DATASET of prompts with answers (`data.rl`), REWARDS
(`algorithms.rewards`) and MAX_PROMPT_LEN. BATCH_SIZE counts prompts per chip and step, each bringing
NUM_GENERATIONS rows. Every parameter: docs/jobs/grpo.md; the method: docs/algorithms/grpo.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Any, ClassVar

import torch

from tpu_helpers.agents import ChatFormat
from tpu_helpers.agents.examples import EXAMPLES
from tpu_helpers.algorithms.episodes import AgentSettings, EpisodeRunner, episode_rewards
from tpu_helpers.algorithms.grpo import GRPOSettings, GRPOTrainer
from tpu_helpers.algorithms.reward_model import place_reward_models
from tpu_helpers.algorithms.rewards import DEFAULT_FORMAT, resolve_rewards
from tpu_helpers.algorithms.rollouts import AnswerRollouts, EpisodeRollouts
from tpu_helpers.config import ConfigError, settings_fields, settings_from
from tpu_helpers.core.extras import require_extra
from tpu_helpers.data.held_out import HeldOut
from tpu_helpers.data.rl import SUMS, load_prompt_records
from tpu_helpers.memory.grpo_plan import grpo_estimate
from tpu_helpers.models import hf, lora
from tpu_helpers.models.generation import check_generation_support
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


def curves_figure(curves: dict[str, list], *, pyplot: bool = False):
    """Mean reward, completion tokens, KL and loss against step, from `GRPO.curves()` (or results.json's "curves"),
    and for agents the turns per episode and the tool-call success rate. `pyplot=True`: a pyplot figure (a notebook
    shows it); otherwise a standalone Figure pyplot does not track (for files: nothing to close)."""
    panels = CURVES + tuple(p for p in AGENT_CURVES if any(v is not None for v in curves.get(p[0]) or ()))
    return panels_figure(curves, panels, width=14 if len(panels) == len(CURVES) else 20, pyplot=pyplot)


@dataclass
@settings_fields(GRPOSettings)  # NUM_GENERATIONS, MAX_NEW_TOKENS, TEMPERATURE, KL_BETA, LOSS_TYPE, ...: declared there
@settings_fields(AgentSettings)  # ENVIRONMENT, TOOLS, MAX_TURNS, TOOL_TOKENS, MASK_TRUNCATED, TOOL_TIMEOUT
class GRPOConfig(HFJobConfig):
    """`HFJobConfig` plus GRPO's settings, each a notebook parameter of the same UPPER_CASE name: the fields of
    `algorithms.grpo.GRPOSettings` (built from them once, `config.grpo`, as the trainer takes them), of
    `algorithms.episodes.AgentSettings` (agents, docs/guides/agents.md: with ENVIRONMENT or TOOLS each row is an
    episode of tool calls, each turn at most MAX_NEW_TOKENS tokens; built once, `config.agent`, the environment
    loaded and probed there) and the recipe's own below. BATCH_SIZE is prompts per chip and step; SEQ_LEN follows
    from MAX_PROMPT_LEN + the completion's columns. An example DATASET of `agents.examples.EXAMPLES` (lockers,
    hunt, ...) given without ENVIRONMENT or TOOLS brings its own, and its rewards where REWARDS is left at its
    default."""

    # "sums" (generated, offline), an example environment's name, a local file or a hub name; agents: None when the
    # environment's reset returns the prompt (TRL's train_dataset=None: STEPS sets the length)
    dataset: str | None = SUMS
    start_from: str | None = SFT  # None | "sft" (brief SFT here first) | adapter dir | model dir | fine-tuning OUT_DIR
    sft_steps: int = 150  # START_FROM "sft": fine-tuning steps (the instruction task; agents: the demonstrations)
    sft_dataset: str | None = None  # START_FROM "sft", agents: a file of your tool conversations (messages, tools)
    system_prompt: str | None = None
    # Comma-separated built-in names (answer, format, number, length, overlong), import paths of TRL-style reward
    # functions, or "model:PATH" (a reward model, scored on the device); agents: empty for the environment's.
    rewards: str = "answer"
    format_pattern: str = DEFAULT_FORMAT  # the regex of the "format" reward
    max_prompt_len: int = 32
    batch_size: int = 8
    steps: int = 200
    lr: float = 2e-3
    warmup_steps: int = 10
    save_every: int = 100
    out_dir: str = "runs/grpo"

    recipe: ClassVar[str] = "GRPO"

    @property
    def agentic(self) -> bool:
        """Whether rows are agent episodes (ENVIRONMENT or TOOLS given)."""
        return self.agent.enabled

    @property
    def turn_shape(self) -> TurnShape | None:
        """An episode's token budget (None for single answers)."""
        return self.agent.shape(self.max_new_tokens) if self.agent.enabled else None

    @property
    def completion_tokens(self) -> int:
        """The columns after the prompt: MAX_NEW_TOKENS, or an episode's whole width."""
        return self.turn_shape.width if self.agent.enabled else self.max_new_tokens

    def __post_init__(self) -> None:
        example = EXAMPLES.get(self.dataset) if isinstance(self.dataset, str) else None
        if example is not None and not (self.environment or self.tools):
            self.environment, self.tools = example.environment, example.tools
            if self.rewards == type(self).rewards:
                self.rewards = example.rewards
        self.agent = settings_from(self, AgentSettings)  # checked; ENVIRONMENT and TOOLS loaded and probed, once
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
        if self.dataset is None and not self.agent.enabled:
            raise ConfigError("DATASET=None: only agents run without a dataset (ENVIRONMENT given, its reset returning "
                              "the prompt, as TRL's train_dataset=None); give DATASET, the prompts with answers")
        if self.dataset is None and len(self.agent.environments) > 1:
            raise ConfigError("DATASET=None with a dict of environments: each row picks its environment by its "
                              "'environment' column, so give DATASET (TRL's rule too)")
        if self.sft_dataset is not None and not Path(self.sft_dataset).expanduser().is_file():
            raise ConfigError(f"SFT_DATASET={self.sft_dataset!r} is no file; give a .jsonl/.json/.csv/.parquet file "
                              "of tool conversations in TRL's SFT form (a 'messages' and a 'tools' column), or None")
        if self.start_from == SFT and self.agent.enabled and example is None and self.sft_dataset is None:
            raise ConfigError(f"START_FROM={SFT!r} with an environment fine-tunes on tool conversations first: an "
                              f"example environment's demonstrations (DATASET one of {sorted(EXAMPLES)}), or yours "
                              f"as SFT_DATASET (TRL's SFT form: messages and tools); DATASET={self.dataset!r} has "
                              "none. Or set START_FROM None, or a fine-tuning run's OUT_DIR")
        # The reward functions, parsed once (an unknown name fails here): episodes score their final answer's text.
        self.reward_funcs = episode_rewards(self.rewards, self.format_pattern) if self.agent.enabled else \
            resolve_rewards(self.rewards, format_pattern=self.format_pattern)
        if (weights := self.grpo.weights) is not None and len(weights) != len(self.reward_funcs):
            raise ConfigError(f"REWARD_WEIGHTS={self.reward_weights!r} gives {len(weights)} weights for the "
                              f"rewards {', '.join(self.reward_funcs)}: one per reward, in REWARDS' order")


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
        if (model_dir := hf.exported_model_dir(path)) is not None:
            return str(model_dir)
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
        example = EXAMPLES.get(cfg.dataset)
        if example is not None or cfg.sft_dataset is not None:
            return self._warm_start_on_demonstrations(out, example)
        sft = FinetuneConfig(model=cfg.model, dataset="instructions", method="full", steps=cfg.sft_steps,
                             batch_size=16, seq_len=48, lr=3e-3, warmup_steps=min(20, cfg.sft_steps // 5),
                             eval_every=cfg.sft_steps, log_every=max(1, cfg.sft_steps // 10), save_every=cfg.sft_steps,
                             out_dir=str(out), device=cfg.device, precision=cfg.precision, sharding=cfg.sharding,
                             xla_checks=cfg.xla_checks, seed=cfg.seed, max_records=2000, export_merged=True)
        job = Finetune(sft, backend=self.backend, progress=self.progress)
        job.train()
        return job.export()["merged"]

    def _warm_start_on_demonstrations(self, out: Path, example: Any) -> str:
        """START_FROM "sft" on tool conversations: MODEL fine-tuned with LoRA (merged after) for SFT_STEPS steps on
        SFT_DATASET (TRL's SFT form: "messages" and "tools"), or on the example environment's demonstrations
        (`agents.examples`: its own tool results, the prompts the episodes render; another seed than the GRPO
        rows', so SFT and RL see other episodes), written to OUT_DIR/sft/demonstrations.jsonl."""
        from tpu_helpers.core.atomic_io import atomic_write_text
        from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig

        cfg = self.config
        seq_len = cfg.max_prompt_len + cfg.completion_tokens  # the episode's budget
        if cfg.sft_dataset is not None:
            path = Path(cfg.sft_dataset).expanduser()
        else:
            demos = example.demonstrations(SFT_DEMONSTRATIONS, seed=cfg.seed + 1)
            path = out / "demonstrations.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, "".join(json.dumps(d) + "\n" for d in demos))
            # Rows as long as the longest demonstration (a multiple of 8), within the budget: padding costs as much
            # as tokens in a forward. MODEL's tokenizer: the job's own loads the start model, this one's output.
            from transformers import AutoTokenizer

            from tpu_helpers.data.sft import encode_tool_conversation

            tok = AutoTokenizer.from_pretrained(self.model_source)
            longest = max(len(encode_tool_conversation(tok, d["messages"], d["tools"])[0]) for d in demos)
            seq_len = min(-(-longest // 8) * 8, seq_len)
        sft = FinetuneConfig(model=cfg.model, dataset=str(path), method="lora", lora_r=16, lora_alpha=32,
                             steps=cfg.sft_steps, batch_size=8, seq_len=seq_len,
                             lr=2e-3, warmup_steps=min(5, cfg.sft_steps // 5), eval_every=cfg.sft_steps,
                             eval_batches=1,  # its validation loss is shown, not used: one batch
                             log_every=max(1, cfg.sft_steps // 10), save_every=cfg.sft_steps, out_dir=str(out),
                             device=cfg.device, precision=cfg.precision, sharding=cfg.sharding,
                             xla_checks=cfg.xla_checks, seed=cfg.seed, export_merged=True,
                             eval_share=0)  # nothing measured on the demonstrations: every one trains
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

    # ---- 3. prompts and rollouts ------------------------------------------------------------------------------
    @cached_property
    def rollouts(self) -> AnswerRollouts | EpisodeRollouts:
        """Where the step's rows come from (`algorithms.rollouts`), chosen here, once: agent episodes with
        ENVIRONMENT or TOOLS (the agent loaded once, by the config), else one answer per row."""
        cfg, tok = self.config, self.tokenizer
        place_reward_models(cfg.reward_funcs, self.backend)  # REWARDS' reward models score on this run's device
        if cfg.agentic:
            runner = EpisodeRunner(cfg.agent.agent(cfg.reward_funcs), ChatFormat(tok), cfg.turn_shape,
                                   prompt_tokens=cfg.max_prompt_len, stop_ids=eos_ids(tok),
                                   pad_token_id=tok.pad_token_id, mask_truncated=cfg.mask_truncated)
            return EpisodeRollouts(runner, cfg.grpo, backend=self.backend, seed=cfg.seed)
        return AnswerRollouts(tok, cfg.reward_funcs, cfg.grpo, stop_ids=lambda: eos_ids(tok, self.model), seed=cfg.seed,
                              backend=self.backend, max_prompt_len=cfg.max_prompt_len, system_prompt=cfg.system_prompt)

    def load_data(self) -> JobData:
        """DATASET's records (an example environment's rows, or read), their prompts as the rollouts render them
        (left-padded to MAX_PROMPT_LEN; stats: kept and too long), no validation rows, and the held-out records
        (`hold_out`: a generated set's test split, EVAL_DATASET or EVAL_SHARE of DATASET; without DATASET, fresh
        resets), whose rows never train."""
        cfg = self.config
        example = EXAMPLES.get(cfg.dataset)
        if cfg.dataset is None:  # the environment's reset makes each episode's task: empty prompts drive the loop
            empty = {"prompt": [{"role": "user", "content": ""}]}
            records = [dict(empty) for _ in range(cfg.batch_size * max(1, self.backend.num_replicas))]
            held = HeldOut([dict(empty) for _ in range(cfg.eval_records)],
                           "fresh resets of ENVIRONMENT, seeded apart from training's", list(range(len(records))))
        else:
            if example is not None:
                records = example.rows(cfg.max_records or 2000, seed=cfg.seed, split="train")
                test = partial(example.rows, cfg.eval_records, seed=cfg.seed, split="test")
            else:
                records = self.read_records(load_prompt_records)
                test = partial(load_prompt_records, SUMS, split="test") if cfg.dataset == SUMS else None
            held = self.hold_out(records, load_prompt_records, generated=test)  # never trains: its rows left out
        data, stats = held.training_rows(*self.rollouts.prompts(records))
        return JobData(data, None, stats, held, records)

    # ---- 4. samples -----------------------------------------------------------------------------------------------
    def samples(self, n: int | None = None) -> dict:
        """Held-out records answered with the run's sampling (a fixed stream) in the training step's shapes (on XLA
        the generation graphs training compiled; `rollouts.held_out`): mean reward, each reward's mean, the rows
        (agents: turns, tool calls and their success, the episodes' messages) and graphs compiled."""
        cfg, b = self.config, self.backend
        records = self.held_out if n is None else self.held_out[:n]
        rows = cfg.grpo.rows(cfg.batch_size) * max(1, b.num_replicas // b.world_size)  # the rollout's shape
        model = self._model_on_device()
        before = b.metrics().get("compilations", 0)
        out = self.rollouts.held_out(model, records, rows=rows)
        return {**out, "compilations": b.metrics().get("compilations", 0) - before}

    @staticmethod
    def compare(before: dict, after: dict, n: int | None = None) -> list[dict]:
        """The same held-out records' completions and rewards before and after training, side by side; where an
        environment chose another task for the same record (its reset's own randomness), each side's own prompt."""
        rows = [{"prompt": b["prompt"] if b["prompt"] == a["prompt"] else f"{b['prompt']} | after: {a['prompt']}",
                 "answer": b["answer"], "before": b["completion"], "after": a["completion"],
                 "reward": f"{b['reward']:g} -> {a['reward']:g}"}
                for b, a in zip(before["rows"], after["rows"], strict=True)]
        return rows if n is None else rows[:n]

    # ---- 5. training ----------------------------------------------------------------------------------------------
    def run_identity(self) -> dict:
        cfg = self.config
        agent = {"environment": cfg.environment, "tools": cfg.tools, "max_turns": cfg.max_turns,
                 "tool_tokens": cfg.tool_tokens} if cfg.turn_shape else {}
        return {**super().run_identity(), "start_from": str(cfg.start_from), "rewards": cfg.rewards,
                "num_generations": cfg.num_generations, "max_prompt_len": cfg.max_prompt_len,
                "max_new_tokens": cfg.max_new_tokens, **agent}

    def make_trainer(self) -> GRPOTrainer:
        return GRPOTrainer(self.model, self.train_data, rollouts=self.rollouts, settings=self.config.grpo,
                           ref_model=self.reference, **self.trainer_options())

    # ---- 6. results -----------------------------------------------------------------------------------------------
    def curves(self) -> dict[str, list]:
        """Per log step: step, reward, completion length, KL and loss (from the run's history)."""
        rows = self.history.train
        keys = ("step", "reward", "completion_tokens", "kl", "loss")
        keys += tuple(k for k, _ in AGENT_CURVES if any(k in r for r in rows))  # episodes' turns and tool success
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
        for key in ("reward", *(k for k, _ in AGENT_CURVES)):  # agents: also turns per episode and tool success
            for when, value in (results.get(key) or {}).items():
                if value is not None:
                    tracked["values"][f"samples/{key}_{when}"] = value
        return tracked

    def results(self, *, before: dict | None = None, after: dict | None = None, **extra: Any) -> dict:
        reward = {"before": before["reward"] if before else None, "after": after["reward"] if after else None}
        for key, _ in AGENT_CURVES:  # episodes: turns and tool-call success, before -> after (None: no tool call)
            if any(key in (s or {}) for s in (before, after)):
                extra.setdefault(key, {w: s[key] if s and s[key] == s[key] else None
                                       for w, s in (("before", before), ("after", after))})
        return super().results(before=before, after=after, reward=reward, curves=self.curves(),
                               data=self.data_stats, generation_seconds=sum(self.trainer.rollout_seconds), **extra)

