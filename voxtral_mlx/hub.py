"""Find a model: a local directory, or a Hugging Face repo resolved through the local cache."""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from . import DEFAULT_REPO  # defined by the package, for a quick start-up
from .errors import ModelNotFoundError
from .fileio import atomic_write_text, one_line, usable_path

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
    found = _layout_patterns(names)
    if found is None:
        return None
    # A voice in both formats (mlx-audio's converter copies the .pt files beside the
    # .safetensors it writes) is read from its .safetensors: the .pt is not fetched.
    safe = {n[: -len(".safetensors")] for n in names if _is_voice(n, ".safetensors")}
    if not safe:
        return found
    pt_only = sorted(n for n in names if _is_voice(n, ".pt") and n[: -len(".pt")] not in safe)
    i = found.index("voice_embedding/*")
    return [*found[:i], "voice_embedding/*.safetensors", *pt_only, *found[i + 1 :]]


def _is_voice(name: str, suffix: str) -> bool:
    return name.startswith("voice_embedding/") and name.count("/") == 1 and name.endswith(suffix)


def _layout_patterns(names: set[str]) -> list[str] | None:
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


# ... and those that cut a transfer off midway.
_CUT_OFF = frozenset(
    {
        "RemoteProtocolError",
        "ProtocolError",
        "ReadError",
        "ReadTimeout",
        "ChunkedEncodingError",
        "IncompleteRead",
        "ConnectionResetError",
    }
)
_TIMEOUTS = frozenset({"Timeout", "TimeoutException", "ReadTimeout", "ConnectTimeout"})


def _named(e: BaseException, names: frozenset[str]) -> bool:
    """Whether ``e``'s class, or one it derives from, has one of ``names``."""
    return any(cls.__name__ in names for cls in type(e).__mro__)


def _unreachable(e: BaseException) -> bool:
    return _named(e, _UNREACHABLE)


def _timed_out(e: BaseException) -> bool:
    return _named(e, _TIMEOUTS) or isinstance(e, TimeoutError)


def _cached_files(repo_id: str) -> list[str] | None:
    """What the local cache holds of a repo, for choosing its layout when the Hub cannot be
    asked (None when it holds neither layout's files)."""
    import huggingface_hub

    found = {name: huggingface_hub.try_to_load_from_cache(repo_id, name) for name in _LAYOUT_FILES}
    cached = [name for name, path in found.items() if isinstance(path, str)]
    if "config.json" in cached:  # its snapshot folder lists the rest (sharded weights)
        with contextlib.suppress(OSError):
            folder = Path(found["config.json"]).parent
            cached = sorted({*cached, *(p.name for p in folder.iterdir() if p.is_file())})
    return cached if layout_patterns(cached) is not None else None


def hub_timeout_s() -> float:
    """How long a Hub request may wait for an answer: huggingface_hub's own
    ``HF_HUB_ETAG_TIMEOUT`` (10 s unless set)."""
    from huggingface_hub import constants

    return float(getattr(constants, "HF_HUB_ETAG_TIMEOUT", 10))


def _list_files(repo_id: str) -> tuple[dict[str, int | None], str | None]:
    """The repo's files (name: size in bytes, None if not told) and the commit they are at,
    in one Hub request with a timeout: huggingface_hub's own listing waits for ever on a
    connection that a proxy or a sign-in page holds open, and ``list_repo_files`` retries a
    refused connection for some 25 s."""
    import huggingface_hub

    info = huggingface_hub.model_info(repo_id, timeout=hub_timeout_s(), files_metadata=True)
    return {s.rfilename: getattr(s, "size", None) for s in info.siblings or []}, info.sha


