"""Experiment tracking (training/tracking/__init__.py, trackers.py): what the trackers hold, read back with each tracker's own
reader, equals the run's results.json; tracking adds no compilation or host transfer; a killed and resumed run
continues the same tracked run without a step twice; bad tracker settings fail before training. No network: W&B
runs offline, trackio in a local store."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

from tests.support import (
    run_script,
    script_result,
    tensorboard_run,
    tensorboard_scalars,
    tensorboard_texts,
    tiny_config,
)
from tpu_helpers.config import TrainConfig, config_from_parameters
from tpu_helpers.core.callbacks import Callback
from tpu_helpers.core.choices import ConfigError
from tpu_helpers.recipes.pretrain import Pretrain
from tpu_helpers.training.tracking import TrackingWarning
from tpu_helpers.training.tracking.clients import Tracker, wandb_history


def offline_env(tmp_path: Path) -> dict[str, str]:
    """Every tracker local: W&B offline with its settings and caches in tmp_path, trackio's store there too."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
            "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
            "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}


def expected_curves(results: dict) -> dict[str, list[tuple[int, float]]]:
    history = results["history"]
    return {"train/loss": [(r["step"], r["loss"]) for r in history["train"]],
            "train/learning_rate": [(r["step"], r["lr"]) for r in history["train"]],
            "train/grad_norm": [(r["step"], r["grad_norm"]) for r in history["train"]],
            "eval/loss": [(r["step"], r["val_loss"]) for r in history["eval"]]}


def assert_same_curves(held: dict[str, list[tuple[int, float]]], results: dict, rel: float = 1e-6) -> None:
    """Each curve of the history holds exactly the history's steps (none twice, none missing) and values."""
    for tag, want in expected_curves(results).items():
        got = held.get(tag)
        assert got is not None, f"{tag} was not logged; logged: {sorted(held)}"
        assert [s for s, _ in got] == [s for s, _ in want], (tag, got, want)
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=rel), tag


# ---- TensorBoard on XLA ------------------------------------------------------------------------------------------
@pytest.mark.xla
def test_tensorboard_on_strict_xla_holds_the_results_and_adds_no_compile_or_transfer(tmp_path):
    def run(name: str, trackers: str) -> dict:
        # Each run in a fresh process: in one process the second run would find the first one's graphs.
        return script_result("tracked_run", {"out_dir": str(tmp_path / name), "trackers": trackers, "device": "xla",
                                             "xla_checks": "strict"})

    tracked, plain = run("tracked", "tensorboard"), run("plain", "")
    # (Graph executions are left out: their count varies by one between identical runs, tracked or not.)
    for counter in ("compilations", "uncached_compiles", "device_to_host_transfers"):
        assert tracked["report"]["xla"][counter] == plain["report"]["xla"][counter], counter
    assert tracked["report"]["xla"]["problems"] == [] and tracked["report"]["xla"]["compilations"] >= 2
    assert not (tmp_path / "plain" / "tensorboard").exists()

    out_dir = tmp_path / "tracked"
    log_dir = tensorboard_run(out_dir)
    run_json = json.loads((out_dir / "checkpoints" / "run.json").read_text())
    assert log_dir.name == run_json["tracked_run"]["id"]
    scalars = tensorboard_scalars(log_dir)
    assert_same_curves(scalars, tracked)
    # The counters the detector reads, at each log step, as the report has them at the end.
    assert [s for s, _ in scalars["xla/compilations"]] == [5, 10, 15, 20]
    assert scalars["xla/host_transfers"][-1][1] <= tracked["report"]["xla"]["device_to_host_transfers"]
    assert {"time/data_wait_ms", "time/host_ms", "time/sync_ms", "time/other_ms", "time/step_ms"} <= set(scalars)
    texts = tensorboard_texts(log_dir)
    config = json.loads(texts["config"][0][1])
    assert config["trackers"] == "tensorboard" and config["memory_plan"]["estimate"]
    assert "final_val_loss" in texts["summary"][0][1]


