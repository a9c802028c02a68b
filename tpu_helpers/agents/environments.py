"""Environments in TRL's form, the episodes they run in, and reward functions called with TRL's keywords.

    agent = Agent(tools=[lookup], environment_factory=Wordle, reward_funcs=[solved])
    episode = agent.start(row)                 # a fresh Wordle(), its reset(**row), the prompt, the episode's tools
    episode.answer(parsed)                     # the assistant message in; its tool messages run, appended, returned
    rewards = agent.rewards([episode, ...], rows)   # {name: [float or nan]}: TRL's keywords, env.get_reward() too

`environment_factory` is what `GRPOTrainer(environment_factory=...)` takes: a callable returning one instance per
rollout, or a dict of them chosen by a row's `environment` field. An instance has `reset(**row) -> str | None` (a
string is appended to the last user message); its public methods are the episode's tools, bound to it (schemas from
their signatures and docstrings); an optional `get_reward() -> float` makes it a reward source named after its class
(reward functions are then optional). One instance of each factory is probed when the Agent is built, as TRL does,
so a missing `reset` or an undocumented method fails there, naming it. A reward function is called as TRL calls it:
`prompts=`, `completions=` (each episode's messages after the prompt), `completion_ids=`, the rows' other columns,
`environments=` (each rollout's instance) and `trainer_state`, `log_extra`, `log_metric`; sync or async; `None` for an
episode means "not applicable" (NaN, as in TRL). An environment's own randomness is its author's to seed.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tpu_helpers.agents.tools import Toolbox, ToolStats, binds, run_async, tool_schema
from tpu_helpers.core.choices import ConfigError

RESERVED = ("reset", "get_reward")  # an environment's methods that are not tools


def environment_methods(cls: type) -> list[str]:
    """The names of an environment class's tools: its public functions but reset and get_reward (listed on the
    class, as TRL does, so properties are not evaluated)."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")]


@dataclass
class EnvironmentSpec:
    """What the probe of one factory found: its class, its tool schemas, whether it owns the reward."""

    name: str | None
    factory: Callable[[], Any]
    cls: type
    schemas: list[dict]
    owns_reward: bool


def probe(name: str | None, factory: Callable[[], Any]) -> EnvironmentSpec:
    """Build one instance and check it as an environment (see the module docstring); ConfigError naming it."""
    label = f"environment {name!r}" if name is not None else "the environment"
    if not callable(factory):
        raise ConfigError(f"{label} factory is a {type(factory).__name__}, not a callable (a class, or a function "
                          "returning an instance)")
    try:
        instance = factory()
    except Exception as err:
        raise ConfigError(f"{label} factory {factory!r} raised {type(err).__name__} when called with no arguments: "
                          f"{err}; an environment_factory builds one instance per rollout, called with no "
                          "arguments (the row goes to reset)") from err
    cls = type(instance)
    if not callable(getattr(instance, "reset", None)):
        raise ConfigError(f"{label} {cls.__qualname__} has no reset method; an environment needs "
                          "reset(**row) -> str | None (TRL's environment_factory contract), and its public methods "
                          "are the tools")
    schemas = [tool_schema(getattr(instance, m), where=f"{cls.__qualname__} method") for m in environment_methods(cls)]
    return EnvironmentSpec(name, factory, cls, schemas, callable(getattr(instance, "get_reward", None)))


@dataclass
class Episode:
    """One rollout: its prompt (after reset's observation), the messages after it, its environment and tools."""

    row: dict
    prompt: list[dict]
    environment: Any
    toolbox: Toolbox
    completion: list[dict] = field(default_factory=list)

    @property
    def schemas(self) -> list[dict]:
        return self.toolbox.schemas

    @property
    def messages(self) -> list[dict]:
        return self.prompt + self.completion

    @property
    def stats(self) -> ToolStats:
        return self.toolbox.stats

    def answer(self, message: dict, errors: Sequence[str] = ()) -> list[dict]:
        """Append the model's assistant message; run its tool calls (and turn the parser's `errors` into tool
        messages); append those tool messages and return them (empty: the episode's answer is final)."""
        self.completion.append(message)
        replies = self.toolbox.run(message.get("tool_calls"), errors)
        self.completion.extend(replies)
        return replies


