"""One configuration object for a training run, `TrainConfig`, and notebook parameters turned into one.

`TrainConfig` has full-size defaults (GPT-2 small on a TPU chip); every field is checked when the object is built,
so a wrong value fails before any compile or download. A recipe's settings are fields of a subclass
(`recipes.finetune.FinetuneConfig`). Notebooks keep their parameters as UPPER_CASE globals (papermill overrides them):

    config = th.config_from_parameters(globals())                       # each NAME -> the field `name`
    config = th.config_from_parameters(globals(), extra={"MOUNT_DRIVE": bool})   # notebook-only values
    config = th.config_from_parameters(globals(), base=FinetuneConfig())         # a recipe's config class

A name that is no field (and not declared in `extra`) is an error listing the known ones. More:
docs/guides/training.md.
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import re
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from tpu_helpers.core.choices import (
    DEVICES,
    ON_DIVERGENCE,
    ON_NONFINITE,
    OPTIMIZERS,
    PRECISIONS,
    PRESET_NAMES,
    RESUME,
    XLA_CHECKS,
    ConfigError,
    best_metric_order,
    check_choice,
    check_trackers,
    did_you_mean,
    misspelt,
)
from tpu_helpers.core.sharding import ShardingError, check_sharding

__all__ = ["ConfigError", "TrainConfig", "config_from_parameters", "notebook_parameters", "settings_field_name",
           "settings_fields", "settings_from"]
S = typing.TypeVar("S")


@dataclass
class TrainConfig:
    # Fields a recipe's config renamed: {old name: new name}. An old notebook parameter (a papermill `-p` of an
    # older notebook) still works, with a warning; the constructor names the new field.
    renamed: ClassVar[dict[str, str]] = {}
    # Settings dataclasses whose fields this config took ({settings class: the fields' name prefix}): `settings_fields`.
    settings_prefixes: ClassVar[dict[type, str]] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> TrainConfig:
        # Before the dataclass __init__: an unknown keyword is a ConfigError naming the config that has it (another
        # recipe's setting, a renamed one), not a bare "unexpected keyword argument".
        unknown = sorted(set(kwargs) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(unknown_fields_message(cls, unknown))
        return super().__new__(cls)

    # device and precision
    device: str = "auto"  # auto | tpu | cuda | cpu | xla
    fallback: bool = False  # when the requested device is missing: warn and use the next best instead of failing
    precision: str = "auto"  # auto (bf16 on TPU, bf16/fp16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16
    spmd: bool | str = "auto"  # XLA with several local chips: one process drives all of them, batch sharded
    sharding: str = "data"  # data (model on every chip) | fsdp (model sharded over the chips) | DxF mesh, e.g. 2x4
    # model
    preset: str = "small"  # GPT size: tiny | mini | small | medium
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    # data
    dataset: str = "embedded"  # "embedded" (generated, offline), a local file/dir, or a hub dataset name
    text_field: str = "text"
    tokenizer: str = "byte"  # "byte" (no download) or a tokenizer name
    max_chars: int | None = None  # cap the text read from a large dataset
    seq_len: int = 256
    val_fraction: float = 0.05
    # optimisation
    batch_size: int = 32  # per chip (per device); the global batch is this x chips x grad_accum
    grad_accum: int = 1
    steps: int = 2000  # optimizer steps
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr x this
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0
    optimizer: str = "adamw"  # adamw | sgd | adafactor (factored second moment: the least optimizer memory)
    # evaluation, logging, checkpoints
    eval_every: int = 200
    eval_batches: int = 20
    log_every: int = 10  # the loss is read on the host only at these steps
    out_dir: str = "runs/quickstart"
    save_every: int = 500
    keep_last: int = 3
    resume: bool | str = True  # True: continue from out_dir's newest good checkpoint | False | "force_new"
    on_nonfinite: str = "stop"  # a nan/inf training loss at a log step: stop (raise, keep the good checkpoints) | warn
    on_divergence: str = "stop"  # a finite loss spike (training/guard/divergence.py): stop (raise) | warn (once) | off
    divergence_factor: float = 3.0  # a spike: a loss above this x its reference (best validation, recent training)
    best_metric: str | None = "val_loss"  # the checkpoint kept whatever keep_last says ("max:NAME" when higher is
    # better, NAME from an eval callback's trainer.eval_metrics); None keeps only the newest keep_last
    seed: int = 0
    # XLA performance (see tpu_helpers.diagnostics)
    compile_cache_dir: str | None = "default"  # persistent XLA compile cache: "default" (on TPU), a dir, or None
    xla_checks: str = "warn"  # recompilation / host-read / CPU-fallback detector on XLA: warn | strict | off
    # XLA: each step's forward and loss (and so its backward) and AdamW's step captured once per shape by dynamo and
    # replayed instead of traced in Python every step (backend.compile_step; Trainer.replayed, replayed_optimizer):
    # the base Trainer, SFT, distillation, GRPO's update, DPO/ORPO (under an SPMD mesh AdamW's step only, see
    # XlaBackend.compile_step). False: plain lazy tracing
    replay_steps: bool = False
    # experiment tracking (see tpu_helpers.training.tracking): the main process logs the loop's log/eval records
    trackers: str = ""  # none, or tensorboard, wandb, trackio (comma separated)
    project: str = "tpu_helpers"  # the trackers' project
    run_name: str = ""  # the tracked run's name; empty: out_dir's folder name
    extra: dict = field(default_factory=dict)  # free-form values a notebook wants recorded with the run

    def __post_init__(self) -> None:
        _check_types(self)
        check_choice("device", self.device, DEVICES)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("xla_checks", self.xla_checks, XLA_CHECKS)
        check_choice("on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        check_choice("on_divergence", self.on_divergence, ON_DIVERGENCE)
        if self.best_metric is not None:
            best_metric_order(self.best_metric)
        if self.resume not in RESUME:  # the type check above already refused 0 and 1
            raise ConfigError(f"resume={self.resume!r} must be True (continue out_dir's run), False (refuse if it "
                              "has checkpoints) or 'force_new' (move its checkpoints into a dated set-aside folder "
                              "and start over)")
        for name in ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "val_fraction", "divergence_factor"):
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{name}={value!r} is not a finite number")
        if self.compile_cache_dir == "":
            raise ConfigError("compile_cache_dir='' is empty: use 'default', a directory, or None to turn it off")
        if self.spmd not in (True, False, "auto"):
            raise ConfigError(f"spmd={self.spmd!r} must be True, False or 'auto'")
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "eval_every", "eval_batches", "log_every",
                     "save_every", "keep_last"):
            _positive(name, getattr(self, name))
        for name in ("warmup_steps", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be >= 0")
        if self.max_chars is not None:
            _positive("max_chars", self.max_chars)
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction={self.val_fraction!r} must be between 0 and 1 (exclusive)")
        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr!r} must be > 0")
        if not self.divergence_factor > 1.0:
            raise ConfigError(f"divergence_factor={self.divergence_factor!r} must be > 1: a loss above this many "
                              "times its reference counts as a spike (on_divergence='off' turns the check off)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio={self.min_lr_ratio!r} must be between 0 and 1")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay={self.weight_decay!r} must be >= 0")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(f"grad_clip={self.grad_clip!r} must be > 0, or None to disable clipping")
        if self.dataset is not None and not self.dataset:  # None: only where the type allows it (GRPO's agents)
            raise ConfigError("dataset='' is empty: use 'embedded', a local path, or a hub dataset name")
        if not self.out_dir:
            raise ConfigError("out_dir='' is empty: give a directory for checkpoints and results")
        if self.device == "cpu" and self.precision == "fp16":
            raise ConfigError("precision='fp16' needs a CUDA GPU; on device='cpu' use 'fp32' or 'bf16'")
        # Choices the backend or the model would only reject later, after a download or a compile.
        check_choice("preset", self.preset, PRESET_NAMES)
        if self.device in ("tpu", "xla") and self.precision == "fp16":
            raise ConfigError(f"precision='fp16' needs a CUDA GPU; on device={self.device!r} use 'bf16' (native "
                              "on TPUs) or 'fp32'")
        if self.spmd is True and self.device in ("cpu", "cuda"):
            raise ConfigError(f"spmd=True drives several XLA devices from one process; device={self.device!r} "
                              "is not XLA (use device='tpu' or 'xla', or spmd='auto')")
        try:
            self.sharding = check_sharding(self.sharding)
        except ShardingError as err:
            raise ConfigError(str(err)) from None
        for name in ("text_field", "tokenizer"):
            if not getattr(self, name).strip():
                raise ConfigError(f"{name}={getattr(self, name)!r} is empty")
        self.trackers = check_trackers(self.trackers)
        if not _PROJECT.match(self.project):
            raise ConfigError(f"project={self.project!r} must be a non-empty name of letters, digits, '.', '_' and "
                              "'-' (the trackers' project)")
        if self.run_name != self.run_name.strip() or any(c in self.run_name for c in "/\\\n"):
            raise ConfigError(f"run_name={self.run_name!r} must have no surrounding spaces, slashes or newlines")

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)  # an unknown field fails in __new__, naming where it belongs

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_PROJECT = re.compile(r"^[A-Za-z0-9._-]+$")


# ---- an algorithm's settings as fields of a recipe's config ------------------------------------------------------
def settings_fields(settings: type, *, prefix: str = "") -> Callable[[type], type]:
    """Class decorator for a recipe's config, under @dataclass: the init fields of the dataclass `settings` become
    fields of the config named `prefix + name`, with their types and defaults, so each is a notebook parameter
    (UPPER_CASE) declared once, on the settings. `settings_from(config, settings)` builds the settings from them.
    A field named with PEP 8's trailing underscore for a keyword (`lambda_`) is the config's `prefix + "lambda"`.

        @dataclass
        @settings_fields(GRPOSettings)            # NUM_GENERATIONS, KL_BETA, LOSS_TYPE, ... are GRPOConfig fields
        class GRPOConfig(HFJobConfig): ...
    """
    def add(cls: type) -> type:
        hints = typing.get_type_hints(settings)
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for f in fields(settings):
            if not f.init:
                continue
            name = settings_field_name(prefix, f.name)
            if name in annotations:
                raise TypeError(f"{cls.__name__}.{name} is a field of {settings.__name__}: declare it there only")
            if f.default is MISSING and f.default_factory is MISSING:
                raise TypeError(f"{settings.__name__}.{f.name} needs a default to be a notebook parameter")
            annotations[name] = hints[f.name]
            setattr(cls, name, f.default if f.default is not MISSING else field(default_factory=f.default_factory))
        cls.__annotations__ = annotations
        cls.settings_prefixes = {**getattr(cls, "settings_prefixes", {}), settings: prefix}
        return cls

    return add


def settings_from(config: TrainConfig, settings: type[S]) -> S:
    """The `settings` object made of `config`'s fields that `settings_fields` gave its class; the settings check
    (and parse) their values themselves, as they are built."""
    prefix = type(config).settings_prefixes[settings]
    return settings(**{f.name: getattr(config, settings_field_name(prefix, f.name)) for f in fields(settings) if f.init})


def settings_field_name(prefix: str, name: str) -> str:
    """The config's field of a settings field: `prefix + name`, a keyword's trailing underscore dropped (needs a
    prefix: `lambda` alone is no field name)."""
    stem = name[:-1] if prefix and name.endswith("_") and keyword.iskeyword(name[:-1]) else name
    return prefix + stem


def _config_classes(root: type = TrainConfig) -> list[type]:
    out = [root]
    for sub in root.__subclasses__():
        out += _config_classes(sub)
    return out


def unknown_fields_message(cls: type, names: list[str]) -> str:
    """Why `names` are no fields of `cls`: renamed (and to what), another recipe's setting (which config holds it),
    or unknown; then the fields `cls` has."""
    said = []
    for name in names:
        if name in cls.renamed:
            said.append(f"{name!r} is now {cls.renamed[name]!r}")
            continue
        owners = sorted({c.__name__ for c in _config_classes() if name in {f.name for f in fields(c)}})
        said.append(f"{name!r} is a setting of {' and '.join(owners)}, not of {cls.__name__}" if owners
                    else f"{name!r} is no setting{did_you_mean(name, [f.name for f in fields(cls)])}")
    return (f"unknown {cls.__name__} field(s) {names}: {'; '.join(said)}. {cls.__name__}'s fields: "
            f"{', '.join(sorted(f.name for f in fields(cls)))}")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name}={value!r} must be >= 1")


def _type_ok(value: Any, annotation: Any) -> bool:
    """Check a value against a simple annotation (int, float, str, bool, dict, unions, None, literals)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None) or annotation is None:
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, annotation)


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "")
    return text.replace("<class '", "").replace("'>", "")


