"""Time to first audio: from the call to the first playable sample.

voxtral_mlx streaming (one frame per chunk) with a voice never used before (its prefix is
prefilled) and with a voice used before (prefix cache hit), against mlx-audio's streaming
mode (``generate(stream=True)``, one-frame chunks) on the same checkpoint in the same run.

    python benchmarks/ttfa.py [--configs tiny,wide] [--no-record]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from common import TEXT, VOICE, checkpoint, injected_noise, load_reference, record, reference_voice

CONFIGS = {"tiny": ("tiny", None, None), "wide": ("wide", 2, 3), "full": ("full", None, None)}


def first_chunk_s(make_iter) -> float:
    t0 = time.perf_counter()
    it = make_iter()
    next(iter(it))
    dt = time.perf_counter() - t0
    close = getattr(it, "close", None)
    if close:
        close()
    return dt


def measure(name: str, repeats: int) -> dict[str, float]:
    import voxtral_mlx

    size, layers, flow_layers = CONFIGS[name]
    path = checkpoint(size, n_layers=layers, flow_layers=flow_layers)
    noise = np.random.default_rng(0).standard_normal((8, 36)).astype(np.float32)
    tts = voxtral_mlx.load(path)

    def ours(clear: bool) -> float:
        if clear:
            tts.clear_prefix_cache()
        # The previous stream was closed after its first chunk: its last frame may still be
        # running. A user's next request could wait for it; the measurement does not.
        while tts.call(lambda: tts.engine.busy):
            time.sleep(0.001)
        return first_chunk_s(lambda: tts.stream(TEXT, VOICE, noise=noise, max_frames=8))

    ref = load_reference(path)
    reference_voice(ref, path, VOICE, ref.audio_codebook_embeddings["embeddings"].weight.dtype)

    def theirs() -> float:
        with injected_noise(noise):
            return first_chunk_s(
                lambda: ref.generate(
                    TEXT, voice=VOICE, max_tokens=8, stream=True, streaming_interval=0.08
                )
            )

    ours(True)  # warm-ups: weights read, graphs compiled
    theirs()
    new, cached, ref_s = [], [], []
    for _ in range(repeats):  # interleaved, so drift in the machine's speed hits all alike
        new.append(ours(True))
        cached.append(ours(False))
        ref_s.append(theirs())
    tts.close()
    med = statistics.median
    return {"new": med(new), "cached": med(cached), "ref": med(ref_s)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,wide")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    rows = [
        (
            "config",
            "ours, new voice",
            "ours, cached voice",
            "mlx-audio stream",
            "new / mlx-audio",
            "cached / mlx-audio",
        )
    ]
    for name in args.configs.split(","):
        m = measure(name, args.repeats)
        rows.append(
            (
                name,
                f"{1000 * m['new']:.0f} ms",
                f"{1000 * m['cached']:.0f} ms",
                f"{1000 * m['ref']:.0f} ms",
                f"{m['new'] / m['ref']:.2f}",
                f"{m['cached'] / m['ref']:.2f}",
            )
        )
        print(" | ".join(rows[-1]), flush=True)
    if not args.no_record:
        print(
            record(
                "Time to first audio",
                "python benchmarks/ttfa.py " + " ".join(argv or sys.argv[1:]),
                rows,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
