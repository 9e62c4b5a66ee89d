"""The voice-prefix cache on disk: a new process (here: a new load) starts a known voice from
the stored KV state with bit-identical output; a changed model, voice or dtype never reuses
a file; damaged files are misses; an unwritable directory only costs the cache."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import voxtral_mlx
from voxtral_mlx.prefix_store import FORMAT, PrefixCacheWarning, model_fingerprint
from voxtral_mlx.torch_pickle import read_pt, to_mlx, write_pt

TEXT = "A voice prefix, stored once."
VOICE = "casual_male"
FRAMES = 6


@pytest.fixture(scope="module")
def noise() -> np.ndarray:
    return np.random.default_rng(5).standard_normal((FRAMES, 36)).astype(np.float32)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, noise):
    """Codes and audio with no disk cache at all."""
    tts = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=None)
    try:
        speech = tts.synthesize(TEXT, VOICE, noise=noise)
        assert not speech.timings.prefix_cached
        return speech
    finally:
        tts.close()


def files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.safetensors") if not p.name.startswith("."))


def run(model: Path, directory: Path | None, noise: np.ndarray, **kwargs):
    tts = voxtral_mlx.load(model, prefix_cache_dir=directory, **kwargs)
    try:
        return tts.synthesize(TEXT, VOICE, noise=noise)
    finally:
        tts.close()


def test_a_new_process_starts_from_the_stored_prefix(tiny_checkpoint, tmp_path, noise, reference):
    first = run(tiny_checkpoint, tmp_path, noise)
    assert not first.timings.prefix_cached and not first.timings.prefix_from_disk
    (stored,) = files(tmp_path)
    second = run(tiny_checkpoint, tmp_path, noise)
    assert second.timings.prefix_cached and second.timings.prefix_from_disk
    for speech in (first, second):
        np.testing.assert_array_equal(speech.codes, reference.codes)
        np.testing.assert_array_equal(speech.audio, reference.audio)
    assert files(tmp_path) == [stored]  # a hit writes nothing new
    # A split text's figures are its first segment's (prefix_from_disk was left out).
    tts = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=tmp_path)
    try:
        split = tts.synthesize(TEXT + "\n\n" + TEXT, VOICE, seed=1, split=True, max_frames=2)
    finally:
        tts.close()
    assert split.timings.prefix_cached and split.timings.prefix_from_disk


def test_a_stored_prefix_is_not_flushed_to_the_drive(tiny_checkpoint, tmp_path, noise, monkeypatch):
    """It is written on the thread that runs the frames, and on macOS a flush empties the
    drive's whole cache; a file lost or torn by a crash fails its checksum and is rebuilt.
    Files that must survive (outputs, converted voices) are still flushed."""
    from voxtral_mlx import fileio

    flushed = []
    monkeypatch.setattr(fileio, "full_fsync", lambda fd: flushed.append(fd))
    run(tiny_checkpoint, tmp_path, noise)
    assert len(files(tmp_path)) == 1 and flushed == []
    fileio.atomic_write(tmp_path / "kept.bin", lambda f: f.write(b"x"))
    assert len(flushed) == 1


def test_the_file_holds_every_layer_at_the_prefix_length(tiny_checkpoint, tmp_path, noise):
    tts = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=tmp_path)
    try:
        tts.synthesize(TEXT, VOICE, noise=noise)
        rows = tts.voices.embedding(VOICE).shape[0]
        layers = len(tts.model.layers)
        args = tts.model.args
    finally:
        tts.close()
    arrays, meta = mx.load(str(files(tmp_path)[0]), return_metadata=True)
    assert meta["format"] == FORMAT and len(meta["key"]) == 64
    assert len(arrays) == 2 * layers
    # [BOS, BEGIN_AUDIO, voice rows..., NEXT_AUDIO_TEXT]
    assert arrays["keys.0"].shape == (1, args.n_kv_heads, rows + 3, args.head_dim)


def test_another_dtype_or_voice_never_reuses_a_file(tiny_checkpoint, tmp_path, noise):
    run(tiny_checkpoint, tmp_path, noise)
    bf16 = run(tiny_checkpoint, tmp_path, noise, dtype="bfloat16")
    assert not bf16.timings.prefix_cached
    assert len(files(tmp_path)) == 2
    tts = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=tmp_path)
    try:
        other = tts.synthesize(TEXT, "fr_male", noise=noise)
    finally:
        tts.close()
    assert not other.timings.prefix_cached
    assert len(files(tmp_path)) == 3


def test_a_changed_voice_file_is_a_miss(tiny_checkpoint, tmp_path, noise):
    model = Path(shutil.copytree(tiny_checkpoint, tmp_path / "model"))
    store = tmp_path / "store"
    run(model, store, noise)
    pt = model / "voice_embedding" / f"{VOICE}.pt"
    rows = np.array(to_mlx(read_pt(pt)).astype(mx.float32))
    write_pt(pt, rows * 1.5)
    changed = run(model, store, noise)
    assert not changed.timings.prefix_cached
    fresh = run(model, None, noise)
    np.testing.assert_array_equal(changed.audio, fresh.audio)


def test_a_changed_model_is_a_miss(tiny_checkpoint, tmp_path, noise):
    model = Path(shutil.copytree(tiny_checkpoint, tmp_path / "model"))
    store = tmp_path / "store"
    before = model_fingerprint(model)
    run(model, store, noise)
    params = json.loads((model / "params.json").read_text())
    params["rope_theta"] = params["rope_theta"] * 2
    (model / "params.json").write_text(json.dumps(params))
    assert model_fingerprint(model) != before
    changed = run(model, store, noise)
    assert not changed.timings.prefix_cached
    np.testing.assert_array_equal(changed.audio, run(model, None, noise).audio)


def test_rewritten_weights_change_the_fingerprint(tiny_checkpoint, tmp_path):
    model = Path(shutil.copytree(tiny_checkpoint, tmp_path / "model"))
    before = model_fingerprint(model)
    weights = model / "consolidated.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert model_fingerprint(model) != before


def test_other_weights_copied_in_with_their_timestamps_change_the_fingerprint(tmp_path):
    """Same shapes, size, header and modification time: only the values differ (as with
    ``cp -p`` of another random checkpoint of the same config over this one)."""
    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint

    a = build_random_checkpoint(tmp_path / "a", "tiny", seed=1)
    b = build_random_checkpoint(tmp_path / "b", "tiny", seed=2)
    name = "consolidated.safetensors"
    old, new = (a / name).read_bytes(), (b / name).read_bytes()
    (n,) = struct.unpack("<Q", old[:8])
    assert len(old) == len(new) and old[: 8 + n] == new[: 8 + n] and old != new
    before = model_fingerprint(a)
    assert model_fingerprint(a) == before  # deterministic
    st = (a / name).stat()
    (a / name).write_bytes(new)
    os.utime(a / name, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_fingerprint(a) != before


def _safetensors_with_header(path: Path, header: bytes, data: bytes = b"\0" * 16) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize(
    "header",
    [
        b"[" * 200_000 + b"]" * 200_000,  # json.loads: RecursionError
        json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 2**64]}}).encode(),
        json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [-(2**70), 0]}}).encode(),
        json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [2**62, 2**63]}}).encode(),
    ],
    ids=["nested", "beyond-seek", "negative", "past-the-end"],
)
def test_a_stray_damaged_safetensors_file_does_not_fail_the_load(
    tiny_checkpoint, tmp_path, noise, reference, header
):
    """The fingerprint read every .safetensors file's header and offsets before the loader
    had judged them: a stray file beside a valid checkpoint (which the loader passes over)
    made load() raise a bare RecursionError or ValueError (a traceback from speak)."""
    model = Path(shutil.copytree(tiny_checkpoint, tmp_path / "model"))
    _safetensors_with_header(model / "notes.safetensors", header)
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before
    speech = run(model, tmp_path / "store", noise)
    np.testing.assert_array_equal(speech.audio, reference.audio)


def test_a_byte_edited_in_place_with_its_time_set_back_is_a_miss(tiny_checkpoint, tmp_path, noise):
    """A byte the fingerprint's samples do not read, edited in place with the size and the
    modification time kept: the stale prefix was reused, speaking other audio than the
    weights make."""
    model = Path(shutil.copytree(tiny_checkpoint, tmp_path / "model"))
    store = tmp_path / "store"
    run(model, store, noise)
    weights = model / "consolidated.safetensors"
    data = bytearray(weights.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    entry = json.loads(data[8 : 8 + n])["layers.0.attention.wv.weight"]
    begin, end = entry["data_offsets"]
    offset = 8 + n + begin + 100  # past the sampled start, well before the middle
    assert end - begin > 400
    st = weights.stat()
    with weights.open("r+b") as f:
        f.seek(offset)
        f.write(bytes([data[offset] ^ 0x40]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size
    edited = run(model, store, noise)
    assert not edited.timings.prefix_cached
    np.testing.assert_array_equal(edited.audio, run(model, None, noise).audio)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign key", "changed byte"])
def test_a_damaged_file_is_a_miss_and_is_replaced(
    tiny_checkpoint, tmp_path, noise, reference, damage
):
    run(tiny_checkpoint, tmp_path, noise)
    (stored,) = files(tmp_path)
    data = stored.read_bytes()
    if damage == "truncate":
        stored.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        stored.write_bytes(b"\x00" * 64)
    elif damage == "changed byte":  # the header is intact: only the digest can tell
        changed = bytearray(data)
        changed[-3] ^= 0x40
        stored.write_bytes(bytes(changed))
    else:  # a well-formed file stored under another key
        arrays, meta = mx.load(str(stored), return_metadata=True)
        mx.save_safetensors(str(stored), arrays, metadata={**meta, "key": "0" * 64})
    again = run(tiny_checkpoint, tmp_path, noise)
    assert not again.timings.prefix_cached
    np.testing.assert_array_equal(again.audio, reference.audio)
    assert run(tiny_checkpoint, tmp_path, noise).timings.prefix_from_disk


def test_a_damaged_file_in_an_unwritable_directory_is_only_a_miss(
    tiny_checkpoint, tmp_path, noise, reference, monkeypatch
):
    """Removing the damaged file failed (a read-only folder) and the request with it."""
    run(tiny_checkpoint, tmp_path, noise)
    (stored,) = files(tmp_path)
    stored.write_bytes(b"\x00" * 64)
    original = Path.unlink

    def unlink(self, missing_ok=False):
        if self.parent == tmp_path:  # what chattr +i or a read-only mount does (root here)
            raise PermissionError(1, "Operation not permitted", str(self))
        return original(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr("voxtral_mlx.fileio.os.replace", _refuse_replace, raising=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        speech = run(tiny_checkpoint, tmp_path, noise)
    assert not speech.timings.prefix_cached
    np.testing.assert_array_equal(speech.audio, reference.audio)
    assert any(issubclass(w.category, PrefixCacheWarning) for w in caught)


def _refuse_replace(src, dst):
    raise PermissionError(1, "Operation not permitted", str(dst))


def test_an_unwritable_directory_only_loses_the_cache(tiny_checkpoint, tmp_path, noise, reference):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        speech = run(tiny_checkpoint, blocker / "prefixes", noise)
    np.testing.assert_array_equal(speech.audio, reference.audio)
    messages = [str(w.message) for w in caught if issubclass(w.category, PrefixCacheWarning)]
    assert len(messages) == 1 and "prefix_cache_dir=None" in messages[0]
    assert "\n" not in messages[0]
    assert blocker.read_text() == "not a directory"


def test_a_directory_that_cannot_be_read_only_loses_the_cache(
    tiny_checkpoint, tmp_path, noise, reference, monkeypatch
):
    """A folder the app may not read (a macOS sandbox denies stat with EPERM) failed the
    request with a raw PermissionError; it is a miss, with one warning."""
    denied = tmp_path / "denied"
    real_is_file = Path.is_file

    def is_file(self):
        if str(self).startswith(str(denied)):
            raise PermissionError(1, "Operation not permitted", str(self))
        return real_is_file(self)

    monkeypatch.setattr(Path, "is_file", is_file)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tts = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=denied)
        try:
            speech = tts.synthesize(TEXT, VOICE, noise=noise)
            again = tts.synthesize(TEXT, VOICE, noise=noise)  # from memory: no new warning
        finally:
            tts.close()
    np.testing.assert_array_equal(speech.audio, reference.audio)
    np.testing.assert_array_equal(again.audio, reference.audio)
    messages = [str(w.message) for w in caught if issubclass(w.category, PrefixCacheWarning)]
    assert len(messages) == 1 and messages[0].startswith("cannot read the voice-prefix cache")
    assert "\n" not in messages[0]


def test_clear_prefix_cache_on_a_file_it_may_not_delete_says_so(
    tiny_checkpoint, tmp_path, noise, monkeypatch
):
    tts = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=tmp_path)
    try:
        tts.synthesize(TEXT, VOICE, noise=noise)
        (stored,) = files(tmp_path)

        def unlink(self, missing_ok=False):
            raise PermissionError(13, "Permission denied", str(self))

        monkeypatch.setattr(Path, "unlink", unlink)
        with pytest.raises(voxtral_mlx.VoxtralError) as exc:
            tts.clear_prefix_cache()
        monkeypatch.undo()
        message = str(exc.value)
        assert "cannot delete the voice-prefix file" in message and stored.name in message
        assert "Permission denied" in message and "\n" not in message
    finally:
        tts.close()


def test_clear_prefix_cache_removes_this_models_files_only(tiny_checkpoint, tmp_path, noise):
    other = tmp_path / ("f" * 16 + "-" + "0" * 32 + ".safetensors")
    other.write_bytes(b"another model's prefix")
    tts = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=tmp_path)
    try:
        tts.synthesize(TEXT, VOICE, noise=noise)
        assert len(files(tmp_path)) == 2
        tts.clear_prefix_cache()
        assert files(tmp_path) == [other]
        again = tts.synthesize(TEXT, VOICE, noise=noise)
        assert not again.timings.prefix_cached
    finally:
        tts.close()


def _stale(directory: Path, i: int) -> Path:
    """An entry named as the cache names its files, last used ``i`` s after the epoch."""
    stale = directory / f"{i:016x}-{'0' * 32}.safetensors"
    stale.write_bytes(b"old")
    os.utime(stale, ns=(i * 10**9, i * 10**9))
    return stale


# Stale entries last used in 1970, or dated in the future (a clock set back since): those
# counted as newer than the file just written, which was deleted at once and never hit.
@pytest.mark.parametrize("first", [0, 2**31 + 10**6], ids=["past", "future"])
def test_old_files_are_pruned_but_never_the_one_just_written(
    tiny_checkpoint, tmp_path, noise, first
):
    for i in range(3):
        _stale(tmp_path, first + i)
    tts = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=tmp_path)
    try:
        tts.engine.prefix_store.max_files = 2
        tts.synthesize(TEXT, VOICE, noise=noise)
    finally:
        tts.close()
    names = [p.name for p in files(tmp_path)]
    assert len(names) == 2
    assert f"{first + 2:016x}-{'0' * 32}.safetensors" in names  # the newest stale one stays
    assert any(n.startswith(model_fingerprint(tiny_checkpoint)[:16]) for n in names)
    assert run(tiny_checkpoint, tmp_path, noise).timings.prefix_from_disk


def test_weights_replaced_while_loading_are_not_cached_under_the_new_files(
    tiny_checkpoint, tmp_path, noise, monkeypatch
):
    """The fingerprint was taken after the weights were read: new files copied in
    meanwhile had prefixes of the old weights saved under their fingerprint, which every
    later process then used with the new weights."""
    import voxtral_mlx.loader

    model = Path(shutil.copytree(tiny_checkpoint, tmp_path / "model"))
    other = tmp_path / "other"
    proc = subprocess.run(
        [sys.executable, "-m", "voxtral_mlx", "random-checkpoint", str(other), "--seed", "9"],
        capture_output=True,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    read = voxtral_mlx.loader.load_model_dir

    def read_then_replace(*args, **kwargs):
        loaded = read(*args, **kwargs)  # the old weights, now in memory
        shutil.copy(other / "consolidated.safetensors", model / ".new.safetensors")
        os.replace(model / ".new.safetensors", model / "consolidated.safetensors")
        return loaded

    store = tmp_path / "store"
    monkeypatch.setattr(voxtral_mlx.loader, "load_model_dir", read_then_replace)
    with pytest.warns(PrefixCacheWarning, match="changed while they were read"):
        tts = voxtral_mlx.load(model, prefix_cache_dir=store)
    try:
        assert tts.engine.prefix_store is None
        tts.synthesize(TEXT, VOICE, noise=noise)  # the old weights' prefix: not on disk
    finally:
        tts.close()
    assert files(store) == []
    monkeypatch.setattr(voxtral_mlx.loader, "load_model_dir", read)
    np.testing.assert_array_equal(run(model, store, noise).audio, run(model, None, noise).audio)


def test_temp_files_of_killed_writers_are_removed(tiny_checkpoint, tmp_path, noise):
    """A process killed mid-write (the CLI exits at once after Ctrl-C) leaves its temp file,
    removed by the next save; a running process's may be its write in progress and stays."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    target = f"{'a' * 16}-{'0' * 32}.safetensors"
    orphan = tmp_path / f".{target}.tmp-{dead.pid}-0123abcd"
    running = [
        tmp_path / f".{target}.tmp-1-0123abcd",  # init
        tmp_path / f".{target}.tmp-{os.getpid()}-89abcdef",  # this process
    ]
    for path in (orphan, *running):
        path.write_bytes(b"half a prefix")
    # Named as a dead process's temp file, but not for a file of this cache: someone else's.
    theirs = tmp_path / f".photos.tmp-{dead.pid}-abcdef12"
    theirs.mkdir()
    (theirs / "img.jpg").write_bytes(b"a photo")
    other_tool = tmp_path / f".notes.txt.tmp-{dead.pid}-abcdef12"
    other_tool.write_bytes(b"a draft")
    run(tiny_checkpoint, tmp_path, noise)
    assert not orphan.exists() and all(p.exists() for p in running)
    assert (theirs / "img.jpg").exists() and other_tool.exists()
    assert len(files(tmp_path)) == 1


