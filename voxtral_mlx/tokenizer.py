"""Mistral's Tekken tokenizer (``tekken.json``) on top of HuggingFace ``tokenizers``.

Tekken is tiktoken-style byte-level BPE: the text is split by ``config.pattern``, each
piece's UTF-8 bytes are merged by rank (a token's rank is its merge priority) over the
first ``default_vocab_size - default_num_special_tokens`` vocab entries, and a text
token's id is its rank plus the number of special tokens. Special tokens are never
produced from text.

tiktoken's semantics map onto a ``tokenizers`` BPE model as follows:

* the vocab is every rank's bytes in the GPT-2 byte-to-unicode alphabet, id = rank + offset;
* tiktoken may merge *any* adjacent pair whose concatenation is a token, so every split
  ``(a, b)`` of a token ``T`` with both halves in the vocab becomes a merge, ranked by
  ``rank(T)`` (then by split point; among splits of one token the order is arbitrary);
* tiktoken emits a piece that is itself a token directly, without merging: that is
  ``ignore_merges=True``.

Building that model from the 15 MB ``tekken.json`` takes about a second, so the serialized
result is cached, keyed by the file's SHA-256 (see :func:`default_cache_dir`); within a
process, tokenizers of the same file content share one built model.
"""

from __future__ import annotations

import binascii
import contextlib
import copy
import hashlib
import json
import operator
import os
import re
import weakref
from collections.abc import Iterable, Mapping
from itertools import groupby
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from .errors import InputError, TokenizerError
from .fileio import (
    TEMP_KIND,
    atomic_write_text,
    one_line,
    prune_oldest,
    read_limited,
    remove_orphans,
    unreadable_fix,
    usable_path,
)

# Bump when the cached file's layout or the way the model is built changes.
CACHE_FORMAT = 4  # 2: max_token_bytes; 3: merges as "a b" strings; 4: a content checksum
# Entries (6.6 MB each for the real vocabulary) of other tekken.json files beyond this are
# deleted, the least recently used first.
MAX_CACHED_TOKENIZERS = 8
MAX_TEKKEN_BYTES = 256 << 20  # the real tekken.json holds 19 MB
MAX_TOKEN_BYTES = 1024  # Tekken's longest token has 78 bytes
MAX_MERGES = 4_000_000  # Tekken's vocabulary makes about 270,000
MAX_VOICE_TOKENS = 4096  # as many rows as a voice file may have (voices.MAX_VOICE_ROWS)
MAX_SPECIAL_TOKENS = 100_000  # Tekken has 1000
RELEASE_GIL_CHARS = 1024  # longer texts are tokenized with the GIL released

BOS = "<s>"
AUDIO = "[AUDIO]"
BEGIN_AUDIO = "[BEGIN_AUDIO]"
NEXT_AUDIO_TEXT = "[NEXT_AUDIO_TEXT]"
REPEAT_AUDIO_TEXT = "[REPEAT_AUDIO_TEXT]"

# What mistral-common assumes for files without a special_tokens list (v7 and older).
LEGACY_SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, the alphabet of ByteLevel models."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


_BYTE_CHARS = _byte_alphabet()
# bytes.decode("latin-1") maps byte b to chr(b); this finishes the mapping to the alphabet.
_LATIN1_TO_ALPHABET = {b: c for b, c in enumerate(_BYTE_CHARS) if chr(b) != c}


def default_cache_dir() -> Path:
    """``$VOXTRAL_MLX_CACHE``, else ``$XDG_CACHE_HOME/voxtral_mlx``, else ``~/.cache/voxtral_mlx``.

    Tokenizer builds go in its ``tokenizers/`` subfolder.
    """
    env = os.environ.get("VOXTRAL_MLX_CACHE")
    if env:
        return usable_path(env, "$VOXTRAL_MLX_CACHE")
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "voxtral_mlx"


