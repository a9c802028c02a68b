"""MODEL (and TEACHER) are checked when the config is built, before anything loads or downloads: a misspelt offline
name gets the nearest one, a hub name is "org/name" (a name without "/" only from the Hugging Face cache), a local
path must be a folder with a config.json, and under HF_HUB_OFFLINE a hub name must be in the cache. No network: the
Hugging Face cache here is a temporary folder in the layout huggingface_hub reads."""

from __future__ import annotations

import pytest

from tpu_helpers.config import ConfigError, config_from_parameters
from tpu_helpers.core.choices import misspelt, nearest
from tpu_helpers.models import hf
from tpu_helpers.recipes.finetune import FinetuneConfig
from tpu_helpers.recipes.grpo import GRPOConfig

OFFLINE = r"The offline models are 'tiny' and 'smollm2-135m' \(built locally, no network\)"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache; `add(name)` puts a model's config.json in it as a download would."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)

    def add(name: str) -> None:
        repo = cache / f"models--{name.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("abc123")
        (repo / "snapshots" / "abc123").mkdir(parents=True)
        (repo / "snapshots" / "abc123" / "config.json").write_text("{}")

    return add


def test_a_misspelt_offline_name_fails_at_config_time_naming_the_offline_models(hub_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("TPU_HELPERS_CACHE", str(tmp_path / "built"))
    with pytest.raises(ConfigError, match=r"^MODEL='smollm2-135' is no local folder, no offline model and no hub name "
                                          rf"\(did you mean 'smollm2-135m'\?\)\. {OFFLINE}.*needs the internet"):
        config_from_parameters({"MODEL": "smollm2-135"}, base=FinetuneConfig())
    with pytest.raises(ConfigError, match=r"^MODEL='Tiny' .*\(did you mean 'tiny'\?\)"):
        GRPOConfig(model="Tiny")
    with pytest.raises(ConfigError, match=r"^TEACHER='smollm-135m' .*\(did you mean 'smollm2-135m'\?\)"):
        FinetuneConfig(method="distill", teacher="smollm-135m")
    assert not (tmp_path / "built").exists()  # nothing was built (or loaded)


def test_a_hub_name_is_org_slash_name_and_one_without_is_taken_from_the_cache_only(hub_cache):
    assert FinetuneConfig(model="Qwen/Qwen2.5-0.5B-Instruct").model == "Qwen/Qwen2.5-0.5B-Instruct"  # online: later
    with pytest.raises(ConfigError, match=r"^MODEL='gpt2' .*no hub name\. .*A name without '/' counts as a hub name "
                                          r"only when that cache holds it \(on the hub, 'gpt2' is "
                                          r"'openai-community/gpt2'\)"):
        hf.check_model_name("gpt2")
    hub_cache("gpt2")
    hf.check_model_name("gpt2")
    with pytest.raises(ConfigError, match=r"^MODEL='runs/x/merged' is no local folder \(nothing exists at that "
                                          r"path\) and no hub name"):
        hf.check_model_name("runs/x/merged")


def test_under_hf_hub_offline_a_hub_name_must_be_in_the_cache(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"^MODEL='Qwen/Qwen2.5-0.5B-Instruct' is a hub name the Hugging Face cache "
                                          r"does not hold, and HF_HUB_OFFLINE .* is set: it cannot load"):
        hf.check_model_name("Qwen/Qwen2.5-0.5B-Instruct")
    hub_cache("Qwen/Qwen2.5-0.5B-Instruct")
    hf.check_model_name("Qwen/Qwen2.5-0.5B-Instruct")


def test_local_paths_must_be_folders_with_a_config(hub_cache, tmp_path):
    with pytest.raises(ConfigError, match=r"^MODEL='\./no-such-folder' is a local path that does not exist\."):
        hf.check_model_name("./no-such-folder")
    with pytest.raises(ConfigError, match=r"is a local path without a config\.json\."):
        hf.check_model_name(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    hf.check_model_name(str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^MODEL='' names no model\. {OFFLINE}"):
        hf.check_model_name("")


def test_the_nearest_name_ignores_case_and_stays_quiet_when_nothing_is_close():
    assert nearest("STPES", ["STEPS", "SEQ_LEN"]) == "STEPS" and nearest("smollm2-135", hf.OFFLINE_MODELS) == "smollm2-135m"
    assert nearest("qwen", hf.OFFLINE_MODELS) is None and nearest(3, ["3"]) is None
    assert misspelt(["STPES", "WHATEVER"], ["STEPS", "LR"]) == " Did you mean STEPS (not STPES)?"
    assert misspelt(["WHATEVER"], ["STEPS"]) == ""