def test_an_entry_that_cannot_be_pruned_is_passed_over(tiny_checkpoint, tmp_path, noise):
    """The oldest entry a folder (or another user's file): pruning stopped at it, with a
    warning that the cache could not be written, and the folder grew past its limit."""
    blocked = tmp_path / f"{0:016x}-{'0' * 32}.safetensors"
    blocked.mkdir()
    os.utime(blocked, ns=(0, 0))
    for i in range(1, 4):
        _stale(tmp_path, i)
    tts = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=tmp_path)
    try:
        tts.engine.prefix_store.max_files = 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no PrefixCacheWarning
            tts.synthesize(TEXT, VOICE, noise=noise)
    finally:
        tts.close()
    names = sorted(p.name for p in files(tmp_path))
    # The folder, which could not go, and the new prefix: the limit of 2 held.
    assert blocked.is_dir() and len(names) == 2 and blocked.name in names
    assert any(n.startswith(model_fingerprint(tiny_checkpoint)[:16]) for n in names)


def test_a_bad_prefix_cache_dir_is_a_one_line_error(tiny_checkpoint):
    from voxtral_mlx.errors import InputError

    with pytest.raises(InputError, match="prefix_cache_dir must be a directory path"):
        voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=3)


def test_pruning_leaves_files_the_cache_did_not_write(tiny_checkpoint, tmp_path, noise):
    """A folder shared with other files (voices, weights): only the cache's own files are
    pruned (it deleted the oldest *.safetensors it found, whatever they were)."""
    theirs = [tmp_path / f"user_{i:02d}.safetensors" for i in range(4)]
    theirs.append(tmp_path / ("A" * 16 + "-" + "0" * 32 + ".safetensors"))  # not hex
    for i, path in enumerate(theirs):
        path.write_bytes(b"not ours")
        os.utime(path, ns=(i * 10**9, i * 10**9))  # older than anything the cache writes
    tts = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir=tmp_path)
    try:
        tts.engine.prefix_store.max_files = 1
        tts.synthesize(TEXT, VOICE, noise=noise)
        tts.synthesize(TEXT, "neutral_female", noise=noise)
        tts.clear_prefix_cache()
    finally:
        tts.close()
    assert all(p.read_bytes() == b"not ours" for p in theirs)
    assert sorted(files(tmp_path)) == sorted(theirs)


