"""SHARDING: FSDP over the SPMD mesh follows a one-device run step for step, and really holds 1/N per chip.

The 8-device runs (CPU_NUM_DEVICES=8, SPMD) and the 1-device runs each need their own process (XLA fixes SPMD and
the device count per process), hence tests/scripts/sharded_runs.py. Models: the package's GPT and a tiny Qwen2 built from a config
(random init, no download), fully fine-tuned and with LoRA.
"""

from __future__ import annotations

import json

import pytest

from tests.support import XLA_BACKEND, script_result
from tpu_helpers.backend import get_backend, runtime_env
from tpu_helpers.backend.units import block_classes
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.core.sharding import ShardingError, check_sharding, is_sharded, mesh_shape


def _train(args: dict, devices: int) -> list[dict]:
    env = runtime_env.xla_cpu_env(devices)
    if args.get("dump"):  # the compiler's HLO, to see what each run's step holds
        env[runtime_env.XLA_FLAGS] = runtime_env.dump_dir_flags(args["dump"])
    return script_result("sharded_runs", args, env=env, timeout=900)


@pytest.mark.xla
def test_fsdp_on_eight_devices_shards_everything_and_matches_one_device(tmp_path):
    steps = 4
    common = {"steps": steps}
    runs8 = [{"model": "gpt", "sharding": "fsdp", "batch_size": 2, "gradient_checkpointing": True},
             {"model": "gpt", "sharding": "2x4", "batch_size": 2},
             {"model": "hf", "sharding": "fsdp", "batch_size": 2},
             {"model": "lora", "sharding": "fsdp", "batch_size": 2}]
    runs1 = [{"model": "gpt", "batch_size": 16}, {"model": "hf", "batch_size": 16}, {"model": "lora", "batch_size": 16}]
    for i, run in enumerate(runs8 + runs1):
        run.update(common, out_dir=str(tmp_path / f"run{i}"))
    gpt8, gpt2x4, hf8, lora8 = _train({"spmd": True, "runs": runs8, "dump": str(tmp_path / "hlo")}, 8)
    gpt1, hf1, lora1 = _train({"spmd": False, "runs": runs1}, 1)

    for name, many, one in (("gpt fsdp", gpt8, gpt1), ("gpt 2x4", gpt2x4, gpt1), ("hf fsdp", hf8, hf1),
                            ("lora fsdp", lora8, lora1)):
        diff = max(abs(a - b) for a, b in zip(many["losses"], one["losses"], strict=True))
        print(f"{name}: mesh {many['mesh']}, max |loss - 1-device loss| over {steps} steps {diff:.3g}, "
              f"param bytes/device {many['param_ratio']:.3f} of the total, state {many['state_ratio']:.3f}, "
              f"compilations by step {many['compiles']}")
        assert diff < 5e-5, (name, many["losses"], one["losses"])
        assert many["unsharded_params"] == [], (name, many["unsharded_params"])
        assert many["n_states"] > 0 and many["unsharded_states"] == 0, name
        assert many["compiles"][str(steps)] == many["compiles"]["2"], (name, many["compiles"])  # none after warm-up
    assert gpt8["losses"][-1] < gpt8["losses"][0]
    # Gradient checkpointing per block under fsdp: torch_xla's checkpoint adds an opt-barrier per recomputed block to
    # the step's HLO, over what the same GPT's step without it has (the 2x4 run: same model, same programs).
    print(f"opt-barriers in the compiled programs: gpt fsdp + checkpointing {gpt8['opt_barriers']}, "
          f"gpt 2x4 without {gpt2x4['opt_barriers']}")
    assert gpt8["opt_barriers"] > gpt2x4["opt_barriers"]
    # Each host's batch is its part of the global one (torch_xla's minibatch input sharding): what a pod needs.
    assert all(r["minibatch"] for r in (gpt8, gpt2x4, hf8, lora8))
    assert gpt8["mesh"] == [1, 8] and gpt2x4["mesh"] == [2, 4]
    for result in (gpt8, hf8, lora8):  # 1/8 each, plus the padding of the tiny tensors that 8 does not divide
        assert 0.12 <= result["param_ratio"] < 0.14 and 0.12 <= result["state_ratio"] < 0.14, result
    assert 0.24 <= gpt2x4["param_ratio"] < 0.27  # sharded 4 ways, replicated over the 2 data groups
    assert lora8["trainable"] and all("lora_" in n for n in lora8["trainable"])
    # The adapter of the FSDP-wrapped LoRA model has the same keys as the unwrapped one's, and only LoRA keys.
    assert lora8["adapter_keys"] == lora1["adapter_keys"] and len(lora8["adapter_keys"]) == 2 * 2 * 2
    assert all("lora_" in k and "_orig_module" not in k for k in lora8["adapter_keys"]), lora8["adapter_keys"]
    print(f"peft's get_peft_model_state_dict alone: {lora8['peft_alone_keys']} keys under fsdp, "
          f"{lora1['peft_alone_keys']} unwrapped")


