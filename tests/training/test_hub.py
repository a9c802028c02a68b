"""PUSH_TO_HUB (recipes/hub.py): the exports uploaded with a model card through huggingface_hub's API, whose network
calls are replaced here (no hub is reachable): what is uploaded, the card, a missing token's and a refused upload's
errors, and the local export left as it was."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import HfHubHTTPError

from tests.support import NOTEBOOKS
from tpu_helpers.config import ConfigError, config_from_parameters
from tpu_helpers.recipes import hub
from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

REPO = "me/smollm2-grpo"
BEFORE = {"reward": 0.05, "completion_tokens": 7.9, "rows": [], "compilations": 0}
AFTER = {"reward": 0.89, "completion_tokens": 6.1, "rows": [], "compilations": 0}


def _export(out: Path, merged: bool = True) -> dict[str, str]:
    """An export as `job.export()` leaves it: adapter/ and merged/ with their files (contents are stand-ins)."""
    files = {"adapter/adapter_config.json": b"{}", "adapter/adapter_model.safetensors": b"A" * 64,
             "adapter/tokenizer.json": b"{}", "finetune.json": b"{}"}
    if merged:
        files.update({"merged/config.json": b"{}", "merged/model.safetensors": b"M" * 128,
                      "merged/tokenizer.json": b"{}"})
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    return {k: str(out / k) for k in ("adapter", "merged") if merged or k == "adapter"}


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


class FakeHub:
    """Stands in for the hub's side of HfApi.create_repo and upload_folder: records the calls and what the
    uploaded folder held (read through its links while the call runs); `refuse` raises the hub's HTTP error."""

    def __init__(self, monkeypatch, refuse: bool = False) -> None:
        self.calls: list[tuple] = []
        self.uploaded: dict[str, bytes] = {}
        self.refuse = refuse
        # Functions on the class, so each call gets the HfApi instance as the real methods do.
        monkeypatch.setattr(HfApi, "create_repo", lambda api, *args, **kwargs: self.create_repo(api, *args, **kwargs))
        monkeypatch.setattr(HfApi, "upload_folder", lambda api, **kwargs: self.upload_folder(api, **kwargs))

    def create_repo(self, api, repo_id, **kwargs):
        assert isinstance(api, HfApi)
        self.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, api, **kwargs):
        self.calls.append(("upload_folder", kwargs["repo_id"], kwargs))
        if self.refuse:
            response = SimpleNamespace(headers={}, request=None, status_code=403)
            raise HfHubHTTPError("403 Forbidden: You don't have the rights to create a model under the namespace "
                                 "'me'.", response=response)
        root = Path(kwargs["folder_path"])
        self.uploaded = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        return SimpleNamespace(commit_url="https://huggingface.co/me/smollm2-grpo/commit/0")


@pytest.fixture
def job(tmp_path):
    return GRPO(GRPOConfig(model="tiny", start_from=None, steps=8, lr=1e-3, device="cpu", push_to_hub=REPO,
                           out_dir=str(tmp_path / "out")))


def test_push_to_hub_is_a_repo_id_checked_at_config_time():
    for good in (None, REPO, "Org-1/model.v2_x"):
        hub.check_repo_id(good)
    for bad in ("smollm2-grpo", "me/", "/x", "me/a/b", "me/x--y", "me/x..y", "me/-x", 3):
        with pytest.raises(ConfigError, match=r"push_to_hub=.* is not a hub repo id: give \"owner/name\""):
            hub.check_repo_id(bad)
    with pytest.raises(ConfigError, match=r"push_to_hub='smollm2' is not a hub repo id"):
        GRPOConfig(model="tiny", push_to_hub="smollm2")
    # The notebooks' parameter, None by default: a config field of every Hugging Face recipe.
    assert config_from_parameters({"PUSH_TO_HUB": REPO}, base=GRPOConfig()).push_to_hub == REPO
    for name in ("finetune_llm", "grpo_llm", "preference_llm"):
        nb = nbformat.read(NOTEBOOKS[name], as_version=4)
        params = next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", []))
        assert "\nPUSH_TO_HUB = None  " in params, name
        export = next(c.source for c in nb.cells if "paths = job.export()" in c.source)
        assert export.endswith("if PUSH_TO_HUB:  # the adapter and merged model with a model card (base model, job, "
                               "settings, held-out figures)\n    from tpu_helpers.recipes import hub\n    "
                               "print('uploaded to', hub.push_export(job, paths, before=before, after=after))"), name


