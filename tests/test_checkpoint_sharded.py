"""Sharded checkpoints on disk (torch.distributed.checkpoint directories): the same guarantees as a .pt.

One process and CPU tensors through DCP's default planners: what the manager does with the directory (manifest,
renames, verification, fallback, pruning, set-aside, nan/inf) does not depend on who wrote the shards. The XLA
SPMD and FSDP2 writers are exercised in tests/training/test_sharding.py and tests/launch/test_fsdp2_torchrun.py.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from tpu_helpers.checkpoint import CheckpointManager, ShardedCheckpoint, dcp


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


def _save(mgr: CheckpointManager, step: int, model, opt):
    tensors = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    planner = dcp.finite_checking(DefaultSavePlanner)()
    return mgr.save_sharded(step, {"step": step, "rng": torch.get_rng_state()},
                            lambda d: dcp.write(d, tensors, planner), writer="test", size=1 << 10)


def test_a_sharded_save_round_trips_whole_with_its_manifest(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path)
    path = _save(mgr, 7, model, opt)
    assert path == tmp_path / "ckpt-00000007.dcp" and path.is_dir()
    manifest = json.loads((tmp_path / "ckpt-00000007.json").read_text())
    assert manifest["writer"] == "test" and set(manifest["files"]) == {p.name for p in path.iterdir()}
    assert dcp.STATE_FILE in manifest["files"] and ".metadata" in manifest["files"]
    assert not list(tmp_path.glob(".ckpt-*")), "no temp directory or save marker left behind"

    step, state = mgr.load_latest()
    assert step == 7 and state["step"] == 7 and isinstance(state["sharded"], ShardedCheckpoint)
    whole = state["sharded"].read_whole()
    for key, value in model.state_dict().items():
        assert torch.equal(whole["model"][key], value), key
    # Optimizer state keyed by int again (DCP made the keys strings): load_state_dict would otherwise drop it all.
    assert sorted(whole["optimizer"]["state"]) == sorted(opt.state_dict()["state"])
    fresh_model, _ = _model_and_optimizer(seed=1)
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=1e-2)
    fresh_opt.load_state_dict(whole["optimizer"])
    for p_new, p_old in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(fresh_opt.state[p_new]["exp_avg"], opt.state[p_old]["exp_avg"])


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path, keep_last=3)
    _save(mgr, 1, model, opt)
    newest = _save(mgr, 2, model, opt)
    shard = next(newest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    infos = {i.step: i for i in mgr.list()}
    assert infos[1].valid and not infos[2].valid and infos[2].reason == f"{shard.name}: checksum mismatch"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, _ = mgr.load_latest()
    assert step == 1 and any("ckpt-00000002.dcp is damaged" in str(w.message) for w in caught)


def test_interrupted_and_unverifiable_directories_are_told_apart(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 3, model, opt)
    (tmp_path / "ckpt-00000003.json").unlink()  # the manifest was lost (not copied): keep, refuse to start over
    assert [i.step for i in mgr.unverifiable()] == [3]
    (tmp_path / ".ckpt-00000003.saving").touch()  # now it reads as our own save cut short: disposable
    assert mgr.unverifiable() == [] and mgr.list()[0].interrupted


def test_nan_weights_are_never_committed(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 1, model, opt)
    with torch.no_grad():
        model[2].bias[0] = float("nan")
    bad = _save(mgr, 2, model, opt)
    assert bad == ["model.2.bias"]
    assert [i.step for i in mgr.list()] == [1] and not list(tmp_path.glob(".ckpt-*"))


def test_pruning_set_aside_and_a_whole_save_of_the_same_step(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        _save(mgr, step, model, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000002.dcp", "ckpt-00000002.json", "ckpt-00000003.dcp", "ckpt-00000003.json"]
    # Resumed unsharded and saved at the same step: the .pt replaces the directory (one data form per step).
    mgr.save(3, {"model": model.state_dict()})
    assert not (tmp_path / "ckpt-00000003.dcp").exists() and mgr.latest().path.name == "ckpt-00000003.pt"
    moved = mgr.set_aside()
    assert (moved / "ckpt-00000002.dcp").is_dir() and not list(tmp_path.glob("ckpt-*"))


def test_a_checkpoint_of_another_model_is_a_clear_error(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 1, model, opt)
    _, state = mgr.load_latest()
    other = torch.nn.Linear(6, 3)
    template = {"model": other.state_dict(), "optimizer": torch.optim.AdamW(other.parameters()).state_dict()}
    with pytest.raises(ValueError, match=r"torch\.distributed\.checkpoint failed on .*ckpt-00000001\.dcp"):
        state["sharded"].load_into(template, None)


def test_files_written_elsewhere_are_an_error_not_a_checkpoint_with_holes(tmp_path: Path) -> None:
    """On a pod each host writes its own shard files; an out_dir the hosts do not share misses the others'."""
    from tpu_helpers.checkpoint import CheckpointError

    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path)

    def write_on_another_disk(directory: Path) -> list[str]:
        bad = dcp.write(directory, {"model": model.state_dict(), "optimizer": opt.state_dict()},
                            DefaultSavePlanner())
        next(directory.glob("*.distcp")).unlink()  # what host 0 sees when host 1 wrote to its own disk
        return bad

    with pytest.raises(CheckpointError, match=r"lacks __0_0\.distcp.*storage every host mounts"):
        mgr.save_sharded(1, {"step": 1}, write_on_another_disk, writer="test")
    assert mgr.list() == [] and not list(tmp_path.glob(".ckpt-*"))