@pytest.mark.xla
def test_a_checkpoint_saved_under_fsdp_on_8_resumes_under_data_on_1_and_fsdp_on_4(tmp_path):
    import shutil

    steps, shared = 5, tmp_path / "shared"
    full8, half8 = _train({"spmd": True, "runs": [
        {"model": "gpt", "sharding": "fsdp", "batch_size": 2, "steps": steps, "out_dir": str(tmp_path / "full")},
        {"model": "gpt", "sharding": "fsdp", "batch_size": 2, "steps": steps, "stop_at": 2, "out_dir": str(shared)},
    ]}, 8)
    shutil.copytree(shared, tmp_path / "on4")
    (data1,) = _train({"spmd": False, "runs": [
        {"model": "gpt", "sharding": "data", "batch_size": 16, "steps": steps, "out_dir": str(shared)}]}, 1)
    shutil.copytree(shared, tmp_path / "pt_to_fsdp")  # its newest checkpoint: step 5, whole (.pt), from data on 1
    fsdp4, pt_to_fsdp4 = _train({"spmd": True, "runs": [
        {"model": "gpt", "sharding": "fsdp", "batch_size": 4, "steps": steps, "out_dir": str(tmp_path / "on4")},
        {"model": "gpt", "sharding": "fsdp", "batch_size": 4, "steps": steps + 2,
         "out_dir": str(tmp_path / "pt_to_fsdp")}]}, 4)
    assert half8["steps"] == [1, 2]
    # Saved sharded: a DCP directory whose manifest lists every file, each tensor written as its 8 shards (no
    # gather onto the host), and no program compiled for the save (a gather compiled one per tensor).
    saved = shared / "checkpoints" / "ckpt-00000002.dcp"
    manifest = json.loads(saved.with_suffix(".json").read_text())
    assert saved.is_dir() and manifest["writer"] == "xla-spmd" and sorted(manifest["files"]) == sorted(
        p.name for p in saved.iterdir()), manifest
    from torch.distributed.checkpoint import FileSystemReader

    tensors = FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    weights = {k: v for k, v in tensors.items() if k.startswith("model.") and len(v.size) == 2}
    moments = {k: v for k, v in tensors.items() if k.endswith(".exp_avg") and len(v.size) == 2}
    assert weights and moments
    for name, item in {**weights, **moments}.items():
        assert len(item.chunks) == 8, (name, item.size, [c.sizes for c in item.chunks])
    print(f"compilations during the sharded save: {half8['compiles_end'] - half8['compiles']['2']}")
    assert half8["compiles_end"] == half8["compiles"]["2"], half8
    for name, resumed in (("data on 1", data1), ("fsdp on 4", fsdp4)):
        assert resumed["resumed_from"] == 2 and resumed["steps"] == list(range(1, steps + 1)), name
        diff = max(abs(a - b) for a, b in zip(resumed["losses"][2:], full8["losses"][2:], strict=True))
        print(f"resumed under {name}: max |loss - uninterrupted fsdp-8 loss| steps 3-{steps}: {diff:.3g}")
        assert diff < 5e-5, (name, resumed["losses"], full8["losses"])
    assert fsdp4["unsharded_params"] == [] and fsdp4["unsharded_states"] == 0  # re-sharded after the load
    # After a resume the first two steps compile (loaded state, then the step's own outputs), then none.
    assert fsdp4["compiles"][str(steps)] == fsdp4["compiles"]["4"], fsdp4["compiles"]
    # And the other way: a whole .pt written by a data-parallel run goes on under fsdp, sharded again after the load.
    assert pt_to_fsdp4["resumed_from"] == steps and pt_to_fsdp4["steps"][-2:] == [steps + 1, steps + 2]
    assert pt_to_fsdp4["unsharded_params"] == [] and pt_to_fsdp4["unsharded_states"] == 0
    assert all(abs(x) < 10 for x in pt_to_fsdp4["losses"][-2:]) and pt_to_fsdp4["losses"][-1] < data1["losses"][0]


