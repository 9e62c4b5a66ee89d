"""Preset voices: which exist, their language, and their embeddings (loaded on first use).

A voice is a ``[N, dim]`` matrix in the backbone's embedding space, shipped as
``voice_embedding/<name>.pt`` (Mistral's checkpoint, a ``torch.save``d BF16 tensor) or
``voice_embedding/<name>.safetensors`` (converted; one tensor under key ``embedding``).
tekken.json lists the row count N each voice must have.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import struct
import tempfile
import threading
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

import mlx.core as mx
import numpy as np

from .checkpoint import load_tensors, some_names
from .errors import CheckpointError, InputError, VoiceError
from .fileio import (
    atomic_write,
    close_quietly,
    dtype_name,
    one_line,
    open_locked,
    owned_name,
    path_text,
    remove_orphans,
    unreadable_fix,
    usable_path,
)
from .output_dir import (
    deliver_signals,
    directory_path,
    make_dirs,
    remove_dirs,
    signals_deferred,
    written_detail,
)
from .torch_pickle import PtTensor, read_pt, to_mlx

T = TypeVar("T")


def case_matches(name: str, named: Iterable[tuple[str, T]]) -> list[T]:
    """The values whose name equals ``name`` but for case (how ``say -v`` takes a voice)
    and Unicode normalization (a name typed as "café" finds a file named in decomposed
    form, as macOS's older disks and zips made on a Mac store it)."""
    folded = folded_name(name)
    return [value for n, value in named if folded_name(n) == folded]


def no_voices_error(model_dir: Path) -> InputError:
    """A model directory without voice files: where they may be instead, or the fix."""
    other = misplaced_voice_folder(model_dir)
    fix = (
        f"its {one_line(other, 60)}/ folder holds voice files: rename it voice_embedding"
        if other is not None
        else "copy the checkpoint's voice_embedding folder there"
    )
    return InputError(f"{model_dir} has no voices in voice_embedding/: {fix}")


def misplaced_voice_folder(model_dir: Path) -> str | None:
    """The name of a folder of ``model_dir`` other than ``voice_embedding`` that holds voice
    files (``.pt``, or ``.safetensors`` not named ``model*``), if there is one: where a
    renamed or re-organised download keeps them. Looks at a few hundred entries at most."""
    try:
        with os.scandir(model_dir) as entries:
            folders = [e for _, e in zip(range(256), entries) if e.is_dir()]
        for folder in sorted(folders, key=lambda e: e.name):
            if folder.name == "voice_embedding" or folder.name.startswith("."):
                continue
            with os.scandir(folder.path) as inside:
                for _, e in zip(range(256), inside):
                    if e.name.endswith(".pt") or (
                        e.name.endswith(".safetensors") and not e.name.startswith("model")
                    ):
                        return folder.name
    except OSError:
        return None
    return None


LANGUAGE_NAMES: dict[str, str] = {
    "en": "English",
    "fr": "French",
    "es": "Spanish",
    "de": "German",
    "it": "Italian",
    "pt": "Portuguese",
    "nl": "Dutch",
    "ar": "Arabic",
    "hi": "Hindi",
}
_ENGLISH_STYLES = ("casual", "cheerful", "neutral")
EMBEDDING_KEY = "embedding"
MAX_VOICE_ROWS = 4096  # the release's voices have 67 to 218 rows; more is no voice (nor fits)
MAX_VOICE_WIDTH = 16384  # a model's width (3072 for the release), for a voice read alone
_SUFFIXES = (".safetensors", ".pt")  # preferred first


def voice_language(name: str) -> str | None:
    """The language code of a preset voice name (``fr_male`` -> ``fr``), None if unknown."""
    prefix = name.split("_", 1)[0]
    if prefix in _ENGLISH_STYLES:
        return "en"
    return prefix if prefix in LANGUAGE_NAMES and "_" in name else None


@dataclass(frozen=True)
class Voice:
    name: str
    path: Path
    language: str | None
    num_tokens: int | None  # rows tekken.json expects; None when tekken does not list the voice


def _is_file(entry: Path | os.DirEntry) -> bool:
    """A regular file (through links); a dangling or looping link or a directory is not."""
    try:
        return entry.is_file()
    except OSError:  # a symbolic link loop
        return False


def unreadable(path: Path) -> str:
    """The words for a voice file that is not a regular file."""
    what = "a broken or looping symbolic link"
    try:
        mode = os.stat(path).st_mode
    except PermissionError as e:  # its folder cannot be searched
        what = f"{e.strerror}: check the permissions of its folder"
    except OSError:
        pass
    else:
        what = "a directory" if stat.S_ISDIR(mode) else "a pipe, socket or device"
    return f"{one_line(str(path))} is not a readable file ({what})"


def _dangling(path: Path) -> bool:
    """A symbolic link whose target is missing, or a loop of links."""
    return os.path.islink(path) and not os.path.exists(path)


def _close_names(name: str, names: list[str]) -> list[str]:
    """Up to six voice names that ``name`` is part of (``neutral``, ``french``, ``male``)
    or up to three it looks like a typo of (``casual_mal``, ``fr-female``, ``French
    female``), compared without case and with ``-`` and spaces read as ``_``."""
    import difflib

    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    if not key:
        return []
    # A language named in full: "french_female" is fr_female, "english" the en voices.
    codes = {language.lower(): code for code, language in LANGUAGE_NAMES.items()}
    key = "_".join(codes.get(part, part) for part in key.split("_"))
    by_key = {n.lower(): n for n in names}
    if key in by_key:  # the name but for its separators
        return [by_key[key]]
    # Part of a name ("neutral", "fr", "male"): the voices that have every part given.
    wanted = {p for p in key.split("_") if p}
    having = [n for k, n in by_key.items() if wanted <= {*k.split("_"), voice_language(k) or ""}]
    if having:
        return having[:6]
    return [by_key[k] for k in difflib.get_close_matches(key, list(by_key), n=3, cutoff=0.75)]


class VoiceRegistry(Mapping[str, Voice]):
    """The voices found in a directory, by name; embeddings are read lazily and cached."""

    def __init__(
        self,
        voices: Mapping[str, Voice],
        dim: int,
        voice_dir: Path | None = None,
        broken: Mapping[str, Path] | None = None,
        missing: Iterable[str] = (),
    ):
        self._voices = dict(sorted(voices.items()))
        self.dim = dim
        self.voice_dir = voice_dir
        # Voice files that are not readable files (a dangling or looping link, a directory):
        # asked for by name, they are reported as such rather than as unknown voices.
        self.broken = dict(broken or {})
        # Voices the tokenizer lists that have no file, beside others that have one (an
        # incomplete download; with none at all, the folder is what is missing).
        present = {folded_name(n) for n in [*self._voices, *self.broken]}
        self.missing = sorted({m for m in missing if folded_name(m) not in present})
        if not self._voices:
            self.missing = []
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, mx.Dtype | None], mx.array] = {}

    @classmethod
    def from_dir(
        cls, voice_dir: Path | None, expected_tokens: Mapping[str, int], dim: int
    ) -> VoiceRegistry:
        """Scan ``voice_dir`` by file name only (no file is opened).

        ``<name>.safetensors`` wins over ``<name>.pt``; other files are ignored. A missing
        directory (or None) gives an empty registry: the checkpoint simply has no voices.
        """
        found: dict[str, Path] = {}
        broken: dict[str, Path] = {}
        if voice_dir is not None:
            voice_dir = Path(voice_dir)
            if _dangling(voice_dir):
                raise VoiceError(
                    f"voice directory {one_line(str(voice_dir))} is a symbolic link to nothing "
                    "(its target is missing, or links loop); fix the link, or replace it with "
                    "the checkpoint's voice_embedding folder"
                )
            if voice_dir.exists() and not voice_dir.is_dir():
                raise VoiceError(
                    f"voice directory {one_line(str(voice_dir))} is a file, not a directory; "
                    "replace it with the checkpoint's voice_embedding folder"
                )
            try:
                entries = list(os.scandir(voice_dir)) if voice_dir.is_dir() else []
            except OSError as e:
                raise VoiceError(
                    f"cannot list voice directory {one_line(str(voice_dir))}: "
                    f"{one_line(e.strerror or str(e))}; "
                    + unreadable_fix(e, "restore the checkpoint's voice_embedding folder")
                ) from e
            for entry in sorted(entries, key=lambda e: e.name):
                path = Path(entry.path)
                if path.name.startswith(".") or path.suffix not in _SUFFIXES:
                    continue
                if not _is_file(entry):
                    broken.setdefault(path.stem, path)
                    continue
                known = found.get(path.stem)
                if known is None or _SUFFIXES.index(path.suffix) < _SUFFIXES.index(known.suffix):
                    found[path.stem] = path
        # A file's name may differ from tekken.json's in case or Unicode form (as lookups
        # allow): its row count still applies.
        folded = {folded_name(k): v for k, v in expected_tokens.items()}
        voices = {
            name: Voice(
                name,
                path,
                voice_language(name),
                expected_tokens.get(name, folded.get(folded_name(name))),
            )
            for name, path in found.items()
        }
        broken = {n: p for n, p in broken.items() if n not in found}
        return cls(voices, dim, voice_dir, broken, missing=expected_tokens)

    # Mapping protocol: KeyError for unknown names, as Mapping.get / `in` expect.
    def __getitem__(self, name: str) -> Voice:
        return self._voices[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._voices)

    def __len__(self) -> int:
        return len(self._voices)

    def get_voice(self, name: str) -> Voice:
        """The voice called ``name`` (or, as ``say -v`` does, the one name equal to it but
        for case); :class:`VoiceError` listing the valid names otherwise."""
        if not isinstance(name, str):
            what = f"{type(name).__name__} {one_line(repr(name), 60)}"
            hint = f": pass its .name, {name.name!r}" if isinstance(name, Voice) else ""
            raise VoiceError(f"a voice is one name (a string), got {what}{hint}")
        voice = self._voices.get(name)
        if voice is not None:
            return voice
        folded = case_matches(name, self._voices.items())
        if len(folded) == 1:
            return folded[0]
        if folded:
            raise VoiceError(
                f"voice {one_line(repr(name))} is ambiguous: it matches "
                f"{one_line(', '.join(v.name for v in folded), 400)} but for case; give "
                "the exact name"
            )
        bad = self.broken.get(name) or next(iter(case_matches(name, self.broken.items())), None)
        if bad is not None:
            raise VoiceError(
                f"voice {one_line(repr(name))}: {unreadable(bad)}; restore it from the checkpoint"
            )
        if name in self.missing or case_matches(name, [(m, m) for m in self.missing]):
            where = one_line(str(self.voice_dir)) if self.voice_dir is not None else "the model"
            raise VoiceError(
                f"voice {one_line(repr(name))} is listed in tekken.json but has no file in "
                f"{where} (an incomplete download?): fetch the model again, or restore its "
                "voice_embedding file"
            )
        if not self._voices:
            where = f" in {one_line(str(self.voice_dir))}" if self.voice_dir is not None else ""
            raise VoiceError(
                f"unknown voice {one_line(repr(name))}: no voice files were found{where}; "
                f"download the checkpoint's voice_embedding folder or convert voices with "
                f"`voxtral-mlx convert-voices`"
            )
        names = one_line(", ".join(self._voices), 4000)
        if not name.strip():
            raise VoiceError(
                f"the voice name is empty (an unset shell variable?); name one of: {names}"
            )
        close = _close_names(name, list(self._voices))
        either = ", ".join(close[:-1]) + " or " + close[-1] if len(close) > 1 else "".join(close)
        hint = f"did you mean {either}? " if close else ""
        raise VoiceError(
            f"unknown voice {one_line(repr(name))}; {hint}available voices: {names} "
            f"(run `voxtral-mlx voices` to list them with their languages)"
        )

    def cached(self, name: str, dtype: mx.Dtype | None = None) -> mx.array | None:
        """The embedding :meth:`embedding` returned before for ``name`` (its canonical
        name) and ``dtype``, else None: no file is read, nothing is evaluated."""
        with self._lock:
            return self._cache.get((name, dtype))

    def clear_cache(self) -> None:
        """Forget the embeddings read so far (they are read again on next use)."""
        with self._lock:
            self._cache.clear()

    def embedding(self, name: str, dtype: mx.Dtype | None = None) -> mx.array:
        """The voice's ``[N, dim]`` embedding (file dtype unless ``dtype``), read on first use."""
        voice = self.get_voice(name)
        name = voice.name  # one entry per voice, however its name was typed
        with self._lock:
            cached = self._cache.get((name, dtype))
            if cached is not None:
                return cached
            raw = self._cache.get((name, None))
            if raw is None:
                raw = self._cache[(name, None)] = self._load(voice)
            if dtype is None or raw.dtype == dtype:
                result = raw
            else:
                result = raw.astype(dtype)
                mx.eval(result)
                if not mx.all(mx.isfinite(result)).item():  # e.g. 1e5 in a float16 model
                    raise VoiceError(
                        f"voice {name!r} ({one_line(str(voice.path))}) holds values beyond the "
                        f"range of {dtype_name(dtype)}; load the model in float32 or "
                        "bfloat16 instead"
                    )
            self._cache[(name, dtype)] = result
            return result

    def _load(self, voice: Voice) -> mx.array:
        try:
            return self._read(voice)
        except VoiceError as e:
            pt = voice.path.with_suffix(".pt")
            if voice.path.suffix == ".pt" or not pt.is_file():
                raise
            # A .safetensors is taken before the .pt of the same name: say which one to drop.
            raise VoiceError(
                f"{e} (or remove it: {one_line(pt.name)} beside it is used then)"
            ) from e.__cause__

    def _read(self, voice: Voice) -> mx.array:
        src = one_line(str(voice.path))
        if voice.path.suffix == ".pt":
            array = to_mlx(_servable(read_pt(voice.path, max_values=MAX_VOICE_ROWS * self.dim)))
        else:
            array = _load_safetensors(voice.path, src)
        shape = tuple(array.shape)
        if voice.path.suffix == ".pt":
            fix = "re-download it from the checkpoint"
        else:
            fix = "re-convert it from the checkpoint's .pt with `voxtral-mlx convert-voices`"
        if len(shape) != 2:
            raise VoiceError(
                f"voice {voice.name!r} ({src}) has shape {list(shape)}, expected a 2-D "
                f"[N, {self.dim}] embedding; {fix}"
            )
        rows, width = shape
        if width != self.dim:
            raise VoiceError(
                f"voice {voice.name!r} ({src}) is {width} wide but the model's embeddings are "
                f"{self.dim}; it belongs to a different model: use this checkpoint's voices"
            )
        if voice.num_tokens is not None and rows != voice.num_tokens:
            raise VoiceError(
                f"voice {voice.name!r} ({src}) has {rows} rows but tekken.json expects "
                f"{voice.num_tokens} (one of the two files is damaged); {fix}, or tekken.json "
                "if the voice is intact"
            )
        if not mx.issubdtype(array.dtype, mx.floating):
            raise VoiceError(
                f"voice {voice.name!r} ({src}) holds {dtype_name(array.dtype)} values, not "
                f"floats; {fix}"
            )
        if rows < 1:
            raise VoiceError(f"voice {voice.name!r} ({src}) has no rows; {fix}")
        if rows > MAX_VOICE_ROWS:
            raise VoiceError(
                f"voice {voice.name!r} ({src}) has {rows} rows; Voxtral's voices have a few "
                f"hundred (at most {MAX_VOICE_ROWS} are taken: its prompt would not fit the "
                "model's memory or context); use a voice embedding of the checkpoint"
            )
        # Evaluated now: MLX cannot evaluate a lazy array from another thread than the one
        # that built it, and cached voices are shared between threads.
        mx.eval(array)
        # A NaN or inf row poisons every frame (and non-finite codes crash the gather that
        # feeds them back): a damaged voice is refused here. Voices are small: this is cheap.
        if not mx.all(mx.isfinite(array)).item():
            raise VoiceError(
                f"voice {voice.name!r} ({src}) holds NaN or infinite values; it is damaged: "
                "re-download it from the checkpoint"
            )
        return array


