"""Finding a model: local directories, path typos (never a Hub call), and the Hub's own cache."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import huggingface_hub.errors
import numpy as np
import pytest
from huggingface_hub import constants as hf_constants

import voxtral_mlx
import voxtral_mlx.hub as hub_module
from voxtral_mlx.errors import ModelNotFoundError, VoxtralError
from voxtral_mlx.hub import (
    DEFAULT_REPO,
    MISTRAL_PATTERNS,
    MLX_PATTERNS,
    allow_patterns,
    looks_like_repo_id,
    resolve_model_dir,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "owner-x/voxtral-tiny"


def one_line(e: BaseException) -> str:
    assert isinstance(e, VoxtralError)
    text = str(e)
    assert text and "\n" not in text and "\r" not in text, repr(text)
    return text


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> list:
    """Fail the test if the Hub is asked anything; returns the calls (for the message)."""
    calls: list = []

    def forbidden(*args, **kwargs):
        calls.append((args, kwargs))
        pytest.fail(f"the Hub was called with {args} {kwargs}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", forbidden)
    monkeypatch.setattr(huggingface_hub, "model_info", forbidden)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", forbidden)
    return calls


_LIST_FILES = hub_module._list_files


def _unreachable(*args, **kwargs):
    raise huggingface_hub.errors.OfflineModeIsEnabled("no network in this test")


def _listing(repo_id: str) -> list[str]:
    owner, name = repo_id.split("/", 1)
    return MLX_FILES if owner == "mlx-community" or "mlx" in name.lower() else MISTRAL_FILES


@pytest.fixture(autouse=True)
def hub_listing(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    """The Hub's model_info as huggingface_hub gives it (no test reaches the network): a
    listing in the layout the repo's owner or name suggests, at COMMIT (``offline_cache``
    makes it raise as huggingface_hub does offline). Returns the calls."""
    calls: list[tuple[str, dict]] = []

    def model_info(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        siblings = [SimpleNamespace(rfilename=f) for f in _listing(repo_id)]
        return SimpleNamespace(siblings=siblings, sha=COMMIT)

    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    return calls


def whole_stand_in(folder: Path) -> Path:
    """A folder holding the names of a whole model of either layout (and no voices), for
    a snapshot that nothing loads: one served from the cache is checked to be whole."""
    folder.mkdir(parents=True)
    for name in ("params.json", "config.json", "consolidated.safetensors", "model.safetensors"):
        (folder / name).write_bytes(b"")
    (folder / "tekken.json").write_text("{}")
    return folder


class FakeHub(list):
    """snapshot_download's calls; ``cached``: whether the local cache has a complete copy."""

    cached = False


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeHub:
    """snapshot_download recording its arguments and returning an empty snapshot directory
    (with ``local_files_only``, only if ``fake_hub.cached``: the local cache is empty)."""
    calls = FakeHub()
    snapshot = whole_stand_in(tmp_path / "snapshot")
    listed: list[str] = []
    list_files = hub_module._list_files

    def listing(repo_id):
        files, commit = list_files(repo_id)
        listed[:] = files
        return files, commit

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        if kwargs.get("local_files_only") and not calls.cached:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not in the cache")
        if not kwargs.get("local_files_only"):  # "fetches" what the listing holds
            for name in listed:
                if any(fnmatch.fnmatch(name, p) for p in kwargs.get("allow_patterns") or []):
                    (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
                    (snapshot / name).touch()
        return str(snapshot)

    monkeypatch.setattr(hub_module, "_list_files", listing)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    return calls


def populate_hub_cache(cache: Path, repo_id: str, source: Path, commit: str = COMMIT) -> Path:
    """Lay ``source`` out as huggingface_hub does: blobs by hash, symlinked snapshot, refs/main."""
    owner, name = repo_id.split("/")
    repo = cache / f"models--{owner}--{name}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        rel = file.relative_to(source)
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs" / "main").write_text(commit)  # no newline, as the Hub writes it
    return snapshot


# --------------------------------------------------------------------------- local paths


def test_existing_directory_is_used_as_is(tiny_checkpoint: Path, no_hub) -> None:
    assert resolve_model_dir(tiny_checkpoint) == tiny_checkpoint.resolve()
    assert resolve_model_dir(str(tiny_checkpoint)) == tiny_checkpoint.resolve()


def test_relative_and_home_directories(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_hub
) -> None:
    monkeypatch.chdir(tiny_checkpoint.parent)
    assert resolve_model_dir(f"./{tiny_checkpoint.name}") == tiny_checkpoint.resolve()
    monkeypatch.setenv("HOME", str(tiny_checkpoint.parent))
    assert resolve_model_dir(f"~/{tiny_checkpoint.name}") == tiny_checkpoint.resolve()


def test_file_path_is_an_error(tiny_checkpoint: Path, no_hub) -> None:
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(tiny_checkpoint / "params.json")
    message = one_line(exc.value)
    assert "is a file" in message and "directory" in message


@pytest.mark.parametrize(
    "spec",
    [
        "./nope",
        "/abs/nope",
        "~/nope",
        "a/b/c",
        "nope",
        "../nope",
        "nope/",
        "owner//name",
        "owner/na me",
        "models--owner--name",
        "owner/../name",
        "C:\\models\\voxtral",
        "",
    ],
)
def test_missing_path_like_string_never_calls_the_hub(
    spec: str, no_hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if spec == "":  # not the current directory (Path("")): `-m "$UNSET"` is a mistake
        with pytest.raises(ModelNotFoundError, match="empty name"):
            resolve_model_dir(spec)
        assert not no_hub
        return
    assert not looks_like_repo_id(spec)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(spec)
    message = one_line(exc.value)
    assert "does not exist" in message and spec in message
    assert not no_hub


@pytest.mark.parametrize(
    ("name", "value"),
    [("HF_HUB_ETAG_TIMEOUT", "2.5"), ("HF_HUB_DOWNLOAD_TIMEOUT", "ten")],
)
def test_a_hub_timeout_that_is_no_whole_number_is_one_line(
    name: str, value: str, no_hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub reads them with int() when first imported: a traceback (and a line
    of its own before it), though the README tells users to set HF_HUB_ETAG_TIMEOUT."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir("acme/tiny")
    message = one_line(exc.value)
    assert f"${name} is '{value}', not a whole number of seconds" in message
    assert not no_hub


@pytest.mark.parametrize(
    "spec",
    [
        "acme/tiny@main",
        "acme/tiny:v1",
        "https://huggingface.co/acme/tiny",
        "https://huggingface.co/acme/tiny/tree/main",
        "hf.co/acme/tiny",
        # as tab completion, a clone URL, Windows or hf:// write it
        "acme/tiny/",
        "acme/tiny.git",
        "acme\\tiny",
        "hf://acme/tiny",
        "hf://models/acme/tiny",
    ],
)
def test_a_page_address_or_a_revision_names_the_repo_id_to_pass(
    spec: str, no_hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """They were "model directory ... does not exist"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(spec)
    message = one_line(exc.value)
    assert "pass the repo id alone, acme/tiny (" in message and "revisions are not" in message
    assert not no_hub
    (tmp_path / "acme").mkdir()  # a local folder by the owner's name: a path typo
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(spec)
    if not spec.startswith(("http", "hf.co")):
        assert "repo id alone" not in one_line(exc.value)
    assert not no_hub


def test_path_object_is_never_a_repo(no_hub, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError):
        resolve_model_dir(Path("owner/name"))


def test_typo_under_an_existing_local_folder_is_a_path(
    no_hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir("models/voxtral-tiny")
    assert "does not exist" in one_line(exc.value)


@pytest.mark.parametrize("spec", ["loop", "loop/sub", "dangling", "dangling/name", "./loop"])
def test_a_link_to_nothing_is_named_and_never_a_repo(
    spec: str, no_hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop").symlink_to("other")
    (tmp_path / "other").symlink_to("loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(spec)
    message = one_line(exc.value)
    link = spec.removeprefix("./").split("/")[0]
    assert f"{link} is a symbolic link to nothing" in message and "fix the link" in message
    assert not no_hub


def test_load_of_a_missing_path_never_calls_the_hub(no_hub, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        voxtral_mlx.load(str(tmp_path / "nope"))


@pytest.mark.parametrize(
    "spec",
    [DEFAULT_REPO, "mlx-community/Voxtral-4B-TTS-2603-mlx-bf16", "a/b", "Owner_1/name.v2-x"],
)
def test_repo_ids_are_recognised(spec: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    assert looks_like_repo_id(spec)


# --------------------------------------------------------------------------- allow_patterns


def test_mistral_patterns_are_exactly_what_inference_reads() -> None:
    assert allow_patterns(DEFAULT_REPO) == [
        "params.json",
        "tekken.json",
        "consolidated.safetensors",
        "voice_embedding/*",
    ]


@pytest.mark.parametrize("quant", ["bf16", "6bit", "4bit"])
def test_mlx_community_patterns(quant: str) -> None:
    patterns = allow_patterns(f"mlx-community/Voxtral-4B-TTS-2603-mlx-{quant}")
    assert set(patterns) == {
        "config.json",
        "params.json",
        "tekken.json",
        "model*.safetensors",
        "model.safetensors.index.json",
        "voice_embedding/*",
    }
    assert "consolidated.safetensors" not in patterns


def test_patterns_are_fresh_lists() -> None:
    allow_patterns(DEFAULT_REPO).append("*")
    assert "*" not in MISTRAL_PATTERNS and "*" not in allow_patterns(DEFAULT_REPO)
    assert "*" not in MLX_PATTERNS


# What is fetched of an MLX repo whose voices are .safetensors: only those.
MLX_FETCHED = [
    "voice_embedding/*.safetensors" if p == "voice_embedding/*" else p for p in MLX_PATTERNS
]


@pytest.mark.parametrize(
    ("repo", "expected"),
    [
        (DEFAULT_REPO, MISTRAL_PATTERNS),
        ("someone/Voxtral-4B-TTS-2603", MISTRAL_PATTERNS),
        ("mlx-community/Voxtral-4B-TTS-2603-mlx-bf16", MLX_FETCHED),
        ("mlx-community/Voxtral-4B-TTS-2603-mlx-4bit", MLX_FETCHED),
    ],
)
def test_snapshot_download_receives_the_layout_patterns(
    repo: str, expected: list[str], fake_hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    path = resolve_model_dir(repo)
    assert path == tmp_path / "snapshot"
    assert len(fake_hub) == 1
    args, kwargs = fake_hub[0]
    assert (args[0] if args else kwargs["repo_id"]) == repo
    assert sorted(kwargs["allow_patterns"]) == sorted(expected)
    # no forced download / token games: the cache and HF_HUB_OFFLINE decide; the revision
    # is the commit just listed, which refs/main names once the download is complete
    assert not {"force_download", "token", "local_files_only"} & set(kwargs)
    assert kwargs["revision"] == COMMIT
    refs = Path(hf_constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "refs"
    assert (refs / "main").read_text() == COMMIT


def test_a_repo_the_hub_cannot_list_comes_from_the_cache_alone(
    fake_hub, hub_listing, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(huggingface_hub, "model_info", _unreachable)
    monkeypatch.chdir(tmp_path)
    fake_hub.cached = True
    assert resolve_model_dir("someone/voxtral-tts") == tmp_path / "snapshot"
    ((_, kwargs),) = fake_hub
    assert kwargs["local_files_only"] is True


MLX_FILES = [
    ".gitattributes",
    "README.md",
    "config.json",
    "params.json",
    "tekken.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "voice_embedding/neutral_male.safetensors",
]
MISTRAL_FILES = [
    "README.md",
    "params.json",
    "tekken.json",
    "consolidated.safetensors",
    "voice_embedding/neutral_male.pt",
]


@pytest.mark.parametrize(
    ("repo", "files", "expected"),
    [
        # the name says nothing (or the wrong thing): the listing decides
        ("someone/Voxtral-4B-TTS-2603-4bit", MLX_FILES, MLX_FETCHED),
        # one shard, no index
        ("someone/voxtral-tts-q6", [*MLX_FILES[2:6], "voice_embedding/a.pt"], MLX_PATTERNS),
        ("someone/voxtral-tts-mlx-ready", MISTRAL_FILES, MISTRAL_PATTERNS),
        # a conversion that kept its source's weights: only the conversion is fetched
        ("someone/voxtral-copy", [*MLX_FILES, "consolidated.safetensors"], MLX_FETCHED),
        # weight files of other names (mlx-audio reads every top-level *.safetensors): they
        # were left out and the download could never be complete
        (
            "someone/voxtral-weights",
            [
                *MLX_FILES[:5],
                "voice_embedding/a.pt",
                "weights.00.safetensors",
                "weights.01.safetensors",
                "consolidated.safetensors",
            ],
            [*MLX_PATTERNS, "weights.00.safetensors", "weights.01.safetensors"],
        ),
        # voices in both formats (mlx-audio's converter copies the .pt files): the .pt of a
        # voice that has a .safetensors is not fetched, that of one without it is
        (
            "someone/voxtral-both-voices",
            [
                *MLX_FILES,
                "voice_embedding/neutral_male.pt",
                "voice_embedding/casual_female.pt",
            ],
            [*MLX_FETCHED, "voice_embedding/casual_female.pt"],
        ),
        # neither layout: the name decides, the loader says what is missing
        ("someone/voxtral-empty", ["README.md", "voice_embedding/a.pt"], MISTRAL_PATTERNS),
        ("someone/voxtral-mlx-empty", ["README.md", "voice_embedding/a.pt"], MLX_PATTERNS),
    ],
)
def test_other_repos_are_fetched_by_what_they_hold(
    repo, files, expected, fake_hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    listed: list[str] = []

    def list_repo_files(repo_id, **kwargs):
        listed.append(repo_id)
        return list(files), COMMIT

    monkeypatch.setattr(hub_module, "_list_files", list_repo_files)
    monkeypatch.chdir(tmp_path)
    resolve_model_dir(repo)
    assert listed == [repo]
    assert sorted(fake_hub[0][1]["allow_patterns"]) == sorted(expected)


def _connect_error() -> Exception:
    httpx = pytest.importorskip("httpx2")  # huggingface_hub's HTTP client in 2.x
    return httpx.ConnectError("[Errno -2] Name or service not known")


def _server_error() -> Exception:
    httpx = pytest.importorskip("httpx2")
    request = httpx.Request("GET", "https://huggingface.co/api/models/someone/x/tree/main")
    response = httpx.Response(500, request=request)
    return huggingface_hub.errors.HfHubHTTPError("500 Server Error", response=response)


def _read_timeout() -> Exception:
    httpx = pytest.importorskip("httpx2")
    return httpx.ReadTimeout("timed out")


@pytest.mark.parametrize(
    ("make_error", "words"),
    [
        (_connect_error, "is not in the local Hugging Face cache"),
        (lambda: ConnectionError("reset"), "is not in the local Hugging Face cache"),
        (_read_timeout, "did not answer within 10 s"),
        (lambda: TimeoutError("timed out"), "did not answer within 10 s"),
        (_server_error, "answered HTTP 500"),
    ],
    ids=["connect", "connection", "read-timeout", "timeout", "http-500"],
)
def test_a_hub_that_cannot_list_a_repo_is_not_asked_twice(
    make_error, words: str, fake_hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """When the listing fails (the network down, a Hub that never answers, its error), the
    cache alone is asked: huggingface_hub would retry a connection for some 25 s, and wait
    for ever on one that a proxy holds open. A complete cached copy serves; without one
    the error says why."""
    error = make_error()

    def list_repo_files(repo_id, **kwargs):
        raise error

    monkeypatch.setattr(hub_module, "_list_files", list_repo_files)
    monkeypatch.setattr(hub_module, "hub_timeout_s", lambda: 10.0)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir("someone/voxtral-tts")
    assert words in one_line(exc.value)
    ((_, kwargs),) = fake_hub
    assert kwargs["local_files_only"] is True
    fake_hub.cached = True
    assert resolve_model_dir("someone/voxtral-tts") == tmp_path / "snapshot"


@pytest.mark.parametrize("repo", [DEFAULT_REPO, "mlx-community/Voxtral-4B-TTS-2603-mlx-4bit"])
def test_every_repo_is_listed_once_with_a_timeout(
    repo: str, fake_hub, hub_listing, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    resolve_model_dir(repo)
    assert len(fake_hub) == 1
    ((listed, kwargs),) = hub_listing
    assert listed == repo and kwargs["timeout"] == hub_module.hub_timeout_s() > 0


@pytest.mark.parametrize(
    ("make_error", "words"),
    [
        (lambda: _http_error(huggingface_hub.errors.GatedRepoError, 403)(), "accept its license"),
        (lambda: _http_error(huggingface_hub.errors.RepositoryNotFoundError, 404)(), "not found"),
    ],
    ids=["gated", "not-found"],
)
def test_listing_a_missing_or_gated_repo_is_one_line(
    make_error, words: str, fake_hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    error = make_error()

    def list_repo_files(repo_id, **kwargs):
        raise error

    monkeypatch.setattr(hub_module, "_list_files", list_repo_files)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(REPO)
    message = one_line(exc.value)
    assert words in message and REPO in message
    assert all(kwargs["local_files_only"] for _, kwargs in fake_hub)  # nothing downloaded


def test_default_is_mistrals_repo(fake_hub, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    resolve_model_dir()
    resolve_model_dir(None)
    assert [(a[0] if a else k["repo_id"]) for a, k in fake_hub] == [DEFAULT_REPO] * 2
    assert all(k["allow_patterns"] == MISTRAL_PATTERNS for _, k in fake_hub)


def test_load_default_goes_through_the_hub(
    fake_hub, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(VoxtralError) as exc:  # the fake snapshot's files are empty
        voxtral_mlx.load()
    assert "params.json" in one_line(exc.value)
    assert fake_hub[0][0][0] == DEFAULT_REPO


def _oserror() -> Exception:
    return OSError("No space left on device\nsecond line")


def _offline() -> Exception:
    return huggingface_hub.errors.LocalEntryNotFoundError("gone\nmore")


def _http_error(cls: type, status: int) -> Callable[[], Exception]:
    def make() -> Exception:
        httpx = pytest.importorskip("httpx2")  # huggingface_hub's HTTP client in 2.x
        request = httpx.Request("GET", f"https://huggingface.co/api/models/{REPO}")
        return cls("server says\nno", response=httpx.Response(status, request=request))

    return make


@pytest.mark.parametrize(
    ("make_error", "words"),
    [
        (_oserror, "No space left on device"),
        (_offline, "HF_HUB_OFFLINE"),
        (_http_error(huggingface_hub.errors.GatedRepoError, 403), "accept its license"),
        (_http_error(huggingface_hub.errors.RepositoryNotFoundError, 404), "not found"),
    ],
    ids=["oserror", "offline", "gated", "not-found"],
)
def test_hub_failures_become_one_line_errors(
    make_error: Callable[[], Exception], words: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.chdir(tmp_path)
    error = make_error()

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(REPO)
    message = one_line(exc.value)
    assert words in message and REPO in message


# ------------------------------------------------------------------------ the real cache, offline


def _empty_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, offline: bool) -> Path:
    """An empty Hub cache in ``tmp_path``, the working folder. huggingface_hub reads these
    variables at import, so the module constants are patched too (the subprocess test below
    checks the variables alone)."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.chdir(tmp_path)
    return cache


@pytest.fixture
def offline_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty Hub cache, offline."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub, "model_info", _unreachable)
    return _empty_cache(monkeypatch, tmp_path, offline=True)


def test_repo_resolves_from_the_cache_offline(offline_cache: Path, tiny_checkpoint: Path) -> None:
    snapshot = populate_hub_cache(offline_cache, REPO, tiny_checkpoint)
    path = resolve_model_dir(REPO)
    assert path == snapshot.resolve() or Path(os.path.realpath(path)) == snapshot.resolve()
    assert (path / "params.json").is_symlink()


def test_load_from_the_cache_offline(offline_cache: Path, tiny_checkpoint: Path, tiny_tts) -> None:
    populate_hub_cache(offline_cache, REPO, tiny_checkpoint)
    tts = voxtral_mlx.load(REPO)
    assert sorted(tts.voices) == sorted(tiny_tts.voices)
    ours = tts.synthesize("Hi.", max_frames=2, seed=0)
    ref = tiny_tts.synthesize("Hi.", max_frames=2, seed=0)
    np.testing.assert_array_equal(ours.codes, ref.codes)
    np.testing.assert_array_equal(ours.audio, ref.audio)


def test_a_conversion_under_any_name_loads_from_the_cache_offline(
    offline_cache: Path, tiny_checkpoint: Path, tiny_tts, tmp_path: Path
) -> None:
    """Offline, the Hub cannot list the repo: what the cache holds picks the layout (a
    conversion whose name lacks "mlx", downloaded earlier)."""
    from voxtral_mlx.convert import convert_model

    converted = convert_model(tiny_checkpoint, tmp_path / "converted", dtype="float32").path
    repo = "owner-x/voxtral-tiny-converted"
    populate_hub_cache(offline_cache, repo, converted)
    tts = voxtral_mlx.load(repo)
    ours = tts.synthesize("Hi.", max_frames=2, seed=0)
    ref = tiny_tts.synthesize("Hi.", max_frames=2, seed=0)
    np.testing.assert_array_equal(ours.codes, ref.codes)


def test_repo_missing_from_the_cache_offline(offline_cache: Path, tiny_checkpoint: Path) -> None:
    populate_hub_cache(offline_cache, REPO, tiny_checkpoint)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir("owner-x/not-cached")
    message = one_line(exc.value)
    assert "HF_HUB_OFFLINE" in message and "owner-x/not-cached" in message


def test_cache_without_refs_main_serves_a_whole_snapshot_offline(
    offline_cache: Path, tiny_checkpoint: Path
) -> None:
    """huggingface_hub cannot tell which snapshot is "main": a whole one still serves; one
    that lacks a file is no model."""
    snapshot = populate_hub_cache(offline_cache, REPO, tiny_checkpoint)
    (snapshot.parent.parent / "refs" / "main").unlink()
    assert resolve_model_dir(REPO) == snapshot
    (snapshot / "tekken.json").unlink()
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(REPO)
    assert "HF_HUB_OFFLINE" in one_line(exc.value)


def test_a_cached_snapshot_with_absurdly_nested_json_is_no_model_offline(
    offline_cache: Path, tiny_checkpoint: Path
) -> None:
    """Judging a snapshot without refs/main parsed its tekken.json with json.loads, whose
    RecursionError on arrays nested 10^5 deep escaped as a traceback."""
    snapshot = populate_hub_cache(offline_cache, REPO, tiny_checkpoint)
    (snapshot.parent.parent / "refs" / "main").unlink()
    tekken = snapshot / "tekken.json"
    tekken.unlink()  # a link into the blobs: write a file of its own
    tekken.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(REPO)
    assert "HF_HUB_OFFLINE" in one_line(exc.value)


@pytest.mark.parametrize("cut", ["tekken.json", "shard", "voice"])
def test_an_update_cut_off_leaves_the_older_whole_copy_in_use_offline(
    offline_cache: Path, tiny_checkpoint: Path, tmp_path: Path, cut: str
) -> None:
    """huggingface_hub points refs/main at a new commit before fetching its files: an update
    cut off midway (by an older version of this package, or another tool) hid the complete
    older copy from every later run, offline or with the Hub unreachable."""
    if cut == "shard":
        from voxtral_mlx.convert import convert_model

        source = convert_model(tiny_checkpoint, tmp_path / "conv", max_shard_bytes=200_000).path
        repo = "mlx-community/voxtral-tiny-mlx"
    else:
        source, repo = tiny_checkpoint, REPO
    older = populate_hub_cache(offline_cache, repo, source)
    newer = older.parent / ("f" * 40)
    for file in older.rglob("*"):
        if file.is_symlink():
            link = newer / file.relative_to(older)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.readlink(file))
    if cut == "shard":
        shards = sorted(newer.glob("model-*.safetensors"))
        assert len(shards) > 1
        shards[-1].unlink()
    elif cut == "voice":  # the weights and tekken.json are in, one of its voices is not
        sorted((newer / "voice_embedding").iterdir())[-1].unlink()
    else:
        (newer / cut).unlink()
    os.utime(newer)  # the most recent snapshot, but not a whole one
    (older.parent.parent / "refs" / "main").write_text(newer.name)
    assert resolve_model_dir(repo) == older


def test_of_two_whole_snapshots_the_one_written_last_serves(
    offline_cache: Path, tiny_checkpoint: Path
) -> None:
    """refs/main names neither: the snapshot whose files came last serves, whatever the
    times of the folders themselves (they change with their top-level entries only)."""
    first = populate_hub_cache(offline_cache, REPO, tiny_checkpoint)
    second = first.parent / ("e" * 40)
    shutil.copytree(first, second, symlinks=True)
    for link in second.rglob("*"):
        os.utime(link, (2e9, 2e9), follow_symlinks=False)
    os.utime(first, (3e9, 3e9))  # the older folder touched later
    (first.parent.parent / "refs" / "main").unlink()
    assert resolve_model_dir(REPO) == second


@pytest.mark.parametrize(
    "spec",
    ["models/tiny-", "owner/name.", "owner./name", "owner/name.git", "owner/" + "a" * 97],
)
def test_ids_the_hub_rejects_are_model_not_found(spec: str, offline_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(spec)
    assert spec in one_line(exc.value)


CHILD = textwrap.dedent(
    """
    import json, sys
    import voxtral_mlx
    from voxtral_mlx.errors import ModelNotFoundError
    from voxtral_mlx.hub import resolve_model_dir

    out = {"path": str(resolve_model_dir(sys.argv[1]))}
    tts = voxtral_mlx.load(sys.argv[1])
    out["codes"] = tts.synthesize("Hi.", max_frames=2, seed=0).codes.tolist()
    try:
        resolve_model_dir("owner-x/not-cached")
    except ModelNotFoundError as e:
        out["missing"] = str(e)
    print(json.dumps(out))
    """
)


def test_environment_variables_alone_select_the_cache(
    tmp_path: Path, tiny_checkpoint: Path, tiny_tts
) -> None:
    """A fresh interpreter configured only through the environment, as a user would do it
    (huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE once, at import)."""
    cache = tmp_path / "cache"
    snapshot = populate_hub_cache(cache, REPO, tiny_checkpoint)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"), HF_HUB_CACHE=str(cache))
    env["PYTHONPATH"] = str(Path(voxtral_mlx.__file__).parents[1])
    result = subprocess.run(
        [sys.executable, "-c", CHILD, REPO],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(out["path"]).resolve() == snapshot.resolve()
    ref = tiny_tts.synthesize("Hi.", max_frames=2, seed=0)
    assert out["codes"] == ref.codes.tolist()
    assert "HF_HUB_OFFLINE" in out["missing"] and "\n" not in out["missing"]


def test_populated_cache_is_what_huggingface_hub_expects(offline_cache, tiny_checkpoint) -> None:
    """Control for the fixture: huggingface_hub itself finds the snapshot offline."""
    snapshot = populate_hub_cache(offline_cache, REPO, tiny_checkpoint)
    found = huggingface_hub.snapshot_download(REPO, allow_patterns=MISTRAL_PATTERNS)
    assert Path(found) == snapshot


# ------------------------------------------------------------- network trouble, a hub review


def _portal_html() -> Exception:
    """What a captive portal's sign-in page makes of the Hub's JSON answer."""
    return json.JSONDecodeError("Expecting value", "<html>sign in</html>", 0)


def _proxy_407() -> Exception:
    httpx = pytest.importorskip("httpx2")
    return httpx.ProxyError("407 Proxy Authentication Required")


@pytest.mark.parametrize("make_error", [_portal_html, _proxy_407], ids=["portal", "proxy"])
def test_any_network_failure_falls_back_to_a_complete_cached_copy(
    make_error, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    """They were tracebacks (JSONDecodeError, ProxyError) even with the model cached. An
    incomplete copy is no fallback: the failure is said, not "using the copy" and then a
    missing file."""
    calls: list[dict] = []
    snapshot = tmp_path / "snapshot"
    shutil.copytree(tiny_checkpoint, snapshot)

    def download(*args, **kwargs):
        calls.append(kwargs)
        if not kwargs.get("local_files_only"):
            raise make_error()
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.chdir(tmp_path)
    failed: list[tuple[str, str]] = []
    monkeypatch.setattr(hub_module, "download_failed", lambda *a: failed.append(a))
    assert resolve_model_dir(DEFAULT_REPO) == snapshot
    assert [c.get("local_files_only", False) for c in calls] == [False, True]
    # The older copy is used, and said to be (after "downloading", silence misleads).
    assert failed == [(DEFAULT_REPO, f"{type(make_error()).__name__}: {make_error()}")]

    (snapshot / "consolidated.safetensors").unlink()  # an interrupted earlier download
    failed.clear()
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(DEFAULT_REPO)
    assert f"could not download {DEFAULT_REPO} ({type(make_error()).__name__}:" in one_line(
        exc.value
    )
    assert failed == []

    def nothing_cached(*args, **kwargs):
        if kwargs.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        raise make_error()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", nothing_cached)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(DEFAULT_REPO)
    message = one_line(exc.value)
    assert f"could not download {DEFAULT_REPO} ({type(make_error()).__name__}:" in message
    assert "HF_HUB_OFFLINE" not in message  # the cache was tried: it has no complete copy


def _failing_download(status: int, wrapped: bool):
    """snapshot_download failing with HTTP ``status``: raised, or (``wrapped``) as the
    cause of a LocalEntryNotFoundError, as huggingface_hub gives a failed listing."""
    http_error = _http_error(huggingface_hub.errors.HfHubHTTPError, status)()

    def download(*args, **kwargs):
        if not wrapped:
            raise http_error
        try:
            raise http_error
        except Exception as cause:
            raise huggingface_hub.errors.LocalEntryNotFoundError("cannot find") from cause

    return download


@pytest.mark.parametrize(
    ("status", "words"), [(401, "log in again with `hf auth login`"), (403, "was refused (403)")]
)
@pytest.mark.parametrize("wrapped", [False, True], ids=["raised", "as-cause"])
def test_login_problems_are_named_as_such(
    status: int, words: str, wrapped: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A revoked token read as a connection problem, a 403 as 'not in the local cache'
    (huggingface_hub raises that, with the HTTP error as its cause)."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _failing_download(status, wrapped))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(DEFAULT_REPO)
    assert words in one_line(exc.value) and f"({status}" in str(exc.value)


@pytest.mark.parametrize(
    ("status", "words"),
    [
        (429, "limiting requests from here (HTTP 429)"),
        (407, "asks for credentials (HTTP 407) for"),
        (404, "answered HTTP 404 for mistralai/Voxtral-4B-TTS-2603: check the repo id"),
        (408, "timed out a request for mistralai/Voxtral-4B-TTS-2603 (HTTP 408): check the net"),
        (416, "could not resume a partial download"),
        (418, "answered HTTP 418 for mistralai/Voxtral-4B-TTS-2603: run again later"),
    ],
)
@pytest.mark.parametrize("wrapped", [False, True], ids=["raised", "as-cause"])
def test_other_http_answers_are_named_not_taken_for_no_network(
    status: int, words: str, wrapped: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A rate limit or a file the Hub did not find read as 'HF_HUB_OFFLINE set or no
    network', a proxy's 407 as 'check the connection and free disk space'."""
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _failing_download(status, wrapped))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(DEFAULT_REPO)
    message = one_line(exc.value)
    assert words in message and "HF_HUB_OFFLINE" not in message
    assert "free disk space" not in message


@pytest.mark.parametrize("variable", ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"])
def test_a_refused_token_from_the_environment_is_named(
    variable: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """It said to log in again, which changes nothing while the variable wins over it."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv(variable, "hf_expired")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _failing_download(401, True))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(DEFAULT_REPO)
    message = one_line(exc.value)
    assert f"refused the token in ${variable}" in message and f"unset {variable}" in message
    assert "hf_expired" not in message


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        (("HF_ENDPOINT", "huggingface.co"), "HF_ENDPOINT='huggingface.co' lacks http:// or"),
        (("HF_ENDPOINT", "https://hub.example"), "HF_ENDPOINT='https://hub.example')"),
        (("HTTPS_PROXY", "http://127.0.0.1:1"), "through the proxy in HTTPS_PROXY"),
    ],
)
def test_an_unreachable_hub_names_the_settings_that_point_at_it(
    setting, words: str, fake_hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A wrong endpoint or proxy read as the network being down."""

    def unreachable(repo_id, **kwargs):
        raise ConnectionError("refused")

    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(*setting)
    monkeypatch.setattr(hub_module, "_list_files", unreachable)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir("someone/voxtral-tts")
    message = one_line(exc.value)
    assert "is not in the local Hugging Face cache" in message and words in message


@pytest.mark.parametrize(
    "files",
    [
        ["params.json", "tekken.json", "consolidated.safetensors"],  # Voxtral Mini Realtime
        ["config.json", "model.safetensors", "tokenizer.json"],  # any text model
    ],
)
def test_a_repo_without_voices_is_refused_before_its_weights_are_fetched(
    files: list[str], fake_hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A speech-to-text Voxtral or another model was downloaded whole (9 to 24 GB), then
    refused for its params, with advice to download it again. Only its params are
    fetched to tell."""

    def listing(repo_id, **kwargs):
        return dict.fromkeys(files), COMMIT

    monkeypatch.setattr(hub_module, "_list_files", listing)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir("mistralai/Voxtral-Mini-4B-Realtime-2602")
    message = one_line(exc.value)
    assert "is not a Voxtral TTS model: it holds no voices" in message
    assert DEFAULT_REPO in message and "--force-download" not in message
    ((_, kwargs),) = fake_hub  # its params alone
    assert kwargs["allow_patterns"] == [f for f in ("params.json", "config.json") if f in files]
    assert kwargs["revision"] == COMMIT


def test_a_tts_repo_without_voices_or_without_a_listing_is_still_fetched(
    fake_hub, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A Voxtral TTS model published without voices (the loader names what it lacks), and
    a listing that names no files (a mirror that leaves them out): not refused."""
    files = ["params.json", "tekken.json", "consolidated.safetensors"]
    listings = iter([dict.fromkeys(files), {}])
    monkeypatch.setattr(hub_module, "_list_files", lambda repo_id, **kw: (next(listings), COMMIT))
    shutil.copy(tiny_checkpoint / "params.json", tmp_path / "snapshot" / "params.json")
    monkeypatch.chdir(tmp_path)
    resolve_model_dir("someone/voxtral-tts-voiceless")
    assert [kw["allow_patterns"] for _, kw in fake_hub] == [["params.json"], MISTRAL_PATTERNS]
    fake_hub.clear()
    resolve_model_dir("someone/voxtral-tts-mirror")
    assert [kw["allow_patterns"] for _, kw in fake_hub] == [MISTRAL_PATTERNS]


def test_a_local_folder_named_like_the_default_repo_does_not_hide_it(
    fake_hub, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """./mistralai/Voxtral-4B-TTS-2603 holding no model (half of an `hf download
    --local-dir`): a command naming no model was refused as that folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / DEFAULT_REPO).mkdir(parents=True)
    resolve_model_dir(None)
    assert fake_hub[0][0][0] == DEFAULT_REPO
    shutil.rmtree(tmp_path / "mistralai")
    shutil.copytree(tiny_checkpoint, tmp_path / DEFAULT_REPO)  # a model there: that one
    assert resolve_model_dir(DEFAULT_REPO) == (tmp_path / DEFAULT_REPO).resolve()
    (tmp_path / DEFAULT_REPO / "params.json").unlink()  # a damaged one: still that one
    assert resolve_model_dir(DEFAULT_REPO) == (tmp_path / DEFAULT_REPO).resolve()
    assert len(fake_hub) == 1


def test_an_interrupted_download_is_named_as_such(monkeypatch, tmp_path) -> None:
    """It was 'not in the local Hugging Face cache' (IncompleteSnapshotError is a
    LocalEntryNotFoundError)."""
    incomplete = getattr(huggingface_hub.errors, "IncompleteSnapshotError", None)
    if incomplete is None:
        pytest.skip("this huggingface_hub does not check a snapshot's completeness")
    # (message, snapshot_path) in huggingface_hub 2.x

    def download(*args, **kwargs):
        raise incomplete(
            f"The cached snapshot for '{DEFAULT_REPO}' is incomplete: 1 file(s) are missing "
            "(consolidated.safetensors).\nMore.",
            str(tmp_path / "snapshot"),
        )

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(DEFAULT_REPO)
    message = one_line(exc.value)
    assert "in the local Hugging Face cache is incomplete" in message
    assert "(consolidated.safetensors)" in message


@pytest.mark.parametrize("owner", ["mistralai", "mlx-community"])
def test_a_local_folder_named_like_a_known_owner_does_not_hide_its_repos(
    owner: str, fake_hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / owner).mkdir()
    resolve_model_dir(f"{owner}/Voxtral-4B-TTS-2603")
    assert fake_hub[0][0][0] == f"{owner}/Voxtral-4B-TTS-2603"


def test_no_progress_bar_over_the_repos_files(fake_hub, monkeypatch, tmp_path) -> None:
    """huggingface_hub's 'Fetching N files' bar showed on every load, cached or not."""
    monkeypatch.chdir(tmp_path)
    resolve_model_dir(DEFAULT_REPO)
    bar = fake_hub[0][1]["tqdm_class"]
    fetching = bar(iter([1, 2]), total=2, desc="Fetching 2 files")
    assert list(fetching) == [1, 2] and fetching.disable
    # The bars of the bytes downloaded (an 8 GB first download) still show.
    assert not bar(total=1, desc="Downloading bytes").disable


def test_a_cached_sharded_conversion_is_not_listed_on_the_hub(
    offline_cache: Path, tiny_checkpoint: Path, fake_hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only fixed names were looked up in the cache: sharded weights sent it to the Hub,
    which an unreachable network made wait ~24 s through retries."""
    source = offline_cache.parent / "sharded"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "model-00001-of-00001.safetensors").write_bytes(b"x")
    populate_hub_cache(offline_cache, "bob/voxtral-q4-sharded", source)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(offline_cache))
    fake_hub.cached = True
    resolve_model_dir("bob/voxtral-q4-sharded")  # offline: not listed
    assert "model*.safetensors" in fake_hub[0][1]["allow_patterns"]


def test_a_repo_is_listed_in_one_request_without_retries(
    fake_hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Offline, a mistyped repo id waited ~24 s through list_repo_files' five retries (each
    logged on stderr) before its one-line error: the listing is one model_info request."""
    from types import SimpleNamespace

    calls: list[str] = []

    def down(repo_id, **kwargs):
        calls.append(repo_id)
        raise _connect_error()

    def forbidden(*args, **kwargs):
        pytest.fail("list_repo_files retries a refused connection")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", forbidden)
    monkeypatch.setattr(huggingface_hub, "model_info", down)
    monkeypatch.chdir(tmp_path)
    fake_hub.cached = True
    resolve_model_dir("someone/voxtral-tts")
    assert calls == ["someone/voxtral-tts"]
    assert fake_hub[0][1]["local_files_only"] is True

    names = ["params.json", "consolidated.safetensors", "tekken.json"]
    siblings = [SimpleNamespace(rfilename=n) for n in names]
    monkeypatch.setattr(
        huggingface_hub,
        "model_info",
        lambda repo_id, **kw: SimpleNamespace(siblings=siblings, sha=COMMIT),
    )
    assert hub_module._list_files("someone/voxtral-tts") == (dict.fromkeys(names), COMMIT)


def test_a_download_the_disk_has_no_room_for_is_refused_before_it_begins(
    fake_hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The listing tells each file's size: 8 GB of weights on a disk with less free fails
    at once, in one line (it failed gigabytes in); with room, or sizes not told, the
    download goes ahead."""
    from types import SimpleNamespace

    sizes = {
        "params.json": 2_000,
        "tekken.json": 15_000_000,
        "consolidated.safetensors": 8e9,
        "voice_embedding/casual_male.pt": 40_000,
    }
    calls: list[dict] = []

    def model_info(repo_id, **kwargs):
        calls.append(kwargs)
        return SimpleNamespace(
            siblings=[SimpleNamespace(rfilename=n, size=int(b)) for n, b in sizes.items()],
            sha=COMMIT,
        )

    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    monkeypatch.chdir(tmp_path)
    free = {"bytes": 3e9}
    monkeypatch.setattr(
        hub_module.shutil, "disk_usage", lambda path: SimpleNamespace(free=int(free["bytes"]))
    )
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model_dir(DEFAULT_REPO)
    assert str(e.value).startswith(f"{DEFAULT_REPO} needs 8.0 GB more in the Hugging Face cache")
    assert "its disk has 3.0 GB free: free some space, or set HF_HOME" in str(e.value)
    assert "\n" not in str(e.value) and calls[0]["files_metadata"] is True
    assert not fake_hub  # nothing was downloaded
    free["bytes"] = 9e9
    assert resolve_model_dir(DEFAULT_REPO) == tmp_path / "snapshot"
    monkeypatch.setattr(  # sizes the Hub did not tell: no guess, the download goes ahead
        huggingface_hub,
        "model_info",
        lambda repo_id, **kw: SimpleNamespace(
            siblings=[SimpleNamespace(rfilename=n, size=None) for n in sizes], sha=COMMIT
        ),
    )
    free["bytes"] = 0
    assert resolve_model_dir(DEFAULT_REPO) == tmp_path / "snapshot"


def test_an_update_the_disk_has_no_room_for_keeps_the_cached_copy(
    offline_cache: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new commit of 8 GB on a nearly full disk: the complete older copy in the cache
    serves (as after a failed download) rather than the whole command failing."""
    from types import SimpleNamespace

    snapshot = populate_hub_cache(offline_cache, REPO, tiny_checkpoint)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    names = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    newer = "f" * 40
    monkeypatch.setattr(
        huggingface_hub,
        "model_info",
        lambda repo_id, **kw: SimpleNamespace(
            siblings=[SimpleNamespace(rfilename=n, size=4 * 10**9) for n in names], sha=newer
        ),
    )
    monkeypatch.setattr(hub_module.shutil, "disk_usage", lambda path: SimpleNamespace(free=10**9))
    failed: list[tuple[str, str]] = []
    monkeypatch.setattr(hub_module, "download_failed", lambda *a: failed.append(a))
    assert resolve_model_dir(REPO) == snapshot
    assert len(failed) == 1 and failed[0][0] == REPO
    assert "needs" in failed[0][1] and "GB more in the Hugging Face cache" in failed[0][1]


def test_download_bars_with_stderr_closed_draw_nothing(monkeypatch):
    """`voxtral-mlx speak ... 2>&-` on a first run: Python sets sys.stderr to None and the
    download's byte bar crashed the download (AttributeError), with no message."""
    from voxtral_mlx.hub import _silent_tqdm

    monkeypatch.setattr(sys, "stderr", None)
    with _silent_tqdm()(total=10, desc="model.safetensors", unit="B") as bar:
        bar.update(5)
    assert bar.disable


# ------------------------------------------------------- a hub review, end to end (2026-11-29)


def _mistral_listing(source: Path) -> list[str]:
    return sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.is_file())


def test_a_complete_cached_snapshot_is_used_after_one_listing(
    offline_cache: Path, tiny_checkpoint: Path, hub_listing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online, a cached model costs the one listing request and no download call; a copy
    that lacks a file, or that ``refs/main`` does not name, goes to snapshot_download."""
    snapshot = populate_hub_cache(offline_cache, DEFAULT_REPO, tiny_checkpoint)
    files = _mistral_listing(tiny_checkpoint)
    listing = SimpleNamespace(siblings=[SimpleNamespace(rfilename=f) for f in files], sha=COMMIT)
    monkeypatch.setattr(huggingface_hub, "model_info", lambda repo_id, **kw: listing)
    downloads: list[dict] = []

    def download(*args, **kwargs):
        downloads.append(kwargs)
        for sibling in listing.siblings:  # fetched
            (snapshot / sibling.rfilename).touch()
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    assert resolve_model_dir(DEFAULT_REPO) == snapshot
    assert downloads == []
    listing.siblings.append(SimpleNamespace(rfilename="voice_embedding/new_voice.pt"))
    resolve_model_dir(DEFAULT_REPO)
    assert len(downloads) == 1 and not downloads[0].get("local_files_only")
    listing.siblings.pop()
    (snapshot.parent.parent / "refs" / "main").write_text("f" * 40)
    resolve_model_dir(DEFAULT_REPO)
    assert len(downloads) == 2


def test_an_update_moves_refs_main_only_once_complete(
    offline_cache: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new commit on the Hub is downloaded at that commit; refs/main names it only once
    the download is done, so an update that fails leaves the complete older copy in use
    (and named by refs/main for the next offline run)."""
    older = populate_hub_cache(offline_cache, DEFAULT_REPO, tiny_checkpoint)
    refs_main = older.parent.parent / "refs" / "main"
    new = "e" * 40
    files = _mistral_listing(tiny_checkpoint)
    listing = SimpleNamespace(siblings=[SimpleNamespace(rfilename=f) for f in files], sha=new)
    monkeypatch.setattr(huggingface_hub, "model_info", lambda repo_id, **kw: listing)
    real = huggingface_hub.snapshot_download
    calls: list[dict] = []

    def cut_off(*args, **kwargs):
        calls.append(kwargs)
        if kwargs.get("local_files_only"):
            return real(*args, **kwargs)
        raise _server_error()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cut_off)
    assert resolve_model_dir(DEFAULT_REPO) == older
    assert calls[0]["revision"] == new and refs_main.read_text() == COMMIT

    newer = older.parent / new
    newer.mkdir()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: str(newer))
    # An empty folder: huggingface_hub answers a failed listing with the folder it has of
    # that commit, whole or not. The complete one serves, and refs/main stays. (Checked
    # against the listing: a repo may lack voices its tekken.json names.)
    assert resolve_model_dir(DEFAULT_REPO) == older
    assert refs_main.read_text() == COMMIT
    newer.rmdir()
    shutil.copytree(older, newer, symlinks=True)  # every file the listing names
    assert resolve_model_dir(DEFAULT_REPO) == newer
    assert refs_main.read_text() == new


@pytest.mark.parametrize("cache_miss", ["plain", "same"])
def test_a_file_the_hub_fails_to_serve_is_named_as_its_error(
    monkeypatch, tmp_path, cache_miss
) -> None:
    """huggingface_hub reports a file's HTTP 500 as "not in the local cache" (with the
    error as its cause): it was called "HF_HUB_OFFLINE set or no network". Then the cache
    was asked for an older copy, and its own miss ("plain": no status) hid the 500."""
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    def download(*args, **kwargs):
        if kwargs.get("local_files_only") and cache_miss == "plain":
            raise huggingface_hub.errors.LocalEntryNotFoundError("not in the cache")
        try:
            raise _server_error()
        except Exception as e:
            raise huggingface_hub.errors.LocalEntryNotFoundError("cannot find it") from e

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(DEFAULT_REPO)
    message = one_line(exc.value)
    assert "answered HTTP 500" in message and "HF_HUB_OFFLINE" not in message


def _download_failing_with(error: Exception):
    def download(*args, **kwargs):
        if kwargs.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        raise error

    return download


def _cut_off() -> Exception:
    httpx = pytest.importorskip("httpx2")
    return httpx.RemoteProtocolError("peer closed connection without sending complete message")


@pytest.mark.parametrize(
    ("make_error", "words"),
    [
        (_cut_off, "was cut off (RemoteProtocolError: peer closed"),
        (_read_timeout, "run the command again to finish it"),
        (_server_error, "the Hugging Face Hub answered HTTP 500"),
        (lambda: OSError(30, "Read-only file system"), "set HF_HOME (or HF_HUB_CACHE) to a"),
        (lambda: OSError(13, "Permission denied"), "cannot write"),
        (lambda: OSError(28, "No space left on device"), "no space left for"),
    ],
    ids=["dropped", "stalled", "http-500", "read-only", "permission", "full"],
)
def test_a_failed_download_says_what_to_do(
    make_error, words: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A dropped or stalled transfer said "set HF_HUB_OFFLINE=1 to use a complete copy"
    (there was none), a 500 "HF_HUB_OFFLINE set or no network", a read-only or full cache
    "check the connection"."""
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _download_failing_with(make_error()))
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model_dir(DEFAULT_REPO)
    message = one_line(exc.value)
    assert words in message and DEFAULT_REPO in message, message
    if "HF_HOME" in words or "space" in words:
        assert str(tmp_path / "hub") in message


def test_an_interrupted_download_leaves_no_partial_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    """Ctrl-C ended the process with a download's thread in the middle of a file: its
    partial file (up to 8 GB, never resumed by huggingface_hub 2.x) stayed in the cache.
    Only the files this process is writing go: another process's, made meanwhile, and
    huggingface_hub 1.x's resumable ones stay."""
    from voxtral_mlx.cli import loading as cli_loading

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_module, "_DOWNLOAD_FOLDERS", set())
    blobs = tmp_path / "hub" / "models--mistralai--Voxtral-4B-TTS-2603" / "blobs"
    blobs.mkdir(parents=True)
    ours = blobs / "cccc.1234abcd.incomplete"
    theirs = blobs / "dddd.89abcdef.incomplete"  # another process's download, meanwhile
    resumable = blobs / "bbbb.incomplete"
    writing = []

    def download(*args, **kwargs):
        writing.append(ours.open("wb"))  # huggingface_hub writes with the file open
        writing[0].write(b"partial")
        theirs.write_bytes(b"partial")
        resumable.write_bytes(b"partial")
        raise KeyboardInterrupt  # Ctrl-C, as the command line's main thread sees it

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    args = SimpleNamespace(quiet=False)
    try:
        with pytest.raises(KeyboardInterrupt), cli_loading.downloads_reported(args):
            resolve_model_dir(DEFAULT_REPO)
    finally:
        writing[0].close()
    assert sorted(p.name for p in blobs.iterdir()) == [resumable.name, theirs.name]
    assert "downloading mistralai/Voxtral-4B-TTS-2603" in capsys.readouterr().err
    assert hub_module.download_started is None  # the library's state as it was


_PARTIAL_LEFT_BY_A_SIGNAL = r"""
import os, signal, sys, threading, time
from pathlib import Path
import huggingface_hub
from huggingface_hub import constants
from voxtral_mlx import cli

constants.HF_HUB_CACHE = sys.argv[-1]
blobs = Path(sys.argv[-1]) / "models--mistralai--Voxtral-4B-TTS-2603" / "blobs"
blobs.mkdir(parents=True)


def download(*args, **kwargs):
    with open(blobs / "cccc.1234abcd.incomplete", "wb") as f:
        f.write(b"partial")
        f.flush()
        print("downloading", flush=True)
        time.sleep(60)


huggingface_hub.snapshot_download = download
voice = type("Sibling", (), {"rfilename": "voice_embedding/casual_male.pt"})()
huggingface_hub.model_info = lambda repo_id, **kw: type(
    "Info", (), {"siblings": [voice], "sha": "0" * 40}
)()
sys.exit(cli.main(["voices", "-m", "mistralai/Voxtral-4B-TTS-2603"], own_process=True))
"""


def test_a_command_that_ends_at_once_on_a_signal_removes_its_partial_file(tmp_path) -> None:
    """`serve` and `voices` end in their signal handler while the model loads: the
    download's partial file stayed."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["PYTHONPATH"] = str(Path(voxtral_mlx.__file__).parents[1])
    launcher = "import signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); exec(sys.argv[1])"
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher, _PARTIAL_LEFT_BY_A_SIGNAL, str(tmp_path / "hub")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "downloading", proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
    blobs = tmp_path / "hub" / "models--mistralai--Voxtral-4B-TTS-2603" / "blobs"
    assert list(blobs.iterdir()) == []


_SILENT_HUB = r"""
import socket, sys, time
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(16)
print(server.getsockname()[1], flush=True)
held = []
while True:  # accept, and never answer: a proxy or a sign-in page holding the line
    held.append(server.accept()[0])
"""


def test_a_hub_that_never_answers_does_not_hang_a_cached_model(tmp_path, tiny_checkpoint):
    """With the model cached, `speak` waited for ever on a Hub connection that was accepted
    and never answered (huggingface_hub's listing has no timeout)."""
    cache = tmp_path / "hf" / "hub"
    populate_hub_cache(cache, DEFAULT_REPO, tiny_checkpoint)
    server = subprocess.Popen([sys.executable, "-c", _SILENT_HUB], stdout=subprocess.PIPE)
    try:
        port = int(server.stdout.readline())
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
        env.update(
            HF_HOME=str(tmp_path / "hf"),
            HF_HUB_CACHE=str(cache),
            HF_ENDPOINT=f"http://127.0.0.1:{port}",
            HF_HUB_ETAG_TIMEOUT="1",
            PYTHONPATH=str(Path(voxtral_mlx.__file__).parents[1]),
        )
        code = "import voxtral_mlx.hub as h; print(h.resolve_model_dir(h.DEFAULT_REPO))"
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        server.kill()
        server.wait()
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).name == COMMIT


def test_fetching_again_is_said_once_with_the_command(monkeypatch, tmp_path) -> None:
    from voxtral_mlx import _name_the_cache_fix
    from voxtral_mlx.errors import CheckpointError

    monkeypatch.setattr(hub_module, "cached_repo", lambda path: REPO)
    error = CheckpointError(
        "model-2.safetensors is missing: the download is incomplete; fetch it again"
    )
    _name_the_cache_fix(error, tmp_path)
    message = str(error)
    assert "fetch it again" not in message
    # What is missing is fetched alone (--force-download would fetch all 8 GB again).
    assert message.endswith(
        "incomplete; this copy is in the Hugging Face cache: "
        f"`hf download {REPO}` fetches what is missing (so does a run online)"
    )
    damaged = CheckpointError("model-2.safetensors is truncated: fetch it again")
    _name_the_cache_fix(damaged, tmp_path)
    assert str(damaged).count("fetch it again") == 1
    assert str(damaged).endswith(
        "truncated; this copy is in the Hugging Face cache: fetch it again with "
        f"`hf download {REPO} --force-download`"
    )


def test_a_damaged_file_in_the_cache_names_the_command_that_fetches_it_again(
    offline_cache: Path, tiny_checkpoint: Path
) -> None:
    """Rerunning never fetches a damaged cached file again (the snapshot looks complete):
    "re-download it" alone left the user stuck."""
    import shutil

    source = offline_cache.parent / "damaged"
    shutil.copytree(tiny_checkpoint, source)
    weights = source / "consolidated.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    populate_hub_cache(offline_cache, REPO, source)
    with pytest.raises(VoxtralError) as exc:
        voxtral_mlx.load(REPO)
    message = one_line(exc.value)
    assert "truncated" in message and f"`hf download {REPO} --force-download`" in message
    assert hub_module.cached_repo(tiny_checkpoint) is None
    # An error a download would not mend says nothing of it.
    populate_hub_cache(offline_cache, "owner-x/healthy", tiny_checkpoint)
    with pytest.raises(VoxtralError) as exc:
        voxtral_mlx.load("owner-x/healthy", dtype="float8")
    assert "float8" in one_line(exc.value) and "hf download" not in str(exc.value)


def test_the_command_line_says_when_a_download_begins(monkeypatch, capsys, tmp_path) -> None:
    """With stderr not a terminal (no progress bar), an 8 GB download was minutes of
    silence; the library itself prints nothing."""
    from voxtral_mlx import cli

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _download_failing_with(_cut_off()))
    monkeypatch.setattr(hub_module, "download_started", None)
    with pytest.raises(ModelNotFoundError):
        resolve_model_dir(DEFAULT_REPO)
    assert capsys.readouterr().err == ""
    assert cli.main(["speak", "-m", DEFAULT_REPO, "Hello.", "-o", str(tmp_path / "x.wav")]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"voxtral-mlx: downloading {DEFAULT_REPO} into {tmp_path}")
    assert "was cut off" in lines[1] and len(lines) == 2


def test_convert_checks_its_options_before_a_download(no_hub, capsys, tmp_path) -> None:
    """convert now fetches a Hub model first (on a helper thread, so that Ctrl-C ends it at
    once): a wrong option must still be said before an 8 GB download."""
    from voxtral_mlx import cli

    out = tmp_path / "out"
    for flags, words in (
        (["--q-bits", "5"], "--q-bits (q_bits=) 5"),
        (["--dtype", "int8"], "int8"),
    ):
        assert cli.main(["convert", DEFAULT_REPO, "-o", str(out), *flags]) == 1
        assert words in capsys.readouterr().err
    assert not out.exists()
    # Nor an output folder that is not empty (it was found after the download).
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli.main(["convert", DEFAULT_REPO, "-o", str(out)]) == 1
    assert "exists and is not empty: pass --force" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


# ------------------------------------------------------------ listing voices without weights


def _fetching_into(cache: Path, source: Path, calls: list[dict]) -> Callable:
    """snapshot_download as huggingface_hub runs it at a commit: the files of ``source`` that
    the patterns take become blobs linked into that commit's snapshot (refs/main untouched);
    with ``local_files_only``, huggingface_hub's own lookup in the cache."""
    real = huggingface_hub.snapshot_download

    def download(repo_id, *, allow_patterns=None, revision=None, local_files_only=False, **kw):
        calls.append({"allow_patterns": allow_patterns, "local_files_only": local_files_only})
        if local_files_only:
            return real(repo_id, allow_patterns=allow_patterns, local_files_only=True, **kw)
        owner, name = repo_id.split("/")
        repo = cache / f"models--{owner}--{name}"
        snapshot = repo / "snapshots" / revision
        for file in sorted(p for p in source.rglob("*") if p.is_file()):
            rel = file.relative_to(source).as_posix()
            if not any(fnmatch.fnmatch(rel, p) for p in allow_patterns):
                continue
            data = file.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = snapshot / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(os.path.relpath(blob, link.parent))
        return str(snapshot)

    return download


def _online_hub(
    monkeypatch: pytest.MonkeyPatch, cache: Path, source: Path, sha: str = COMMIT
) -> list[dict]:
    """Online, with an empty Hub cache ``cache``: the Hub lists ``source``'s files at
    ``sha`` and snapshot_download fetches them into the cache (:func:`_fetching_into`).
    Returns the download calls."""
    cache.mkdir(parents=True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    files = _mistral_listing(source)
    listing = SimpleNamespace(siblings=[SimpleNamespace(rfilename=f) for f in files], sha=sha)
    monkeypatch.setattr(huggingface_hub, "model_info", lambda repo_id, **kw: listing)
    calls: list[dict] = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _fetching_into(cache, source, calls))
    return calls


@pytest.mark.parametrize("layout", ["mistral", "mlx"])
def test_listing_voices_fetches_the_voices_not_the_weights(
    layout: str, tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """`voxtral-mlx voices` (and `speak -v '?'`) of a model not in the cache downloaded the
    whole model (8 GB) to list 20 names: now only its config, tokenizer and voices. They
    list offline afterwards too; loading the model fetches the rest; an offline load in
    between says what is missing in one line."""
    from voxtral_mlx import cli

    if layout == "mlx":
        from voxtral_mlx.convert import convert_model

        source = convert_model(tiny_checkpoint, tmp_path / "conv", max_shard_bytes=200_000).path
        repo, weights = "mlx-community/voxtral-tiny-mlx", "model-*.safetensors"
    else:
        source, repo, weights = tiny_checkpoint, "owner-x/voxtral-tiny", "consolidated.safetensors"
    cache = tmp_path / "hf" / "hub"
    calls = _online_hub(monkeypatch, cache, source)
    online = huggingface_hub.model_info

    assert cli.main(["voices", "-m", repo]) == 0
    captured = capsys.readouterr()
    listed = captured.out.split()
    assert "casual_male" in listed and "neutral_female" in listed
    assert captured.err.startswith(f"voxtral-mlx: downloading the voices of {repo} (its config")
    assert len(calls) == 1 and not calls[0]["local_files_only"]
    fetched = calls[0]["allow_patterns"]
    assert not any(fnmatch.fnmatch(w, p) for p in fetched for w in (weights, "model.safetensors"))
    assert "tekken.json" in fetched and any(p.startswith("voice_embedding/") for p in fetched)
    snapshot = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / COMMIT
    names = {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()}
    assert not any(fnmatch.fnmatch(n, weights) for n in names)
    assert any(n.startswith("voice_embedding/") for n in names)

    # Listed again: from the cache, online (one listing, no download) or offline.
    calls.clear()
    assert cli.main(["speak", "-m", repo, "-v", "?"]) == 0
    assert "casual_male" in capsys.readouterr().out and calls == []
    monkeypatch.setattr(huggingface_hub, "model_info", _unreachable)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    assert cli.main(["voices", "-m", repo]) == 0
    assert "casual_male" in capsys.readouterr().out

    # The model itself, offline: no weights in the cache, said in one line.
    with pytest.raises(VoxtralError) as exc:
        voxtral_mlx.load(repo)
    message = one_line(exc.value)
    assert "incomplete" in message and "safetensors" in message, message

    # Online: loading fetches what is missing, and the model speaks.
    monkeypatch.setattr(huggingface_hub, "model_info", online)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    calls.clear()
    tts = voxtral_mlx.load(repo)
    try:
        assert calls and calls[-1]["allow_patterns"] and not calls[-1]["local_files_only"]
        assert tts.synthesize("Hi.", max_frames=2, seed=0).codes.shape[0] == 2
    finally:
        tts.close()
    assert any(fnmatch.fnmatch(p.name, weights) for p in snapshot.iterdir())


def test_listing_voices_of_a_cached_model_downloads_nothing(
    offline_cache: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A whole model in the cache serves the listing, offline or online with an unchanged
    repo (one listing request, no download)."""
    from voxtral_mlx import cli

    populate_hub_cache(offline_cache, REPO, tiny_checkpoint)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _download_failing_with(_cut_off()))
    assert cli.main(["voices", "-m", REPO]) == 0
    assert "casual_male" in capsys.readouterr().out
    files = _mistral_listing(tiny_checkpoint)
    listing = SimpleNamespace(siblings=[SimpleNamespace(rfilename=f) for f in files], sha=COMMIT)
    monkeypatch.setattr(huggingface_hub, "model_info", lambda repo_id, **kw: listing)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    assert cli.main(["voices", "-m", REPO]) == 0
    captured = capsys.readouterr()
    assert "casual_male" in captured.out and "downloading" not in captured.err


def test_listing_the_voices_of_an_update_keeps_refs_main_on_the_whole_model(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """With the whole model cached and a newer commit on the Hub, `voices` fetched that
    commit's voices and pointed refs/main at it: offline, huggingface_hub (and every tool
    reading the cache) then found no model. refs/main stays; the next listing finds the
    voices by their commit, without a download."""
    from voxtral_mlx import cli

    cache = tmp_path / "hf" / "hub"
    newer = "b" * 40
    calls = _online_hub(monkeypatch, cache, tiny_checkpoint, sha=newer)
    whole = populate_hub_cache(cache, REPO, tiny_checkpoint)
    refs_main = whole.parent.parent / "refs" / "main"
    for downloads in (1, 0):
        calls.clear()
        assert cli.main(["voices", "-m", REPO]) == 0
        assert "casual_male" in capsys.readouterr().out
        assert len(calls) == downloads and refs_main.read_text() == COMMIT
    fetched = whole.parent / newer
    assert (fetched / "tekken.json").exists()
    assert not (fetched / "consolidated.safetensors").exists()
    # Offline, huggingface_hub's own lookup finds the whole model.
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    found = huggingface_hub.hf_hub_download(REPO, "consolidated.safetensors", local_files_only=True)
    assert Path(found).parent == whole
    # Online, loading fetches the newer commit's weights and moves refs/main to it.
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    assert resolve_model_dir(REPO) == fetched
    assert refs_main.read_text() == newer and (fetched / "consolidated.safetensors").exists()


def test_listing_the_voices_online_names_a_whole_cached_model_in_refs_main_again(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """refs/main gone (or naming a deleted snapshot) with the whole model cached at the
    Hub's commit: `voices` online put it back, as a load does, for huggingface_hub's own
    offline lookups; the voices-only path had stopped doing so."""
    from voxtral_mlx import cli

    cache = tmp_path / "hf" / "hub"
    calls = _online_hub(monkeypatch, cache, tiny_checkpoint)
    whole = populate_hub_cache(cache, REPO, tiny_checkpoint)
    refs_main = whole.parent.parent / "refs" / "main"
    for damage in ("missing", "dangling"):
        if damage == "missing":
            refs_main.unlink()
        else:
            refs_main.write_text("d" * 40)
        assert cli.main(["voices", "-m", REPO]) == 0
        assert "casual_male" in capsys.readouterr().out
        assert calls == [] and refs_main.read_text() == COMMIT


# ------------------------------------------------------ a cached copy read while the Hub answers


@pytest.fixture
def online_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty Hub cache, online (downloads fail the test unless a test fakes them)."""
    cache = _empty_cache(monkeypatch, tmp_path, offline=False)

    def no_download(*args, **kwargs):
        if not kwargs.get("local_files_only"):
            pytest.fail(f"a download was started: {args} {kwargs}")
        return _SNAPSHOT_DOWNLOAD(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    return cache


_SNAPSHOT_DOWNLOAD = huggingface_hub.snapshot_download


def _files_of(folder: Path) -> dict[str, int]:
    return {
        p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()
    }


class Loads(list):
    """Each model load's folder and how it ended; ``started`` is set as the first begins."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()


def _record_loads(monkeypatch: pytest.MonkeyPatch) -> Loads:
    import voxtral_mlx.loader as loader

    loads = Loads()
    real = loader.load_model_dir

    def recorded(model_dir, *args, **kwargs):
        entry = {"path": Path(model_dir), "end": None}
        loads.append(entry)
        loads.started.set()
        try:
            out = real(model_dir, *args, **kwargs)
        except BaseException as e:
            entry["end"] = type(e).__name__
            raise
        entry["end"] = "loaded"
        return out

    monkeypatch.setattr(loader, "load_model_dir", recorded)
    return loads


def test_a_cached_repo_is_read_while_the_hub_is_asked_whether_it_changed(
    online_cache: Path, tiny_checkpoint: Path, tiny_tts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hub's answer (a request of up to 10 s) came before anything was read: now the
    copy refs/main names is read meanwhile, and used once the Hub says it is current."""
    snapshot = populate_hub_cache(online_cache, REPO, tiny_checkpoint)
    loads = _record_loads(monkeypatch)
    asked: list[bool] = []

    def listing(repo_id):
        assert repo_id == REPO
        # The read has begun before the Hub answers (it would wait here for ever if not).
        asked.append(loads.started.wait(30))
        return _files_of(tiny_checkpoint), COMMIT

    monkeypatch.setattr(hub_module, "_list_files", listing)
    tts = voxtral_mlx.load(REPO)
    try:
        assert asked == [True]
        assert [(e["path"], e["end"]) for e in loads] == [(snapshot, "loaded")]
        assert Path(tts.path) == snapshot
        ours = tts.synthesize("Hi.", max_frames=2, seed=0)
        np.testing.assert_array_equal(
            ours.codes, tiny_tts.synthesize("Hi.", max_frames=2, seed=0).codes
        )
    finally:
        tts.close()


@pytest.mark.parametrize("fail", [False, True], ids=["downloaded", "download-fails"])
def test_an_update_the_hub_names_replaces_the_copy_read_meanwhile(
    online_cache: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, fail: bool
) -> None:
    """The Hub lists a newer commit: the older copy's read stops before the download, and
    the new files are downloaded and loaded, as when nothing was read ahead; a download
    that fails leaves the older copy in use, read again."""
    older = populate_hub_cache(online_cache, REPO, tiny_checkpoint)
    newer_commit = "f" * 40
    newer = older.parent / newer_commit
    loads = _record_loads(monkeypatch)

    def listing(repo_id):
        assert loads.started.wait(30)
        return _files_of(tiny_checkpoint), newer_commit

    def download(repo_id, *, allow_patterns=None, revision=None, local_files_only=False, **kw):
        if local_files_only:
            return _SNAPSHOT_DOWNLOAD(repo_id, allow_patterns=allow_patterns, **kw)
        assert revision == newer_commit
        # The read ahead was told to stop before the download: it ends meanwhile, not
        # once the download is done (the real one takes minutes, the read gigabytes).
        deadline = time.monotonic() + 30
        while loads[0]["end"] is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loads[0]["end"] is not None
        if fail:
            raise huggingface_hub.errors.HfHubHTTPError("503 Service Unavailable")
        shutil.copytree(older, newer, symlinks=True)
        return str(newer)

    monkeypatch.setattr(hub_module, "_list_files", listing)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.setattr(hub_module, "download_failed", None)
    tts = voxtral_mlx.load(REPO)
    try:
        if fail:  # the complete older copy serves, read again (what was read is gone)
            assert Path(tts.path) == older
            assert [e["path"] for e in loads] == [older, older]
            assert loads[1]["end"] == "loaded"
            return
        assert Path(tts.path) == newer
        assert [e["path"] for e in loads] == [older, newer]
        # Stopped between parts, or done already when the answer came: dropped either way.
        assert loads[0]["end"] in ("ReadAheadDropped", "loaded")
        assert loads[1]["end"] == "loaded"
        assert (
            online_cache / f"models--{REPO.replace('/', '--')}" / "refs" / "main"
        ).read_text() == newer_commit
    finally:
        tts.close()


def test_an_interrupt_while_the_hub_is_asked_stops_the_read_ahead(
    online_cache: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    populate_hub_cache(online_cache, REPO, tiny_checkpoint)
    loads = _record_loads(monkeypatch)

    def listing(repo_id):
        assert loads.started.wait(30)
        raise KeyboardInterrupt

    monkeypatch.setattr(hub_module, "_list_files", listing)
    before = {t for t in threading.enumerate() if t.name == "voxtral-mlx"}
    with pytest.raises(KeyboardInterrupt):
        voxtral_mlx.load(REPO)
    left = {t for t in threading.enumerate() if t.name == "voxtral-mlx"} - before
    for thread in left:
        thread.join(30)
    assert not any(t.is_alive() for t in left)
    assert loads[0]["end"] in ("UsageError", "loaded")


def test_what_is_read_ahead_is_a_whole_copy_the_hub_is_asked_about(
    online_cache: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from voxtral_mlx.hub import cached_main_snapshot

    assert cached_main_snapshot(REPO) is None  # nothing cached
    snapshot = populate_hub_cache(online_cache, REPO, tiny_checkpoint)
    assert cached_main_snapshot(REPO) == snapshot
    assert cached_main_snapshot(str(tiny_checkpoint)) is None  # a local folder
    assert cached_main_snapshot(Path(REPO)) is None  # a Path is never a repo
    (snapshot / "tekken.json").unlink()  # not whole: resolve_model_dir decides
    assert cached_main_snapshot(REPO) is None
    populate_hub_cache(online_cache, "owner-x/other", tiny_checkpoint)
    assert cached_main_snapshot("owner-x/other") is not None
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)  # no question asked
    assert cached_main_snapshot("owner-x/other") is None
