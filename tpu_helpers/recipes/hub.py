"""Share what a job trained on the Hugging Face Hub: PUSH_TO_HUB, a repo id, uploads the exports with a model card.

    paths = job.export()                                  # adapter/ (LoRA) and merged/, whatever EXPORT wrote
    print(hub.push_export(job, paths, before=before, after=after))   # PUSH_TO_HUB="me/smollm2-grpo"

One commit to the repo (created when absent): the merged model at the repo's root (`from_pretrained("me/x")`
loads it) and the adapter under `adapter/` (`PeftModel.from_pretrained(base, "me/x", subfolder="adapter")`), or the
adapter at the root when nothing merged was exported; EXPORT_GGUF's file at the root too (llama.cpp, Ollama and LM
Studio fetch a GGUF from a hub repo); and README.md, the model card: the base model, the job, its
settings and the held-out figures before and after training. The upload reads the export through links in a
temporary folder, so the export is never touched; the card is also written next to it (`model_card.md`), for an
upload by hand when the hub refuses.

The token comes from where huggingface_hub looks (HF_TOKEN, the login `hf auth login` stored, Colab's secret
HF_TOKEN), never from a notebook parameter. No token, or a refused upload, is a `HubError` naming the repo id and
what to do.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tpu_helpers.config import ConfigError
from tpu_helpers.core.atomic_io import atomic_write_text

# owner/name as the hub spells them: letters, digits, "-", "_" and "."; no "--" or "..", nor at either end.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
REPO_ID = re.compile(rf"^{_PART}/{_PART}$")
CARD = "README.md"
LOCAL_CARD = "model_card.md"  # the card, next to the export
TOKEN_HELP = ("set the HF_TOKEN environment variable to a token with write access (huggingface.co/settings/tokens), "
              "run `hf auth login`, or on Colab add the secret HF_TOKEN (the key icon) and give this notebook access")


class HubError(RuntimeError):
    """An upload that could not be made; the message names the repo id and what to do."""


def check_repo_id(repo_id: str | None) -> None:
    """ConfigError unless `repo_id` is None or a hub repo id "owner/name" (config time: before anything trains)."""
    if repo_id is None:
        return
    if not isinstance(repo_id, str) or not REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id:
        raise ConfigError(f"push_to_hub={repo_id!r} is not a hub repo id: give \"owner/name\" (your user or "
                          "organisation, a slash, the new model's name, e.g. \"me/smollm2-grpo\"), or None")


def hub_token() -> str | None:
    """The Hugging Face token from the usual places: HF_TOKEN, huggingface_hub's stored login, Colab's secrets."""
    from huggingface_hub import get_token

    token = get_token()
    if token:
        return token
    try:  # older huggingface_hub releases do not read Colab's secrets themselves
        from google.colab import userdata  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        return userdata.get("HF_TOKEN") or None
    except Exception:  # no such secret, or access to it not granted
        return None


def _figures(before: Mapping | None, after: Mapping | None) -> dict[str, tuple[float | None, float | None]]:
    """The held-out figures both sample sets report as numbers (reward, exact match, ...): name -> (before, after)."""
    def numbers(d: Mapping | None) -> dict[str, float]:
        return {k: v for k, v in (d or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                and k != "compilations"}

    was, now = numbers(before), numbers(after)
    return {k: (was.get(k), now.get(k)) for k in [*was, *(k for k in now if k not in was)]}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def model_card(job: Any, paths: Mapping[str, str], *, before: Mapping | None = None,
               after: Mapping | None = None) -> str:
    """The model card (README.md) of an upload: metadata, the base model, the job, its settings and the held-out
    figures before and after training."""
    cfg = job.config
    settings = cfg.to_dict()
    base = str(cfg.model)
    hub_base = bool(REPO_ID.match(base)) and not Path(base).expanduser().exists()
    kind = type(job).__name__
    adapter_only = "adapter" in paths and "merged" not in paths
    meta = ["---", "library_name: " + ("peft" if adapter_only else "transformers"),
            *([f"base_model: {base}"] if hub_base else []),
            "tags:", "- tpu_helpers", f"- {kind.lower()}", f"- {cfg.method}", "---"]
    start = getattr(job, "source", None)
    lines = [*meta, "", f"# {cfg.push_to_hub or 'model'}", "",
             f"Trained with [tpu_helpers](https://github.com/OWNER/tpu_helpers): the {kind} job, METHOD "
             f"`{cfg.method}`, from the base model `{base}`"
             + (f" (started from `{start}`)" if start and str(start) != base and kind == "GRPO" else "") + ".", ""]
    figures = _figures(before, after)
    if figures:
        lines += ["## Held-out figures", "", "| metric | before | after |", "|---|---|---|"]
        lines += [f"| {k.replace('_', ' ')} | {_fmt(was)} | {_fmt(now)} |" for k, (was, now) in figures.items()]
        lines.append("")
    lines += ["## Files", ""]
    if "merged" in paths:
        lines.append("- the merged model at the root: `AutoModelForCausalLM.from_pretrained(repo_id)`")
    if "adapter" in paths:
        where = "the root" if adapter_only else "`adapter/`"
        sub = "" if adapter_only else ', subfolder="adapter"'
        lines.append(f"- the PEFT adapter in {where}: `PeftModel.from_pretrained(base_model, repo_id{sub})`")
    if "gguf" in paths:
        lines.append(f"- `{Path(paths['gguf']).name}`, the merged model for llama.cpp, Ollama and LM Studio")
    lines += ["", "## Settings", "", "```json", json.dumps(settings, indent=1, sort_keys=True, default=str), "```", ""]
    return "\n".join(lines)


def _link_tree(source: Path, target: Path) -> None:
    """`target` mirrors `source`'s files as symbolic links (folders made, files never copied nor changed)."""
    for path in sorted(source.rglob("*")):
        if path.is_file():
            link = target / path.relative_to(source)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path.resolve())