class Agent:
    """Tools, environments and reward sources in TRL's form, checked once (see the module docstring)."""

    def __init__(self, *, tools: Sequence[Callable] = (), environment_factory: Callable | Mapping | None = None,
                 reward_funcs: Sequence[Callable] | Mapping[str, Callable] = (), timeout_s: float | None = 30.0):
        self.tools = list(tools)
        self.timeout_s = timeout_s
        Toolbox(self.tools, timeout_s=timeout_s)  # checks the standalone tools' schemas and names once, here
        self.multi = isinstance(environment_factory, Mapping)
        if environment_factory is None:
            factories: dict = {}
        elif self.multi:
            if not environment_factory:
                raise ConfigError("environment_factory is an empty dict; give {name: factory} with at least one")
            factories = dict(environment_factory)
        else:
            factories = {None: environment_factory}
        self.environments = {name: probe(name, f) for name, f in factories.items()}
        for spec in self.environments.values():  # a method named as a standalone tool would shadow it
            Toolbox([*self.tools, *_methods_of(spec)], timeout_s=timeout_s,
                    where=f"TOOLS with {spec.cls.__qualname__}'s methods")
        named = reward_funcs.items() if isinstance(reward_funcs, Mapping) else \
            [(getattr(f, "__name__", type(f).__name__), f) for f in reward_funcs]
        self.rewards_funcs: dict[str, Callable] = {}
        for name, fn in named:
            if not callable(fn):
                raise ConfigError(f"reward {name!r} is a {type(fn).__name__}, not a callable")
            self.rewards_funcs[name] = fn
        for spec in self.environments.values():
            if spec.owns_reward and spec.cls.__name__ not in self.rewards_funcs:
                self.rewards_funcs[spec.cls.__name__] = _environment_reward(spec.cls)
        if not self.rewards_funcs:
            raise ConfigError("no reward source: give reward functions (REWARDS), or an environment whose class "
                              "defines get_reward() (TRL's rule)")

    def schemas(self, row: Mapping | None = None) -> list[dict]:
        """The tool schemas a row's prompt is rendered with: the standalone tools' and its environment's."""
        own = [tool_schema(t) for t in self.tools]
        spec = self._spec(row or {}) if self.environments else None
        return own + (spec.schemas if spec else [])

    def _spec(self, row: Mapping) -> EnvironmentSpec:
        if not self.multi:
            return self.environments[None]
        name = row.get("environment")
        if name not in self.environments:
            raise ConfigError(f"a row has environment={name!r}, which is not among the environments given "
                              f"({sorted(map(str, self.environments))}); each row picks one by its 'environment' "
                              "field")
        return self.environments[name]

    def start(self, row: Mapping) -> Episode:
        """A new episode for a row: a fresh environment instance, reset with the row (its 'environment' field aside
        when several environments are given), reset's string appended to the last user message, as TRL does."""
        row = dict(row)
        prompt = row.get("prompt") or [{"role": "user", "content": ""}]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        environment, methods = None, []
        if self.environments:
            spec = self._spec(row)
            environment = spec.factory()
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi else row
            try:
                observation = environment.reset(**kwargs)
            except TypeError as err:
                if binds(environment.reset, dict(kwargs)) is not False:
                    raise
                raise ConfigError(f"{spec.cls.__qualname__}.reset cannot take the row's fields {sorted(kwargs)} "
                                  f"({err}); TRL calls reset(**row) with every field of the row, the prompt "
                                  "included: give reset a **kwargs") from None
            if observation is not None:
                if not isinstance(observation, str):
                    raise ConfigError(f"{spec.cls.__qualname__}.reset returned a {type(observation).__name__}; it "
                                      "must return a string (appended to the last user message) or None")
                prompt[-1] = {**prompt[-1], "content": prompt[-1]["content"] + observation}
            methods = [getattr(environment, m) for m in environment_methods(spec.cls)]
        return Episode(row, prompt, environment, Toolbox([*self.tools, *methods], timeout_s=self.timeout_s))

    def rewards(self, episodes: Sequence[Episode], *, completion_ids: Sequence | None = None,
                trainer_state: Any = None, log_extra: Callable | None = None,
                log_metric: Callable | None = None, only: str | None = None) -> dict[str, list[float]]:
        """Every reward source's values for the episodes (`only`: that source's): {name: [float, NaN where it
        returned None]}."""
        rows = [e.row for e in episodes]
        envs = [e.environment for e in episodes] if self.environments else None
        return {name: call_reward(fn, name=name, prompts=[e.prompt for e in episodes],
                                  completions=[e.completion for e in episodes], rows=rows, environments=envs,
                                  completion_ids=completion_ids, trainer_state=trainer_state, log_extra=log_extra,
                                  log_metric=log_metric)
                for name, fn in self.rewards_funcs.items() if only is None or name == only}