def _first_line(e: Exception) -> str:
    return one_line(str(e).splitlines()[0] if str(e) else type(e).__name__, 120)


def _load_safetensors(path: Path, src: str) -> mx.array:
    try:
        tensors = load_tensors(path)
    except Exception as e:  # mlx raises RuntimeError/ValueError with multi-line texts
        if isinstance(e, CheckpointError) and str(e).startswith(f"{path} "):
            raise VoiceError(f"voice file {e}") from None  # the file, what is wrong, the fix
        raise VoiceError(
            f"cannot read voice file {src} ({_first_line(e)}); re-download or re-convert it"
        ) from e
    if not isinstance(tensors, dict):
        raise VoiceError(f"voice file {src} is not a safetensors file; re-convert it")
    if EMBEDDING_KEY in tensors:
        array = tensors[EMBEDDING_KEY]
    elif len(tensors) == 1:
        array = next(iter(tensors.values()))
    else:
        keys = ", ".join(one_line(k, 60) for k in sorted(tensors)[:20]) or "none"
        raise VoiceError(
            f"voice file {src} has no '{EMBEDDING_KEY}' tensor (it holds: {keys}); re-convert it"
        )
    try:
        mx.eval(array)  # read now, under the lock, so a truncated file fails here
    except Exception as e:
        raise VoiceError(
            f"cannot read voice file {src} ({_first_line(e)}); re-download or re-convert it"
        ) from e
    return array