def push_export(job: Any, paths: Mapping[str, str], *, before: Mapping | None = None, after: Mapping | None = None,
                repo_id: str | None = None, api: Any = None) -> str:
    """Upload the exports `paths` (`job.export()`'s) to `repo_id` (default PUSH_TO_HUB) with a model card, in one
    commit; returns the repo's URL. HubError for no token or a refused upload; the export is left as it was."""
    repo_id = repo_id or job.config.push_to_hub
    check_repo_id(repo_id)
    if not repo_id:
        raise HubError("push_export needs a repo id: set PUSH_TO_HUB (e.g. \"me/smollm2-grpo\") or pass repo_id")
    folders = {k: Path(paths[k]) for k in ("merged", "adapter") if k in paths}
    if not folders:
        raise HubError(f"PUSH_TO_HUB={repo_id!r}: nothing to upload (the export wrote {sorted(paths)}; expected "
                       "merged/ or adapter/)")
    out = next(iter(folders.values())).parent
    card = model_card(job, paths, before=before, after=after)
    atomic_write_text(out / LOCAL_CARD, card)
    token = hub_token()
    if not token:
        raise HubError(f"PUSH_TO_HUB={repo_id!r}: no Hugging Face token found. To upload, {TOKEN_HELP}; then run "
                       f"this cell again. The export is kept in {out} (model card: {out / LOCAL_CARD}).")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = api or HfApi()
    with tempfile.TemporaryDirectory(prefix="tpu_helpers-hub-") as tmp:
        stage = Path(tmp)
        root = folders.get("merged", folders.get("adapter"))
        _link_tree(root, stage)
        if "merged" in folders and "adapter" in folders:
            _link_tree(folders["adapter"], stage / "adapter")
        if "gguf" in paths:
            (stage / Path(paths["gguf"]).name).symlink_to(Path(paths["gguf"]).resolve())
        (stage / CARD).write_text(card)
        try:
            url = api.create_repo(repo_id, token=token, exist_ok=True)
            api.upload_folder(repo_id=repo_id, folder_path=str(stage), token=token,
                              commit_message=f"{type(job).__name__} ({job.config.method}) from tpu_helpers")
        except HfHubHTTPError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise HubError(f"PUSH_TO_HUB={repo_id!r}: the hub refused the upload ({first}). Check that the token "
                           f"has write access and that {repo_id.split('/')[0]!r} is your user name or an organisation "
                           f"you may write to. The export is kept in {out}; upload it later with: hf upload "
                           f"{repo_id} {root} . (and {LOCAL_CARD} as README.md)") from err
    return str(url)
