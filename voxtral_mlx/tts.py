"""The loaded text-to-speech object: prompts, one-shot synthesis, streaming, decoding."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from .config import ModelConfig
from .errors import InputError
from .generate import Frame, NoiseSource, generate_frames
from .loader import LoadedModel
from .model.flow import DEFAULT_CFG_ALPHA
from .tokenizer import TekkenTokenizer, speech_prompt_ids
from .voices import Voice, VoiceRegistry

DEFAULT_VOICE = "casual_male"
DEFAULT_MAX_FRAMES = 2400  # 192 s of audio at 12.5 frames/s
MAX_TEXT_TOKENS = 8192
SYNTH_CHUNK_FRAMES = 16


@dataclass
class Timings:
    """Wall-clock figures of one request (seconds unless named otherwise)."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0
    first_audio_s: float = 0.0
    total_s: float = 0.0
    frames: int = 0
    audio_s: float = 0.0
    peak_memory_bytes: int = 0

    @property
    def ms_per_frame(self) -> float:
        gen = self.total_s - self.prefill_s
        return 1000.0 * gen / self.frames if self.frames else 0.0

    @property
    def rtf(self) -> float:
        """Real-time factor: wall time / audio duration (below 1 is faster than real time)."""
        return self.total_s / self.audio_s if self.audio_s else float("inf")


@dataclass
class Speech:
    """A whole utterance."""

    audio: np.ndarray  # [samples] float32, mono
    sample_rate: int
    codes: np.ndarray  # [frames, 37] int32, +2-offset codes as generated
    voice: str
    seed: int | None  # None when the noise was given explicitly
    timings: Timings = field(default_factory=Timings)

    @property
    def duration(self) -> float:
        return len(self.audio) / self.sample_rate


@dataclass
class AudioChunk:
    """A piece of a streamed utterance, playable as soon as it arrives."""

    audio: np.ndarray  # [frames * 1920] float32
    sample_rate: int
    frame_index: int  # index of the chunk's first frame in the utterance
    frames: int
    is_final: bool
    codes: np.ndarray  # [frames, 37]
    timings: Timings
    seed: int | None  # the noise seed (None when the noise was given explicitly)


