"""Find a model: a local directory, or a Hugging Face repo resolved through the local cache."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from . import DEFAULT_REPO  # defined by the package, for a quick start-up
from .errors import ModelNotFoundError
from .fileio import one_line, usable_path

KNOWN_OWNERS = ("mistralai", "mlx-community")  # their repos' layouts follow from the owner

# Only what inference reads; the Mistral repo also carries README and license files.
MISTRAL_PATTERNS = ["params.json", "tekken.json", "consolidated.safetensors", "voice_embedding/*"]
MLX_PATTERNS = [
    "config.json",
    "params.json",
    "tekken.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "voice_embedding/*",
]

# The Hub's rules: segments of [A-Za-z0-9_.-], not starting or ending with '-' or '.',
# no '--' or '..', names of at most 96 characters, no '.git' suffix.
_SEGMENT = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^{_SEGMENT}/{_SEGMENT}$")


# Files that tell the layouts apart, looked up in the local cache when the Hub cannot be asked.
_LAYOUT_FILES = (
    "config.json",
    "model.safetensors.index.json",
    "model.safetensors",
    "consolidated.safetensors",
)


def layout_patterns(files: Iterable[str]) -> list[str] | None:
    """The files to fetch from a repo holding ``files``: an MLX conversion (``config.json``
    and ``model*.safetensors``, even beside a copied ``consolidated.safetensors``; or, with
    no ``model*`` file, weight files of other names such as ``weights.safetensors``, as
    mlx-audio reads them) or Mistral's layout; None when it holds neither."""
    names = set(files)
    if "config.json" in names:
        if any(fnmatch.fnmatchcase(n, "model*.safetensors") for n in names):
            return list(MLX_PATTERNS)
        others = sorted(
            n
            for n in names
            if n.endswith(".safetensors")
            and "/" not in n
            and not n.startswith(".")
            and n != "consolidated.safetensors"
        )
        if others:
            return [*MLX_PATTERNS, *others]
    if "consolidated.safetensors" in names:
        return list(MISTRAL_PATTERNS)
    return None


def allow_patterns(repo_id: str, files: Iterable[str] | None = None) -> list[str]:
    """The files to fetch for a repo: by what it holds when its listing ``files`` is known,
    else by its owner and name (mlx-community, or "mlx" in the name, for a conversion)."""
    if files is not None:
        found = layout_patterns(files)
        if found is not None:
            return found
    owner, name = repo_id.split("/", 1)
    if owner.lower() == "mlx-community" or "mlx" in name.lower():
        return list(MLX_PATTERNS)
    return list(MISTRAL_PATTERNS)


# Exception classes (by name, across huggingface_hub's HTTP clients: requests, httpx, httpx2)
# that mean the Hub could not be reached at all, as opposed to an HTTP error it answered.
_UNREACHABLE = frozenset(
    {"ConnectionError", "ConnectError", "ConnectTimeout", "Timeout", "TransportError"}
)


def _unreachable(e: Exception) -> bool:
    return any(cls.__name__ in _UNREACHABLE for cls in type(e).__mro__)


def _repo_files(repo_id: str) -> tuple[list[str] | None, bool]:
    """What a repo holds, for choosing its layout (None when its owner's layout is known or
    neither the local cache nor the Hub can say), and whether the Hub is reachable.

    Mistral's and mlx-community's repos are known by their owner (no extra Hub call on every
    load); any other repo is looked up in the cache, then listed on the Hub. A repo that does
    not exist or is gated raises here, as the download would.
    """
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    if repo_id.split("/", 1)[0].lower() in KNOWN_OWNERS:
        return None, True
    found = {name: huggingface_hub.try_to_load_from_cache(repo_id, name) for name in _LAYOUT_FILES}
    cached = [name for name, path in found.items() if isinstance(path, str)]
    if "config.json" in cached:  # its snapshot folder lists the rest (sharded weights)
        with contextlib.suppress(OSError):
            folder = Path(found["config.json"]).parent
            cached = sorted({*cached, *(p.name for p in folder.iterdir() if p.is_file())})
    if layout_patterns(cached) is not None:
        return cached, True
    try:
        return _list_files(repo_id), True
    except RepositoryNotFoundError:  # gated repos too (a subclass)
        raise
    except Exception as e:  # offline, no network, Hub down: the download reports it
        return None, not _unreachable(e)


