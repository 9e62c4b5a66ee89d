"""Shared benchmark plumbing: random checkpoints, the mlx-audio reference, timing, RESULTS.md."""

from __future__ import annotations

import datetime as dt
import itertools
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

RESULTS = REPO / "benchmarks" / "RESULTS.md"
CACHE = Path(
    os.environ.get("VOXTRAL_MLX_BENCH_DIR", Path.home() / ".cache" / "voxtral_mlx" / "bench")
)
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away."
VOICE = "neutral_female"
# A 20-sentence text for long-text figures (split into segments, batched).
SENTENCES = " ".join(
    f"This is sentence number {i + 1}, and it carries a few words of its own." for i in range(20)
)


def checkpoint(
    size: str,
    *,
    dtype: str = "bfloat16",
    n_layers: int | None = None,
    flow_layers: int | None = None,
    seed: int = 0,
) -> Path:
    """A random checkpoint in Mistral's layout with END suppressed, built once and cached."""
    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint, make_params

    name = f"{size}-{dtype}-L{n_layers}-F{flow_layers}-s{seed}-noend"
    out = CACHE / name
    if not (out / "params.json").is_file():
        params = make_params(size, n_layers=n_layers, flow_layers=flow_layers)
        build_random_checkpoint(out, params, seed=seed, dtype=dtype, suppress_end=True)
    return out


BUILT_IN = ("tiny", "wide", "full")  # the configs' names (each script has its own subset)
# Configs as :func:`resolve` takes them (size, backbone layers, flow layers): "wide" has the
# real layer widths but 2 backbone layers, so that it finishes on a CPU.
TINY_AND_WIDE = {"tiny": ("tiny", None, None), "wide": ("wide", 2, 3)}
TINY_WIDE_FULL = {**TINY_AND_WIDE, "full": ("full", None, None)}


def at_least_one(text: str) -> int:
    """An argparse type: a whole number >= 1 (repeats, frames, batch sizes)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def is_model_dir(config: str) -> bool:
    """A ``--config`` value naming a checkpoint directory rather than a built-in config. A
    built-in name means the built-in config even beside a directory of that name (which
    ``./tiny`` names)."""
    return os.sep in config or (config not in BUILT_IN and Path(config).is_dir())


def resolve(config: str, configs: dict[str, tuple], dtype: str = "bfloat16") -> Path:
    """The checkpoint a benchmark runs on: ``config`` is a name in ``configs`` (whose first
    three fields are size, backbone layers, flow layers: a random checkpoint with END
    suppressed, built once and cached) or a checkpoint directory of any layout ``load``
    reads (yours, a real download). mlx-audio is compared only on Mistral's layout."""
    if is_model_dir(config):
        path = Path(config).expanduser()
        if not path.is_dir():
            raise SystemExit(f"{config}: no such checkpoint directory")
        check_model_dir(path)
        return path
    if config not in configs:
        raise SystemExit(f"unknown config {config!r}: use one of {sorted(configs)} or a directory")
    size, layers, flow_layers = configs[config][:3]
    return checkpoint(size, dtype=dtype, n_layers=layers, flow_layers=flow_layers)


def check_model_dir(path: Path) -> None:
    """Stop in one line unless ``path`` holds a model's config (params.json or config.json),
    before anything else about it is looked at."""
    from voxtral_mlx.errors import ModelNotFoundError, VoxtralError

    try:
        model_config(path)
    except ModelNotFoundError as e:
        # The loader's advice mentions Hugging Face repo ids, which benchmarks do not take.
        raise SystemExit(str(e).split("; ")[0] + "; give a checkpoint directory") from None
    except VoxtralError as e:
        raise SystemExit(str(e)) from None


def is_narrow(path: Path) -> bool:
    """True for test-sized checkpoints (backbone narrower than 1024), where a frame costs
    milliseconds and many frames are affordable."""
    import json

    for name in ("params.json", "config.json"):
        if (path / name).is_file():
            dim = json.loads((path / name).read_text()).get("dim")
            if isinstance(dim, int):
                return dim < 1024
    return False


