"""Time to first audio: from the call to the first playable sample.

voxtral_mlx streaming (its default: the first chunk is one frame) with a voice never used
before (its prefix is prefilled) and with a voice used before (prefix cache hit), against
mlx-audio's streaming mode (``generate(stream=True)``) on the same checkpoint in the same
run, twice: as a user gets it (its default ``streaming_interval`` of 2 s, so the first chunk
is 25 frames) and at its best (``streaming_interval=0.08``, one-frame chunks). The ratios to
both are printed; the first is the target's ("mlx-audio's streaming first chunk").
"Long text" is a 20-sentence text streamed with ``split=True`` (cached voice): its first
segment's first audio, while the next segments are handed over and join the batch.

    python benchmarks/ttfa.py [--configs tiny,wide,CHECKPOINT_DIR] [--no-record]
                              [--no-default-interval]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np
from common import (
    SENTENCES,
    TEXT,
    TINY_WIDE_FULL,
    at_least_one,
    command_line,
    config_list,
    injected_noise,
    label,
    load_reference,
    pick_voice,
    record,
    reference_voice,
    require_audio,
    resolve,
    run_script,
    show_row,
    start_noise,
    suppress_end,
)

CONFIGS = TINY_WIDE_FULL
DEFAULT_INTERVAL_S = 2.0  # mlx-audio's generate(streaming_interval=...) default
ONE_FRAME_S = 0.08
DEFAULT_CHUNK = int(DEFAULT_INTERVAL_S / ONE_FRAME_S)  # frames in its default first chunk


def first_chunk_s(make_iter) -> float:
    t0 = time.perf_counter()
    it = make_iter()
    # As a player needs it: samples in memory. mlx-audio yields a lazy MLX array (its codec
    # decode not yet run), ours finished numpy audio; the clock stops once both exist.
    audio = np.asarray(next(iter(it)).audio)
    dt = time.perf_counter() - t0
    require_audio(audio, "time to first audio")
    close = getattr(it, "close", None)
    if close:
        close()
    return dt


def measure(name: str, repeats: int, default_interval: bool = True) -> dict[str, float]:
    import voxtral_mlx

    path = resolve(name, CONFIGS)
    noise = start_noise(path, DEFAULT_CHUNK)
    voice = pick_voice(path)
    # Voice prefixes in a folder of this run's own: clear_prefix_cache() below empties the
    # prefix folder, which by default is the user's (a real checkpoint's saved voices).
    prefixes = tempfile.TemporaryDirectory(prefix="voxtral-ttfa-prefixes-")
    tts = voxtral_mlx.load(path, prefix_cache_dir=prefixes.name)

    def wait_idle() -> None:
        # The previous stream was closed after its first chunk: its last frame may still be
        # running. A user's next request could wait for it; the measurement does not.
        while tts.call(lambda: tts.engine.busy):
            time.sleep(0.001)

    def ours(clear: bool) -> float:
        if clear:
            tts.clear_prefix_cache()
        wait_idle()
        return first_chunk_s(lambda: tts.stream(TEXT, voice, noise=noise, max_frames=8))

    def ours_long() -> float:
        wait_idle()
        return first_chunk_s(
            lambda: tts.stream(SENTENCES, voice, seed=0, split=True, max_chars=80, max_frames=8)
        )

    ref = load_reference(path)
    reference_voice(ref, path, voice, ref.audio_codebook_embeddings["embeddings"].weight.dtype)
    suppress_end(tts, ref)

    def theirs(interval: float) -> float:
        with injected_noise(noise):
            return first_chunk_s(
                lambda: ref.generate(
                    TEXT,
                    voice=voice,
                    max_tokens=DEFAULT_CHUNK,
                    stream=True,
                    streaming_interval=interval,
                )
            )

    ours(True)  # warm-ups: weights read, graphs compiled
    theirs(ONE_FRAME_S)
    ours_long()
    new, cached, long, ref_one, ref_default = [], [], [], [], []
    for _ in range(repeats):  # interleaved, so drift in the machine's speed hits all alike
        new.append(ours(True))
        cached.append(ours(False))
        long.append(ours_long())
        ref_one.append(theirs(ONE_FRAME_S))
        if default_interval:
            ref_default.append(theirs(DEFAULT_INTERVAL_S))
    tts.close()
    prefixes.cleanup()
    med = statistics.median
    return {
        "new": med(new),
        "cached": med(cached),
        "long": med(long),
        "ref_one": med(ref_one),
        "ref_default": med(ref_default) if ref_default else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,wide")
    parser.add_argument("--repeats", type=at_least_one, default=5)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument(
        "--no-default-interval",
        action="store_true",
        help=f"skip mlx-audio at its default chunks ({DEFAULT_CHUNK} frames: 2 s of audio at "
        "the release's 12.5 frames/s; long on the wide config)",
    )
    args = parser.parse_args(argv)
    rows = [
        (
            "config",
            "ours, new voice",
            "ours, cached voice",
            "ours, long text",
            f"mlx-audio stream, default ({DEFAULT_CHUNK}-frame chunks)",
            "new / default",
            "cached / default",
            "mlx-audio stream, 1-frame chunks",
            "new / 1-frame",
            "cached / 1-frame",
        )
    ]

    def ms(s: float) -> str:
        return "not run" if s != s else f"{1000 * s:.0f} ms"

    def ratio(a: float, b: float, digits: int) -> str:
        return "" if b != b else f"{a / b:.{digits}f}"

    for name in config_list(args.configs):
        m = measure(name, args.repeats, default_interval=not args.no_default_interval)
        rows.append(
            (
                label(name),
                ms(m["new"]),
                ms(m["cached"]),
                ms(m["long"]),
                ms(m["ref_default"]),
                ratio(m["new"], m["ref_default"], 3),
                ratio(m["cached"], m["ref_default"], 3),
                ms(m["ref_one"]),
                ratio(m["new"], m["ref_one"], 2),
                ratio(m["cached"], m["ref_one"], 2),
            )
        )
        show_row(rows)
    if not args.no_record:
        print(
            record(
                "Time to first audio",
                command_line(__file__, argv or sys.argv[1:]),
                rows,
                "From the call to the first playable sample, medians. mlx-audio's streaming "
                f"mode by default yields its first chunk after {DEFAULT_CHUNK} frames "
                "(streaming_interval=2.0); with streaming_interval=0.08 after one frame, its "
                "best case. voxtral_mlx streams its first frame by default. The clock stops "
                "once the first chunk's samples are in memory (mlx-audio's lazy array "
                "evaluated).",
                runs=args.repeats,
            )
        )
    return 0


if __name__ == "__main__":
    run_script(main)