@pytest.mark.xla
def test_replayed_optimizer_steps_over_a_mesh_match_lazy_ones_keep_their_shardings_and_resume(tmp_path):
    # A full fine-tune (every weight changes, the token embedding included): under replay_steps a mesh replays
    # AdamW's step and traces the forward lazily (XlaBackend.compile_step says why); both must give the lazy run's
    # losses, with the parameters and moments still sharded and nothing compiled after the warm-up.
    steps, runs = 5, []
    for sharding in ("data", "fsdp", "2x4"):
        for replay in (False, True):
            runs.append({"model": "hf", "sharding": sharding, "batch_size": 2, "steps": steps,
                         "replay_steps": replay, "out_dir": str(tmp_path / f"{sharding}-{replay}")})
    resumed_dir = str(tmp_path / "resumed")
    runs += [{"model": "hf", "sharding": "fsdp", "batch_size": 2, "steps": steps, "replay_steps": True,
              "stop_at": 2, "out_dir": resumed_dir},
             {"model": "hf", "sharding": "fsdp", "batch_size": 2, "steps": steps, "replay_steps": True,
              "out_dir": resumed_dir}]
    results = _train({"spmd": True, "runs": runs}, 8)
    for i, sharding in enumerate(("data", "fsdp", "2x4")):
        lazy, replayed = results[2 * i], results[2 * i + 1]
        diff = max(abs(a - b) for a, b in zip(lazy["losses"], replayed["losses"], strict=True))
        print(f"{sharding}: max |replayed - lazy loss| over {steps} steps {diff:.3g}, compilations by step "
              f"{replayed['compiles']} (lazy {lazy['compiles']})")
        assert diff < 1e-6, (sharding, lazy["losses"], replayed["losses"])
        assert replayed["steps_on_device"] and all(replayed["steps_on_device"]), sharding  # AdamW was replayed
        assert not any(lazy["steps_on_device"]), sharding
        assert replayed["unsharded_params"] == [] and replayed["unsharded_states"] == 0, sharding
        assert abs(replayed["param_ratio"] - lazy["param_ratio"]) < 1e-9, sharding
        assert replayed["compiles"][str(steps)] == replayed["compiles"]["2"], (sharding, replayed["compiles"])
    stopped, resumed, whole = results[6], results[7], results[3]
    assert stopped["steps"] == [1, 2] and resumed["resumed_from"] == 2, (stopped["steps"], resumed["resumed_from"])
    assert resumed["losses"][2:] == whole["losses"][2:], (resumed["losses"], whole["losses"])


