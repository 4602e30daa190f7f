"""Turn a local folder or a Hugging Face Hub repo id into a local folder of checkpoint files.

Only safetensors, GGUF and JSON/text metadata are fetched: pickled weights are never downloaded or
loaded. ``HF_HUB_OFFLINE=1`` (or ``local_files_only=True``) reads the local cache only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import CheckpointError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
METADATA_PATTERNS = ["*.json", "*.jinja", "tokenizer*", "*.txt", "*.model"]


def is_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in {"1", "true", "yes", "on"}


def resolve_folder(path_or_repo_id: str | os.PathLike, *, gguf_file: str | None = None, revision: str | None = None,
                   cache_dir: str | None = None, token: str | bool | None = None,
                   local_files_only: bool = False, weights: bool = True) -> Path:
    """A local folder holding the checkpoint; downloads from the Hub (or reads its cache) if needed."""
    path = Path(os.fspath(path_or_repo_id)).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        hint = f"from_pretrained({str(path.parent)!r}, gguf_file={path.name!r})" if path.suffix == ".gguf" \
            else f"from_pretrained({str(path.parent)!r})"
        raise CheckpointError(f"{path} is a file; pass the folder that holds it: {hint}")
    name = os.fspath(path_or_repo_id)
    if not _REPO_ID.match(name):
        raise CheckpointError(f"{name!r} is neither a local folder nor a Hugging Face repo id ('owner/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    offline = local_files_only or is_offline()
    patterns = list(METADATA_PATTERNS)
    if weights:
        patterns += [gguf_file] if gguf_file else ["*.safetensors", "*.safetensors.index.json"]
    try:
        folder = snapshot_download(name, revision=revision, cache_dir=cache_dir, token=token,
                                   allow_patterns=patterns, local_files_only=offline)
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE=1 is set" if is_offline() else "offline mode was asked for or the Hub is unreachable"
        what = repr(name) if revision is None else f"{name!r} at revision {revision!r}"
        raise CheckpointError(
            f"{what} is not in the local Hugging Face cache and {why}. Download it once with network access "
            f"(`hf download {name}`) or pass a local folder.") from e
    except GatedRepoError as e:
        raise CheckpointError(f"{name!r} is gated: accept the model's license on its Hub page and pass "
                              "token=... (or log in with `hf auth login`)") from e
    except RevisionNotFoundError as e:
        raise CheckpointError(f"{name!r} has no revision {revision!r}") from e
    except RepositoryNotFoundError as e:
        raise CheckpointError(f"no Hugging Face repo {name!r} (or it is private: pass token=...)") from e
    return Path(folder)
