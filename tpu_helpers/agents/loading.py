"""The notebook parameters ENVIRONMENT and TOOLS: import paths to an environment class and to tool functions.

    factory = load_environment("my_envs.wordle:Wordle")          # a module on sys.path
    factory = load_environment("envs/wordle.py:Wordle")          # a file, relative to the working directory
    tools = load_tools("my_tools:lookup, my_tools:calculator")   # the same forms, comma separated

Each value is `module:Name` or `path/to/file.py:Name` (`module.Name` too), and REWARDS' import paths load here as
well: one loader for every parameter that names code. Every bad value is a ConfigError naming the parameter, the
value and what is allowed: not of that form, a module that does not import or a file that is not there, a name the
module lacks (with the public names it has), something not callable, an environment without `reset` (checked on one
probed instance, as TRL probes), and a tool or environment method without type hints or a docstring (what
transformers' get_json_schema raises, re-raised naming it). A file is imported once per path, under a module name
made from its absolute path, so two files of one name do not collide.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tpu_helpers.agents.environments import EnvironmentSpec, probe
from tpu_helpers.agents.tools import tool_schema
from tpu_helpers.core.choices import ConfigError

FORMS = "'module:Name' or 'path/to/file.py:Name'"  # 'module.Name' is taken too


def _module(parameter: str, value: str, where: str) -> Any:
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"{parameter}={value!r}: there is no file {path}; give {FORMS} (a path is relative to "
                              f"the working directory, {Path.cwd()})")
        name = "tpu_helpers_user_" + path.stem + "_" + hashlib.sha1(str(path).encode()).hexdigest()[:8]
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: dataclasses and pickling look the module up by name
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[name]
            raise ConfigError(f"{parameter}={value!r}: importing {path} raised {type(err).__name__}: {err}") from err
        return module
    try:
        return importlib.import_module(where)
    except ImportError as err:
        raise ConfigError(f"{parameter}={value!r}: module {where!r} cannot be imported ({type(err).__name__}: "
                          f"{err}); give {FORMS}") from err


def load_object(value: str, *, parameter: str) -> Any:
    """The object a `module:Name` or `path/to/file.py:Name` value names (see the module docstring)."""
    if not isinstance(value, str):
        raise ConfigError(f"{parameter}={value!r} is not of the form {FORMS}")
    dotted = ":" not in value and "/" not in value and "\\" not in value and not value.strip().endswith(".py")
    where, _, attr = value.strip().rpartition("." if dotted else ":")
    if not where or not attr.isidentifier():
        raise ConfigError(f"{parameter}={value!r} is not of the form {FORMS}")
    module = _module(parameter, value, where)
    if not hasattr(module, attr):
        public = sorted(n for n, v in vars(module).items() if not n.startswith("_") and callable(v)
                        and getattr(v, "__module__", None) == module.__name__)
        raise ConfigError(f"{parameter}={value!r}: {where} has no {attr!r}; it defines {public or 'no callables'}")
    obj = getattr(module, attr)
    if not callable(obj):
        raise ConfigError(f"{parameter}={value!r} is a {type(obj).__name__}, not a callable (a class or a function)")
    return obj


def load_environments(value: Any, *, parameter: str = "ENVIRONMENT") -> dict[str | None, EnvironmentSpec]:
    """The environments ENVIRONMENT names, each probed once (reset, its methods' schemas): {None: spec} for one
    value (an import path, or a class or factory from Python), {name: spec} for a dict of them (TRL's
    multi-environment mode: each row picks one by its `environment` column); {} for None."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        if not value:
            raise ConfigError(f"{parameter}={{}} names no environment; give {{name: {FORMS}}}, one per value of the "
                              "rows' 'environment' column")
        for name in value:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{parameter} has the key {name!r}; the keys are the names the rows' 'environment' "
                                  "column gives (strings)")
        return {name: _probed(name, item, f"{parameter}[{name!r}]") for name, item in value.items()}
    return {None: _probed(None, value, parameter)}


def _probed(name: str | None, value: Any, parameter: str) -> EnvironmentSpec:
    factory = value if callable(value) and not isinstance(value, str) else load_object(value, parameter=parameter)
    try:
        return probe(name, factory)
    except ConfigError as err:
        raise ConfigError(f"{parameter}={value!r}: {err}") from None


def load_environment(value: str, *, parameter: str = "ENVIRONMENT") -> Callable[[], Any]:
    """The environment factory ENVIRONMENT names, probed once (reset, its methods' schemas)."""
    return load_environments(value, parameter=parameter)[None].factory


def load_tools(value: str | list, *, parameter: str = "TOOLS") -> list[Callable]:
    """The tool functions TOOLS names (comma separated, or a list of values and callables), each with a schema."""
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    items = [v for v in items if not (isinstance(v, str) and not v)]
    if not items:
        raise ConfigError(f"{parameter}={value!r} names no tools; give {FORMS}, comma separated")
    tools = []
    for item in items:
        fn = item if callable(item) else load_object(item, parameter=parameter)
        try:
            tool_schema(fn, where="tool")
        except ConfigError as err:
            raise ConfigError(f"{parameter}={value!r}: {err}") from None
        tools.append(fn)
    return tools