def _methods_of(spec: EnvironmentSpec) -> list[Callable]:
    """The class's tool functions, unbound: their schemas skip `self`, so the names are checked without an instance."""
    return [getattr(spec.cls, m) for m in environment_methods(spec.cls)]


def _environment_reward(cls: type) -> Callable:
    """TRL's reward source for an environment that owns its reward: get_reward() of each rollout's instance of
    exactly this class (None for the others: another environment's rollout)."""

    def reward(environments, **_: Any) -> list:
        out = []
        for env in environments:
            if type(env) is not cls:
                out.append(None)
                continue
            value = env.get_reward()
            out.append(run_async(value) if inspect.isawaitable(value) else value)
        return out

    reward.__name__ = cls.__name__
    return reward


def call_reward(fn: Callable, *, name: str, prompts: Sequence, completions: Sequence, rows: Sequence[Mapping],
                environments: Sequence | None = None, completion_ids: Sequence | None = None,
                trainer_state: Any = None, log_extra: Callable | None = None,
                log_metric: Callable | None = None) -> list[float]:
    """A TRL-style reward function's values, called with TRL's keywords (see the module docstring): the rows'
    columns but prompt, completion and completion_ids, one list each. A function without **kwargs gets the keywords
    its signature names. None becomes NaN; a wrong count or a value that is not a number is a ConfigError naming it."""
    n = len(completions)
    keys = [k for k in (rows[0] if rows else {}) if k not in ("prompt", "completion", "completion_ids")]
    kwargs: dict[str, Any] = {k: [r.get(k) for r in rows] for k in keys}
    kwargs.update(prompts=list(prompts), completions=list(completions),
                  completion_ids=list(completion_ids) if completion_ids is not None else None,
                  trainer_state=trainer_state, log_extra=log_extra or (lambda *a, **k: None),
                  log_metric=log_metric or (lambda *a, **k: None))
    if environments is not None:
        kwargs["environments"] = list(environments)
    try:
        params = inspect.signature(fn).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in params}
    except (TypeError, ValueError):
        pass
    values = fn(**kwargs)
    if inspect.isawaitable(values):
        values = run_async(values)
    try:
        values = list(values)
    except TypeError:
        raise ConfigError(f"reward {name!r} returned a {type(values).__name__}, not a list of {n} numbers") from None
    if len(values) != n:
        raise ConfigError(f"reward {name!r} returned {len(values)} values for {n} episodes; it must return one "
                          "number (or None: not applicable) per episode")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
        elif isinstance(v, numbers.Real) and math.isfinite(v):
            out.append(float(v))
        else:
            raise ConfigError(f"reward {name!r} returned {v!r} for episode {i}; rewards must be finite numbers "
                              "or None")
    return out