# ---- W&B offline, trackio local, TensorBoard: killed and resumed ----------------------------------------------------
@pytest.mark.slow
def test_a_stopped_then_killed_run_continues_each_tracked_run_without_a_step_twice(tmp_path):
    env = offline_env(tmp_path)
    out_dir = tmp_path / "run"
    args = {"out_dir": str(out_dir), "trackers": "tensorboard,wandb,trackio", "project": "tracking-test"}
    first = script_result("tracked_run", {**args, "stop_at": 10}, env=env)  # stopped cleanly, saved at 10
    assert first["report"]["steps"] == 10
    with pytest.raises(AssertionError, match=r"failed \(-9\)"):  # resumed, then SIGKILLed after step 17
        run_script("tracked_run", json.dumps({**args, "kill_at": 17}), env=env)
    results = script_result("tracked_run", args, env=env)  # resumed from 10 again, to the end
    assert results["report"]["resumed_from"] == 10 and results["report"]["steps"] == 20
    tracked = json.loads((out_dir / "checkpoints" / "run.json").read_text())["tracked_run"]
    # The uninterrupted run logs train records at 5..20 and evaluations at 0, 10, 20: so must every tracker.
    assert [r["step"] for r in results["history"]["train"]] == [5, 10, 15, 20]

    # W&B: three offline files of one run id, one per process. The first holds steps 0 to 10; the killed process's
    # is empty (W&B's service drops what it had not written when its process dies); the last one logged from 15.
    files = sorted(out_dir.glob(f"wandb/offline-run-*-{tracked['id']}/run-{tracked['id']}.wandb"))
    assert len(files) == 3
    rows = [list(wandb_history(f)) for f in files]
    assert [[s for s, _ in r] for r in rows] == [[0, 5, 10], [], [15, 20]]
    held: dict[str, list] = {}
    for step, values in rows[0] + rows[1] + rows[2]:
        for key, value in values.items():
            if not key.startswith("_") and isinstance(value, (int, float)):
                held.setdefault(key, []).append((step, value))
    assert_same_curves(held, results)

    # trackio: one run, resumed by name; each step of each curve once (the killed process had stored step 15).
    logs = script_result("tracker_stores", {"read": "trackio", "project": "tracking-test"}, env=env)
    assert list(logs) == [f"{tracked['name']}-{tracked['id']}"]
    assert {log["step"] for log in next(iter(logs.values()))} == {0, 5, 10, 15, 20}
    held = {}
    for log in next(iter(logs.values())):
        for key, value in log.items():
            if "/" in key and isinstance(value, (int, float)):
                held.setdefault(key, []).append((log["step"], value))
    assert_same_curves(held, results)

    # TensorBoard: each rerun purged what the earlier process logged from step 10 on and logged it again.
    log_dir = out_dir / "tensorboard" / tracked["id"]
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 3
    assert_same_curves(tensorboard_scalars(log_dir), results)


# ---- bad settings fail before training ------------------------------------------------------------------------------
def test_an_unknown_tracker_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"'tensorbord'.*known: tensorboard, wandb, trackio"):
        TrainConfig(trackers="tensorboard,tensorbord")
    with pytest.raises(ConfigError, match=r"TRACKERS='mlflow'"):
        config_from_parameters({"TRACKERS": "mlflow"})
    assert TrainConfig(trackers=" TensorBoard , wandb,tensorboard").trackers == "tensorboard,wandb"
    assert TrainConfig(trackers="none").trackers == ""
    with pytest.raises(ConfigError, match="project"):
        TrainConfig(project="my project")


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "trackio"])
def test_a_tracker_whose_package_is_missing_is_refused_naming_the_extra(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # how Python marks a module that cannot be imported
    config = tiny_config(tmp_path, trackers=name)
    with pytest.raises(ConfigError, match=rf'needs the {name} package.*tpu_helpers\[tracking\].*tpu_helpers\[{name}\]'):
        Pretrain(config, progress=False)


def test_wandb_without_a_login_is_refused_before_training(tmp_path):
    # No key in the environment, settings or netrc, and not offline (a fresh process: W&B reads them once).
    (tmp_path / "netrc").write_text("")
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "", "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
           "NETRC": str(tmp_path / "netrc"), "HOME": str(tmp_path)}
    error = script_result("tracker_stores", {"read": "wandb_login"}, env=env)
    assert error.startswith("ConfigError") and "wandb login" in error and "WANDB_MODE=offline" in error, error
    assert script_result("tracker_stores", {"read": "wandb_login"}, env={**env, "WANDB_MODE": "offline"}) is None


# ---- a tracker that fails mid-run --------------------------------------------------------------------------------
class Unreachable(Tracker):
    """A tracker whose server went away after the run started."""

    name = "unreachable"

    def log(self, metrics, step):
        raise ConnectionError("the server cannot be reached")


class LoseTheNetwork(Callback):
    """After the first step, the run's trackers include one that fails on every call."""

    def on_step_end(self, trainer):
        if trainer.step == 1:
            trainer.tracking.trackers.append(Unreachable())
            trainer.tracking.floors[Unreachable.name] = -1


def test_a_tracker_failing_mid_run_warns_once_and_training_goes_on(tmp_path):
    config = tiny_config(tmp_path, trackers="tensorboard", steps=20)
    job = Pretrain(config, progress=False, callbacks=[LoseTheNetwork()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = job.train()
    failures = [w for w in caught if issubclass(w.category, TrackingWarning)]
    assert len(failures) == 1, [str(w.message) for w in caught]
    assert "cannot be reached" in str(failures[0].message) and "goes on" in str(failures[0].message)
    assert report.steps == 20 and report.stop_reason is None
    # The other tracker logged every record.
    scalars = tensorboard_scalars(tensorboard_run(tmp_path / "run"))
    assert [s for s, _ in scalars["train/loss"]] == [5, 10, 15, 20]