class TekkenTokenizer:
    """Text <-> ids for a ``tekken.json``; ids are the model's ids (rank + special count)."""

    def __init__(
        self,
        backend: Tokenizer,
        *,
        vocab_size: int,
        special_tokens: list[str],
        version: str | None,
        audio: dict[str, Any],
        path: Path | None = None,
        max_token_bytes: int | None = None,
    ):
        self._backend = backend
        # The most bytes of text one token stands for (a floor on a text's token count).
        self.max_token_bytes = max_token_bytes or max(map(len, backend.get_vocab()), default=1)
        self.vocab_size = vocab_size
        self.num_special_tokens = len(special_tokens)
        self.version = version
        self.special_tokens: tuple[str, ...] = tuple(special_tokens)
        self.special_ids: dict[str, int] = {s: i for i, s in enumerate(special_tokens)}
        self.audio = audio
        self.voice_num_audio_tokens: dict[str, int] = _voice_counts(audio)
        self.path = path
        self._built: _Built | None = None  # the shared build this one is made from, if any

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_file(cls, path: str | Path, cache_dir: Path | None = None) -> TekkenTokenizer:
        """Load ``tekken.json``, reusing a cached build of the same file content if present.

        The cache lives in ``<cache_dir or default_cache_dir()>/tokenizers``; when it cannot
        be written, the tokenizer is simply built every time. While a tokenizer of the same
        content (and cache folder) lives in this process, its built model is shared instead.
        """
        path = Path(path)
        try:
            raw = read_limited(path, MAX_TEKKEN_BYTES)
        except FileNotFoundError:
            raise TokenizerError(
                f"tokenizer file {path} not found: point to the model's tekken.json "
                "or download the model again"
            ) from None
        except IsADirectoryError:
            raise TokenizerError(
                f"{path} is a directory: pass the tekken.json file inside it"
            ) from None
        except OSError as e:
            fix = unreadable_fix(e, "restore it from the model's download")
            raise TokenizerError(
                f"cannot read tokenizer file {path}: {e.strerror or e}; {fix}"
            ) from None

        digest = hashlib.sha256(raw).hexdigest()
        cache_file = _cache_root(cache_dir) / f"tekken-{digest}-f{CACHE_FORMAT}.json"
        key = os.fspath(cache_file)  # names the content (its digest) and the cache folder
        built = _LIVE.get(key)
        if built is None and (cached := _read_cache(cache_file, digest)) is not None:
            built = _shared(key, *cached)
        if built is not None:
            with contextlib.suppress(OSError):
                os.utime(cache_file)  # least recently used order for pruning
            try:
                return cls._from_built(built, path)
            except Exception:
                _LIVE.pop(key, None)  # an entry this release cannot use: built again below
        meta, backend = _build(raw, path)
        _write_cache(cache_file, {"sha256": digest, "format": CACHE_FORMAT, **meta}, backend)
        return cls._from_built(_shared(key, meta, backend), path)

    @classmethod
    def _from_built(cls, built: _Built, path: Path) -> TekkenTokenizer:
        meta = copy.deepcopy(built.meta)  # an instance's attributes are its own
        tokenizer = cls(
            built.backend,
            vocab_size=meta["vocab_size"],
            special_tokens=meta["special_tokens"],
            version=meta["version"],
            audio=meta["audio"],
            path=path,
            max_token_bytes=meta["max_token_bytes"],
        )
        tokenizer._built = built  # keeps it listed in _LIVE while this one lives
        return tokenizer

    # ------------------------------------------------------------------ text

    def encode(self, text: str) -> list[int]:
        """Text ids of ``text`` (no BOS/EOS); special-token strings in it are plain text."""
        if not isinstance(text, str):
            raise InputError(f"text to tokenize must be a str, got {type(text).__name__}")
        try:
            try:
                return self._encode(text)
            except TypeError:
                # Lone surrogates cannot cross into Rust; tiktoken replaces them the same way.
                fixed = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
                return self._encode(fixed)
        except BaseException as e:
            # A Rust panic (pyo3's PanicException, a BaseException): e.g. a config.pattern
            # that backtracks without end on this text.
            if type(e).__name__ != "PanicException":
                raise
            reason = one_line(str(e).splitlines()[0] if str(e) else "a panic", 120)
            # Oniguruma's backtracking bound, which Tekken's own pattern reaches only on a run
            # of millions of characters (a damaged pattern on a short text: restore it).
            if "retry-limit" in reason and len(text) >= 1_000_000:
                raise TokenizerError(
                    f"the tokenizer's pattern gave up on this text ({reason}): it holds a run "
                    f"too long to tokenize ({len(text):,} characters; e.g. millions of spaces), "
                    "as mistral-common's does too: shorten that run"
                ) from None
            raise TokenizerError(
                f"{self.path}: the tokenizer failed on this text ({reason}), which Tekken's "
                "own config.pattern does not: restore tekken.json from the model's download"
            ) from None

    def _encode(self, text: str) -> list[int]:
        if len(text) > RELEASE_GIL_CHARS:
            # The same ids, and other threads (an event loop) run meanwhile: encode() holds
            # the GIL throughout (0.3 s for 100,000 words), encode_batch() does not.
            return self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special ids are skipped, invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise InputError(f"ids must be a sequence of integers, got {type(ids).__name__}")
        out = []
        for i in ids:
            try:
                out.append(operator.index(i))  # 3.0 or 1046.9 is no id (int() would cut it)
            except TypeError:
                raise InputError(
                    f"token ids must be integers, got {one_line(repr(i), 40)} ({type(i).__name__})"
                ) from None
        ids = out
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise TokenizerError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        n_special = self.num_special_tokens
        # Like mistral-common, each run between special ids is decoded on its own.
        return "".join(
            self._backend.decode(list(run))
            for is_special, run in groupby(ids, lambda i: i < n_special)
            if not is_special
        )

    def special_id(self, token_str: str) -> int:
        """Id of the special token ``token_str`` (e.g. ``"[AUDIO]"``)."""
        if not isinstance(token_str, str):
            raise InputError(
                f"a special token is a str such as '[AUDIO]', got {type(token_str).__name__}"
            )
        try:
            return self.special_ids[token_str]
        except KeyError:
            where = f" {self.path}" if self.path else ""
            raise TokenizerError(
                f"special token {one_line(token_str, 60)} is not in tokenizer{where}: "
                "use the tekken.json shipped with Voxtral-4B-TTS"
            ) from None

    def min_tokens(self, text: str) -> int:
        """A floor on ``len(encode(text))`` found without tokenizing: a text far too long
        is refused before the tokenizer's regex, which gives up on runs of some ten
        million characters, ever sees it."""
        return -(-len(text) // self.max_token_bytes)  # at least a byte per character

    @property
    def backend(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (text ids only, no special tokens)."""
        return self._backend

    def __repr__(self) -> str:
        return (
            f"TekkenTokenizer(path={str(self.path)!r}, version={self.version!r}, "
            f"vocab_size={self.vocab_size}, num_special_tokens={self.num_special_tokens})"
        )


def speech_prompt_ids(tokenizer: TekkenTokenizer, text: str, num_voice_tokens: int) -> list[int]:
    """The TTS prompt: ``<s> [BEGIN_AUDIO] [AUDIO]*N [NEXT_AUDIO_TEXT] text
    [REPEAT_AUDIO_TEXT] [BEGIN_AUDIO]``, text tokenized raw."""
    try:
        if isinstance(num_voice_tokens, bool):
            raise TypeError
        num_voice_tokens = operator.index(num_voice_tokens)
    except TypeError:
        raise InputError(
            f"num_voice_tokens must be an int, got {type(num_voice_tokens).__name__}"
        ) from None
    if num_voice_tokens < 0:
        raise InputError(f"num_voice_tokens must be >= 0, got {num_voice_tokens}")
    sid = tokenizer.special_id
    begin_audio = sid(BEGIN_AUDIO)
    return [
        sid(BOS),
        begin_audio,
        *([sid(AUDIO)] * num_voice_tokens),
        sid(NEXT_AUDIO_TEXT),
        *tokenizer.encode(text),
        sid(REPEAT_AUDIO_TEXT),
        begin_audio,
    ]


# ---------------------------------------------------------------------- building


def _build(raw: bytes, path: Path) -> tuple[dict[str, Any], Tokenizer]:
    """Validate a tekken.json's bytes and build its metadata and BPE tokenizer."""
    try:
        return _build_checked(raw, path)
    except TokenizerError as e:
        if ";" in str(e) or "tekken.json" in str(e).removeprefix(str(path)):  # names a fix
            raise
        raise TokenizerError(f"{e}; restore tekken.json from the model's download") from None


def _build_checked(raw: bytes, path: Path) -> tuple[dict[str, Any], Tokenizer]:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(
            f"{path} is not valid JSON ({e}): download tekken.json again"
        ) from None
    except (ValueError, RecursionError):  # a 5000-digit number, arrays nested 10^5 deep
        raise TokenizerError(
            f"{path} is not a usable tekken.json (absurdly long numbers or nesting): "
            "download tekken.json again"
        ) from None
    if isinstance(data, list):
        raise TokenizerError(
            f"{path} uses the legacy bare-list tekken layout, which is not supported: "
            "use a tekken.json with 'config', 'vocab' and 'special_tokens'"
        )
    if not isinstance(data, dict):
        raise TokenizerError(
            f"{path} has an unsupported layout (top level is {type(data).__name__}, "
            "expected an object with 'config' and 'vocab')"
        )
    for key in ("config", "vocab"):
        if key not in data:
            raise TokenizerError(
                f"{path} is missing the '{key}' section: it is not a tekken.json file"
            )
    config, vocab = data["config"], data["vocab"]
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: 'config' must be an object")
    if not isinstance(vocab, list):
        raise TokenizerError(f"{path}: 'vocab' must be a list of tokens")

    pattern = config.get("pattern")
    if not isinstance(pattern, str) or not pattern:
        raise TokenizerError(f"{path}: config.pattern is missing or not a string")
    vocab_size = _config_int(config, "default_vocab_size", path)
    n_special = _config_int(config, "default_num_special_tokens", path)
    if n_special > MAX_SPECIAL_TOKENS:  # each gets a name string, built up front
        raise TokenizerError(
            f"{path}: config.default_num_special_tokens is {n_special} (Tekken has 1000; "
            f"at most {MAX_SPECIAL_TOKENS} are accepted): restore tekken.json from the "
            "model's download"
        )
    version = config.get("version")
    if version is not None and not isinstance(version, str):
        raise TokenizerError(f"{path}: config.version must be a string, got {version!r}")
    n_text = vocab_size - n_special
    if n_text < 256:
        raise TokenizerError(
            f"{path}: default_vocab_size {vocab_size} leaves {n_text} text tokens after "
            f"{n_special} special tokens (byte-level BPE needs at least the 256 byte tokens)"
        )
    if len(vocab) < n_text:
        raise TokenizerError(
            f"{path}: vocab has {len(vocab)} entries but default_vocab_size - "
            f"default_num_special_tokens = {n_text}: the file is truncated or inconsistent"
        )

    special_tokens = _special_tokens(data.get("special_tokens"), n_special, path)
    audio = data.get("audio") or {}
    if not isinstance(audio, dict):
        raise TokenizerError(f"{path}: 'audio' must be an object")
    try:
        _voice_counts(audio)
    except TokenizerError as e:
        raise TokenizerError(f"{path}: {e}") from None

    strings = _vocab_strings(vocab[:n_text], path)
    backend = _build_backend(strings, pattern, n_special, path)
    meta = {
        "vocab_size": vocab_size,
        "special_tokens": special_tokens,
        "version": version,
        "audio": audio,
        "max_token_bytes": max(map(len, strings), default=1) or 1,  # a character per byte
    }
    return meta, backend


def _config_int(config: Mapping[str, Any], key: str, path: Path) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        shown = one_line(repr(value), 60)
        raise TokenizerError(f"{path}: config.{key} must be a positive integer, got {shown}")
    return value


def _special_tokens(entries: Any, n_special: int, path: Path) -> list[str]:
    """Special token strings by id, padded with ``<SPECIAL_i>`` like mistral-common."""
    if entries is None:
        names = list(LEGACY_SPECIAL_TOKENS[:n_special])
    else:
        if not isinstance(entries, list):
            raise TokenizerError(f"{path}: 'special_tokens' must be a list")
        if len(entries) > n_special:
            raise TokenizerError(
                f"{path}: {len(entries)} special tokens but "
                f"config.default_num_special_tokens is {n_special}"
            )
        names = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("token_str"), str):
                raise TokenizerError(f"{path}: special_tokens[{i}] has no string 'token_str'")
            if entry.get("rank") != i:
                raise TokenizerError(
                    f"{path}: special_tokens[{i}] ({one_line(entry['token_str'], 60)}) has rank "
                    f"{one_line(repr(entry.get('rank')), 60)}, expected {i}"
                )
            names.append(entry["token_str"])
    names += [f"<SPECIAL_{i}>" for i in range(len(names), n_special)]
    if len(set(names)) != len(names):
        dup = next(s for s in names if names.count(s) > 1)
        raise TokenizerError(f"{path}: special token {one_line(dup, 60)} appears more than once")
    return names


def _voice_counts(audio: Mapping[str, Any]) -> dict[str, int]:
    counts = audio.get("voice_num_audio_tokens") or {}
    if not isinstance(counts, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in counts.items()
    ):
        raise TokenizerError(
            "audio.voice_num_audio_tokens must map voice names to non-negative integers"
        )
    # The release's voices have 67 to 218 rows: a count past any voice is a damaged file
    # (the voice's own file would be blamed for not matching it).
    huge = next(((k, v) for k, v in counts.items() if v > MAX_VOICE_TOKENS), None)
    if huge is not None:
        raise TokenizerError(
            f"audio.voice_num_audio_tokens gives voice {one_line(huge[0], 60)} {huge[1]:,} "
            f"rows (at most {MAX_VOICE_TOKENS:,} are accepted; Mistral's voices have 67 to "
            "218): the file is damaged; re-download tekken.json"
        )
    return dict(counts)


def _vocab_strings(vocab: list[Any], path: Path) -> list[str]:
    """Each rank's bytes spelled in the byte-level alphabet; checks tiktoken's invariants."""
    out: list[str] = []
    for i, entry in enumerate(vocab):
        try:
            rank, b64 = entry["rank"], entry["token_bytes"]
            token = binascii.a2b_base64(b64)
        except (TypeError, KeyError, binascii.Error, ValueError):
            raise TokenizerError(
                f"{path}: vocab[{i}] needs an integer 'rank' and base64 'token_bytes'"
            ) from None
        if rank != i:
            shown = one_line(repr(rank), 60)
            raise TokenizerError(f"{path}: vocab[{i}] has rank {shown}, expected {i}")
        if i < 256 and token != bytes([i]):
            raise TokenizerError(f"{path}: vocab[{i}] must be the single byte {i}, got {token!r}")
        if not token:  # a2b_base64 skips what is not base64: "@@@" decodes to nothing
            what = (
                "empty token_bytes" if not b64 else f"token_bytes {b64!r:.40} that are not base64"
            )
            raise TokenizerError(f"{path}: vocab[{i}] has {what}; re-download tekken.json")
        if len(token) > MAX_TOKEN_BYTES:  # building merges costs its length squared
            raise TokenizerError(
                f"{path}: vocab[{i}] is {len(token)} bytes long (at most {MAX_TOKEN_BYTES} are "
                "accepted; Tekken's longest has 78): the file is damaged; re-download tekken.json"
            )
        out.append(token.decode("latin-1").translate(_LATIN1_TO_ALPHABET))
    return out


def _build_backend(strings: list[str], pattern: str, offset: int, path: Path) -> Tokenizer:
    vocab = {s: i + offset for i, s in enumerate(strings)}
    if len(vocab) != len(strings):
        first = {}
        for i, s in enumerate(strings):
            if s in first:
                raise TokenizerError(f"{path}: vocab[{i}] repeats the bytes of vocab[{first[s]}]")
            first[s] = i
    # Strings are in rank order, so merges come out ordered by rank(T), then split point.
    merges: list[tuple[str, str]] = []
    for s in strings:
        merges.extend(
            (a, b) for k in range(1, len(s)) if (a := s[:k]) in vocab and (b := s[k:]) in vocab
        )
        if len(merges) > MAX_MERGES:
            # Every substring of one long token as a token: 19 MB made 10.7 M merges and
            # took over 8 GB to build.
            raise TokenizerError(
                f"{path}: its vocabulary makes over {MAX_MERGES:,} merges (Tekken's makes "
                "about 270,000): the file is damaged; re-download tekken.json"
            )
    try:
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    except Exception as e:
        reason = one_line(str(e), 200)
        raise TokenizerError(f"{path}: config.pattern is not a usable regex ({reason})") from None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            split,
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


# ---------------------------------------------------------------------- sharing


class _Built:
    """A built tokenizer and its metadata, shared by every :class:`TekkenTokenizer` of the
    same file content (and cache entry) in this process."""

    __slots__ = ("__weakref__", "backend", "meta")

    def __init__(self, meta: dict[str, Any], backend: Tokenizer):
        self.meta = meta
        self.backend = backend


# Builds in use, by cache entry (file SHA-256 and cache folder): a model loaded again, or
# another precision of it, reuses the one in memory (the real vocabulary takes 0.3 to 0.9 s
# to read back from the cache) as long as a tokenizer made from it lives. The backend is
# only ever read (encode and decode take &self in Rust), so sharing it across threads is safe.
_LIVE: weakref.WeakValueDictionary[str, _Built] = weakref.WeakValueDictionary()


def _shared(key: str, meta: dict[str, Any], backend: Tokenizer) -> _Built:
    built = _Built(meta, backend)
    _LIVE[key] = built
    return built


# ---------------------------------------------------------------------- cache


def _cache_root(cache_dir: Path | None) -> Path:
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / "tokenizers"


def _checksum(meta: dict[str, Any], body: str) -> str:
    head = json.dumps(meta, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(f"{head}\n{body}".encode()).hexdigest()


def _read_cache(file: Path, digest: str) -> tuple[dict[str, Any], Tokenizer] | None:
    """Cache entry = one JSON line of metadata, a newline, the tokenizer's own JSON. The
    metadata's ``content`` is a checksum of the rest: a damaged or edited entry is rebuilt,
    never trusted."""
    try:
        text = read_limited(file, 2 * MAX_TEKKEN_BYTES).decode("utf-8")
        head, _, body = text.partition("\n")
        meta = json.loads(head)
        if meta.get("sha256") != digest or meta.get("format") != CACHE_FORMAT:
            return None
        if meta.pop("content", None) != _checksum(meta, body):
            return None
        keys = ("vocab_size", "special_tokens", "version", "audio", "max_token_bytes")
        if not all(k in meta for k in keys):
            return None
        if not isinstance(meta["max_token_bytes"], int) or meta["max_token_bytes"] < 1:
            return None
        return meta, Tokenizer.from_str(body)
    except Exception:
        # Missing, unreadable, half-written by an older version, ...: rebuild.
        return None


def _serialized(backend: Tokenizer) -> str:
    """The tokenizer's JSON with its merges as ``"a b"`` strings, which ``from_str`` reads in
    about three quarters of the time of ``["a", "b"]`` pairs (0.31 vs 0.42 s for the real vocab).
    That form cannot hold a space inside a token: byte-level tokens never do (a space is
    ``Ġ``), but pairs are kept whenever one would."""
    data = json.loads(backend.to_str())
    merges = data["model"]["merges"]
    if all(isinstance(m, list) and len(m) == 2 and " " not in m[0] + m[1] for m in merges):
        data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    return json.dumps(data, ensure_ascii=False)


# The cache's file names (``tekken-<sha256>-f<format>.json``), whose temp files it tidies.
_CACHE_NAME = re.compile(r"tekken-[0-9a-f]+(?:-f\d+)?\.json")


def _write_cache(file: Path, meta: dict[str, Any], backend: Tokenizer) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        remove_orphans(file.parent, _CACHE_NAME, TEMP_KIND)  # of writers killed meanwhile
        body = _serialized(backend)
        head = json.dumps({**meta, "content": _checksum(meta, body)}, ensure_ascii=False)
        payload = head + "\n" + body
        atomic_write_text(file, payload, durable=False)  # checksummed: a torn one is rebuilt
        for old in range(1, CACHE_FORMAT):  # this file's entries in formats no longer read
            with contextlib.suppress(OSError):
                file.with_name(f"tekken-{meta['sha256']}-f{old}.json").unlink(missing_ok=True)
        prune_oldest(file.parent, _CACHE_NAME, file.name, MAX_CACHED_TOKENIZERS)
    except OSError:
        pass  # an unwritable cache only costs the build time on the next load