def test_the_models_own_folder_is_refused(tiny_checkpoint, tmp_path):
    """Its prefix files would be hashed with the weights (a new fingerprint each run) and
    pruned beside them: the 33rd run deleted consolidated.safetensors."""
    from voxtral_mlx.errors import InputError

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    before = sorted(p.name for p in model.iterdir())
    for given in (model, tmp_path / "link", f"{model}/."):
        (tmp_path / "link").unlink(missing_ok=True)
        (tmp_path / "link").symlink_to(model)
        with pytest.raises(InputError, match="is the model's folder"):
            voxtral_mlx.load(model, prefix_cache_dir=given)
    assert sorted(p.name for p in model.iterdir()) == before
    voices = sorted(p.name for p in (model / "voice_embedding").iterdir())
    with pytest.raises(InputError, match="is the model's voice folder"):  # taken for voices
        voxtral_mlx.load(model, prefix_cache_dir=model / "voice_embedding" / ".")
    assert sorted(p.name for p in (model / "voice_embedding").iterdir()) == voices
    inside = model / "prefix-cache"  # a folder of its own inside it is fine
    tts = voxtral_mlx.load(model, prefix_cache_dir=inside)
    tts.close()


def test_a_relative_folder_is_the_one_at_load_time(tiny_checkpoint, tmp_path, noise, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tts = voxtral_mlx.load(tiny_checkpoint, prefix_cache_dir="rel")
    try:
        (tmp_path / "elsewhere").mkdir()
        monkeypatch.chdir(tmp_path / "elsewhere")
        tts.synthesize(TEXT, VOICE, noise=noise)
    finally:
        tts.close()
    assert len(files(tmp_path / "rel")) == 1
    assert not (tmp_path / "elsewhere" / "rel").exists()


def test_the_key_names_the_mlx_build_and_device(tiny_checkpoint, tmp_path):
    """A prefix computed by another MLX version or on another device (CPU vs GPU) differs in
    its last bits from one computed here: it is another key."""
    from voxtral_mlx.prefix_store import PrefixStore

    store = PrefixStore(tmp_path, model_fingerprint(tiny_checkpoint))
    rows = mx.zeros((3, 8), dtype=mx.bfloat16)
    here = store.key([1, 2], rows)
    assert store.key([1, 2], rows) == here
    with pytest.MonkeyPatch.context() as m:
        m.setattr(mx, "__version__", mx.__version__ + ".other")
        assert store.key([1, 2], rows) != here
    with pytest.MonkeyPatch.context() as m:
        m.setattr(mx, "default_device", lambda: "Device(gpu, 0)")
        assert store.key([1, 2], rows) != here


def test_the_key_names_the_code_that_computes_it(tiny_checkpoint, tmp_path, noise, monkeypatch):
    """A prefix stored by another voxtral_mlx (an upgrade whose backbone or prefill differs)
    was reused: the output then matched neither version's uncached run."""
    from voxtral_mlx import prefix_store

    store = tmp_path / "store"
    read = prefix_store._module_code
    try:
        run(tiny_checkpoint, store, noise)
        assert run(tiny_checkpoint, store, noise).timings.prefix_from_disk
        here = prefix_store.code_digest()
        for module in ("voxtral_mlx.model.backbone", "voxtral_mlx.config", "voxtral_mlx.engine"):
            monkeypatch.setattr(
                prefix_store,
                "_module_code",
                lambda name, module=module: read(name) + (b"#" if name == module else b""),
            )
            prefix_store.code_digest.cache_clear()
            assert prefix_store.code_digest() != here, module
        assert not run(tiny_checkpoint, store, noise).timings.prefix_cached
        monkeypatch.undo()
        prefix_store.code_digest.cache_clear()
        monkeypatch.setattr(voxtral_mlx, "__version__", voxtral_mlx.__version__ + "+next")
        assert prefix_store.code_digest() != here
        monkeypatch.undo()
        prefix_store.code_digest.cache_clear()
        monkeypatch.setattr("voxtral_mlx.engine.PREFIX_PART_TOKENS", 32)
        assert prefix_store.code_digest() != here
    finally:
        monkeypatch.undo()
        prefix_store.code_digest.cache_clear()
    assert prefix_store.code_digest() == here


def test_compiled_modules_alone_are_read_for_the_key(tmp_path, monkeypatch):
    """An app bundle or a zip may ship .pyc files only: their code is what counts (the
    version alone would not tell a patched build)."""
    import py_compile
    import zipfile

    from voxtral_mlx.prefix_store import _module_code

    codes = []
    for i, body in enumerate(("X = 1\n", "X = 2\n")):
        (tmp_path / f"mod{i}.py").write_text(body)
        py_compile.compile(str(tmp_path / f"mod{i}.py"), cfile=str(tmp_path / f"m{i}.pyc"))
        archive = tmp_path / f"app{i}.zip"
        with zipfile.ZipFile(archive, "w") as z:
            z.write(tmp_path / f"m{i}.pyc", "frozen_prefix_mod.pyc")
        monkeypatch.syspath_prepend(str(archive))
        monkeypatch.delitem(sys.modules, "frozen_prefix_mod", raising=False)
        codes.append(_module_code("frozen_prefix_mod"))
        monkeypatch.undo()
        monkeypatch.delitem(sys.modules, "frozen_prefix_mod", raising=False)
    assert codes[0] != codes[1] and b"absent" not in codes[0]
    assert _module_code("voxtral_mlx.model.backbone").startswith(b'"""')