# --------------------------------------------------------------------------- conversion


def _safetensors_bytes_header(t: PtTensor) -> bytes:
    header = {
        "__metadata__": {"format": "pt"},
        EMBEDDING_KEY: {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [0, t.data.nbytes],
        },
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the tensor data 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _write_safetensors(path: Path, t: PtTensor) -> None:
    def write(f: BinaryIO) -> None:
        f.write(_safetensors_bytes_header(t))
        f.write(memoryview(t.data.reshape(-1).view(np.uint8)))

    atomic_write(path, write)


def _voice_sources(sources: object) -> list[Path]:
    if isinstance(sources, (str, os.PathLike)):  # one file or directory, not its letters
        sources = [sources]
    if not isinstance(sources, Iterable) or isinstance(sources, (bytes, bytearray)):
        raise VoiceError(
            f"voice sources are paths (a string or a list of them), got {type(sources).__name__}"
        )
    sources = list(sources)
    if not sources:
        raise VoiceError("no voice sources given: name .pt files or directories holding them")
    files: list[Path] = []
    for source in sources:
        if not isinstance(source, (str, os.PathLike)):
            raise VoiceError(
                f"a voice source is a path (a string), got {type(source).__name__}: name .pt "
                "files or directories"
            )
        source = usable_path(source, "voice source", VoiceError)
        if source.is_dir():
            try:
                with os.scandir(source) as entries:
                    names = [e.name for e in entries if e.name.endswith(".pt")]
            except OSError as e:  # glob() would say "no voices" for a folder it cannot list
                raise VoiceError(
                    f"cannot list voice directory {one_line(str(source))}: "
                    f"{one_line(e.strerror or str(e))}; "
                    f"{unreadable_fix(e, 'check that it is a folder this user can read')}"
                ) from None
            found = sorted(source / n for n in names if not n.startswith("."))
            for path in found:
                if not _is_file(path):
                    raise VoiceError(
                        f"{unreadable(path)}; restore it, or convert the other files one by one"
                    )
            if not found:
                raise VoiceError(
                    f"{one_line(str(source))} holds no .pt voice files: pass the model's "
                    "voice_embedding folder or .pt files"
                )
            files.extend(found)
        elif source.is_file():
            if source.suffix != ".pt":
                raise VoiceError(
                    f"{one_line(str(source))} is not a .pt voice file; name .pt files or "
                    "directories holding them"
                )
            files.append(source)
        elif source.exists() or _dangling(source):
            raise VoiceError(f"{unreadable(source)}; name .pt files or directories holding them")
        else:
            raise VoiceError(f"voice source {one_line(str(source))} does not exist; check the path")
    unique: dict[object, Path] = {}
    for file in files:  # a file named both directly and through its directory counts once
        try:  # by inode and folded name: on APFS v/a.pt and v/A.pt are one file
            st = file.stat()
            key: object = (st.st_dev, st.st_ino, folded_name(file.name))
        except OSError:  # reported when it is read
            key = file.resolve()
        unique.setdefault(key, file)
    return list(unique.values())


def folded_name(name: str) -> str:
    """A name as APFS compares names: case and Unicode normalization ignored."""
    return unicodedata.normalize("NFD", name).casefold()


def _check_voice_tensor(src: Path, tensor) -> None:
    """A voice embedding is a non-empty ``[rows, dim]`` float tensor of finite values; what
    a model would refuse at load is refused at conversion."""
    data = tensor.data
    if tensor.dtype == "BF16":  # stored as 16-bit words: widen to float32 for the checks
        data = (data.astype(np.uint32) << 16).view(np.float32)
    problem = None
    if len(tensor.shape) != 2 or 0 in tensor.shape:
        problem = f"has shape {list(tensor.shape)}, not [rows, dim]"
    elif data.dtype.kind != "f":
        problem = f"holds {tensor.dtype} values, not floats"
    elif not np.all(np.isfinite(data)):
        problem = "holds NaN or infinite values"
    elif tensor.shape[0] > MAX_VOICE_ROWS:
        problem = f"has {tensor.shape[0]} rows (at most {MAX_VOICE_ROWS} are taken)"
    if problem is not None:
        raise VoiceError(
            f"{one_line(str(src))} {problem}: it is not a voice embedding (take the .pt files "
            "from the checkpoint's voice_embedding folder)"
        )


def _servable(tensor: PtTensor) -> PtTensor:
    """``tensor`` in a dtype MLX holds: float64 becomes float32 (Metal has no float64, and
    MLX reads no F64 safetensors), as the model would serve it anyway."""
    if tensor.dtype == "F64":
        return PtTensor("F32", tensor.shape, tensor.data.astype(np.float32))
    return tensor


def _place_new(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst`` unless ``dst`` exists, atomically where the file system has
    hard links: another conversion may have written ``dst`` since it was checked."""
    taken = VoiceError(
        f"{one_line(str(dst))} was written by something else during the conversion; "
        "nothing of this run was kept: remove it or pass --force (overwrite=True) to overwrite it"
    )
    try:
        os.link(src, dst)
    except FileExistsError:
        raise taken from None
    except OSError:  # no hard links here (FAT, some network shares): checked, then moved
        if dst.exists() or dst.is_symlink():
            raise taken from None
        os.replace(src, dst)
    else:
        src.unlink()


def convert_voice_files(
    sources: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    overwrite: bool = True,
) -> list[Path]:
    """Convert ``.pt`` voices (files, or directories of them) to ``out_dir/<stem>.safetensors``.

    Each output holds one tensor under key ``embedding`` with the source's dtype and shape,
    bit-exact (float64, which MLX cannot read, is written as float32). Every source and
    target is checked before anything is written, and the files are written into a hidden
    directory inside ``out_dir`` first, so a failure leaves ``out_dir`` as it was (and
    removes it if it was created); a Ctrl-C while they are moved into place waits until all
    of them are. Returns the written paths in order. Raises
    :class:`VoiceError` (or :class:`UnsafePickleError` for a hostile .pt), also for a
    tensor no model could load (not ``[rows, dim]``, empty, not floats, not finite, more
    than :data:`MAX_VOICE_ROWS` rows).
    """
    if not isinstance(overwrite, (bool, np.bool_)):  # "no" must not mean yes
        raise InputError(f"overwrite must be True or False, got {one_line(repr(overwrite), 60)}")
    files = _voice_sources(sources)
    out_dir = directory_path(out_dir, error=VoiceError)
    targets = [out_dir / f"{src.stem}.safetensors" for src in files]
    seen: dict[str, Path] = {}
    for src, dst in zip(files, targets, strict=True):
        key = folded_name(str(dst))  # APFS: a.safetensors is A.safetensors
        if key in seen:
            raise VoiceError(
                f"{one_line(str(seen[key]))} and {one_line(str(src))} would both be written to "
                f"{one_line(str(dst))}; convert them into separate directories"
            )
        seen[key] = src
        if not overwrite and (dst.exists() or dst.is_symlink()):
            raise VoiceError(
                f"{path_text(dst)} already exists; remove it or pass --force "
                "(overwrite=True) to overwrite it"
            )
        if dst.is_dir() or (dst.exists() and not dst.is_file()):
            raise VoiceError(
                f"{path_text(dst)} exists and is not a file; remove it or choose another "
                "output directory"
            )
    # Voices are small: all are read before anything is written. (Their width is known
    # only to a model: bounded as the widest a voice could be.)
    tensors = [read_pt(src, max_values=MAX_VOICE_ROWS * MAX_VOICE_WIDTH) for src in files]
    for src, tensor in zip(files, tensors, strict=True):
        _check_voice_tensor(src, tensor)
    tensors = [_servable(t) for t in tensors]
    if out_dir.exists() and not out_dir.is_dir():
        raise VoiceError(
            f"output {one_line(str(out_dir))} is a file, not a directory; pick another"
        )
    replaced = {dst for dst in targets if dst.exists() or dst.is_symlink()}
    created: list[Path] = []
    stage: Path | None = None
    lock: int | None = None  # tells other runs (even in other PID namespaces) it is in use
    received: list[int] = []  # signals held while the files went into place
    try:
        created = make_dirs(out_dir)
        remove_orphans(out_dir, "voices", "partial")
        stage = out_dir / owned_name("voices", "partial")
        stage.mkdir(mode=0o700)
        lock = open_locked(stage)
        for tensor, dst in zip(tensors, targets, strict=True):
            _write_safetensors(stage / dst.name, tensor)
        # Ctrl-C is held while the files go into place: all of them or none.
        with signals_deferred() as received:
            _place_all(stage, targets, overwrite, replaced)
            shutil.rmtree(stage, ignore_errors=True)
            close_quietly(lock)
    except BaseException as e:
        with signals_deferred() as again:
            if stage is not None and not (isinstance(e, _NotPutBack) and e.in_stage):
                shutil.rmtree(stage, ignore_errors=True)
            close_quietly(lock)
            remove_dirs(created)
        # (Where replaced voices are, if they could not be put back, is the line to show.)
        deliver_signals([*received, *again], str(e) if isinstance(e, _NotPutBack) else None)
        if isinstance(e, OSError):
            raise VoiceError(
                f"cannot write voices to {one_line(str(out_dir))}: "
                f"{one_line(e.strerror or str(e))}; choose a writable output directory"
            ) from e
        raise
    deliver_signals(received, written_detail(out_dir))
    return targets


def _place_all(stage: Path, targets: list[Path], overwrite: bool, replaced: set[Path]) -> None:
    """Move the staged files onto ``targets``, all of them or none: on a failure the ones
    placed are removed and the files they replaced put back. A replaced file is kept (in a
    folder of the stage no target can be named) as a hard link, so every target holds its
    old file or its new one at each moment (a model reading its voices meanwhile finds one)."""
    placed: list[tuple[Path, Path | None]] = []
    try:
        for dst in targets:
            if not overwrite:
                _place_new(stage / dst.name, dst)
                placed.append((dst, None))
                continue
            kept = _keep(dst, stage / _KEPT / dst.name) if dst in replaced else None
            if kept is not None:
                placed.append((dst, kept))
            os.replace(stage / dst.name, dst)
            if kept is None:
                placed.append((dst, None))
    except BaseException as e:
        failed = _put_back(placed)
        if failed:
            raise _not_put_back(stage, failed, e) from e
        raise


# The stage's folder of the replaced files (the staged files are *.safetensors beside it).
_KEPT = "replaced"


class _NotPutBack(VoiceError):
    """Replaced voices that could not be put back: where they are is kept and named."""

    def __init__(self, message: str, in_stage: bool) -> None:
        super().__init__(message)
        self.in_stage = in_stage  # they could not be moved out of the stage: keep it


def _keep(dst: Path, kept: Path) -> Path | None:
    """``dst`` kept as ``kept`` (a hard link; moved where there are none); None if it is
    gone."""
    kept.parent.mkdir(exist_ok=True)
    try:
        os.link(dst, kept, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except (OSError, NotImplementedError):  # no hard links here (FAT, some shares)
        try:
            os.replace(dst, kept)
        except FileNotFoundError:
            return None
    return kept


def _put_back(placed: list[tuple[Path, Path | None]]) -> list[tuple[Path, Path | None]]:
    """Undo :func:`_place_all`'s renames, latest first; the ones that could not be undone."""
    failed = []
    for dst, kept in reversed(placed):
        try:
            if kept is not None:
                os.replace(kept, dst)
            else:
                dst.unlink(missing_ok=True)
        except OSError:
            failed.append((dst, kept))
    return failed


def _not_put_back(
    stage: Path, failed: list[tuple[Path, Path | None]], cause: BaseException
) -> VoiceError:
    """The error for renames :func:`_put_back` could not undo. Replaced voices among them
    are moved out of the stage (which would be removed) into a new visible folder, named."""
    why = one_line(str(cause) or type(cause).__name__, 100)
    old = [dst for dst, kept in failed if kept is not None]
    out_dir = path_text(stage.parent)  # files named by name: each is in the output folder
    if not old:
        return VoiceError(
            f"{some_names([d.name for d, _ in failed], 2)} could not be removed from {out_dir} "
            f"after the conversion failed ({why}): remove {'it' if len(failed) == 1 else 'them'}"
        )
    kept_dir = stage / _KEPT
    in_stage = True
    try:  # a new name each time: a folder from an earlier run stays as it is
        visible = Path(tempfile.mkdtemp(prefix="replaced-voices-", dir=stage.parent))
    except OSError:
        visible = None
    if visible is not None:
        try:
            os.rename(kept_dir, visible / "voices")
            kept_dir, in_stage = visible / "voices", False
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(visible)
    return _NotPutBack(
        f"{some_names([d.name for d in old], 2)} could not be put back after the conversion "
        f"failed ({why}): the voices it replaced are in {path_text(kept_dir)}; move them "
        f"back into {out_dir}",
        in_stage,
    )