def _shortfall(repo_id: str, missing: list[str] | None, files: Iterable[str]) -> str | None:
    """Why the cache's disk has no room for a download, said before it begins (a Mac with a
    nearly full disk learnt it gigabytes in), or None. ``missing``: the files to fetch;
    ``files``: names with their sizes, as :func:`_list_files` gives them (names alone skip
    it)."""
    sizes = files if isinstance(files, dict) else {}
    if not missing or any(not isinstance(sizes.get(f), int) for f in missing):
        return None  # nothing to fetch, or a size the Hub did not tell: no guess
    needed = sum(sizes[f] for f in missing)
    folder = _repo_cache(repo_id)
    existing = next((p for p in (folder, *folder.parents) if p.is_dir()), None)
    if existing is None:
        return None
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return None
    if needed <= free:
        return None
    cache = one_line(str(folder.parent), 200)
    return (
        f"{repo_id} needs {needed / 1e9:.1f} GB more in the Hugging Face cache ({cache}) "
        f"and its disk has {free / 1e9:.1f} GB free"
    )


def _cached_snapshot(
    repo_id: str,
    commit: str | None,
    files: Iterable[str],
    patterns: list[str],
    named: bool = True,
) -> tuple[Path | None, list[str] | None]:
    """The cached snapshot at ``commit`` if it holds every file of ``files`` the patterns
    take and ``refs/main`` names it (so that an offline run finds it too; not asked
    without ``named``), else None; and the files the patterns take that the cache lacks at
    ``commit`` (None if they take none)."""
    import huggingface_hub

    wanted = [f for f in files if any(fnmatch.fnmatch(f, p) for p in patterns)]
    if not wanted:
        return None, None
    paths = [huggingface_hub.try_to_load_from_cache(repo_id, f, revision=commit) for f in wanted]
    missing = [f for f, p in zip(wanted, paths) if not isinstance(p, str)]
    if commit is None or missing:
        return None, missing
    root = Path(paths[0]).parents[len(Path(wanted[0]).parts) - 1]
    if not named or _main_commit(root.parent.parent) == commit:
        return root, []
    return None, []


def _whole_snapshot(repo_id: str, weights: bool = True) -> Path | None:
    """The most recent snapshot in the cache that holds a whole model (without
    ``weights``: its voices, see :func:`_holds_a_model`), whatever
    ``refs/main`` names: an update cut off by an earlier version of this package, or by
    another tool, leaves it naming an incomplete one, which huggingface_hub then refuses to
    serve offline. Files are linked into a snapshot only once downloaded, so one that holds
    a layout's files (every shard its index names, every voice its tekken.json lists) is
    whole; the most recent is the one whose latest file came last."""
    try:
        snapshots = [p for p in (_repo_cache(repo_id) / "snapshots").iterdir() if p.is_dir()]
    except OSError:
        return None
    snapshots.sort(key=_last_written, reverse=True)
    return next((s for s in snapshots if _holds_a_model(s, weights)), None)


def cached_main_snapshot(path_or_repo: object = None) -> Path | None:
    """The snapshot :func:`resolve_model_dir` will most likely return for a Hub repo id it
    is about to ask the Hub about: the one ``refs/main`` names in the cache, when it holds a
    whole model. None for a local path, offline (no question asked), or without one.
    ``load()`` reads it while the Hub answers, which is that it is current unless the repo
    changed since."""
    spec = DEFAULT_REPO if path_or_repo is None else path_or_repo
    if not isinstance(spec, str) or not _repo_id_syntax(spec):
        return None
    try:
        if os.path.lexists(os.path.expanduser(spec)) or not looks_like_repo_id(spec):
            return None
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return None
        snapshot = _whole_main_snapshot(spec)
    except Exception:  # (its settings, a path it cannot take): resolve_model_dir says
        return None
    if snapshot is None:
        return None
    # What asking the Hub imports (0.2-0.3 s of Python holding the GIL), imported before
    # the read starts: while the read builds the tokenizer (which holds the GIL too), the
    # question would wait for it.
    with contextlib.suppress(Exception):
        import huggingface_hub.errors  # noqa: F401
        from huggingface_hub import model_info, snapshot_download  # noqa: F401
    return snapshot


