"""Turn what a user typed into an fsspec URL: a path, a URL, or a Hugging Face repo id.

A bare `org/name` or `org/name@revision` that is not a local folder is a Hugging Face model:
with `HF_HUB_OFFLINE=1` it must be in the local HF cache and resolves to its snapshot folder;
otherwise it becomes `hf://org/name@revision`, which fsspec reads by byte range.
"""

from __future__ import annotations

import os
import re
from urllib.parse import quote

from ram_dist.errors import RamDistError

HF_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


def resolve_location(location: str, label: str) -> str:
    """The fsspec URL for `location` (a folder, a URL, or a Hugging Face repo id)."""
    if "://" in location:
        return location.rstrip("/")
    if os.path.exists(location) or location.startswith((".", "/", "~")):
        return os.path.abspath(os.path.expanduser(location))
    match = HF_ID.match(location)
    if not match:
        return os.path.abspath(location)
    repo, revision = match["repo"], match["revision"]
    if _offline():
        return _cached_snapshot(repo, revision, label)
    url = f"hf://{repo}"
    return url + f"@{quote(revision, safe='')}" if revision else url


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _cached_snapshot(repo: str, revision: str | None, label: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
        rev = f"@{revision}" if revision else ""
        raise RamDistError(
            f"{label}: Hugging Face model {repo}{rev} is not in the local cache and "
            "HF_HUB_OFFLINE=1 forbids downloading it; download it first "
            f"(`hf download {repo}`) or unset HF_HUB_OFFLINE"
        ) from e


def resolve_output(location: str) -> str:
    """The output as a URL or an absolute local path (never a Hugging Face id)."""
    if "://" in location:
        return location.rstrip("/")
    return os.path.abspath(os.path.expanduser(location))
