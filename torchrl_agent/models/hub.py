"""Hub model names (``Qwen/Qwen2.5-1.5B-Instruct``) resolved from the local Hugging Face cache, offline.

A name is looked up as ``huggingface_hub`` stores it: ``<hub cache>/models--<org>--<name>/`` with
``refs/main`` naming a folder of ``snapshots/``. The hub cache is ``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub`` (read when called, so a changed environment is
seen). Nothing is downloaded: a name that is not in the cache fails with the path searched and the
command that fills it. Both engines load the folder this returns (transformers through
:func:`~torchrl_agent.models.load_model`, vLLM through :class:`~torchrl_agent.modules.VLLMPolicy`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["hub_cache_dir", "is_hub_name", "resolve_model_path"]

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache folder (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def is_hub_name(value: str) -> bool:
    """``org/name`` that is not an existing local path."""
    return bool(_HUB_NAME.match(value)) and not Path(value).exists()


def resolve_model_path(value: str | os.PathLike) -> Path:
    """A local model folder as given, or a hub name's snapshot folder in the local cache.

    Raises:
        FileNotFoundError: a path that does not exist, or a hub name that is not cached (the message
            names the cache folder searched and how to fill it).
    """
    text = str(value)
    if not is_hub_name(text):
        path = Path(text).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model.path={text}: no such folder")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    entry = cache / ("models--" + text.replace("/", "--"))
    try:
        folder = Path(snapshot_download(repo_id=text, cache_dir=str(cache), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError) as err:
        raise FileNotFoundError(
            f"model.path={text}: not in the local Hugging Face cache (searched {entry}, offline). Fill it "
            f"on a machine with network: `hf download {text} --cache-dir {cache}` (or set HF_HOME / "
            f"HF_HUB_CACHE to a cache that holds it), or set model.path to a local model folder"
        ) from err
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model.path={text}: the cached snapshot {folder} has no config.json "
                                f"(an incomplete download?); fill it again with `hf download {text}`")
    return folder