def _list_files(repo_id: str) -> list[str]:
    """The repo's file names, in one Hub request: ``list_repo_files`` retries a refused
    connection for some 25 s, logging each retry, before a mistyped repo id offline could
    be reported."""
    import huggingface_hub

    info = huggingface_hub.model_info(repo_id)
    return [s.rfilename for s in info.siblings or []]


def looks_like_repo_id(spec: str) -> bool:
    if not _REPO_ID.match(spec) or ".." in spec or "--" in spec or spec.endswith(".git"):
        return False
    # "models/tiny" with an existing local "models/" (or a link by that name, even a broken
    # one) is a path typo, not a repo.
    owner = spec.split("/", 1)[0]
    if owner.lower() in KNOWN_OWNERS:  # a folder ./mistralai must not hide Mistral's repo
        return True
    first = Path(owner).expanduser()
    return not (first.is_dir() or first.is_symlink())


def _broken_link(path: Path) -> Path | None:
    """The first of ``path`` and its parents that is a link leading nowhere (or in a loop)."""
    for p in (path, *path.parents):
        if p.is_symlink() and not p.exists():
            return p
    return None


def resolve_model_dir(path_or_repo: str | os.PathLike[str] | None = None) -> Path:
    """Return a local directory holding the model, downloading it from the Hub if needed.

    Existing paths are used as they are. Strings shaped like ``owner/name`` are Hub repos,
    fetched with ``snapshot_download`` (honouring ``HF_HUB_OFFLINE``, ``HF_HOME`` and the
    local cache). Anything else that does not exist is an error, never a Hub lookup.
    """
    if path_or_repo is not None and not isinstance(path_or_repo, (str, os.PathLike)):
        raise ModelNotFoundError(
            f"the model must be a directory path or a Hugging Face repo id (a string), got "
            f"{type(path_or_repo).__name__}"
        )
    spec = DEFAULT_REPO if path_or_repo is None else os.fspath(path_or_repo)
    if isinstance(spec, bytes):
        spec = os.fsdecode(spec)
    if isinstance(spec, str) and not spec.strip():  # Path("") would be the current directory
        raise ModelNotFoundError(
            f"the model is an empty name; pass a directory or a Hugging Face repo id such as "
            f"{DEFAULT_REPO}"
        )
    path = usable_path(spec, "model directory", ModelNotFoundError)
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(
                f"{spec} is a file; pass the model directory that holds params.json"
            )
        try:  # else every file in it would look missing ("has no params.json")
            os.scandir(path).close()
            os.lstat(path / "params.json")
        except FileNotFoundError:
            pass
        except OSError as e:
            shown = one_line(spec, 100)
            raise ModelNotFoundError(
                f"cannot read model directory {shown}: {one_line(e.strerror or str(e))}; give "
                f"yourself read access to it (chmod u+rx {shown})"
            ) from None
        return path.resolve()
    link = _broken_link(path)
    if link is not None:
        raise ModelNotFoundError(
            f"model directory {spec} cannot be reached: {link} is a symbolic link to nothing "
            "(its target is missing, or links loop); fix the link or pass an existing directory"
        )
    if isinstance(path_or_repo, Path) or not looks_like_repo_id(spec):
        raise ModelNotFoundError(
            f"model directory {spec} does not exist: pass an existing directory or a Hugging "
            f"Face repo id such as {DEFAULT_REPO}"
        )
    return _download(spec)


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError:  # pragma: no cover - a declared dependency
        raise ModelNotFoundError(
            f"cannot fetch {repo_id}: huggingface_hub is not installed "
            "(pip install huggingface_hub)"
        ) from None
    quiet = {"tqdm_class": _silent_tqdm()}  # no "Fetching N files" bar on every load
    try:
        files, reachable = _repo_files(repo_id)
        patterns = allow_patterns(repo_id, files)
        if not reachable:  # the listing has waited through its retries: only the cache is left
            return Path(
                snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True, **quiet)
            )
        try:
            return Path(snapshot_download(repo_id, allow_patterns=patterns, **quiet))
        except (HFValidationError, GatedRepoError, RepositoryNotFoundError):
            raise
        except Exception as e:  # a captive portal's HTML, a proxy's 407, a dropped link...
            if _status(e) in (401, 403):
                raise
            try:  # ...a complete copy in the cache still serves
                return Path(
                    snapshot_download(
                        repo_id, allow_patterns=patterns, local_files_only=True, **quiet
                    )
                )
            except LocalEntryNotFoundError:
                raise e from None
    except HFValidationError:
        raise ModelNotFoundError(
            f"{repo_id} is neither an existing directory nor a valid Hugging Face repo id"
        ) from None
    except GatedRepoError:
        raise ModelNotFoundError(
            f"{repo_id} is gated: accept its license on https://huggingface.co/{repo_id} and "
            "log in with `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"Hugging Face repo {repo_id} not found (or private): check the name, or pass a "
            "local directory"
        ) from None
    except LocalEntryNotFoundError as e:
        if _status(e) in (401, 403):
            raise _auth_error(repo_id, _status(e)) from None
        if type(e).__name__ == "IncompleteSnapshotError":
            raise ModelNotFoundError(
                f"the copy of {repo_id} in the local Hugging Face cache is incomplete (an "
                f"interrupted download: {_first_line(e)}): connect and run again to finish it "
                "(with HF_HUB_OFFLINE unset), or pass a local directory"
            ) from None
        raise ModelNotFoundError(
            f"{repo_id} is not in the local Hugging Face cache and downloading is off or "
            "impossible (HF_HUB_OFFLINE set or no network): connect and unset HF_HUB_OFFLINE, "
            "or pass a local directory"
        ) from None
    except Exception as e:
        status = _status(e)
        if status in (401, 403):
            raise _auth_error(repo_id, status) from None
        if isinstance(e, OSError):
            raise ModelNotFoundError(
                f"could not download {repo_id}: {_first_line(e)}; check the connection and "
                "free disk space, or pass a local directory"
            ) from None
        raise ModelNotFoundError(
            f"could not download {repo_id} ({type(e).__name__}: {_first_line(e)}): check the "
            "network (a proxy or a sign-in page in the way?), or set HF_HUB_OFFLINE=1 to use "
            "a complete copy in the cache, or pass a local directory"
        ) from None