def _main_commit(repo_cache: Path) -> str | None:
    """The commit ``refs/main`` of a repo's cache folder names, if it can be read."""
    try:
        return (repo_cache / "refs" / "main").read_text().strip()
    except OSError:
        return None


def _whole_main_snapshot(repo_id: str) -> Path | None:
    """The snapshot ``refs/main`` names, if it holds a whole model."""
    repo = _repo_cache(repo_id)
    commit = _main_commit(repo)
    if not commit or not _COMMIT.fullmatch(commit):
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if _holds_a_model(snapshot) else None


def _main_is_whole(repo_id: str) -> bool:
    """Whether the snapshot ``refs/main`` names holds a whole model."""
    return _whole_main_snapshot(repo_id) is not None


def _last_written(folder: Path) -> float:
    """When the latest file was linked into a snapshot (its folder's own time changes with
    its top-level entries only)."""
    times = [0.0]
    with contextlib.suppress(OSError):
        times.extend(p.lstat().st_mtime for p in folder.rglob("*"))
    return max(times)


def _holds_a_model(folder: Path, weights: bool = True) -> bool:
    """Whether ``folder`` holds a layout's files: tokenizer, weights (every shard its index
    names) and every voice its tekken.json lists. Without ``weights``: what listing the
    voices reads (a config, tokenizer and voices), whether or not the weights are there."""
    try:
        names = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        if "tekken.json" not in names:
            return False
        if not weights:
            if not names & {"params.json", "config.json"}:
                return False
            return _holds_its_voices(folder, names)
        patterns = layout_patterns(names)
        if patterns is None:
            return False
        if patterns == MISTRAL_PATTERNS and "params.json" not in names:
            return False
        if "model.safetensors.index.json" in names:
            index = json.loads((folder / "model.safetensors.index.json").read_text())
            shards = set(index.get("weight_map", {}).values())
            if not shards or not shards <= names:
                return False
        return _holds_its_voices(folder, names)
    except (OSError, ValueError, AttributeError, TypeError, RecursionError):  # another shape
        return False


def _holds_its_voices(folder: Path, names: set[str]) -> bool:
    """Whether ``names`` (the files in ``folder``) include every voice its tekken.json lists."""
    voices = _tekken_voices(folder / "tekken.json")
    return all(
        f"voice_embedding/{v}.safetensors" in names or f"voice_embedding/{v}.pt" in names
        for v in voices
    )


def without_weights(patterns: list[str]) -> list[str]:
    """Of a layout's ``patterns``, those that listing its voices needs: its config,
    tokenizer and voices (a few megabytes of the model's gigabytes)."""
    return [p for p in patterns if p in _VOICE_LIST_FILES or p.startswith("voice_embedding/")]


_VOICE_LIST_FILES = frozenset({"params.json", "config.json", "tekken.json"})


def _tekken_voices(path: Path) -> dict:
    """The voices a tekken.json lists (``audio.voice_num_audio_tokens``): read from that
    key on, near the file's end, without parsing its 10 MB vocabulary (0.15 s) when it
    can be found."""
    data = path.read_bytes()
    key = b'"voice_num_audio_tokens"'
    at = data.rfind(key)
    if at >= 0:
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            rest = data[at + len(key) :].decode("utf-8").lstrip()
            if rest.startswith(":"):
                voices, _ = json.JSONDecoder().raw_decode(rest[1:].lstrip())
                if isinstance(voices, dict):
                    return voices
    tekken = json.loads(data)
    return (tekken.get("audio") or {}).get("voice_num_audio_tokens") or {}


_COMMIT = re.compile(r"[0-9a-f]{40}")


def _point_main_at(repo_id: str, commit: str) -> None:
    """``refs/main`` of the repo's cache names ``commit`` (as huggingface_hub writes it: the
    hash alone), so that later runs, offline ones too, find that snapshot."""
    refs = _repo_cache(repo_id) / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    atomic_write_text(refs / "main", commit)