def test_the_exports_and_a_model_card_are_uploaded_in_one_commit(job, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    fake = FakeHub(monkeypatch)
    paths = _export(tmp_path / "out")
    export = _tree(tmp_path / "out")
    url = hub.push_export(job, paths, before=BEFORE, after=AFTER)
    assert url == f"https://huggingface.co/{REPO}"
    assert [c[:2] for c in fake.calls] == [("create_repo", REPO), ("upload_folder", REPO)]
    assert fake.calls[0][2]["exist_ok"] is True and fake.calls[0][2]["token"] == "hf_test_token"
    assert fake.calls[1][2]["token"] == "hf_test_token"
    # The merged model at the root (from_pretrained(repo) loads it), the adapter under adapter/, the card.
    assert sorted(fake.uploaded) == ["README.md", "adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                                     "adapter/tokenizer.json", "config.json", "model.safetensors", "tokenizer.json"]
    assert fake.uploaded["model.safetensors"] == b"M" * 128
    assert fake.uploaded["adapter/adapter_model.safetensors"] == b"A" * 64
    card = fake.uploaded["README.md"].decode()
    meta = ModelCard(card).data.to_dict()  # the front matter the hub validates
    assert meta["library_name"] == "transformers" and meta["tags"] == ["tpu_helpers", "grpo", "lora"]
    assert "base_model" not in meta  # "tiny" is no hub model
    assert "the GRPO job, METHOD `lora`, from the base model `tiny`" in card
    assert "| reward | 0.05 | 0.89 |" in card and "| completion tokens | 7.9 | 6.1 |" in card
    assert "compilations" not in card
    assert '"lr": 0.001' in card and f'"push_to_hub": "{REPO}"' in card and '"steps": 8' in card
    assert 'PeftModel.from_pretrained(base_model, repo_id, subfolder="adapter")' in card
    # The export is as it was; the card is written next to it too (for an upload by hand).
    assert _tree(tmp_path / "out") == {**export, hub.LOCAL_CARD: hashlib.sha256(card.encode()).hexdigest()}


def test_the_gguf_file_goes_to_the_root_beside_the_merged_model(job, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    fake = FakeHub(monkeypatch)
    paths = _export(tmp_path / "out")
    (tmp_path / "out" / "model-q8_0.gguf").write_bytes(b"GGUF" * 8)
    hub.push_export(job, {**paths, "gguf": str(tmp_path / "out" / "model-q8_0.gguf")}, before=BEFORE, after=AFTER)
    assert fake.uploaded["model-q8_0.gguf"] == b"GGUF" * 8 and "model.safetensors" in fake.uploaded
    assert "- `model-q8_0.gguf`, the merged model for llama.cpp, Ollama and LM Studio" in \
        fake.uploaded["README.md"].decode()


def test_an_adapter_alone_goes_to_the_root_and_a_hub_base_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    fake = FakeHub(monkeypatch)
    job = SimpleNamespace(config=GRPOConfig(model="tiny", start_from=None, push_to_hub=REPO), source="tiny")
    job.config.model = "Qwen/Qwen2.5-0.5B-Instruct"  # as a hub run has it (nothing loaded here)
    hub.push_export(job, _export(tmp_path / "out", merged=False), before=BEFORE, after=AFTER)
    assert sorted(fake.uploaded) == ["README.md", "adapter_config.json", "adapter_model.safetensors", "tokenizer.json"]
    meta = ModelCard(fake.uploaded["README.md"].decode()).data.to_dict()
    assert meta["library_name"] == "peft" and meta["base_model"] == "Qwen/Qwen2.5-0.5B-Instruct"


def test_no_token_is_a_clear_error_and_nothing_is_uploaded(job, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # no stored login either
    fake = FakeHub(monkeypatch)
    paths = _export(tmp_path / "out")
    export = _tree(tmp_path / "out")
    with pytest.raises(hub.HubError, match=r"^PUSH_TO_HUB='me/smollm2-grpo': no Hugging Face token found\. To "
                       r"upload, set the HF_TOKEN environment variable .*run `hf auth login`, or on Colab add the "
                       r"secret HF_TOKEN .*then run this cell again\. The export is kept in .*out \(model card: "):
        hub.push_export(job, paths, before=BEFORE, after=AFTER)
    assert fake.calls == []
    assert {k: v for k, v in _tree(tmp_path / "out").items() if k != hub.LOCAL_CARD} == export


def test_a_refused_upload_is_a_clear_error_and_the_export_stays(job, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_read_only")
    fake = FakeHub(monkeypatch, refuse=True)
    paths = _export(tmp_path / "out")
    export = _tree(tmp_path / "out")
    with pytest.raises(hub.HubError, match=r"^PUSH_TO_HUB='me/smollm2-grpo': the hub refused the upload \(403 "
                       r"Forbidden: .*\)\. Check that the token has write access and that 'me' is your user name or "
                       r"an organisation you may write to\. The export is kept in .*; upload it later with: hf upload "
                       r"me/smollm2-grpo .*merged \. \(and model_card\.md as README\.md\)$") as err:
        hub.push_export(job, paths, before=BEFORE, after=AFTER)
    assert isinstance(err.value.__cause__, HfHubHTTPError) and [c[0] for c in fake.calls] == ["create_repo",
                                                                                             "upload_folder"]
    assert {k: v for k, v in _tree(tmp_path / "out").items() if k != hub.LOCAL_CARD} == export
    assert not any(p.is_symlink() for p in (tmp_path / "out").rglob("*"))