def config_list(text: str) -> list[str]:
    """``--configs`` values: comma-separated, unless the whole value is a directory (whose
    name may hold a comma)."""
    if Path(text).expanduser().is_dir() and text not in BUILT_IN:
        return [text]
    configs = [c.strip() for c in text.split(",")]
    if not all(configs):
        raise SystemExit(f"--configs {text!r} holds an empty name: drop the extra comma")
    return configs


def label(config: str) -> str:
    return Path(config).name if is_model_dir(config) else config


END_MASK = 1e9  # how far END's logit is pushed down (less where the dtype cannot hold it)


class EndMasked(nn.Module):
    """A semantic head whose END_AUDIO logit is pushed far down, so END can never win.

    Zeroing END's row is not enough: where every other logit is negative (a random head
    can be so), a logit of 0 still wins at the first frame. One add per frame, the same
    for both implementations. The push stays finite in the logits' dtype (-1e9 is -inf in
    float16, which the engine rightly takes for an overflow)."""

    def __init__(self, head: nn.Module):
        super().__init__()
        from voxtral_mlx.config import END_AUDIO

        self.head = head
        rows = head.weight.shape[0]
        self._mask = mx.where(mx.arange(rows) == END_AUDIO, -1.0, 0.0)

    @property
    def weight(self) -> mx.array:
        """The wrapped head's weight (what is read per frame)."""
        return self.head.weight

    def __call__(self, x: mx.array) -> mx.array:
        y = self.head(x)
        push = min(END_MASK, mx.finfo(y.dtype).max / 4)
        return y + (self._mask * push).astype(y.dtype)


def mask_end(flow) -> None:
    """Wrap ``flow.semantic_codebook_output`` (voxtral_mlx's or mlx-audio's flow head, plain
    or quantized) in :class:`EndMasked`, once."""
    if not isinstance(flow.semantic_codebook_output, EndMasked):
        flow.semantic_codebook_output = EndMasked(flow.semantic_codebook_output)
        mx.eval(flow.semantic_codebook_output._mask)


def suppress_end(tts, ref=None) -> None:
    """Benchmarks need a fixed number of frames, but a random checkpoint's END can win early
    (3 of 8 tiny seeds end within 40 frames, some at the first). Both implementations get
    the same in-memory patch of the semantic head before anything is generated (our
    compiled frame is rebuilt to see it)."""

    def ours() -> None:
        flow = tts.model.acoustic_transformer
        mask_end(flow)
        flow.prepare(compile=flow._compiled is not None)

    tts.call(ours)
    if ref is not None:
        mask_end(ref.acoustic_transformer)


def require_audio(audio, what: str) -> None:
    """Stop in one line if the first chunk holds no audio: there is nothing to time."""
    if not np.asarray(audio).size:
        raise SystemExit(
            f"{what}: the first chunk holds no audio (END at the first frame, or max_frames "
            "0), so there is no first audio to time"
        )


def run_script(main: Callable[[], int | None]) -> None:
    """Run a script's ``main``: an error voxtral_mlx raises on purpose (a voice file that
    does not fit, a checkpoint it refuses) is its one line, as the CLI prints it."""
    from voxtral_mlx.errors import VoxtralError

    try:
        code = main()
    except VoxtralError as e:
        raise SystemExit(f"{Path(sys.argv[0]).name}: {e}") from None
    sys.exit(code)


