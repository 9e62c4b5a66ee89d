"""Shared benchmark plumbing: random checkpoints, the mlx-audio reference, timing, RESULTS.md."""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
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


def is_model_dir(config: str) -> bool:
    """A ``--config`` value naming a checkpoint directory rather than a built-in config."""
    return os.sep in config or Path(config).is_dir()


def resolve(config: str, configs: dict[str, tuple], dtype: str = "bfloat16") -> Path:
    """The checkpoint a benchmark runs on: ``config`` is a name in ``configs`` (whose first
    three fields are size, backbone layers, flow layers: a random checkpoint with END
    suppressed, built once and cached) or a checkpoint directory of any layout ``load``
    reads (yours, a real download). mlx-audio is compared only on Mistral's layout."""
    if is_model_dir(config):
        path = Path(config).expanduser()
        if not path.is_dir():
            raise SystemExit(f"{config}: no such checkpoint directory")
        return path
    if config not in configs:
        raise SystemExit(f"unknown config {config!r}: use one of {sorted(configs)} or a directory")
    size, layers, flow_layers = configs[config][:3]
    return checkpoint(size, dtype=dtype, n_layers=layers, flow_layers=flow_layers)


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


def label(config: str) -> str:
    return Path(config).name if is_model_dir(config) else config


def zero_end_row(head) -> None:
    """Make END_AUDIO's semantic logit 0 (plain or quantized head): with random weights it
    is then never the argmax, as in a checkpoint built with END suppressed."""
    from voxtral_mlx.config import END_AUDIO

    if isinstance(head, nn.QuantizedLinear):
        head.scales[END_AUDIO] = 0
        if getattr(head, "biases", None) is not None:
            head.biases[END_AUDIO] = 0
        mx.eval(head.scales, head.biases)
    else:
        head.weight[END_AUDIO] = 0
        mx.eval(head.weight)


def suppress_end(tts, ref=None) -> None:
    """Benchmarks need a fixed number of frames, but a random checkpoint's END can win early
    (3 of 8 tiny seeds end within 40 frames). For a checkpoint directory not built with END
    suppressed, both implementations get the same in-memory patch of the semantic head,
    before anything is generated (our compiled frame is rebuilt to see it)."""

    def ours() -> None:
        flow = tts.model.acoustic_transformer
        zero_end_row(flow.semantic_codebook_output)
        flow.prepare(compile=flow._compiled is not None)

    tts.call(ours)
    if ref is not None:
        zero_end_row(ref.acoustic_transformer.semantic_codebook_output)


def load_reference(model_dir: Path):
    """mlx-audio's Voxtral model on the same checkpoint (see tests/mlx_audio_reference.py)."""
    from tests.mlx_audio_reference import load_reference as load

    if not (Path(model_dir) / "consolidated.safetensors").is_file():
        raise SystemExit(
            f"{model_dir}: the mlx-audio comparison needs Mistral's layout "
            "(consolidated.safetensors): give a directory in that layout (frame_speed.py "
            "can also time voxtral_mlx alone with --no-reference)"
        )
    from voxtral_mlx.loader import find_weight_files

    if find_weight_files(Path(model_dir))[0] != "mistral":
        raise SystemExit(
            f"{model_dir} holds a conversion (config.json, model*.safetensors) beside "
            "consolidated.safetensors: voxtral_mlx loads the conversion, mlx-audio's reference "
            "would read the original; compare on a directory holding only one of them"
        )
    try:
        return load(model_dir)
    except (ValueError, KeyError, TypeError) as e:  # a shape mlx-audio's model cannot hold
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SystemExit(
            f"{model_dir}: mlx-audio cannot load this checkpoint ({first}), so there is "
            "nothing to compare with (frame_speed.py can time voxtral_mlx alone with "
            "--no-reference)"
        ) from None


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


def reference_voice(ref, model_dir: Path, voice: str, dtype) -> None:
    """Give mlx-audio the voice from our reader (it only reads .safetensors voices)."""
    import voxtral_mlx.torch_pickle as tp

    if voice not in _tekken_voices(model_dir):
        raise SystemExit(
            f"{model_dir}: voice {voice!r} is not in tekken.json's voice list, which is all "
            "mlx-audio's tokenizer accepts (voxtral_mlx takes any voice file): list it there "
            "to compare, or time voxtral_mlx alone (frame_speed.py --no-reference)"
        )

    folder = Path(model_dir) / "voice_embedding"
    if (folder / f"{voice}.pt").is_file():
        rows = tp.to_mlx(tp.read_pt(folder / f"{voice}.pt"))
    else:
        rows = mx.load(str(folder / f"{voice}.safetensors"))["embedding"]
    ref._voice_embeddings[voice] = rows.astype(dtype)


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
    if VOICE in names:
        return VOICE
    listed = _tekken_voices(model_dir)
    return next((n for n in names if n in listed), names[0])


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


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
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


def record(title: str, command: str, table: list[tuple[str, ...]], notes: str = "") -> str:
    """Append a section to RESULTS.md and return it."""
    header, *rows = table
    lines = [
        f"## {title}",
        "",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')} (commit {git_rev()})",
        f"- machine: {machine()}",
        f"- command: `{command}`",
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