def test_sharding_values_are_checked():
    assert check_sharding("fsdp") == "fsdp" and check_sharding(" Data ") == "data"
    assert check_sharding("2x4") == "2x4" and check_sharding((2, 4)) == "2x4"
    assert mesh_shape("data", 8) == (8, 1) and mesh_shape("fsdp", 8) == (1, 8) and mesh_shape("2x4", 8) == (2, 4)
    assert is_sharded("fsdp") and is_sharded("2x4") and not is_sharded("data") and not is_sharded("8x1")
    with pytest.raises(ShardingError, match=r"sharding='3x4' needs 3 x 4 = 12 chips but this run has 8.*2x4"):
        mesh_shape("3x4", 8)
    with pytest.raises(ShardingError, match=r"sharding='zero3' is not one of"):
        check_sharding("zero3")
    with pytest.raises(ShardingError, match=r"both mesh sizes must be >= 1"):
        check_sharding("0x8")
    with pytest.raises(ShardingError, match=r"needs 2 x 4 = 8 chips but this run has 1; .* \(e.g. 1x1\)"):
        mesh_shape("2x4", 1)
    with pytest.raises(ShardingError, match=r"sharding=\(True, 4\) must be one of"):
        check_sharding((True, 4))
    with pytest.raises(ConfigError, match=r"sharding='fdsp' is not one of \('data', 'fsdp', 'DxF \(e.g. 2x4\)'\)"):
        TrainConfig(sharding="fdsp")
    assert TrainConfig(sharding="2X4").sharding == "2x4"


def test_block_classes_are_the_models_own_layers():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tpu_helpers.models.gpt import GPT, Block, gpt_config

    assert block_classes(GPT(gpt_config("tiny", vocab_size=64, block_size=16))) == {Block}
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1))
    assert {c.__name__ for c in block_classes(hf)} == {"Qwen2DecoderLayer"}
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(hf, LoraConfig(r=2, target_modules=["q_proj"]))
    assert {c.__name__ for c in block_classes(lora)} == {"Qwen2DecoderLayer"}
    with pytest.raises(ShardingError, match=r"cannot find the repeated layer of Linear"):
        block_classes(torch.nn.Linear(4, 4))


def test_the_v5e8_plan_checks_the_sharding_and_states_the_memory():
    from tpu_helpers.launch import multichip

    plan = multichip.plan_multichip(TrainConfig(preset="small", seq_len=1024, sharding="fsdp"), global_batch=64,
                                    chips=8)
    advice = multichip.sharding_advice(plan)
    assert advice.startswith("SHARDING='fsdp': about ") and "fits data parallel on TPU v5e" in advice, advice
    with pytest.raises(ConfigError, match=r"SHARDING='3x4' needs 3 x 4 = 12 chips but this run has 8"):
        multichip.plan_multichip(TrainConfig(sharding="3x4"), global_batch=64, chips=8)
    with pytest.raises(ConfigError, match=r"SHARDING='fsdp' needs MODE='spmd'"):
        multichip.plan_multichip(TrainConfig(sharding="fsdp"), global_batch=64, chips=8, mode="spawn")


def test_fsdp_on_a_single_chip_keeps_the_models_own_gradient_checkpointing():
    # "fsdp" with one XLA device runs the model unwrapped (nothing to shard over), so no per-block wrapper
    # checkpoints it: the model must do it itself, or the memory saving silently disappears.
    from types import SimpleNamespace

    from tpu_helpers.backend.xla_fsdp import SpmdSharding

    on = SpmdSharding.checkpoints_blocks  # the XLA backend's answer, for a given device count
    assert not on(SimpleNamespace(device_count=1), "fsdp")
    assert on(SimpleNamespace(device_count=8), "fsdp") and on(SimpleNamespace(device_count=8), "2x4")
    assert not on(SimpleNamespace(device_count=8), "8x1") and not on(SimpleNamespace(device_count=8), "data")
    if XLA_BACKEND is not None:
        assert not XLA_BACKEND.checkpoints_blocks("fsdp")  # this process: one XLA:CPU device
    assert not get_backend("cpu").checkpoints_blocks("fsdp")  # FSDP2: the model's own