def check_comparable(model_dir: Path, voice: str | None = None) -> str:
    """The checkpoint's layout (``"mistral"`` or ``"mlx"``) if mlx-audio can run on
    ``model_dir``: Mistral's layout, which it reads with its model's ``sanitize``, or its own
    (an mlx-community conversion, its converter's or ``voxtral-mlx convert``'s output, any
    precision), which it reads with its own loader. Otherwise, or if ``voice`` is not in
    tekken.json's list, stop in one line before anything is timed."""
    from voxtral_mlx.errors import VoxtralError
    from voxtral_mlx.loader import find_weight_files

    model_dir = Path(model_dir)
    try:
        layout = find_weight_files(model_dir)[0]
    except VoxtralError as e:
        raise SystemExit(str(e)) from None
    if layout == "mlx" and not (model_dir / "config.json").is_file():
        raise SystemExit(
            f"{model_dir}: MLX weights without config.json, which mlx-audio's loader needs: "
            "give the conversion's whole directory"
        )
    _check_reference_codebooks(model_dir)
    if voice is not None:
        _check_listed(model_dir, voice)
    return layout


def _check_reference_codebooks(model_dir: Path) -> None:
    """mlx-audio sizes its audio code table ``(s // 128 + 1) * 128 + pad(n * a, 128)`` rows
    and its semantic head ``(s // 128 + 1) * 128`` outputs, for ``s`` semantic codes and
    ``n`` acoustic codebooks of ``a`` levels; the codes (two special ones per codebook)
    need ``s + 2 + n * (a + 2)`` rows and ``s + 2`` outputs. Enough at the release's sizes;
    a checkpoint needing more is one it cannot run (one needing fewer rows is padded for
    it: tests/mlx_audio_reference.py)."""
    from voxtral_mlx.errors import VoxtralError
    from voxtral_mlx.loader import read_model_config

    try:
        flow = read_model_config(model_dir).flow
    except VoxtralError as e:
        raise SystemExit(str(e)) from None
    s, a, n = flow.semantic_codebook_size, flow.acoustic_codebook_size, flow.n_acoustic_codebook
    semantic = (s // 128 + 1) * 128
    table = semantic + -(-n * a // 128) * 128
    if table < s + 2 + n * (a + 2) or semantic < s + 2:
        raise SystemExit(
            f"{model_dir}: mlx-audio cannot run {s} semantic codes and {n} acoustic codebooks "
            f"of {a} levels (its code table holds {table} rows for {s + 2 + n * (a + 2)} codes, "
            f"its semantic head {semantic} outputs for {s + 2}), so there is nothing to compare "
            "with (frame_speed.py can time voxtral_mlx alone with --no-reference)"
        )


def load_reference(model_dir: Path):
    """mlx-audio's Voxtral model on the same checkpoint (see tests/mlx_audio_reference.py):
    Mistral's layout through its model's ``sanitize``, a conversion through its loader."""
    from tests.mlx_audio_reference import load_converted_reference
    from tests.mlx_audio_reference import load_reference as load_original

    model_dir = Path(model_dir)
    if check_comparable(model_dir) == "mistral":
        load, path = load_original, model_dir
    else:
        load, path = load_converted_reference, _without_original(model_dir)
    try:
        return load(path)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:  # nothing it can hold
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, KeyError) and e.args:
            first = f"it found no key {e.args[0]!r}"
        raise SystemExit(
            f"{model_dir}: mlx-audio cannot load this checkpoint ({first}), so there is "
            "nothing to compare with (frame_speed.py can time voxtral_mlx alone with "
            "--no-reference)"
        ) from None


def _without_original(model_dir: Path) -> Path:
    """``model_dir`` as mlx-audio should see a conversion: without the copy of Mistral's
    ``consolidated.safetensors`` that mlx-audio's converter leaves beside it (voxtral_mlx
    loads the conversion; mlx-audio's loader would read every ``*.safetensors``), through a
    folder of links kept until the process exits."""
    from voxtral_mlx.mlx_layout import CONSOLIDATED

    if not (model_dir / CONSOLIDATED).exists():
        return model_dir
    import atexit
    import shutil
    import tempfile

    view = Path(tempfile.mkdtemp(prefix="voxtral-bench-view-"))
    atexit.register(shutil.rmtree, view, ignore_errors=True)
    for entry in model_dir.resolve().iterdir():
        if entry.name != CONSOLIDATED:
            (view / entry.name).symlink_to(entry)
    return view


def injected_noise(rows: np.ndarray):
    from tests.mlx_audio_reference import injected_noise as inject

    return inject(rows)


def _tekken_voices(model_dir: Path) -> set[str]:
    """The voices tekken.json lists (mlx-audio's tokenizer knows only those)."""
    import json

    try:
        audio = json.loads((Path(model_dir) / "tekken.json").read_text()).get("audio") or {}
        return set(audio.get("voice_num_audio_tokens") or {})
    except (OSError, ValueError, AttributeError):
        return set()


def _check_listed(model_dir: Path, voice: str) -> None:
    listed = _tekken_voices(model_dir)
    if not listed:
        raise SystemExit(
            f"{model_dir}: tekken.json lists no voices (audio.voice_num_audio_tokens), which "
            "mlx-audio's tokenizer needs (voxtral_mlx takes any voice file): restore it to "
            "compare, or time voxtral_mlx alone (frame_speed.py --no-reference)"
        )
    if voice not in listed:
        raise SystemExit(
            f"{model_dir}: voice {voice!r} is not in tekken.json's voice list, which is all "
            "mlx-audio's tokenizer accepts (voxtral_mlx takes any voice file): list it there "
            "to compare, or time voxtral_mlx alone (frame_speed.py --no-reference)"
        )


def reference_voice(ref, model_dir: Path, voice: str, dtype) -> None:
    """Give mlx-audio the voice as voxtral_mlx reads it (a .pt, or a .safetensors under any
    single key; mlx-audio reads only .safetensors voices keyed ``embedding``)."""
    from voxtral_mlx.voices import VoiceRegistry

    _check_listed(model_dir, voice)
    folder = Path(model_dir) / "voice_embedding"
    voices = VoiceRegistry.from_dir(folder, {}, model_config(model_dir).backbone.dim)
    ref._voice_embeddings[voice] = voices.embedding(voice).astype(dtype)


def model_config(model_dir: Path):
    """The :class:`~voxtral_mlx.config.ModelConfig` of a model directory (any layout)."""
    from voxtral_mlx.loader import read_model_config

    return read_model_config(Path(model_dir))


def pick_voice(model_dir: Path) -> str:
    """:data:`VOICE` if the checkpoint has it, else its first voice by name that tekken.json
    lists (so that mlx-audio can use it too), else its first (a checkpoint built with other
    voices than the release's still runs)."""
    folder = Path(model_dir) / "voice_embedding"
    names = sorted(
        {p.stem for p in folder.glob("*") if p.suffix in (".pt", ".safetensors")}
        if folder.is_dir()
        else set()
    )
    if not names:
        raise SystemExit(f"{model_dir}: no voices in voice_embedding/ (*.pt or *.safetensors)")
    listed = _tekken_voices(model_dir)
    # Files named but for case as tekken.json spells them (Neutral_Female.pt): voxtral_mlx
    # finds them by that spelling too, and mlx-audio knows only it.
    spelled = {n.casefold(): n for n in listed}
    if VOICE in {n.casefold() for n in names} and (VOICE in listed or not listed):
        return VOICE
    return next((spelled[n.casefold()] for n in names if n.casefold() in spelled), names[0])


def start_noise(model_dir: Path, frames: int, seed: int = 0) -> np.ndarray:
    """Flow-matching start noise ``[frames, n_acoustic_codebook]`` for the checkpoint."""
    width = model_config(model_dir).flow.n_acoustic_codebook
    return np.random.default_rng(seed).standard_normal((frames, width)).astype(np.float32)


def frame_ms(model_dir: Path) -> float:
    """Milliseconds of audio per frame (80 for the release: 1920 samples at 24 kHz)."""
    config = model_config(model_dir)
    return 1000.0 * config.samples_per_frame / config.sampling_rate


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_marginal_ms(pairs: Sequence[tuple[float, float]], n1: int, n2: int) -> float:
    """Milliseconds per frame from ``(seconds for n1 frames, seconds for n2 frames)`` pairs
    timed back to back: the median over pairs of each pair's difference / (n2 - n1). A pair
    shares the machine's speed of the moment, so drift cancels within it (a difference of
    two separate medians would mix runs from different moments)."""
    return statistics.median(1000 * (t2 - t1) / (n2 - n1) for t1, t2 in pairs)


def longest_gap(tts, voice: str, newcomer: Callable[[], object]) -> float:
    """The longest gap between chunks of a stream in ``voice``, already running, while
    ``newcomer()`` runs on another thread (the stall a listener would hear without
    pre-roll)."""
    running = tts.stream("Keep talking while the other one starts.", voice, seed=1)
    next(running)
    done = threading.Event()

    def run() -> None:
        newcomer()
        done.set()

    worker = threading.Thread(target=run)
    arrivals = [time.perf_counter()]
    worker.start()
    for _ in running:
        arrivals.append(time.perf_counter())
        if done.is_set():
            break
    worker.join()
    running.close()
    return max(b - a for a, b in itertools.pairwise(arrivals))


def cancel_latency(stream, delay_s: float) -> float:
    """From ``stream.cancel()``, sent ``delay_s`` after a consumer starts reading it, to the
    stream's end."""
    ended: list[float] = []
    consumer = threading.Thread(target=lambda: (list(stream), ended.append(time.perf_counter())))
    consumer.start()
    time.sleep(delay_s)
    t0 = time.perf_counter()
    stream.cancel()
    consumer.join()
    return ended[0] - t0


def blas() -> str:
    """Which BLAS MLX's CPU float32 matmuls call in this process (bf16/f16 products use
    MLX's own kernels): the wheel's bundled reference BLAS unless another was preloaded."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "Accelerate" if sys.platform == "darwin" else "unknown"
    for lib in ("openblas", "mkl_rt", "blis"):
        if f"lib{lib}" in maps:
            return lib.replace("_rt", "")
    return "reference BLAS (bundled with mlx[cpu])" if "libblas" in maps else "unknown"


def _sysctl(name: str) -> str:
    try:
        done = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        if sys.platform == "darwin":  # platform.processor() says "arm": "Apple M2 Pro"
            cpu = _sysctl("machdep.cpu.brand_string") or cpu
    return (
        f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores, "
        f"MLX {mx.__version__} ({mx.default_device()}), BLAS: {blas()}, "
        f"Python {platform.python_version()}"
    )


def git_rev() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "uncommitted"


def command_line(script: str, args: Sequence[str]) -> str:
    """The command that reproduces a run of ``script`` (a benchmark's ``__file__``) with
    ``args``, for RESULTS.md."""
    return " ".join(["python", f"benchmarks/{Path(script).name}", *args])


def show_row(rows: list[tuple[str, ...]]) -> None:
    """Print the table's newest row as soon as it is measured, and its header before the
    first (with --no-record no table is printed at the end)."""
    if len(rows) == 2:
        print(" | ".join(rows[0]), flush=True)
    print(" | ".join(rows[-1]), flush=True)


def record(
    title: str,
    command: str,
    table: list[tuple[str, ...]],
    notes: str = "",
    runs: int | None = None,
) -> str:
    """Append a section to RESULTS.md and return it. ``runs``: how many timed runs each
    median is of, stated in the section (the command line omits a default --repeats)."""
    header, *rows = table
    lines = [
        f"## {title}",
        "",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')} (commit {git_rev()})",
        f"- machine: {machine()}",
        f"- command: `{command}`",
        *([f"- runs: medians of {runs}"] if runs is not None else []),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
    ]
    if notes:
        lines += [notes, ""]
    text = "\n".join(lines) + "\n"
    if not RESULTS.exists():
        RESULTS.write_text(
            "# Benchmark results\n\nAppended by the scripts in benchmarks/. "
            "Ratios are measured in one process run on one machine.\n\n"
        )
    with RESULTS.open("a") as fh:
        fh.write(text)
    return text
