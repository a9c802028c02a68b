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
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tpu_helpers.agents.tools import Toolbox, ToolStats, binds, block_text, run_async, tool_schema
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
                 reward_funcs: Sequence[Callable] | Mapping[str, Callable] = (), timeout_s: float | None = 30.0,
                 environments: Mapping[str | None, EnvironmentSpec] | None = None):
        self.tools = list(tools)
        self.timeout_s = timeout_s
        Toolbox(self.tools, timeout_s=timeout_s)  # checks the standalone tools' schemas and names once, here
        if environments is not None:  # probed already (agents.loading.load_environments): not probed again
            if environment_factory is not None:
                raise ConfigError("give environment_factory or environments (probed specs), not both")
            factories: dict = {}
            self.multi = None not in environments and bool(environments)
        elif environment_factory is None:
            factories, self.multi = {}, False
        elif isinstance(environment_factory, Mapping):
            if not environment_factory:
                raise ConfigError("environment_factory is an empty dict; give {name: factory} with at least one")
            factories, self.multi = dict(environment_factory), True
        else:
            factories, self.multi = {None: environment_factory}, False
        self.environments = dict(environments) if environments is not None else \
            {name: probe(name, f) for name, f in factories.items()}
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
                text = block_text(observation, where=f"{spec.cls.__qualname__}.reset")
                prompt[-1] = {**prompt[-1], "content": block_text(prompt[-1]["content"], where="the row's prompt")
                              + text}
            methods = [getattr(environment, m) for m in environment_methods(spec.cls)]
        return Episode(row, prompt, environment, Toolbox([*self.tools, *methods], timeout_s=self.timeout_s))

    def rewards(self, episodes: Sequence[Episode], *, warn: Callable[[str], None] | None = None,
                **keywords: Any) -> dict[str, list[float]]:
        """Every reward source's values for the episodes ({name: [float, NaN where not applicable or where it
        raised]}; `call_rewards`): TRL's keywords, `environments=` each rollout's instance, and `keywords`
        (completion_ids, trainer_state, log_extra, log_metric) as given."""
        envs = [e.environment for e in episodes] if self.environments else None
        return call_rewards(self.rewards_funcs, prompts=[e.prompt for e in episodes],
                            completions=[e.completion for e in episodes], rows=[e.row for e in episodes],
                            environments=envs, warn=warn, **keywords)


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


def _arguments(fn: Callable, positional: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """How `fn` is called: by TRL's keywords (all of them with a **kwargs, else those its signature names); a
    function whose first two parameters are positional and named otherwise (`lambda p, c: ...`) gets the prompts
    and the completions by position."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return (), kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return (), kwargs
    ordered = [p.name for p in params.values() if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                             inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if len(ordered) >= 2 and not {"prompts", "completions"} & set(ordered[:2]):
        return positional, {k: v for k, v in kwargs.items() if k in params and k not in ordered[:2]}
    return (), {k: v for k, v in kwargs.items() if k in params}


def call_reward(fn: Callable, *, name: str, prompts: Sequence, completions: Sequence,
                rows: Sequence[Mapping] = (), **keywords: Any) -> list[float]:
    """A reward function's values, called as TRL calls it: `prompts=`, `completions=` and the rows' columns (but
    prompt, completion and completion_ids, one list each), then `keywords` (`environments=`, `completion_ids=`,
    `trainer_state`, `log_extra`, `log_metric`, or other columns such as `answer=`: lists, one value per
    completion, or plain values); see `_arguments` for a function without **kwargs. A value of None means "not
    applicable" (NaN, as in TRL); a wrong count or a value that is not a finite number is a ConfigError naming the
    reward and the completion. The one call of every reward function in the package."""
    n = len(completions)
    keys = [k for k in (rows[0] if rows else {}) if k not in ("prompt", "completion", "completion_ids")]
    kwargs: dict[str, Any] = {k: [r.get(k) for r in rows] for k in keys}
    kwargs.update(prompts=list(prompts), completions=list(completions), completion_ids=None, trainer_state=None,
                  log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None)
    kwargs.update({k: v for k, v in keywords.items() if v is not None})
    args, kwargs = _arguments(fn, (kwargs["prompts"], kwargs["completions"]), kwargs)
    values = fn(*args, **kwargs)
    if inspect.isawaitable(values):
        values = run_async(values)
    try:
        values = list(values)
    except TypeError:
        raise ConfigError(f"reward {name!r} returned a {type(values).__name__}, not a list of {n} numbers") from None
    if len(values) != n:
        raise ConfigError(f"reward {name!r} returned {len(values)} values for {n} completions; it must return one "
                          "number (or None: not applicable) per completion")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
        elif isinstance(v, numbers.Real) and math.isfinite(v):
            out.append(float(v))
        else:
            raise ConfigError(f"reward {name!r} returned {v!r} for completion {i} ({completions[i]!r:.80}); rewards "
                              "must be finite numbers or None (not applicable)")
    return out


def _one(i: int, n: int, value: Any) -> Any:
    """Row i of a per-completion argument (a list or tuple of n values); anything else as it is."""
    return value[i:i + 1] if isinstance(value, (list, tuple)) and len(value) == n else value


def call_rewards(funcs: Mapping[str, Callable], *, prompts: Sequence, completions: Sequence,
                 rows: Sequence[Mapping] = (), warn: Callable[[str], None] | None = None,
                 **keywords: Any) -> dict[str, list[float]]:
    """Every reward function's values ({name: [float, NaN where not applicable]}), each called once on the batch
    (`call_reward`). One that raises is called completion by completion: where it still raises, that completion's
    value is NaN and `warn` (default: a UserWarning) says so, naming the reward, the completion and the error; one
    that raises on every completion is a ConfigError naming it (a broken reward must not train on nothing)."""
    n = len(completions)
    out: dict[str, list[float]] = {}
    for name, fn in funcs.items():
        try:
            out[name] = call_reward(fn, name=name, prompts=prompts, completions=completions, rows=rows, **keywords)
            continue
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 (a user's reward failed on some completion: find which, keep the others)
            pass
        values, failed = [], []
        for i in range(n):
            try:
                values += call_reward(fn, name=name, prompts=list(prompts)[i:i + 1],
                                      completions=list(completions)[i:i + 1], rows=list(rows)[i:i + 1],
                                      **{k: _one(i, n, v) for k, v in keywords.items()})
            except ConfigError:
                raise
            except Exception as err:  # noqa: BLE001
                values.append(math.nan)
                failed.append((i, err))
        if failed and len(failed) == n:
            i, err = failed[0]
            raise ConfigError(f"reward {name!r} raised {type(err).__name__} on every one of the {n} completions "
                              f"(the first: {completions[i]!r:.80}): {err}; a reward must return a number, or None "
                              "(not applicable), for any completion") from err
        for i, err in failed:
            message = (f"reward {name!r} raised {type(err).__name__} on completion {i} ({completions[i]!r:.80}): "
                       f"{str(err)[:200]}; its value there is NaN")
            (warn or (lambda m: warnings.warn(m, UserWarning, stacklevel=4)))(message)
        out[name] = values
    return out
