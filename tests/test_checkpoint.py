"""Checkpoints on real files: round trips, pruning, damage detection, fallback and a full disk."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import warnings
from pathlib import Path

import pytest
import torch

from tpu_helpers.checkpoint import CheckpointCorrupt, CheckpointError, CheckpointManager
from tpu_helpers.core.atomic_io import atomic_write_bytes, atomic_write_text


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"w": torch.randn(64, 32), "seed": seed}


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _temps(directory: Path) -> list[str]:
    return [name for name in _names(directory) if name.endswith(".tmp")]


def _steps(mgr: CheckpointManager) -> list[int]:
    return [info.step for info in mgr.list()]


@pytest.fixture
def disk_full(monkeypatch: pytest.MonkeyPatch):
    """Make os.write (which the checkpoint writer goes through) fail with ENOSPC past `allow` bytes."""

    def install(allow: int = 0, only_if=lambda data: True) -> None:
        real_write = os.write
        written = 0

        def write(fd: int, data) -> int:
            nonlocal written
            if only_if(bytes(data[:16])) and written + len(data) > allow:
                raise OSError(errno.ENOSPC, "No space left on device")
            written += len(data)
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", write)  # undone by monkeypatch when the test ends

    return install


def test_round_trip_model_optimizer_and_rng(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    random.seed(1234)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "py_rng": random.getstate()}
    expected_next = random.random()

    mgr = CheckpointManager(tmp_path / "ckpt")
    path = mgr.save(7, state, meta={"loss": 0.25})
    assert path == tmp_path / "ckpt" / "ckpt-00000007.pt"

    manifest = json.loads(path.with_suffix(".json").read_text())
    assert manifest["format"] == 1 and manifest["step"] == 7 and manifest["meta"] == {"loss": 0.25}
    assert manifest["bytes"] == path.stat().st_size
    assert manifest["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()

    step, loaded = mgr.load_latest()
    assert step == 7
    for key, value in model.state_dict().items():
        assert torch.equal(loaded["model"][key], value)
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.1)
    opt2.load_state_dict(loaded["optim"])
    exp_avg = next(iter(opt.state_dict()["state"].values()))["exp_avg"]
    assert torch.equal(next(iter(opt2.state_dict()["state"].values()))["exp_avg"], exp_avg)
    random.setstate(loaded["py_rng"])
    assert random.random() == expected_next
    assert torch.equal(mgr.load(7)["model"]["weight"], model.weight.detach())
    assert _temps(tmp_path / "ckpt") == []


def test_keep_last_prunes_oldest_and_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, _state(step))
    assert _steps(mgr) == [3, 4]
    assert _names(tmp_path) == [
        "ckpt-00000003.json",
        "ckpt-00000003.pt",
        "ckpt-00000004.json",
        "ckpt-00000004.pt",
    ]

    mgr.save(4, _state(40))
    assert mgr.load(4)["seed"] == 40
    assert all(info.valid for info in mgr.list())


def test_pruning_counts_only_valid_checkpoints(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        CheckpointManager(tmp_path, keep_last=3).save(step, _state(step))
    (tmp_path / "ckpt-00000003.json").unlink()  # step 3 damaged: it must not use up a keep_last slot
    CheckpointManager(tmp_path, keep_last=2).save(4, _state(4))
    assert [(i.step, i.valid) for i in CheckpointManager(tmp_path).list()] == [(2, True), (4, True)]


def test_interrupted_save_without_manifest_is_skipped(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    # A save killed after the .pt rename but before the manifest: the data may even be complete.
    (tmp_path / "ckpt-00000003.pt").write_bytes((tmp_path / "ckpt-00000002.pt").read_bytes())
    (tmp_path / ".ckpt-00000003.saving").touch()  # what save leaves until its manifest is in place

    info = mgr.list()[-1]
    assert (info.step, info.valid, info.reason) == (3, False, "no manifest: its save was interrupted")
    assert info.interrupted and not info.unverifiable and mgr.unverifiable() == []
    assert mgr.latest().step == 2
    with pytest.warns(UserWarning, match=r"ckpt-00000003\.pt.*no manifest.*falling back"):
        step, state = mgr.load_latest()
    assert (step, state["seed"]) == (2, 2)


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_damaged_checkpoint_detected_and_load_latest_falls_back(tmp_path: Path, damage: str) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(1))
    bad = mgr.save(2, _state(2))
    data = bad.read_bytes()
    if damage == "truncate":
        bad.write_bytes(data[: len(data) // 2])
        reason = f"truncated: {len(data) // 2} of {len(data)} bytes"
    else:
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x01
        bad.write_bytes(bytes(flipped))
        reason = "checksum mismatch"

    assert [(i.step, i.valid, i.reason) for i in mgr.list()] == [(1, True, None), (2, False, reason)]
    assert mgr.latest().step == 1
    with pytest.warns(UserWarning, match=re.escape(f"{bad} is damaged ({reason})")):
        step, state = mgr.load_latest()
    assert (step, state["seed"]) == (1, 1)
    with pytest.raises(CheckpointCorrupt, match=re.escape(reason)) as exc:
        mgr.load(2)
    assert "ckpt-00000002.pt" in str(exc.value)


def test_manifest_valid_but_unloadable_falls_back(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(1))
    junk = b"not a torch file" * 10
    atomic_write_bytes(tmp_path / "ckpt-00000002.pt", junk)
    manifest = {
        "format": 1,
        "step": 2,
        "sha256": hashlib.sha256(junk).hexdigest(),
        "bytes": len(junk),
        "meta": {},
    }
    atomic_write_text(tmp_path / "ckpt-00000002.json", json.dumps(manifest))

    assert mgr.latest().step == 2  # it verifies; only unpickling reveals the problem
    with pytest.warns(UserWarning, match=r"ckpt-00000002\.pt.*torch\.load failed"):
        step, _ = mgr.load_latest()
    assert step == 1
    with pytest.raises(CheckpointCorrupt, match="ckpt-00000002.pt"):
        mgr.load(tmp_path / "ckpt-00000002.pt")


def test_only_valid_checkpoint_is_never_pruned(tmp_path: Path) -> None:
    writer = CheckpointManager(tmp_path, keep_last=3)
    writer.save(1, _state(1))
    writer.save(3, _state(3))
    (tmp_path / "ckpt-00000002.pt").write_bytes(b"half a checkpoint")  # no manifest
    (tmp_path / "ckpt-00000003.pt").write_bytes(b"x")  # truncated after the fact

    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.prune()
    assert [(i.step, i.valid) for i in mgr.list()] == [(1, True), (2, False), (3, False)]
    with pytest.warns(UserWarning, match="falling back"):
        assert mgr.load_latest()[0] == 1

    # The next good save makes the older damaged ones and the surplus valid one deletable.
    mgr.save(4, _state(4))
    assert [(i.step, i.valid) for i in mgr.list()] == [(4, True)]


def test_all_damaged_or_empty_returns_none(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "missing")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mgr.load_latest() is None
        assert mgr.latest() is None and mgr.list() == []
    (tmp_path / "missing").mkdir()
    (tmp_path / "missing" / "ckpt-00000005.pt").write_bytes(b"junk")
    with pytest.warns(UserWarning) as record:
        assert mgr.load_latest() is None
    messages = [str(w.message) for w in record]
    assert len(messages) == 2 and "ckpt-00000005.pt is damaged" in messages[0]
    assert "no valid checkpoint" in messages[1]
    with pytest.raises(FileNotFoundError):
        mgr.load(9)


@pytest.mark.parametrize("where", ["pt_start", "pt_middle", "manifest"])
def test_disk_full_keeps_previous_checkpoint_and_leaves_no_temp_files(
    tmp_path: Path, disk_full, where
) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(1, _state(1))
    before = _names(tmp_path)
    if where == "manifest":
        disk_full(only_if=lambda head: head.startswith(b'{\n  "format"'))
    else:
        disk_full(allow=0 if where == "pt_start" else 4000)

    with pytest.raises(CheckpointError) as exc:
        mgr.save(2, _state(2))
    message = str(exc.value)
    assert "step 2" in message and "disk is full" in message and str(tmp_path) in message
    assert f"{64 * 32 * 4:,} bytes" in message  # how much the tensors needed

    assert _names(tmp_path) == before  # nothing new, no temp files
    step, state = mgr.load_latest()
    assert (step, state["seed"]) == (1, 1)


def test_disk_full_when_resaving_same_step_keeps_old_copy(tmp_path: Path, disk_full) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(1))
    disk_full(allow=100)
    with pytest.raises(CheckpointError, match="disk is full"):
        mgr.save(1, _state(99))
    assert mgr.load(1)["seed"] == 1
    assert _temps(tmp_path) == []


def test_unpicklable_state_raises_checkpoint_error(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(1))
    with pytest.raises(CheckpointError, match=r"step 2 could not be saved"):
        mgr.save(2, {"fn": lambda: 1})
    with pytest.raises(CheckpointError, match="step 3"):
        mgr.save(3, _state(3), meta={"not json": object()})
    assert _names(tmp_path) == ["ckpt-00000001.json", "ckpt-00000001.pt"]


def test_stale_temp_files_are_removed_after_a_save(tmp_path: Path) -> None:
    stale = tmp_path / ".ckpt-00000002.pt.abcd1234.tmp"
    stale.write_bytes(b"left by a killed save")
    os.utime(stale, (1_000_000, 1_000_000))
    unrelated = tmp_path / "notes.tmp"
    unrelated.write_text("not ours")
    CheckpointManager(tmp_path).save(3, _state(3))
    assert not stale.exists() and unrelated.exists()


def test_keep_last_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last.*0"):
        CheckpointManager(tmp_path, keep_last=0)


def test_non_main_process_writes_nothing(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "ckpt", is_main=False)
    assert mgr.save(3, _state(3)) == tmp_path / "ckpt" / "ckpt-00000003.pt"
    mgr.write_run_info({"run": "a"})
    assert not (tmp_path / "ckpt").exists()

    main = CheckpointManager(tmp_path / "ckpt", keep_last=1)
    main.save(1, _state(1))
    main.save(2, _state(2))
    assert CheckpointManager(tmp_path / "ckpt", is_main=False).load_latest()[0] == 2


def test_run_info_round_trip(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    assert mgr.read_run_info() is None
    mgr.write_run_info({"config_sha": "abc", "model": "tiny"})
    mgr.write_run_info({"config_sha": "def", "model": "tiny"})
    assert mgr.read_run_info() == {"config_sha": "def", "model": "tiny"}
    assert _names(tmp_path) == ["run.json"]
    (tmp_path / "run.json").write_text("{broken")
    with pytest.raises(CheckpointCorrupt, match="run.json"):
        mgr.read_run_info()


def test_atomic_write_keeps_old_content_on_failure(tmp_path: Path, disk_full) -> None:
    target = tmp_path / "results" / "metrics.json"
    atomic_write_text(target, '{"acc": 0.5}')
    atomic_write_bytes(target, b'{"acc": 0.9}')
    assert target.read_text() == '{"acc": 0.9}'
    disk_full(allow=3)
    with pytest.raises(OSError) as exc:
        atomic_write_text(target, '{"acc": 1.0}')
    assert exc.value.errno == errno.ENOSPC
    assert target.read_text() == '{"acc": 0.9}'
    assert _names(target.parent) == ["metrics.json"]


def test_importing_never_touches_the_umask_and_files_follow_it(tmp_path: Path) -> None:
    import json

    from tests.support import run_script

    out = run_script("umask_on_import", str(tmp_path / "r.json")).stdout.strip().splitlines()[-1]
    assert json.loads(out.removeprefix("RESULT ")) == {"calls": [], "umask": "0o27", "mode": "0o640"}


def test_second_signal_during_a_save_stops_as_itself_not_as_a_checkpoint_error(tmp_path: Path, monkeypatch) -> None:
    """Two SIGTERMs 1-30 ms apart: the second lands inside torch.save's writes. It must end the process as the
    stop it is (SystemExit 143 from the signal guard), not as a misleading CheckpointError "unexpected pos"."""
    import os
    import signal

    def second_sigterm(signum, frame):  # what training.signals does on a second signal
        raise SystemExit(128 + signum)

    real_write, calls = os.write, []

    def write(fd, data):
        n = real_write(fd, data)
        calls.append(n)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered before the next bytecode: inside this write
        return n

    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(1))
    previous = signal.signal(signal.SIGTERM, second_sigterm)
    monkeypatch.setattr(os, "write", write)
    try:
        with pytest.raises(SystemExit) as info:
            mgr.save(2, _state(2))
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGTERM, previous)
    assert info.value.code == 143
    assert [(i.step, i.valid) for i in mgr.list()] == [(1, True)]
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_kill_while_pruning_leaves_nothing_that_blocks_the_rerun(tmp_path: Path, monkeypatch) -> None:
    """SIGKILL between the two deletions of a pruned checkpoint: the rerun must still start (seen in the kill test:
    a .pt left without its manifest reads as data whose manifest was lost, and the run refused to start)."""
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(1, _state(1))
    real_unlink, calls = Path.unlink, []

    def killed_after_first(self, *args, **kwargs):
        calls.append(self.name)
        real_unlink(self, *args, **kwargs)
        if len(calls) == 1:
            raise KeyboardInterrupt  # stands in for SIGKILL between the two unlinks

    monkeypatch.setattr(Path, "unlink", killed_after_first)
    with pytest.raises(KeyboardInterrupt):
        mgr._delete(1)
    monkeypatch.undo()
    rerun = CheckpointManager(tmp_path, keep_last=1)
    assert rerun.unverifiable() == []
    rerun.save(2, _state(2))
    assert [(i.step, i.valid) for i in rerun.list()] == [(2, True)]
