"""Table-driven: every bad input fails early with its own message (what was given, what is allowed).

Each row is (id, call, exception type, regex the message must match). The calls fail before any training step:
a bad value must never cost a run's work. Rows cover TrainConfig fields, notebook parameters, get_backend, data
paths, model sizes, the checkpoint manager, Trainer/fit arguments and out_dir conflicts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from tpu_helpers.backend import BackendUnavailable, get_backend
from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.config import ConfigError, TrainConfig, config_from_parameters
from tpu_helpers.core.callbacks import Callback
from tpu_helpers.data import build_datasets, load_text, make_loader
from tpu_helpers.data.tokenizer import get_tokenizer
from tpu_helpers.models.gpt import GPTConfig, gpt_config
from tpu_helpers.recipes.pretrain import Pretrain
from tpu_helpers.training.trainer import Trainer, fit


def _data(n: int = 16) -> TensorDataset:
    return TensorDataset(torch.randn(n, 4), torch.randn(n, 4))


def _cfg(tmp: Path, **kw) -> TrainConfig:
    return TrainConfig(**{"device": "cpu", "steps": 1, "batch_size": 4, "eval_every": 1, "eval_batches": 1,
                          "out_dir": str(tmp / "run"), **kw})


def _trainer(tmp: Path, model=None, train=None, val=None, **kw) -> Trainer:
    cfg = kw.pop("config", None) or _cfg(tmp)
    return Trainer(torch.nn.Linear(4, 4) if model is None else model, _data() if train is None else train,
                   val, config=cfg, loss_fn=kw.pop("loss_fn", torch.nn.functional.mse_loss), progress=False, **kw)


def _frozen() -> torch.nn.Module:
    model = torch.nn.Linear(4, 4)
    model.requires_grad_(False)
    return model


def _other_run_in_out_dir(tmp: Path) -> None:
    _trainer(tmp, config=_cfg(tmp, batch_size=4)).fit()
    _trainer(tmp, config=_cfg(tmp, batch_size=2)).fit()


def _restart_without_resume(tmp: Path) -> None:
    _trainer(tmp).fit()
    _trainer(tmp, config=_cfg(tmp, resume=False)).fit()


def _out_dir_is_a_file(tmp: Path) -> None:
    (tmp / "run").write_text("not a directory")
    _trainer(tmp).fit()


def _empty_dir(tmp: Path) -> Path:
    (tmp / "empty").mkdir()
    (tmp / "empty" / "image.png").write_bytes(b"\x89PNG")
    return tmp / "empty"


class _MisspeltCallback:
    def on_step(self, trainer) -> None: ...  # not a hook: it would never be called


class _NoHooks:
    def log(self, trainer) -> None: ...


CASES = [
    # ---- TrainConfig fields: type, range, choice, conflicts ----
    ("steps=0", lambda t: TrainConfig(steps=0), ConfigError, r"steps=0 must be >= 1"),
    ("steps str", lambda t: TrainConfig(steps="100"), ConfigError, r"steps='100' has type str; expected int"),
    ("batch_size bool", lambda t: TrainConfig(batch_size=True), ConfigError, r"batch_size=True has type bool"),
    ("lr=0", lambda t: TrainConfig(lr=0), ConfigError, r"lr=0\.0 must be > 0"),
    ("lr<0", lambda t: TrainConfig(lr=-1e-3), ConfigError, r"lr=-0\.001 must be > 0"),
    ("val_fraction=1", lambda t: TrainConfig(val_fraction=1.0), ConfigError, r"val_fraction=1\.0 must be between"),
    ("min_lr_ratio", lambda t: TrainConfig(min_lr_ratio=1.5), ConfigError, r"min_lr_ratio=1\.5 must be between 0"),
    ("device", lambda t: TrainConfig(device="gpu"), ConfigError, r"device='gpu' is not one of \('auto'"),
    ("precision", lambda t: TrainConfig(precision="fp8"), ConfigError, r"precision='fp8' is not one of"),
    ("optimizer", lambda t: TrainConfig(optimizer="adam"), ConfigError, r"optimizer='adam' is not one of"),
    ("spmd", lambda t: TrainConfig(spmd="yes"), ConfigError, r"spmd='yes' has type str|spmd='yes' must be"),
    ("preset", lambda t: TrainConfig(preset="huge"), ConfigError, r"preset='huge' is not one of \('tiny'"),
    ("grad_clip=0", lambda t: TrainConfig(grad_clip=0), ConfigError, r"grad_clip=0 must be > 0, or None to disable"),
    ("warmup<0", lambda t: TrainConfig(warmup_steps=-1), ConfigError, r"warmup_steps=-1 must be >= 0"),
    ("max_chars=0", lambda t: TrainConfig(max_chars=0), ConfigError, r"max_chars=0 must be >= 1"),
    ("seq_len=0", lambda t: TrainConfig(seq_len=0), ConfigError, r"seq_len=0 must be >= 1"),
    ("keep_last=0", lambda t: TrainConfig(keep_last=0), ConfigError, r"keep_last=0 must be >= 1"),
    ("weight_decay<0", lambda t: TrainConfig(weight_decay=-0.1), ConfigError, r"weight_decay=-0\.1 must be >= 0"),
    ("seed<0", lambda t: TrainConfig(seed=-1), ConfigError, r"seed=-1 must be >= 0"),
    ("out_dir empty", lambda t: TrainConfig(out_dir=""), ConfigError, r"out_dir='' is empty"),
    ("dataset empty", lambda t: TrainConfig(dataset=""), ConfigError, r"dataset='' is empty"),
    ("tokenizer blank", lambda t: TrainConfig(tokenizer=" "), ConfigError, r"tokenizer=' ' is empty"),
    ("extra list", lambda t: TrainConfig(extra=[]), ConfigError, r"extra=\[\] has type list; expected dict"),
    ("fp16 on cpu", lambda t: TrainConfig(device="cpu", precision="fp16"), ConfigError,
     r"precision='fp16' needs a CUDA GPU; on device='cpu'"),
    ("fp16 on tpu", lambda t: TrainConfig(device="tpu", precision="fp16"), ConfigError,
     r"precision='fp16' needs a CUDA GPU; on device='tpu' use 'bf16'"),
    ("spmd on cpu", lambda t: TrainConfig(device="cpu", spmd=True), ConfigError,
     r"spmd=True .* device='cpu' is not XLA"),
    ("replace unknown", lambda t: TrainConfig().replace(stpes=10), ConfigError,
     r"unknown TrainConfig field\(s\) \['stpes'\]"),
    # ---- notebook parameters ----
    ("param unknown", lambda t: config_from_parameters({"STPES": 10}), ConfigError,
     r"unknown notebook parameter\(s\) \['STPES'\]; allowed: .*STEPS"),
    ("param type", lambda t: config_from_parameters({"STEPS": "10"}), ConfigError,
     r"STEPS='10' has type str; expected int"),
    ("param range", lambda t: config_from_parameters({"LR": -1.0}), ConfigError, r"LR=-1\.0 must be > 0"),
    ("param extra type", lambda t: config_from_parameters({"MOUNT_DRIVE": "yes"}, extra={"MOUNT_DRIVE": bool}),
     ConfigError, r"MOUNT_DRIVE='yes' has type str; expected <class 'bool'>"),
    ("param extra spec", lambda t: config_from_parameters({}, extra={"mount": bool}), ConfigError,
     r"keys must be UPPER_CASE parameter names"),
    ("param namespace", lambda t: config_from_parameters(["STEPS"]), TypeError,
     r"namespace must be a dict such as globals\(\), got list"),
    # ---- backends ----
    ("backend device", lambda t: get_backend("gpu"), ValueError, r"device='gpu' is not one of"),
    ("backend spmd", lambda t: get_backend("cpu", spmd="yes"), ValueError, r"spmd='yes' must be True, False"),
    ("backend fp16 cpu", lambda t: get_backend("cpu", precision="fp16"), ValueError,
     r"precision='fp16' needs a CUDA GPU"),
    ("backend precision", lambda t: get_backend("cpu", precision="half"), ValueError,
     r"precision='half' is not one of"),
    ("backend no tpu", lambda t: get_backend("tpu"), BackendUnavailable,
     r"device='tpu' cannot be used: .*Pass fallback=True"),
    # ---- data ----
    ("data missing file", lambda t: load_text(str(t / "missing.txt")), FileNotFoundError,
     r"no such file or directory: '.*missing\.txt'"),
    ("data empty dir", lambda t: load_text(str(_empty_dir(t))), ValueError, r"has no \.txt/.*files"),
    ("data max_chars", lambda t: load_text("embedded", max_chars=0), ValueError,
     r"max_chars must be a positive int or None, got 0"),
    ("data block_size", lambda t: build_datasets("embedded", block_size=0, max_chars=1000), ValueError,
     r"block_size must be a positive int, got 0"),
    ("tokenizer empty", lambda t: get_tokenizer(""), ValueError, r"tokenizer name must be a non-empty string"),
    ("loader batch", lambda t: make_loader(_data(), 0), ValueError, r"batch_size must be a positive int, got 0"),
    ("loader too small", lambda t: make_loader(_data(3), 4), ValueError, r"dataset too small: 3 samples"),
    # ---- model sizes ----
    ("model preset", lambda t: gpt_config("huge"), ValueError, r"unknown preset 'huge'; choose one of"),
    ("model heads", lambda t: GPTConfig(n_embd=30, n_head=4), ValueError, r"n_embd \(30\) must be divisible"),
    ("model layers", lambda t: GPTConfig(n_layer=0), ValueError, r"GPTConfig\.n_layer must be an integer >= 1"),
    ("model dropout", lambda t: GPTConfig(dropout=1.0), ValueError, r"dropout must be in \[0, 1\), got 1\.0"),
    ("seq_len > context", lambda t: Pretrain(TrainConfig(device="cpu", preset="tiny", seq_len=4096)),
     ConfigError, r"seq_len=4096 exceeds the context of preset 'tiny' \(block_size 64\)"),
    # ---- checkpoint manager ----
    ("ckpt keep_last", lambda t: CheckpointManager(t, keep_last=0), ValueError, r"keep_last must be an int >= 1"),
    ("ckpt step<0", lambda t: CheckpointManager(t).save(-1, {}), ValueError, r"step must be a non-negative int"),
    ("ckpt step bool", lambda t: CheckpointManager(t).save(True, {}), ValueError, r"non-negative int, got True"),
    ("ckpt missing", lambda t: CheckpointManager(t).load(3), FileNotFoundError, r"no checkpoint .*ckpt-00000003"),
    # ---- Trainer / fit arguments ----
    ("model not Module", lambda t: _trainer(t, model="gpt"), TypeError,
     r"model must be a torch\.nn\.Module, got str"),
    ("model frozen", lambda t: _trainer(t, model=_frozen()), ConfigError, r"Linear has no trainable parameters"),
    ("loss_fn", lambda t: _trainer(t, loss_fn=3), TypeError, r"loss_fn must be callable .* got int"),
    ("train too small", lambda t: _trainer(t, train=_data(3)), ConfigError,
     r"train_data has 3 samples, fewer than one batch of 4"),
    ("val too small", lambda t: _trainer(t, val=_data(2)), ConfigError,
     r"val_data has 2 samples, fewer than one batch of 4"),
    ("train not data", lambda t: _trainer(t, train=5), TypeError, r"train_data must be a map-style Dataset"),
    ("config dict", lambda t: _trainer(t, config={"steps": 3}), TypeError,
     r"config must be a TrainConfig or None, got dict; build one with TrainConfig"),
    ("backend str", lambda t: _trainer(t, backend="cpu"), TypeError, r"backend must be a tpu_helpers Backend"),
    ("callback misspelt", lambda t: _trainer(t, callbacks=[_MisspeltCallback()]), TypeError,
     r"callbacks\[0\] \(_MisspeltCallback\) on_step is not a hook; a callback defines some of: on_fit_start, "
     r"on_batch, on_step_end, on_log, on_eval_start, on_eval_end, on_fit_end"),
    ("callback without hooks", lambda t: _trainer(t, callbacks=[_NoHooks()]), TypeError,
     r"callbacks\[0\] \(_NoHooks\) has no hook method"),
    ("callbacks not list", lambda t: _trainer(t, callbacks=Callback()), TypeError,
     r"callbacks must be a list of Callback objects, got Callback"),
    ("run_identity", lambda t: _trainer(t, run_identity="v1"), TypeError, r"run_identity must be a dict"),
    ("save_trainable_only", lambda t: _trainer(t, save_trainable_only="yes"), TypeError,
     r"save_trainable_only must be True or False, got 'yes'"),
    ("fit without data", lambda t: Trainer(torch.nn.Linear(4, 4), None, config=_cfg(t), progress=False).fit(),
     ConfigError,
     r"this Trainer was made without train_data \(for its step alone\): pass a Dataset"),
    ("grad ckpt", lambda t: _trainer(t, config=_cfg(t, gradient_checkpointing=True)), ConfigError,
     r"gradient_checkpointing=True but Linear has no set_gradient_checkpointing"),
    ("fit unknown arg", lambda t: fit(torch.nn.Linear(4, 4), _data(), confg=_cfg(t)), TypeError,
     r"unexpected keyword argument 'confg'"),
    # ---- out_dir conflicts (checked at fit start, before any step) ----
    ("out_dir is a file", _out_dir_is_a_file, ConfigError, r"is a file, not a directory; choose another out_dir"),
    ("other run's checkpoints", _other_run_in_out_dir, ConfigError,
     r"holds checkpoints of a different run \(global_batch: 4 there vs 2 now\)"),
    ("resume=False over checkpoints", _restart_without_resume, ConfigError,
     r"already holds checkpoints \(newest: step 1\) and resume=False"),
]


def test_table_has_enough_cases() -> None:
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("call, exc, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_with_its_message(call, exc, message, tmp_path: Path) -> None:
    with pytest.raises(exc, match=message):
        call(tmp_path)
