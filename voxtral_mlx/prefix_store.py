"""Voice-prefix KV states on disk, so a new process starts a known voice without its prefill.

One safetensors file per (model, voice, compute dtype): the keys and values of every backbone
layer after ``[BOS, BEGIN_AUDIO, voice rows..., NEXT_AUDIO_TEXT]``. The file name and the
key stored inside it hash everything the state depends on -- the model files (names, sizes,
modification times, safetensors headers and a sample of every tensor), the compute dtype,
the prompt ids, the voice's rows themselves, and the code and MLX build that compute it --
so a changed model, voice, dtype or upgraded voxtral_mlx does not reuse a stale file.
The file also records a digest of its tensors' bytes: a file that is unreadable, truncated,
inconsistent or has bytes changed on disk is a miss (and is removed); a
directory that cannot be written only loses the cache (a :class:`PrefixCacheWarning`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import marshal
import os
import pkgutil
import re
import struct
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import VoxtralError
from .fileio import TEMP_KIND, atomic_write, one_line, path_text, prune_oldest, remove_orphans
from .model.cache import KVCache

FORMAT = "voxtral_mlx.prefix/3"  # 3: prefilled in fixed parts
MAX_FILES = 32  # least recently used files beyond this are deleted
_MODEL_FILES = (".safetensors", ".json")
_HEADER_LIMIT = 64 << 20  # a safetensors header larger than this is not one
_SAMPLE = 64  # bytes of each tensor read at its start, middle and end
# The files this cache writes (see PrefixStore._path): pruning and clear() touch no other,
# whatever else the folder holds.
_OWN_NAME = re.compile(r"[0-9a-f]{16}-[0-9a-f]{32}\.safetensors")


# The code that computes a prefix, beside voxtral_mlx.model's modules: an upgrade that
# changes it must not be served the old code's states.
_PREFIX_CODE = ("config", "engine", "generate", "loader", "checkpoint", "mlx_layout")


@functools.cache
def code_digest() -> str:
    """A hash of voxtral_mlx's version, the size of its prefill parts and the code that
    computes a prefix (the model's modules, the config, engine and loader), so that a
    prefix stored by another version or a patched copy is another key."""
    from . import __version__, model
    from .engine import PREFIX_PART_TOKENS

    names = [f"{__package__}.{n}" for n in _PREFIX_CODE]
    names += [f"{model.__name__}.{m.name}" for m in pkgutil.iter_modules(model.__path__)]
    h = hashlib.sha256(f"{__version__}\0{PREFIX_PART_TOKENS}\0".encode())
    for name in sorted(names):
        h.update(f"{name}\0".encode() + _module_code(name))
    return h.hexdigest()


def _module_code(name: str) -> bytes:
    """The source of module ``name``; in an app bundle or a zip that ships compiled
    modules only, its code object."""
    try:
        loader = importlib.import_module(name).__spec__.loader
        source = loader.get_source(name)
        if source is not None:
            return source.encode()
        return marshal.dumps(loader.get_code(name))
    except Exception:  # nothing to read: the version and the module's name still count
        return b"\0absent"


class PrefixCacheWarning(UserWarning):
    """The voice-prefix cache directory could not be used; generation goes on without it."""


def model_fingerprint(model_dir: Path) -> str:
    """A hash of the model directory's weight and config files: name, size, modification
    and change times, and for safetensors the header (every tensor's name, dtype,
    shape and offsets) and a sample of every tensor's bytes (its start, middle and end), so
    that another checkpoint of the same shapes copied in with its timestamps kept is not
    taken for it. The change time, which no tool can set back, catches an edit in place that
    restored the modification time (at the cost of one prefill after the file is copied or
    its permissions change)."""
    h = hashlib.sha256(FORMAT.encode())
    for path in sorted(Path(model_dir).iterdir()):
        if path.suffix not in _MODEL_FILES or path.name.startswith("."):
            continue
        try:
            if not path.is_file():
                continue
            st = path.stat()
            stamp = f"{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
            h.update(f"{path.name}\0{stamp}\0".encode())
            if path.suffix == ".safetensors":
                with path.open("rb") as f:
                    _hash_safetensors(f, h, st.st_size)
            elif st.st_size <= _HEADER_LIMIT:
                h.update(path.read_bytes())
        except OSError:  # a file the loader did not need (it read the rest): its name counts
            h.update(f"{path.name}\0unreadable\0".encode())
    return h.hexdigest()


def _hash_safetensors(f, h, size: int) -> None:
    head = f.read(8)
    if len(head) < 8:
        return
    (n,) = struct.unpack("<Q", head)
    header = f.read(min(n, _HEADER_LIMIT))
    h.update(header)
    # Not for the fingerprint to judge a damaged header or spans outside the file (a stray
    # file the loader passes over, or one it is about to report): it samples what it can.
    try:
        entries = json.loads(header)
        spans = [
            tuple(e["data_offsets"])
            for k, e in entries.items()
            if k != "__metadata__" and isinstance(e, dict)
        ]
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return
    data = size - 8 - n
    offsets = set()
    for span in spans:
        if len(span) == 2 and all(type(v) is int for v in span) and 0 <= span[0] < span[1]:
            b, e = span
            if e <= data:
                offsets.update((b, (b + e) // 2, max(b, e - _SAMPLE)))
    for offset in sorted(offsets):  # in file order: a few hundred small reads
        f.seek(8 + n + offset)
        h.update(f.read(_SAMPLE))


def _digest(arrays: dict[str, mx.array]) -> str:
    """SHA-256 of the arrays' names, shapes, dtypes and bytes (evaluates them)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}\0{a.dtype}\0{tuple(a.shape)}\0".encode())
        h.update(_bytes(a))
    return h.hexdigest()


def _bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:  # numpy has no bfloat16: take its bits
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


class PrefixStore:
    """The prefix files of one loaded model (``fingerprint``) in ``directory``."""

    def __init__(
        self, directory: str | os.PathLike[str], fingerprint: str, max_files: int = MAX_FILES
    ):
        # Absolute: an app that changes its working directory keeps using this folder.
        self.directory = Path(directory).expanduser().absolute()
        self.fingerprint = fingerprint
        self.max_files = max_files
        self._warned = False

    def key(self, prompt_ids: list[int], voice_rows: mx.array) -> str:
        """The full key of a prefix: model, dtype, prompt ids and the voice rows' bytes, and
        the code, MLX version and device that compute it (another kernel's last bits would
        make the output differ from an uncached run's)."""
        h = hashlib.sha256(f"{FORMAT}\0{self.fingerprint}\0{voice_rows.dtype}\0".encode())
        h.update(f"{code_digest()}\0{mx.__version__}\0{mx.default_device()}\0".encode())
        h.update(json.dumps(prompt_ids).encode())
        h.update(str(tuple(voice_rows.shape)).encode())
        h.update(_bytes(voice_rows))
        return h.hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / f"{self.fingerprint[:16]}-{key[:32]}.safetensors"

    def load(
        self, key: str, n_layers: int, shape: tuple[int, int, int, int], dtype: mx.Dtype
    ) -> list[KVCache] | None:
        """The stored state for ``key`` (``n_layers`` caches of keys and values ``shape``
        ``[1, kv_heads, positions, head_dim]``), or None. The stored key, shapes and dtype
        are checked."""
        path = self._path(key)
        try:
            if not path.is_file():
                return None
        except OSError as e:  # a folder the app may not read (a sandbox): as if empty
            self._warn("read", e)
            return None
        try:
            arrays, meta = mx.load(str(path), return_metadata=True)
            if meta.get("format") != FORMAT or meta.get("key") != key:
                raise ValueError("key mismatch")
            caches = []
            for i in range(n_layers):
                k, v = arrays[f"keys.{i}"], arrays[f"values.{i}"]
                if tuple(k.shape) != shape or tuple(v.shape) != shape:
                    raise ValueError("wrong shape")
                if k.dtype != dtype or v.dtype != dtype:
                    raise ValueError("wrong dtype")
                cache = KVCache()
                cache.keys, cache.values, cache.offset = k, v, shape[2]
                caches.append(cache)
            if len(arrays) != 2 * n_layers:
                raise ValueError("wrong layer count")
            if meta.get("sha256") != _digest(arrays):
                raise ValueError("content changed")
        except Exception:
            # Damaged or foreign: recompute (the caller does) and replace it, if the folder
            # lets us (if not, saving will say so once).
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # least recently used order for pruning
        return caches

    def save(self, key: str, caches: list[KVCache]) -> None:
        """Store ``caches`` (evaluated) under ``key``, atomically; prune the oldest files."""
        arrays = {}
        for i, cache in enumerate(caches):
            arrays[f"keys.{i}"], arrays[f"values.{i}"] = cache.state
        meta = {"format": FORMAT, "key": key, "sha256": _digest(arrays)}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            atomic_write(
                self._path(key),
                lambda f: mx.save_safetensors(f, arrays, metadata=meta),
                durable=False,  # checked when read: need not reach the drive at once
            )
            self._prune(keep=self._path(key))
        except (OSError, RuntimeError, ValueError) as e:
            self._warn("write", e)

    def _warn(self, what: str, error: BaseException) -> None:
        if self._warned:  # once per store: it would repeat for every voice
            return
        self._warned = True
        # Warnings turned into errors must not fail the frame (and every running request)
        # over a cache that is only lost: the requests go on, prefilled each time.
        with contextlib.suppress(Exception):
            self._warn_now(what, error)

    def _warn_now(self, what: str, error: BaseException) -> None:
        warnings.warn(
            f"cannot {what} the voice-prefix cache in {one_line(str(self.directory))}: "
            f"{one_line(str(error))}; voices are prefilled again in each process "
            "(turn the cache off with --no-prefix-cache, or prefix_cache_dir=None "
            "in load())",
            PrefixCacheWarning,
            stacklevel=4,
        )

    def clear(self) -> None:
        """Delete this model's files (other models' are left alone)."""
        for path in self._files():
            if path.name.startswith(self.fingerprint[:16] + "-"):
                try:
                    path.unlink(missing_ok=True)
                except OSError as e:
                    raise VoxtralError(
                        f"cannot delete the voice-prefix file {path_text(path)}: "
                        f"{e.strerror or e}; delete it by hand or fix the folder's permissions"
                    ) from None

    def _files(self) -> list[Path]:
        try:
            return [p for p in self.directory.iterdir() if _OWN_NAME.fullmatch(p.name)]
        except OSError:
            return []

    def _prune(self, keep: Path) -> None:
        """Delete the oldest of the cache's files beyond ``max_files``, never ``keep``."""
        # Temp files of processes killed while writing (the CLI exits without waiting
        # after Ctrl-C); a running process's may be a write in progress and stays. Only
        # those of files this cache names: a shared folder holds others' too.
        remove_orphans(self.directory, _OWN_NAME, TEMP_KIND)
        prune_oldest(self.directory, _OWN_NAME, keep.name, self.max_files)