def _check_types(cfg: Any) -> None:
    hints = typing.get_type_hints(type(cfg))
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if not _type_ok(value, hints[f.name]):
            raise ConfigError(
                f"{f.name}={value!r} has type {type(value).__name__}; expected {_type_name(hints[f.name])}"
            )
        # A float that holds an integer is fine where a float is expected; normalise it for the checks above.
        if hints[f.name] is float and isinstance(value, int):
            setattr(cfg, f.name, float(value))


# ---- notebook parameters ----------------------------------------------------------------------------------------
_UPPER = re.compile(r"^[A-Z][A-Z0-9_]*$")
# The setup cell's parameters, which every notebook that opens on Colab or Kaggle has (platform.setup_notebook):
# known to every notebook without being declared, stored in config.extra like any notebook-only parameter.
SETUP_PARAMETERS: dict[str, type] = {"INSTALL": bool, "REPO_URL": str}


def notebook_parameters(namespace: dict) -> dict[str, Any]:
    """The UPPER_CASE names of a notebook's namespace (its parameters cell and papermill's injected cell)."""
    return {k: v for k, v in namespace.items() if _UPPER.match(k) and not isinstance(v, types.ModuleType)}


def config_from_parameters(
    namespace: dict, *, base: TrainConfig | None = None, extra: dict[str, type | tuple] | None = None
) -> TrainConfig:
    """A config of `base`'s class (TrainConfig by default) from a notebook's UPPER_CASE parameters.

    `extra` declares notebook-only parameters (e.g. {"MOUNT_DRIVE": bool}); they are type-checked and stored in
    `config.extra` under their lower-case names. Any other UPPER_CASE name that is no field is an error.
    """
    if not isinstance(namespace, dict):
        raise TypeError(f"namespace must be a dict such as globals(), got {type(namespace).__name__}")
    if base is not None and not isinstance(base, TrainConfig):
        raise TypeError(f"base must be a TrainConfig or None, got {type(base).__name__}")
    base = base or TrainConfig()
    extra = {**SETUP_PARAMETERS, **(extra or {})}
    for name, expected in extra.items():
        kinds = expected if isinstance(expected, tuple) else (expected,)
        if not _UPPER.match(name) or not all(isinstance(k, type) for k in kinds):
            raise ConfigError(f"extra={{{name!r}: {expected!r}}}: keys must be UPPER_CASE parameter names and "
                              "values a type or a tuple of types, e.g. {'MOUNT_DRIVE': bool}")
    known = {f.name.upper() for f in fields(base) if f.name != "extra"}
    params = notebook_parameters(namespace)
    for old, new in type(base).renamed.items():
        if old.upper() in params and old.upper() not in known:
            if new.upper() in params:
                raise ConfigError(f"{old.upper()} and {new.upper()} are both set: {old.upper()} is the old name of "
                                  f"{new.upper()}; keep {new.upper()} only")
            warnings.warn(f"{old.upper()} is now {new.upper()} ({type(base).__name__}); the old name still works "
                          "for now", FutureWarning, stacklevel=2)
            params[new.upper()] = params.pop(old.upper())
    unknown = sorted(set(params) - known - set(extra))
    if unknown:
        owners = {n: sorted({c.__name__ for c in _config_classes() if n.lower() in {f.name for f in fields(c)}})
                  for n in unknown}
        where = "; ".join(f"{n} is a setting of {' and '.join(o)}" for n, o in owners.items() if o)
        allowed = ", ".join(sorted(known | set(extra)))
        guesses = misspelt([n for n in unknown if not owners[n]], known | set(extra))
        raise ConfigError(f"unknown notebook parameter(s) {unknown}; allowed: {allowed}"
                          f"{f'. {where}, not of {type(base).__name__}' if where else ''}.{guesses}")
    changes: dict[str, Any] = {}
    extras = dict(base.extra)
    for name, value in params.items():
        if name in extra:
            expected = extra[name]
            if not isinstance(value, expected) or (expected in (int, float) and isinstance(value, bool)):
                raise ConfigError(f"{name}={value!r} has type {type(value).__name__}; expected {expected}")
            extras[name.lower()] = value
        else:
            changes[name.lower()] = value
    try:
        return base.replace(extra=extras, **changes)
    except ConfigError as err:
        # Re-word field names as the notebook spells them, so the message matches what the user typed.
        message = re.sub(r"\b([a-z][a-z0-9_]*)=", lambda m: f"{m.group(1).upper()}=" if m.group(1).upper()
                         in known else m.group(0), str(err))
        raise ConfigError(message) from None