# Called with (repo id, its cache folder) when files are about to be downloaded: the command
# line says so (the library itself never prints).
download_started: Callable[[str, Path], None] | None = None
# Called with (repo id, why) when a download failed and a complete older copy in the cache
# is used instead: the command line says so (after "downloading", silence misleads).
download_failed: Callable[[str, str], None] | None = None

_BARS_DRAWN = threading.Event()
# huggingface_hub 2.x downloads into a name unique to the download, which the next run
# cannot resume: the partial files of an interrupted process are worth nothing (up to 8 GB).
_UNIQUE_PARTIAL = re.compile(r"\.[0-9a-f]{8}\.incomplete$")
_DOWNLOAD_FOLDERS: set[Path] = set()  # the blobs folders of downloads begun here
_FOLDERS_LOCK = threading.RLock()  # RLock: taken again by a signal handler on its thread


def remove_partial_downloads() -> int:
    """Delete the partial files this process is writing (of downloads it began), for a
    process about to end: its download threads end with it. Another process's partial
    files in the same cache stay. Returns how many were deleted."""
    with _FOLDERS_LOCK:
        folders = list(_DOWNLOAD_FOLDERS)
    candidates = [blobs / name for blobs in folders for name in _unique_partials(blobs)]
    if not candidates:
        return 0
    mine = _open_files()
    removed = 0
    for path in candidates:
        with contextlib.suppress(OSError):
            st = path.stat()
            if (st.st_dev, st.st_ino) in mine:
                path.unlink()
                removed += 1
    return removed


def _open_files() -> set[tuple[int, int]]:
    """(device, inode) of every file this process has open (``/dev/fd`` on macOS and
    Linux)."""
    for folder in ("/dev/fd", "/proc/self/fd"):
        try:
            fds = os.listdir(folder)
        except OSError:
            continue
        found = set()
        for fd in fds:
            with contextlib.suppress(OSError, ValueError):
                st = os.fstat(int(fd))
                found.add((st.st_dev, st.st_ino))
        return found
    return set()


def download_bars_drawn() -> bool:
    """Whether a download's progress bar was drawn on stderr (output after it should start
    on a new line)."""
    return _BARS_DRAWN.is_set()


