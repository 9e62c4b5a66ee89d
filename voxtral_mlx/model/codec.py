"""The codec decoder (``audio_tokenizer``): 37 codes per frame -> 1920 samples at 24 kHz.

SPEC §6: dequantize -> causal Conv1d (replicate pad) -> per stage a transformer with a
causal ALiBi sliding window (stages > 0 first upsample with a ConvTranspose1d trimmed on
the right) -> causal Conv1d (reflect pad) -> unpatch. The decoder is causal with a
bounded receptive field, so streaming is exact with bounded state: the caller holds a
:class:`CodecState` (conv tails, the last ``W`` keys/values of every layer, the position)
and feeds frames through :meth:`CodecDecoder.decode_chunk`; nothing is ever re-decoded.
:meth:`CodecDecoder.decode` is the same path over bounded chunks, so long inputs never
need quadratic memory.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import N_SPECIAL_AUDIO_CODES, CodecArgs
from ..errors import InputError
from ..fileio import dtype_name
from .codec_layers import (
    CausalConv1d,
    CausalConvTranspose1d,
    CodecTransformer,
    CodecTransformerLayer,
    ConvBlock,
    alibi_slopes,
    attention_bias,
    banded_attention_bias,
    reflect_context,
    replicate_context,
)

# Frames per chunk in one-shot decode: large enough that per-call overhead vanishes,
# small enough that a chunk's activations stay a few MB.
ONE_SHOT_CHUNK_FRAMES = 64
# Chunks longer than this many steps (or the window) attend in blocks of this size, each
# block seeing only the keys its window reaches: work linear in the chunk, not quadratic.
BAND_BLOCK = 16
# Chunks of up to this many frames (the streaming sizes: live chunks grow to 8 frames,
# synthesize decodes 16 at a time, a segment's end leaves fewer) run as one compiled step;
# longer ones as steps of 64, 32 and 16 frames and such a remainder. Each length compiles
# a graph kept for the model's life (~1 MB): lengths an app picks freely must not each
# add one.
WHOLE_CHUNK_FRAMES = 16
_PIECE_FRAMES = (64, 32, 16)
# Masks for up to this many queries (the streaming sizes) are kept; larger ones are cheap
# next to the chunk they serve and would hold megabytes each.
_CACHED_MASK_MAX_QUERIES = 64
_MAX_CACHED_MASKS = 256


@dataclass
class CodecState:
    """Streaming state of one stream (or one batch of streams), held by the caller.

    All arrays have fixed shapes from :meth:`CodecDecoder.new_state` on, so memory per
    stream is constant however long the stream runs. :meth:`CodecDecoder.decode_chunk`
    replaces the arrays in place.

    ``conv``: per stage, the last inputs its conv needs (``[B, context, channels]``).
    ``keys``/``values``: per stage, per layer, the last ``W`` keys (after k_norm) and values
    ``[B, kv_heads, W, head_dim]``; slots before the first frame are masked out.
    ``output``: the last inputs of ``output_proj``. ``position``: frames decoded so far.
    """

    batch: int
    conv: list[mx.array]
    keys: list[list[mx.array]]
    values: list[list[mx.array]]
    output: mx.array
    position: int = 0

    def arrays(self) -> list[mx.array]:
        """Every array the state holds."""
        out = [*self.conv, self.output]
        for ks, vs in zip(self.keys, self.values):
            out += ks + vs
        return out

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


@dataclass
class _Plan:
    """Constants fixed at construction (a plain object, so MLX sees no parameters in it)."""

    windows: tuple[int, ...]  # attention window of each stage, in that stage's steps
    rates: tuple[int, ...]  # steps per frame at each stage (1, 2, 4, 8 for the real codec)
    slopes: mx.array  # ALiBi slope per head
    # Additive ALiBi + window masks by (stage, queries, valid cache slots, dtype), LRU.
    masks: OrderedDict = field(default_factory=OrderedDict)


class CodecDecoder(nn.Module):
    """Mistral's codec decoder; parameter names equal the sanitized checkpoint's."""

    def __init__(self, args: CodecArgs):
        super().__init__()
        self.args = args
        blocks: list[nn.Module] = []
        for s in range(args.n_stages):
            in_ch = args.codebook_dim if s == 0 else args.dim
            k, stride = args.conv_kernels[s], args.conv_strides[s]
            if s > 0:  # a ConvTranspose1d even at stride 1, as in Mistral's codec
                conv = CausalConvTranspose1d(in_ch, args.dim, k, stride)
            else:
                conv = CausalConv1d(in_ch, args.dim, k)
            blocks.append(ConvBlock(conv))
            blocks.append(
                CodecTransformer(
                    args.transformer_lengths[s],
                    dim=args.dim,
                    hidden_dim=args.hidden_dim,
                    n_heads=args.n_heads,
                    n_kv_heads=args.n_kv_heads,
                    head_dim=args.head_dim,
                    norm_eps=args.norm_eps,
                    qk_norm_eps=args.qk_norm_eps,
                )
            )
        self.decoder_blocks = blocks
        self.output_proj = ConvBlock(
            CausalConv1d(args.dim, args.patch_size, args.patch_proj_kernel_size)
        )
        self.semantic_codebook = mx.zeros((args.semantic_codebook_size, args.semantic_dim))
        self._compiled_steps: dict[bool, Callable] = {}
        self._plan = _Plan(
            windows=args.windows,
            rates=tuple(math.prod(args.conv_strides[: s + 1]) for s in range(args.n_stages)),
            slopes=mx.array(alibi_slopes(args.n_heads), dtype=mx.float32),
        )

    # -- properties ---------------------------------------------------------------------
    @property
    def samples_per_frame(self) -> int:
        return self.args.samples_per_frame

    @property
    def num_codebooks(self) -> int:
        return 1 + self.args.acoustic_dim

    @property
    def dtype(self) -> mx.Dtype:
        """Compute dtype: that of the loaded weights."""
        return self.output_proj.conv.weight.dtype

    @property
    def windows(self) -> tuple[int, ...]:
        return self._plan.windows

    def _conv(self, s: int) -> CausalConv1d | CausalConvTranspose1d:
        return self.decoder_blocks[2 * s].conv

    # -- codes -> features --------------------------------------------------------------
    def dequantize(self, codes: mx.array) -> mx.array:
        """Codes ``[B, T, 37]`` (with their +2 offset) -> ``[B, T, semantic_dim + acoustic_dim]``.

        Semantic: a row of the folded codebook; acoustic: ``c * 2 / (levels - 1) - 1`` with
        ``c = code - 2``. Out-of-range semantic codes are clipped rather than read out of
        bounds (the generator never produces them).
        """
        a = self.args
        sem = mx.clip(codes[..., 0] - N_SPECIAL_AUDIO_CODES, 0, a.semantic_codebook_size - 1)
        semantic = self.semantic_codebook[sem]
        c = (codes[..., 1:] - N_SPECIAL_AUDIO_CODES).astype(mx.float32)
        acoustic = (c * 2) / (a.acoustic_codebook_size - 1) - 1
        return mx.concatenate([semantic, acoustic.astype(semantic.dtype)], axis=-1)

    # -- streaming ----------------------------------------------------------------------
    def new_state(self, batch: int = 1) -> CodecState:
        """A fresh state for ``batch`` streams decoded together (in the compute dtype)."""
        a, dt = self.args, self.dtype
        conv = []
        for s in range(a.n_stages):
            in_ch = a.codebook_dim if s == 0 else a.dim
            conv.append(mx.zeros((batch, self._conv(s).context, in_ch), dtype=dt))
        keys, values = [], []
        for s in range(a.n_stages):
            shape = (batch, a.n_kv_heads, self._plan.windows[s], a.head_dim)
            n_layers = a.transformer_lengths[s]
            keys.append([mx.zeros(shape, dtype=dt) for _ in range(n_layers)])
            values.append([mx.zeros(shape, dtype=dt) for _ in range(n_layers)])
        output = mx.zeros((batch, self.output_proj.conv.context, a.dim), dtype=dt)
        return CodecState(batch, conv, keys, values, output)

    def decode_chunk(self, codes: mx.array, state: CodecState) -> mx.array:
        """Decode ``t`` new frames ``[B, t, 37]`` -> audio ``[B, t * samples_per_frame]``.

        Updates ``state`` in place (arrays replaced, ``position`` advanced). Lazy: nothing is
        evaluated here; evaluate the audio (and with it the state) at frame boundaries.
        Exact: any split of a stream into chunks gives the one-shot result, the first chunk
        included, provided the first chunk yields more than ``patch_proj_kernel_size - 1``
        steps at the last stage (one frame gives 8 for the real codec). A chunk longer than
        :data:`WHOLE_CHUNK_FRAMES` runs as the steps :func:`piece_frames` lists.
        """
        codes = self._check_codes(codes, state.batch)
        t = codes.shape[1]
        if t == 0:
            return mx.zeros((state.batch, 0), dtype=self.dtype)
        if t <= WHOLE_CHUNK_FRAMES:
            return self._decode_piece(codes, state)
        parts, start = [], 0
        for n in piece_frames(t):
            parts.append(self._decode_piece(codes[:, start : start + n], state))
            start += n
        return mx.concatenate(parts, axis=1)

    def _decode_piece(self, codes: mx.array, state: CodecState) -> mx.array:
        t = codes.shape[1]
        plan = self._plan
        masks = [
            self._mask(s, t * plan.rates[s], min(state.position * plan.rates[s], w), self.dtype)
            for s, w in enumerate(plan.windows)
        ]
        # The masks carry the position (filled window slots), so one compiled graph per
        # chunk size serves every chunk after the first, and one more the first chunk.
        first = state.position == 0
        args = (codes, state.conv, state.keys, state.values, state.output, masks)
        step = self._compiled_steps.get(first) or partial(self._step, first=first)
        y, state.conv, state.keys, state.values, state.output = step(*args)
        state.position += t
        return y

    def decode_chunks(self, chunks: list[tuple[mx.array, CodecState]]) -> list[mx.array]:
        """:meth:`decode_chunk` for several streams at once: ``[(codes, state), ...]`` ->
        their audio, in order, each state updated in place.

        Streams whose chunks have the same length and whose states are in the same phase
        (first chunk or not, attention windows filled alike, so the masks are equal) run as
        one batch: one step for all of them instead of one each. Equal to decoding each
        stream alone up to the rounding of batched matrix products.
        """
        if len({id(state) for _, state in chunks}) != len(chunks):
            raise InputError("a codec state can take only one chunk per decode_chunks() call")
        checked = [(self._check_codes(codes, state.batch), state) for codes, state in chunks]
        groups: dict[tuple, list[int]] = {}
        for i, (codes, state) in enumerate(checked):
            groups.setdefault(self._phase(codes.shape[1], state), []).append(i)
        out: list[mx.array | None] = [None] * len(checked)
        for members in groups.values():
            if len(members) == 1:
                out[members[0]] = self.decode_chunk(*checked[members[0]])
                continue
            states = [checked[i][1] for i in members]
            merged = _concat_states(states)
            codes = mx.concatenate([checked[i][0] for i in members])
            audio = self.decode_chunk(codes, merged)
            start, steps = 0, codes.shape[1]
            for i, state in zip(members, states):
                out[i] = audio[start : start + state.batch]
                _take_rows(merged, start, state, steps)
                start += state.batch
        return out

    def _phase(self, t: int, state: CodecState) -> tuple:
        """What the step's graph and masks depend on besides the batch size."""
        plan = self._plan
        filled = tuple(min(state.position * r, w) for r, w in zip(plan.rates, plan.windows))
        return t, state.position == 0, filled

    def prepare(self, compile: bool = True) -> None:
        """Fuse the transformer layers' projections and compile the streaming step (after
        the weights are loaded): one function for a stream's first chunk (start padding),
        one for the others."""
        for module in self.modules():
            if isinstance(module, CodecTransformerLayer):
                module.fuse()
        self._compiled_steps = (
            {first: mx.compile(partial(self._step, first=first)) for first in (True, False)}
            if compile
            else {}
        )

    def _step(
        self,
        codes: mx.array,
        conv: list[mx.array],
        keys: list[list[mx.array]],
        values: list[list[mx.array]],
        output: mx.array,
        masks: list[mx.array],
        first: bool,
    ) -> tuple[mx.array, list, list, list, mx.array]:
        """One chunk through the decoder: audio ``[B, samples]`` and the next state arrays."""
        conv, keys, values = list(conv), [list(k) for k in keys], [list(v) for v in values]
        x = self.dequantize(codes)
        for s in range(self.args.n_stages):
            layer_conv = self._conv(s)
            context = conv[s]
            if first and isinstance(layer_conv, CausalConv1d):
                context = replicate_context(x, layer_conv.context)
            x, conv[s] = layer_conv(x, context)
            x = self._stage_transformer(s, x, keys[s], values[s], masks[s])
        out_conv = self.output_proj.conv
        context = reflect_context(x, out_conv.context) if first else output
        y, output = out_conv(x, context)
        return y.reshape(codes.shape[0], -1), conv, keys, values, output

    def _stage_transformer(
        self, s: int, x: mx.array, keys: list[mx.array], values: list[mx.array], mask: mx.array
    ) -> mx.array:
        """Stage ``s``'s transformer over new steps ``x``; replaces each layer's K/V window
        in ``keys``/``values`` with its last ``W`` steps."""
        window = self._plan.windows[s]
        for j, layer in enumerate(self.decoder_blocks[2 * s + 1].layers):
            x, k, v = layer(x, keys[j], values[j], mask)
            keys[j], values[j] = k[:, :, -window:], v[:, :, -window:]
        return x

    def _mask(self, s: int, n: int, n_valid: int, dtype: mx.Dtype) -> mx.array:
        """The attention mask of stage ``s`` for ``n`` new steps: full ``[heads, n, W + n]``
        for short chunks, banded (linear in ``n``) for long ones."""
        window = self._plan.windows[s]
        block = max(window, BAND_BLOCK)

        def build() -> mx.array:
            if n > block:
                return banded_attention_bias(self._plan.slopes, window, block, n, n_valid, dtype)
            return attention_bias(self._plan.slopes, window, n, n_valid, dtype)

        if n > _CACHED_MASK_MAX_QUERIES:
            return build()
        key = (s, n, n_valid, dtype)
        masks = self._plan.masks
        mask = masks.get(key)
        if mask is None:
            mask = build()
            masks[key] = mask
            if len(masks) > _MAX_CACHED_MASKS:
                masks.popitem(last=False)
        else:
            masks.move_to_end(key)
        return mask

    def _check_codes(self, codes: mx.array, batch: int) -> mx.array:
        if not isinstance(codes, mx.array):
            codes = mx.array(np.asarray(codes))
        if codes.ndim != 3 or codes.shape[-1] != self.num_codebooks:
            raise InputError(
                f"codec codes must have shape [batch, frames, {self.num_codebooks}], got "
                f"{list(codes.shape)}"
            )
        if codes.shape[0] != batch:
            raise InputError(
                f"codes hold {codes.shape[0]} streams but the codec state was made for {batch}: "
                f"use new_state(batch={codes.shape[0]})"
            )
        if not mx.issubdtype(codes.dtype, mx.integer):
            raise InputError(f"codec codes must be integers, got {dtype_name(codes.dtype)}")
        return codes

    # -- one-shot -----------------------------------------------------------------------
    def decode(self, codes: mx.array, chunk_frames: int = ONE_SHOT_CHUNK_FRAMES) -> mx.array:
        """Codes ``[T, 37]`` -> audio ``[T * spf]``, or ``[B, T, 37]`` -> ``[B, T * spf]``.

        Runs the streaming path over chunks of ``chunk_frames`` frames, evaluating each, so
        memory stays bounded for any length (a single chunk is not evaluated: up to
        ``chunk_frames`` frames the result is as lazy as :meth:`decode_chunk`'s).
        """
        if not isinstance(codes, mx.array):
            codes = mx.array(np.asarray(codes))
        single = codes.ndim == 2
        if single:
            codes = codes[None]
        if codes.ndim != 3:
            raise InputError(
                f"codec codes must have shape [frames, {self.num_codebooks}] or "
                f"[batch, frames, {self.num_codebooks}], got {list(codes.shape)}"
            )
        if chunk_frames < 1:
            raise InputError(f"chunk_frames must be at least 1, got {chunk_frames}")
        state = self.new_state(codes.shape[0])
        total = codes.shape[1]
        if total <= chunk_frames:
            audio = self.decode_chunk(codes, state)
        else:
            parts = []
            for start in range(0, total, chunk_frames):
                part = self.decode_chunk(codes[:, start : start + chunk_frames], state)
                mx.eval(part, state.arrays())
                parts.append(part)
            audio = mx.concatenate(parts, axis=1)
        return audio[0] if single else audio


