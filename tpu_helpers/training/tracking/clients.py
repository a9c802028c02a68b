"""The experiment trackers a run can log to, TensorBoard, Weights & Biases and trackio, behind one small interface.

`training/tracking/__init__.py` drives them (which values, when, resume, failures); this module only talks to each package:

    check_ready(["tensorboard", "wandb"])        # ConfigError now for a missing package or a W&B login
    tracker = open_tracker("wandb", run)         # run: a TrackedRun (id and name kept in run.json, out_dir, ...)
    tracker.log({"train/loss": 2.1}, step=10); tracker.close()

Each package is imported on first use (the package imports without any of them: they are the `tracking` extra).
Where each one writes, and how a rerun of the same tracked run logs no step twice: docs/guides/tracking.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpu_helpers.core.choices import TRACKERS, ConfigError

INSTALL_ALL = 'pip install "tpu_helpers[tracking]"'


@dataclass
class TrackedRun:
    """What every tracker is told about the run it logs."""

    id: str  # kept in run.json: a resumed run logs to the same tracked run
    name: str
    project: str
    out_dir: Path
    start_step: int  # the step this process starts from (a resumed run's checkpoint step, else 0)
    config: dict = field(default_factory=dict)  # the run's config/hparams


def check_ready(names: list[str]) -> None:
    """ConfigError, before anything trains, for an unknown tracker, one whose package is missing (naming the extra
    to install) or W&B without credentials outside offline mode."""
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"trackers: {name!r} is no tracker; known: {', '.join(TRACKERS)}")
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"trackers={name!r} needs the {name} package, which is not installed: "
                              f'{INSTALL_ALL} (all trackers) or pip install "tpu_helpers[{name}]"')
    if "wandb" in names:
        _check_wandb_login()
    if "trackio" in names and os.environ.get("TRACKIO_SPACE_ID"):
        from huggingface_hub import get_token

        if get_token() is None:
            raise ConfigError("trackers='trackio' logs to the Space TRACKIO_SPACE_ID="
                              f"{os.environ['TRACKIO_SPACE_ID']!r}, which needs a Hugging Face login: run "
                              "`hf auth login` (or set HF_TOKEN), or unset TRACKIO_SPACE_ID to log locally")


def _check_wandb_login() -> None:
    import wandb

    if wandb.setup().settings.mode in ("offline", "dryrun", "disabled"):
        return  # nothing to log in to
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return  # checked by the server when the run starts
    if not wandb.login(verify=False, prompt=False):  # the key `wandb login` saved, if any (no network)
        raise ConfigError("trackers='wandb' needs a W&B login and none is configured: run `wandb login` (in a "
                          "notebook: import wandb; wandb.login()), set WANDB_API_KEY (on Colab from its Secrets), "
                          "or set WANDB_MODE=offline to log locally and upload later with `wandb sync`")


class Tracker:
    """One tracked run in one tracker."""

    name = ""

    def last_step(self) -> int | None:
        """The highest step the tracked run already holds (logged by an earlier process), or None."""
        return None

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_table(self, key: str, rows: list[dict], step: int) -> None:
        raise NotImplementedError

    def summary(self, values: dict[str, Any], step: int) -> None:
        """The run's final figures (`step`: the last step, where a tracker without summaries shows them)."""

    def flush(self) -> None: ...

    def close(self) -> None: ...


def open_tracker(name: str, run: TrackedRun) -> Tracker:
    return {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "trackio": TrackioTracker}[name](run)


def _cell(value: Any) -> str:
    """A value as one markdown table cell: newlines and tabs written as escapes (a generated answer may be only
    whitespace), "|" escaped."""
    return json.dumps(str(value), ensure_ascii=False)[1:-1].replace("|", "\\|")


def _columns(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for row in rows for k in row))