def _repo_cache(repo_id: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"


def _unique_partials(blobs: Path) -> set[str]:
    try:
        with os.scandir(blobs) as it:
            return {e.name for e in it if _UNIQUE_PARTIAL.search(e.name)}
    except OSError:
        return set()


def cached_repo(path: str | os.PathLike[str]) -> str | None:
    """The repo whose Hugging Face cache snapshot ``path`` is (``…/models--OWNER--NAME/
    snapshots/COMMIT``), or None."""
    p = Path(path)
    repo = p.parent.parent.name
    if p.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    owner, sep, name = repo.removeprefix("models--").partition("--")
    return f"{owner}/{name}" if sep and _REPO_ID.match(f"{owner}/{name}") else None


def _repo_id_syntax(spec: str) -> bool:
    """``spec`` is written as a Hub repo id (whether or not a local path shadows it)."""
    return bool(_REPO_ID.match(spec)) and not (
        ".." in spec or "--" in spec or spec.endswith(".git")
    )


def looks_like_repo_id(spec: str) -> bool:
    if not _repo_id_syntax(spec):
        return False
    # "models/tiny" with an existing local "models/" (or a link by that name, even a broken
    # one) is a path typo, not a repo.
    owner = spec.split("/", 1)[0]
    if owner.lower() in KNOWN_OWNERS:  # a folder ./mistralai must not hide Mistral's repo
        return True
    first = Path(owner).expanduser()
    return not (first.is_dir() or first.is_symlink())


def _shadows_a_known_repo(given: object, spec: str, path: Path) -> bool:
    """A folder of the current directory named like a repo of Mistral's or mlx-community's
    (``./mistralai/Voxtral-4B-TTS-2603``, as ``hf download --local-dir`` might leave one
    just begun) that holds no model file at all: the repo is meant, not that folder (no
    model named at all meant the default repo, and was refused as that folder)."""
    if isinstance(given, Path) or not _repo_id_syntax(spec):
        return False
    if spec.split("/", 1)[0].lower() not in KNOWN_OWNERS or not path.is_dir():
        return False
    try:  # one it cannot read is named as such, below
        with os.scandir(path) as entries:
            names = [e.name for e in entries]
    except OSError:
        return False
    return not any(n in ("params.json", "config.json") or n.endswith(".safetensors") for n in names)


def _broken_link(path: Path) -> Path | None:
    """The first of ``path`` and its parents that is a link leading nowhere (or in a loop)."""
    for p in (path, *path.parents):
        if p.is_symlink() and not p.exists():
            return p
    return None


def resolve_model_dir(
    path_or_repo: str | os.PathLike[str] | None = None,
    *,
    weights: bool = True,
    before_download: Callable[[], None] | None = None,
) -> Path:
    """Return a local directory holding the model, downloading it from the Hub if needed.

    Existing paths are used as they are. Strings shaped like ``owner/name`` are Hub repos,
    fetched with ``snapshot_download`` (honouring ``HF_HUB_OFFLINE``, ``HF_HOME`` and the
    local cache). Anything else that does not exist is an error, never a Hub lookup.
    ``weights=False`` fetches only what listing the voices reads (config, tokenizer,
    voices) when the cache has no whole copy; loading the model later fetches the rest.
    ``before_download`` is called before files are downloaded (a copy read ahead of the
    Hub's answer is of no use then: see :func:`cached_main_snapshot`).
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
    if _shadows_a_known_repo(path_or_repo, spec, path):
        return _download(spec, weights, before_download)
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
        meant = None if isinstance(path_or_repo, Path) else _repo_id_meant(spec)
        if meant is not None:
            raise ModelNotFoundError(
                f"{one_line(spec, 200)} is neither an existing directory nor a Hugging Face repo "
                f"id: pass the repo id alone, {meant} (its latest files are used; revisions "
                "are not supported)"
            )
        raise ModelNotFoundError(
            f"model directory {spec} does not exist: pass an existing directory or a Hugging "
            f"Face repo id such as {DEFAULT_REPO}"
        )
    return _download(spec, weights, before_download)


_HUB_URL = re.compile(r"(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co)/", re.IGNORECASE)


def _repo_id_meant(spec: str) -> str | None:
    """The repo id in a model page's address or an id with a revision (``@main``, ``:v1``),
    when that id is a valid one."""
    rest = spec.strip().replace("\\", "/")
    url = _HUB_URL.match(rest)
    if url:
        rest = "/".join(rest[url.end() :].split("/")[:2])
        return rest if rest != spec and _repo_id_syntax(rest) else None
    rest = re.sub(r"^hf://(?:models/)?", "", rest)
    rest = re.split(r"[@:]", rest, maxsplit=1)[0].rstrip("/").removesuffix(".git")
    # "models/tiny/" with a local "models/" is a path typo, as looks_like_repo_id() says
    return rest if rest != spec and looks_like_repo_id(rest) else None


# huggingface_hub reads these with int() when first imported, printing its own line first.
_WHOLE_SECONDS = ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")


def _check_settings(repo_id: str) -> None:
    for name in _WHOLE_SECONDS:
        value = os.environ.get(name)
        if value is None:
            continue
        try:
            int(value)
        except ValueError:
            raise ModelNotFoundError(
                f"cannot fetch {repo_id}: ${name} is {one_line(repr(value), 40)}, not a whole "
                "number of seconds; fix or unset it"
            ) from None


def _download(
    repo_id: str, weights: bool = True, before_download: Callable[[], None] | None = None
) -> Path:
    _check_settings(repo_id)
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
    except ValueError as e:  # it reads its HF_HUB_* settings when first imported
        raise ModelNotFoundError(
            f"cannot fetch {repo_id}: a HF_HUB_* setting is not valid ({_first_line(e)}); "
            "fix or unset it (HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT take whole "
            "seconds)"
        ) from None
    quiet = {"tqdm_class": _silent_tqdm()}  # no "Fetching N files" bar on every load

    def needed(patterns: list[str]) -> list[str]:
        return patterns if weights else without_weights(patterns)

    def whole(folder: Path) -> bool:
        return _holds_a_model(folder, weights)

    def cached(patterns: list[str]) -> Path:
        try:
            path = Path(
                snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True, **quiet)
            )
        except LocalEntryNotFoundError:
            older = _whole_snapshot(repo_id, weights)
            if older is None:
                raise
            return older
        if whole(path):
            return path
        # huggingface_hub checks a snapshot against its listing only where it kept one
        return _whole_snapshot(repo_id, weights) or path  # (else the loader names what is missing)

    downloading = False
    try:
        try:
            files, commit = _list_files(repo_id)
        except HFValidationError:
            raise
        except Exception as e:  # offline, unreachable, silent, its error, gated or missing:
            try:  # a complete copy in the cache serves
                return cached(needed(allow_patterns(repo_id, _cached_files(repo_id))))
            except LocalEntryNotFoundError as missing:
                if _timed_out(e):
                    raise ModelNotFoundError(
                        f"the Hugging Face Hub did not answer within {hub_timeout_s():g} s and "
                        f"{repo_id} is not (completely) in the local cache: check the network "
                        "(a proxy or a sign-in page in the way?) and run again, or pass a "
                        "local directory"
                    ) from None
                if _unreachable(e):
                    raise missing from None  # said as "not in the cache" or "incomplete"
                raise e from e.__cause__ or e.__context__  # where its HTTP status is
        if files and not any(_is_voice(f, ".pt") or _is_voice(f, ".safetensors") for f in files):
            # No voices: a speech-to-text Voxtral, or another model? Its params say, before
            # its weights are fetched (gigabytes).
            _check_speaks(repo_id, files, commit, quiet)
        patterns = needed(allow_patterns(repo_id, files))
        # The voices alone do not move refs/main off a whole model: found by their commit.
        snapshot, missing = _cached_snapshot(repo_id, commit, files, patterns, named=weights)
        if snapshot is not None:  # what the Hub would have answered: no second request
            if not weights and commit is not None and not _main_is_whole(repo_id):
                _point_main_at(repo_id, commit)  # a missing or dangling one: as a download
            return snapshot
        no_room = _shortfall(repo_id, missing, files)
        if no_room is not None:
            older = _whole_snapshot(repo_id, weights)  # an update there is no room for: the
            if older is None:  # copy already in the cache serves, as after a failed download
                raise ModelNotFoundError(
                    f"{no_room}: free some space, or set HF_HOME (or HF_HUB_CACHE) to a disk "
                    "with room, and run again"
                )
            if download_failed is not None:
                download_failed(repo_id, no_room)
            return older
        downloading = True
        if before_download is not None:
            before_download()
        folder = _repo_cache(repo_id)
        if download_started is not None and (missing is None or missing or commit is None):
            download_started(repo_id, folder)
        with _FOLDERS_LOCK:
            _DOWNLOAD_FOLDERS.add(folder / "blobs")
        try:
            if commit is None or not _COMMIT.fullmatch(commit):
                return Path(snapshot_download(repo_id, allow_patterns=patterns, **quiet))
            # At the commit just listed (no second request to resolve "main"), and refs/main
            # moved to it only once every file is in: huggingface_hub moves it first, and a
            # cut-off update then hid the complete older copy from every offline run.
            path = Path(
                snapshot_download(repo_id, allow_patterns=patterns, revision=commit, **quiet)
            )
            wanted = [f for f in files if any(fnmatch.fnmatch(f, p) for p in patterns)]
            if all((path / f).is_file() for f in wanted):  # every file the listing named
                # Not at the voices alone while it names a whole model: offline, the other
                # tools that read the cache (and huggingface_hub itself) would find none.
                if weights or not _main_is_whole(repo_id):
                    _point_main_at(repo_id, commit)
                return path
            # huggingface_hub answers a failed listing with the folder it has of that commit,
            # whole or not: a complete copy (refs/main's) serves rather than a partial one.
            with contextlib.suppress(LocalEntryNotFoundError):
                other = cached(patterns)
                if whole(other):
                    return other
            return path  # the loader names what it lacks
        except (HFValidationError, GatedRepoError, RepositoryNotFoundError):
            raise
        except Exception as e:  # a captive portal's HTML, a proxy's 407, a dropped link...
            if _status(e) in (401, 403):
                raise
            try:  # ...a complete (older) copy in the cache still serves
                older = cached(patterns)
            except LocalEntryNotFoundError:
                older = None
            if older is None or not whole(older):  # an incomplete one does not
                # Not "from None": huggingface_hub gives a file's HTTP error as the cause.
                raise e from e.__cause__ or e.__context__
            if download_failed is not None:
                status = _status(e)
                download_failed(
                    repo_id, f"HTTP {status}" if status else f"{type(e).__name__}: {_first_line(e)}"
                )
            return older
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
        answered = _http_error(repo_id, _status(e))
        if answered is not None:  # not a network that is down: what the Hub said
            raise answered from None
        if type(e).__name__ == "IncompleteSnapshotError":
            raise ModelNotFoundError(
                f"the copy of {repo_id} in the local Hugging Face cache is incomplete (an "
                "interrupted download, or only the files `voxtral-mlx voices` reads: "
                f"{_first_line(e)}): connect and run again to finish it "
                "(with HF_HUB_OFFLINE unset), or pass a local directory"
            ) from None
        raise ModelNotFoundError(
            f"{repo_id} is not in the local Hugging Face cache and downloading is off or "
            f"impossible (HF_HUB_OFFLINE set or no network{_network_settings()}): connect and "
            "unset HF_HUB_OFFLINE, or pass a local directory"
        ) from None
    except ModelNotFoundError:
        raise
    except Exception as e:
        answered = _http_error(repo_id, _status(e))
        if answered is not None:
            raise answered from None
        cache = one_line(str(_repo_cache(repo_id).parent), 200)
        if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise ModelNotFoundError(
                f"cannot write {repo_id} into the Hugging Face cache ({cache}): "
                f"{e.strerror or _first_line(e)}; set HF_HOME (or HF_HUB_CACHE) to a writable "
                "directory, or pass a local directory"
            ) from None
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ModelNotFoundError(
                f"no space left for {repo_id} in the Hugging Face cache ({cache}): free some "
                "space, or set HF_HOME (or HF_HUB_CACHE) to a disk with room, and run again"
            ) from None
        if downloading and _named(e, _CUT_OFF):
            raise ModelNotFoundError(
                f"the download of {repo_id} was cut off ({type(e).__name__}: "
                f"{_first_line(e)}): run the command again to finish it (the files already "
                "fetched are kept)"
            ) from None
        if isinstance(e, OSError):
            raise ModelNotFoundError(
                f"could not download {repo_id}: {_first_line(e)}; check the connection and "
                "free disk space, or pass a local directory"
            ) from None
        raise ModelNotFoundError(  # the cache was tried: it holds no complete copy
            f"could not download {repo_id} ({type(e).__name__}: {_first_line(e)}): check the "
            "network (a proxy or a sign-in page in the way?) and run again, or pass a local "
            "directory"
        ) from None


def _check_speaks(repo_id: str, files: dict, commit: str | None, quiet: dict) -> None:
    """Refuse ``repo_id`` unless its params.json (or config.json) is a Voxtral TTS model's,
    fetching that file alone."""
    from huggingface_hub import snapshot_download

    from .errors import VoxtralError
    from .loader import read_model_config

    configs = [name for name in ("params.json", "config.json") if name in files]
    if configs:
        revision = commit if commit is not None and _COMMIT.fullmatch(commit) else None
        folder = snapshot_download(repo_id, allow_patterns=configs, revision=revision, **quiet)
        try:
            read_model_config(Path(folder))
            return  # a Voxtral TTS model without voices: the loader says what it lacks
        except VoxtralError:
            pass
    raise ModelNotFoundError(
        f"{repo_id} is not a Voxtral TTS model: it holds no voices (voice_embedding/) and its "
        f"params are not a Voxtral TTS model's (Voxtral Mini and Small are speech-to-text "
        f"models): pass {DEFAULT_REPO} or a conversion of it, or a local directory"
    )


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


def _server_error(repo_id: str, status: int | None) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"the Hugging Face Hub answered HTTP {status} for {repo_id} (a problem on its side): "
        "try again later, or pass a local directory"
    )


def _http_error(repo_id: str, status: int | None) -> ModelNotFoundError | None:
    """What an HTTP error answer of the Hub (or of a proxy) means; None for no answer."""
    if status in (401, 403):
        return _auth_error(repo_id, status)
    if status is not None and status >= 500:  # e.g. a file's download failed on its side
        return _server_error(repo_id, status)
    if status == 429:
        return ModelNotFoundError(
            f"the Hugging Face Hub is limiting requests from here (HTTP 429) for {repo_id}: "
            "wait a few minutes and run again (logged in with `hf auth login`, the limit is "
            "higher), or pass a local directory"
        )
    if status == 407:
        return ModelNotFoundError(
            f"the proxy between here and the Hugging Face Hub asks for credentials (HTTP 407) "
            f"for {repo_id}: put them in HTTPS_PROXY (http://user:password@host:port), or "
            "pass a local directory"
        )
    if status == 408:
        return ModelNotFoundError(
            f"the Hugging Face Hub timed out a request for {repo_id} (HTTP 408): check the "
            f"network (a proxy or a sign-in page in the way?{_network_settings()}) and run "
            "again, or pass a local directory"
        )
    if status == 416:
        return ModelNotFoundError(
            f"the Hugging Face Hub could not resume a partial download of {repo_id} (HTTP "
            "416): run again; if it persists, delete the repo's *.incomplete files under "
            "blobs/ in the Hugging Face cache"
        )
    if status is not None and 400 <= status < 500:
        check = "check the repo id and " if status in (400, 404, 410) else ""
        settings = _network_settings()  # a wrong HF_ENDPOINT answers 404 too
        where = f" ({settings[2:]})" if settings else ""
        return ModelNotFoundError(
            f"the Hugging Face Hub answered HTTP {status} for {repo_id}{where}: {check}run "
            "again later, or pass a local directory"
        )
    return None


def _network_settings() -> str:
    """The settings that decide where the Hub is asked, when set: a wrong one looks like no
    network at all."""
    said = []
    endpoint = os.environ.get("HF_ENDPOINT")
    if endpoint:
        shown = one_line(repr(endpoint), 80)
        lacks = "" if re.match(r"https?://", endpoint) else " lacks http:// or https://"
        said.append(f"HF_ENDPOINT={shown}{lacks}")
    # The proxy variables of the endpoint's scheme (https unless HF_ENDPOINT says http).
    plain = (endpoint or "").lower().startswith("http://")
    scheme = ("HTTP_PROXY", "http_proxy") if plain else ("HTTPS_PROXY", "https_proxy")
    for name in (*scheme, "ALL_PROXY", "all_proxy"):
        if os.environ.get(name):
            said.append(f"through the proxy in {name}")
            break
    return "".join(f"; {s}" for s in said)


def _auth_error(repo_id: str, status: int | None) -> ModelNotFoundError:
    token = next((n for n in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN") if os.environ.get(n)), None)
    if status == 401 and token is not None:  # it wins over a stored login
        return ModelNotFoundError(
            f"the Hugging Face Hub refused the token in ${token} for {repo_id} (401: invalid "
            f"or expired): replace it, or unset {token} to use your `hf auth login`"
        )
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
            if not self.disable:
                _BARS_DRAWN.set()

    return Quiet
