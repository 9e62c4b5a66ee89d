"""Milliseconds per frame and real-time factor: voxtral_mlx vs mlx-audio, same checkpoint.

Per-frame cost is the marginal cost: (time for N2 frames - time for N1 frames) / (N2 - N1),
medians of repeated runs, so prefill and fixed costs cancel. Both implementations get the
same injected start noise and END suppressed, so every run has exactly the requested length:
the same amount of work. In float32 they generate the same frames; in bfloat16 their codes
part after a few frames (rounding differs, e.g. mlx-audio's flow head runs in float32).

    python benchmarks/frame_speed.py [--configs tiny,wide,CHECKPOINT_DIR] [--no-record]

A config is a built-in random checkpoint (tiny, wide, full) or a checkpoint directory (in
Mistral's layout for the mlx-audio comparison). Both implementations get END suppressed in
memory (see ``common.suppress_end``), so any random checkpoint runs its full length.
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx
from common import (
    TEXT,
    at_least_one,
    command_line,
    config_list,
    frame_ms,
    injected_noise,
    is_model_dir,
    is_narrow,
    label,
    load_reference,
    median_marginal_ms,
    pick_voice,
    record,
    reference_voice,
    resolve,
    run_script,
    show_row,
    start_noise,
    suppress_end,
)

CONFIGS = {
    # name: (size, backbone layers, flow layers, n1, n2)
    "tiny": ("tiny", None, None, 8, 40),
    "wide": ("wide", 2, 3, 1, 3),
    "full": ("full", None, None, 1, 3),
}


def measure(
    name: str, repeats: int, reference: bool = True, dtype: str | None = None
) -> dict[str, float]:
    """Marginal ms per frame of both implementations, runs interleaved (ours n2, ours n1,
    theirs n2, theirs n1, repeated) so that drift in the machine's speed hits both alike;
    the median over repetitions of each one's per-frame estimate. Also each one's peak
    memory over its n2 runs (see :func:`peak_mib`)."""
    import voxtral_mlx

    if dtype is not None and is_model_dir(name):
        raise SystemExit(
            f"{name}: --dtype applies to the built-in configs; a checkpoint directory is "
            "measured in its own dtype (make a float32 one with `voxtral-mlx random-checkpoint "
            "DIR --dtype float32`)"
        )
    path = resolve(name, CONFIGS, dtype or "bfloat16")
    if is_model_dir(name):
        n1, n2 = (8, 40) if is_narrow(path) else (1, 3)
    else:
        n1, n2 = CONFIGS[name][3:]
    noise = start_noise(path, n2)
    voice = pick_voice(path)

    tts = voxtral_mlx.load(path)
    spf = tts.samples_per_frame

    def ours(n: int) -> float:
        t0 = time.perf_counter()
        speech = tts.synthesize(TEXT, voice, noise=noise[:n], max_frames=n)
        if len(speech.codes) != n:
            raise SystemExit(f"{path}: {len(speech.codes)} of {n} frames")
        return time.perf_counter() - t0

    ref = None
    if reference:
        ref = load_reference(path)
        reference_voice(ref, path, voice, ref.audio_codebook_embeddings["embeddings"].weight.dtype)
    suppress_end(tts, ref)

    def theirs(n: int) -> float:
        t0 = time.perf_counter()
        with injected_noise(noise[:n]):
            out = list(ref.generate(TEXT, voice=voice, max_tokens=n))
            # Its generate() yields lazy arrays (the codec decode not yet run), while ours
            # returns finished audio: the clock stops only once its audio exists too.
            mx.eval([r.audio for r in out])
        assert out[-1].audio.shape[0] == n * spf
        return time.perf_counter() - t0

    ours_weights = tts.call(lambda: weight_bytes(tts.model))
    ours(n1)  # warm-up: weights read, graphs compiled, voice prefix cached
    if ref is not None:
        ref_weights = weight_bytes(ref)
        theirs(n1)
    ours_t, ref_t, ours_mib, ref_mib = [], [], [], []
    for _ in range(repeats):
        t2, mib = peak_mib(lambda: ours(n2), ours_weights)
        ours_t.append((ours(n1), t2))
        ours_mib.append(mib)
        if ref is not None:
            t2, mib = peak_mib(lambda: theirs(n2), ref_weights)
            ref_t.append((theirs(n1), t2))
            ref_mib.append(mib)
    tts.close()
    nan = float("nan")
    return {
        "ours_ms": median_marginal_ms(ours_t, n1, n2),
        "ref_ms": median_marginal_ms(ref_t, n1, n2) if ref_t else nan,
        "ours_mib": max(ours_mib),
        "ref_mib": max(ref_mib) if ref_mib else nan,
        "frame_ms": frame_ms(path),
    }


def weight_bytes(model) -> int:
    """Bytes of a model's parameters (its weights, resident whether or not it runs)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def peak_mib(run, weights: int) -> tuple[float, float]:
    """``run()``'s result and the peak memory of the implementation running it, in MiB: its
    weights plus the most that ``run`` held above what was allocated before it (both
    models are resident in this process, so MLX's process-wide peak alone would count the
    other one's weights too)."""
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    result = run()
    return result, (weights + mx.get_peak_memory() - before) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,wide")
    parser.add_argument("--repeats", type=at_least_one, default=5)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        help="of the built-in configs (default bfloat16); a directory runs in its own",
    )
    parser.add_argument(
        "--no-reference",
        action="store_true",
        help="skip mlx-audio (its full prompt prefill takes minutes per run on the full model)",
    )
    args = parser.parse_args(argv)
    rows = [
        (
            "config",
            "voxtral_mlx ms/frame",
            "mlx-audio ms/frame",
            "ratio (ours/theirs)",
            "voxtral_mlx RTF",
            "voxtral_mlx peak MiB",
            "mlx-audio peak MiB",
            "peak ratio (ours/theirs)",
        )
    ]
    names = config_list(args.configs)
    for name in names:
        m = measure(name, args.repeats, reference=not args.no_reference, dtype=args.dtype)
        rows.append(
            (
                label(name),
                f"{m['ours_ms']:.1f}",
                "not run" if args.no_reference else f"{m['ref_ms']:.1f}",
                "" if args.no_reference else f"{m['ours_ms'] / m['ref_ms']:.2f}",
                f"{m['ours_ms'] / m['frame_ms']:.2f}",
                f"{m['ours_mib']:.0f}",
                "not run" if args.no_reference else f"{m['ref_mib']:.0f}",
                "" if args.no_reference else f"{m['ours_mib'] / m['ref_mib']:.2f}",
            )
        )
        show_row(rows)
    if not args.no_record:
        built_in = {
            "tiny": "tiny: the test config (64-wide backbone): per-operation costs dominate (on "
            "a CPU backend, so does the compute of its many small matmuls). ",
            "wide": "wide: the real layer shapes (3072-wide backbone and flow head, 1024-wide "
            "codec) with 2 backbone layers. ",
            "full": "full: the real 26 + 3 layers. ",
        }
        notes = "".join(built_in[n] for n in names if n in built_in) + (
            "A directory is the checkpoint it holds. " if any(map(is_model_dir, names)) else ""
        )
        notes += (
            "RTF = ms per frame / ms of audio per frame (80 ms for Voxtral; below 1 is faster "
            "than real time). Peak memory: each implementation's weights plus the most its "
            "n2-frame run held above what was allocated before it (MLX's active memory; both "
            "models share the process), the largest over the runs."
        )
        print(
            record(
                "Frame speed" + ("" if args.dtype in (None, "bfloat16") else f" ({args.dtype})"),
                command_line(__file__, argv or sys.argv[1:]),
                rows,
                notes,
                runs=args.repeats,
            )
        )
    return 0


if __name__ == "__main__":
    run_script(main)