def piece_frames(t: int) -> list[int]:
    """The lengths of the compiled steps a chunk of ``t`` frames runs as, in order."""
    if t <= WHOLE_CHUNK_FRAMES:
        return [t]
    pieces = [_PIECE_FRAMES[0]] * (t // _PIECE_FRAMES[0])
    t %= _PIECE_FRAMES[0]
    for n in _PIECE_FRAMES[1:]:
        if t >= n:
            pieces.append(n)
            t -= n
    return [*pieces, t] if t else pieces


def _concat_states(states: list[CodecState]) -> CodecState:
    """One state holding the rows of ``states`` in order (at the first one's position;
    the caller groups states whose masks agree)."""

    def cat(arrays: list[mx.array]) -> mx.array:
        return mx.concatenate(arrays, axis=0)

    def cat_each(lists: list[list[mx.array]]) -> list[mx.array]:
        return [cat(list(same_slot)) for same_slot in zip(*lists)]

    return CodecState(
        sum(s.batch for s in states),
        cat_each([s.conv for s in states]),
        [cat_each(list(stage)) for stage in zip(*(s.keys for s in states))],
        [cat_each(list(stage)) for stage in zip(*(s.values for s in states))],
        cat([s.output for s in states]),
        states[0].position,
    )


def _take_rows(merged: CodecState, start: int, state: CodecState, steps: int) -> None:
    """Give ``state`` its rows of ``merged`` after ``merged`` decoded ``steps`` frames."""
    rows = slice(start, start + state.batch)
    state.conv = [c[rows] for c in merged.conv]
    state.keys = [[k[rows] for k in ks] for ks in merged.keys]
    state.values = [[v[rows] for v in vs] for vs in merged.values]
    state.output = merged.output[rows]
    state.position += steps