def _status(e: BaseException | None) -> int | None:
    """The HTTP status of a Hub error, or of the error that caused it (huggingface_hub turns
    a failed listing into "not in the cache"), if one carries a response."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int):
            return status
        e = e.__cause__ or e.__context__
    return None


def _auth_error(repo_id: str, status: int | None) -> ModelNotFoundError:
    if status == 401:
        return ModelNotFoundError(
            f"the Hugging Face Hub refused your login for {repo_id} (401: the token is invalid "
            "or expired): log in again with `hf auth login`"
        )
    return ModelNotFoundError(
        f"access to {repo_id} was refused (403): accept its license on "
        f"https://huggingface.co/{repo_id} and log in with a token that can read it "
        "(`hf auth login`), or check that no proxy or firewall blocks huggingface.co"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return one_line(text.splitlines()[0] if text else repr(e), 200)


def _silent_tqdm() -> type:
    """huggingface_hub's tqdm without its "Fetching N files" bar, which showed on every load
    even with nothing to download; the bars of bytes actually downloaded still show."""
    from huggingface_hub.utils import tqdm

    class Quiet(tqdm):
        def __init__(self, *args, **kwargs) -> None:
            if str(kwargs.get("desc") or "").startswith("Fetching"):
                kwargs["disable"] = True
            if kwargs.get("file") is None and sys.stderr is None:  # 2>&-: nowhere to draw
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Quiet