class VoxtralTTS:
    """Voxtral-4B-TTS loaded for inference. Create it with :func:`voxtral_mlx.load`.

    Calls from several threads are serialised (one request generates at a time).
    """

    def __init__(self, loaded: LoadedModel):
        self.model = loaded.model
        self.config: ModelConfig = loaded.config
        self.tokenizer: TekkenTokenizer = loaded.tokenizer
        self.voices: VoiceRegistry = loaded.voices
        self.dtype: mx.Dtype = loaded.dtype
        self.path: Path = loaded.path
        self._lock = threading.RLock()

    @property
    def sample_rate(self) -> int:
        return self.config.sampling_rate

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    @property
    def default_voice(self) -> str:
        if DEFAULT_VOICE in self.voices:
            return DEFAULT_VOICE
        if not self.voices:
            raise InputError(f"{self.path} has no voices in voice_embedding/")
        return sorted(self.voices)[0]

    def _voice(self, voice: str | None) -> Voice:
        return self.voices.get_voice(self.default_voice if voice is None else voice)

    def prompt_ids(self, text: str, voice: str | None = None) -> list[int]:
        """The prompt's token ids: ``[BOS, BEGIN_AUDIO] + [AUDIO]*N + [NEXT_AUDIO_TEXT] +
        text + [REPEAT_AUDIO_TEXT, BEGIN_AUDIO]`` (raw text, no normalisation)."""
        v = self._voice(voice)
        n = v.num_tokens if v.num_tokens is not None else self.voices.embedding(v.name).shape[0]
        return speech_prompt_ids(self.tokenizer, text, n)

    def _prompt(self, text: str, voice: str | None) -> tuple[Voice, list[int], mx.array]:
        if not isinstance(text, str):
            raise InputError(f"text must be a string, got {type(text).__name__}")
        if not text.strip():
            raise InputError("text is empty: give some words to speak")
        v = self._voice(voice)
        ids = self.prompt_ids(text, v.name)
        n_text = len(ids) - 5 - (v.num_tokens or 0)
        if n_text > MAX_TEXT_TOKENS:
            raise InputError(
                f"text is too long for one utterance ({n_text} tokens, limit {MAX_TEXT_TOKENS}): "
                "split it into paragraphs"
            )
        rows = self.voices.embedding(v.name, self.dtype)
        start = ids.index(self.config.audio_token_id)
        return v, ids, self.model.embed_prompt(ids, rows, start)

    def prompt_embeddings(self, text: str, voice: str | None = None) -> mx.array:
        """Prompt embeddings ``[1, T, dim]``: token rows with the voice spliced in."""
        return self._prompt(text, voice)[2]

    def _frames(
        self,
        text: str,
        voice: str | None,
        seed: int | None,
        noise: np.ndarray | None,
        max_frames: int,
        cfg_alpha: float,
    ) -> tuple[Voice, NoiseSource, Iterator[Frame]]:
        if max_frames < 0:
            raise InputError(f"max_frames must be >= 0, got {max_frames}")
        v, _ids, prompt = self._prompt(text, voice)
        source = NoiseSource(self.config.flow.n_acoustic_codebook, seed=seed, noise=noise)
        frames = generate_frames(
            self.model, prompt, source, max_frames=max_frames, cfg_alpha=cfg_alpha
        )
        return v, source, frames

    def stream(
        self,
        text: str,
        voice: str | None = None,
        *,
        seed: int | None = None,
        noise: np.ndarray | None = None,
        chunk_frames: int = 1,
        max_frames: int = DEFAULT_MAX_FRAMES,
        cfg_alpha: float = DEFAULT_CFG_ALPHA,
    ) -> Iterator[AudioChunk]:
        """Yield audio as it is decoded, ``chunk_frames`` frames (80 ms each) at a time.

        The first chunk is ready after the prompt's prefill and one frame. The last chunk has
        ``is_final=True`` (it may be empty when END falls on a chunk boundary). Closing the
        iterator stops generation. Concatenated chunks equal :meth:`synthesize` for the same
        seed or noise.
        """
        if chunk_frames < 1:
            raise InputError(f"chunk_frames must be >= 1, got {chunk_frames}")
        with self._lock:
            yield from self._stream(text, voice, seed, noise, chunk_frames, max_frames, cfg_alpha)

    def _stream(
        self, text, voice, seed, noise, chunk_frames, max_frames, cfg_alpha
    ) -> Iterator[AudioChunk]:
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        _v, source, frames = self._frames(text, voice, seed, noise, max_frames, cfg_alpha)
        timings = Timings()
        codec = self.model.audio_tokenizer
        state = codec.new_state(1)
        pending: list[mx.array] = []
        first_index = 0

        def emit(final: bool) -> AudioChunk:
            nonlocal pending, first_index
            if pending:
                codes_mx = mx.stack(pending)
                audio_mx = codec.decode_chunk(codes_mx[None], state)[0].astype(mx.float32)
                audio, codes = np.array(audio_mx), np.array(codes_mx)
            else:
                audio = np.zeros(0, np.float32)
                codes = np.zeros((0, self.config.num_codebooks), np.int32)
            now = time.perf_counter()
            timings.total_s = now - t0
            if timings.first_audio_s == 0.0 and len(audio):
                timings.first_audio_s = now - t0
            timings.audio_s += len(audio) / self.sample_rate
            timings.peak_memory_bytes = mx.get_peak_memory()
            chunk = AudioChunk(
                audio,
                self.sample_rate,
                first_index,
                len(pending),
                final,
                codes,
                timings,
                source.seed,
            )
            first_index += len(pending)
            pending = []
            return chunk

        try:
            for frame in frames:
                timings.prompt_tokens = frame.timings.prompt_tokens
                timings.prefill_s = frame.timings.prefill_s
                timings.frames = frame.index + 1
                pending.append(frame.codes)
                if len(pending) == chunk_frames:
                    yield emit(False)
            yield emit(True)
        finally:
            frames.close()

    def synthesize(
        self,
        text: str,
        voice: str | None = None,
        *,
        seed: int | None = None,
        noise: np.ndarray | None = None,
        max_frames: int = DEFAULT_MAX_FRAMES,
        cfg_alpha: float = DEFAULT_CFG_ALPHA,
    ) -> Speech:
        """Speak ``text`` with ``voice``; returns the whole utterance.

        ``seed`` fixes the flow-matching start noise (the only randomness; the semantic code
        is greedy), ``noise`` gives it explicitly as ``[frames, 36]`` floats (frame i uses
        row i; generation stops after ``len(noise)`` frames at most). ``max_frames`` bounds
        runaway generation (80 ms per frame).
        """
        with self._lock:
            chunks = list(
                self._stream(text, voice, seed, noise, SYNTH_CHUNK_FRAMES, max_frames, cfg_alpha)
            )
        audio = np.concatenate([c.audio for c in chunks]).astype(np.float32, copy=False)
        codes = np.concatenate([c.codes for c in chunks]).reshape(-1, self.config.num_codebooks)
        v = self._voice(voice)
        timings = chunks[-1].timings
        return Speech(
            audio,
            self.sample_rate,
            codes.astype(np.int32),
            v.name,
            chunks[-1].seed,
            timings,
        )

    def decode(self, codes: np.ndarray | mx.array) -> np.ndarray:
        """Waveform (float32, 24 kHz) of a ``[frames, 37]`` array of +2-offset codes."""
        arr = np.asarray(codes)
        n = self.config.num_codebooks
        if arr.ndim != 2 or arr.shape[1] != n or not np.issubdtype(arr.dtype, np.integer):
            raise InputError(
                f"codes must be an integer array of shape [frames, {n}], got "
                f"{arr.dtype} {list(arr.shape)}"
            )
        f = self.config.flow
        sem, ac = arr[:, 0], arr[:, 1:]
        if arr.size and (
            sem.min() < 2
            or sem.max() >= f.semantic_codebook_size + 2
            or ac.min() < 2
            or ac.max() >= f.acoustic_codebook_size + 2
        ):
            raise InputError(
                "codes out of range: semantic codes must lie in "
                f"[2, {f.semantic_codebook_size + 1}] and acoustic codes in "
                f"[2, {f.acoustic_codebook_size + 1}] (END=1 is not audio)"
            )
        with self._lock:
            audio = self.model.audio_tokenizer.decode(mx.array(arr.astype(np.int32)))
            return np.array(audio.astype(mx.float32))