def flat_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """Nested values as "a/b" keys; values a tracker's hparams cannot hold (None, lists) as text."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat_config(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value,
                                                                                                      default=str)
    return out


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, run: TrackedRun) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.Summary, self.Value = Summary, Summary.Value

        self.log_dir = Path(run.out_dir) / "tensorboard" / run.id
        earlier = self.log_dir.is_dir() and any(self.log_dir.glob("events.out.tfevents.*"))
        self.earlier_through = run.start_step - 1 if earlier else None
        # flush_secs: what is logged shows in TensorBoard within seconds (the writer flushes on its own thread).
        self.writer = SummaryWriter(str(self.log_dir), purge_step=run.start_step if earlier else None,
                                    flush_secs=10)
        flat = flat_config(run.config)
        for summary in hparams(flat, {"train/loss": 0.0, "eval/loss": 0.0}):
            self.writer.file_writer.add_summary(summary, run.start_step)
        self.writer.add_text("config", "    " + json.dumps(run.config, indent=1, default=str).replace("\n", "\n    "),
                             run.start_step)

    def last_step(self) -> int | None:
        return self.earlier_through  # what earlier processes logged from the start step on is purged

    def log(self, metrics: dict[str, float], step: int) -> None:
        # One event for all of a step's values (add_scalar would make one each: ten times the host time).
        values = [self.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()]
        self.writer.file_writer.add_summary(self.Summary(value=values), step)

    def log_table(self, key: str, rows: list[dict], step: int) -> None:
        columns = _columns(rows)
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in rows]
        self.writer.add_text(key, "\n".join(lines), step)

    def summary(self, values: dict[str, Any], step: int) -> None:
        self.writer.add_text("summary", "\n".join(f"    {k}: {v}" for k, v in values.items()), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, run: TrackedRun) -> None:
        import wandb

        self.wandb = wandb
        self.out_dir = Path(run.out_dir)
        self.run = wandb.init(project=run.project, id=run.id, name=run.name, dir=str(self.out_dir),
                              resume="allow", reinit="create_new")
        self.run.config.update(run.config, allow_val_change=True)  # a resumed run may have changed settings
        self.offline = self.run.settings.mode in ("offline", "dryrun")

    def last_step(self) -> int | None:
        if not self.offline:
            return self.run.step - 1 if self.run.step > 0 else None  # online: the server's count of the run
        # Offline: the earlier processes' files of this run (each process writes a folder of its own).
        files = {p.resolve() for p in self.out_dir.glob(f"wandb/*-{self.run.id}/run-{self.run.id}.wandb")}
        here = Path(self.run.dir).resolve().parent
        steps = [step for path in sorted(files) if path.parent != here for step, _ in wandb_history(path)]
        return max(steps, default=None)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, key: str, rows: list[dict], step: int) -> None:
        columns = _columns(rows)
        table = self.wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
        self.run.log({key: table}, step=step)

    def summary(self, values: dict[str, Any], step: int) -> None:
        self.run.summary.update(values)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker(Tracker):
    name = "trackio"

    def __init__(self, run: TrackedRun) -> None:
        import trackio

        self.trackio = trackio
        # No dashboard server from a notebook (embed), no system sampling threads: only what the loop logs.
        self.run = trackio.init(project=run.project, name=f"{run.name}-{run.id}", resume="allow",
                                config=flat_config(run.config), embed=False, auto_log_cpu=False,
                                auto_log_gpu=False)

    def last_step(self) -> int | None:
        # trackio counts a resumed run's steps from its store (local or the Space's); 0.43 has no public accessor.
        following = getattr(self.run, "_next_step", 0)
        return following - 1 if isinstance(following, int) and following > 0 else None

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def summary(self, values: dict[str, Any], step: int) -> None:
        # trackio has no run summary: the numbers go in as one more row at the last step.
        self.run.log({f"summary/{k}": v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def log_table(self, key: str, rows: list[dict], step: int) -> None:
        columns = _columns(rows)
        self.run.log({key: self.trackio.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])},
                     step=step)

    def close(self) -> None:
        self.run.finish()


# ---- W&B's local run files ----------------------------------------------------------------------------------------
_BLOCK, _HEADER = 32768, 7  # W&B's transaction log: LevelDB's log format (32 KiB blocks, 7-byte record headers)


def wandb_records(path: str | Path) -> Iterator[bytes]:
    """The serialized protobuf records of a W&B run file (`run-<id>.wandb`, online or offline), in order."""
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (header {data[:4]!r})")
    pos, parts = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the rest of a block too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        if pos + _HEADER + length > len(data):  # cut short (the process writing it was killed)
            return
        chunk, pos = data[pos + _HEADER:pos + _HEADER + length], pos + _HEADER + length
        if kind == 1:  # a whole record; 2, 3, 4: its first, middle and last pieces
            yield chunk
        elif kind == 2:
            parts = chunk
        elif kind == 3:
            parts += chunk
        elif kind == 4:
            yield parts + chunk


def wandb_history(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(step, values) of each history row a W&B run file holds, read with W&B's own protobuf messages."""
    from wandb.proto import wandb_internal_pb2

    for data in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            values = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                      for item in record.history.item}
            yield int(values.get("_step", record.history.step.num)), values
