"""``acoustic_transformer``: the greedy semantic head and the flow-matching acoustic head."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ..config import N_SPECIAL_AUDIO_CODES, FlowArgs
from .layers import TransformerBlock

DEFAULT_CFG_ALPHA = 1.2
# Guidance weights beyond this are no use, and near float32's range they overflow the ODE.
MAX_CFG_ALPHA = 100.0
# What :meth:`FlowHead.frame` returns as the semantic code of a hidden state holding NaN or
# inf, and (+ the code offset) as an acoustic code whose ODE state became NaN.
NOT_FINITE = -1


def time_embedding(t: mx.array, dim: int) -> mx.array:
    """Sinusoidal embedding of times ``t`` ``[n]`` -> ``[n, dim]``, cosines first."""
    half = dim // 2
    freqs = mx.exp(-math.log(10000.0) * mx.arange(half, dtype=mx.float32) / half)
    angles = t.astype(mx.float32)[:, None] * freqs[None, :]
    return mx.concatenate([mx.cos(angles), mx.sin(angles)], axis=-1)


class FlowHead(nn.Module):
    """Semantic code by argmax, 36 acoustic codes by Euler-integrated flow matching.

    The 3 transformer layers see 3 tokens ``[x, time, llm]``, bidirectionally and with no
    positional encoding; conditional and unconditional (llm token zeroed) passes run as
    one batch.
    """

    def __init__(self, args: FlowArgs, semantic_rows: int | None = None):
        super().__init__()
        self.args = args
        rows = semantic_rows or args.semantic_output_rows
        self.input_projection = nn.Linear(args.n_acoustic_codebook, args.dim, bias=False)
        self.llm_projection = nn.Linear(args.input_dim, args.dim, bias=False)
        self.time_projection = nn.Linear(args.dim, args.dim, bias=False)
        self.layers = [
            TransformerBlock(
                args.dim,
                args.n_heads,
                args.n_kv_heads,
                args.head_dim,
                args.hidden_dim,
                args.norm_eps,
            )
            for _ in range(args.n_layers)
        ]
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.semantic_codebook_output = nn.Linear(args.dim, rows, bias=False)
        self.acoustic_codebook_output = nn.Linear(args.dim, args.n_acoustic_codebook, bias=False)
        valid = mx.arange(rows)
        limit = args.semantic_codebook_size + N_SPECIAL_AUDIO_CODES
        # EMPTY_AUDIO (0) and the padding rows can never be predicted.
        self._semantic_mask = mx.where((valid == 0) | (valid >= limit), -mx.inf, 0.0)
        self._time_tokens: mx.array | None = None
        self._time_projections: mx.array | None = None
        self._compiled = None

    def prepare(self, compile: bool = True) -> None:
        """Fuse the layers' projections and precompute the time tokens (and their first-layer
        projections) once (after the weights are loaded; again after they change), and
        compile the frame: semantic head + all Euler steps, fixed shapes per batch size."""
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            layer.prepare(query_apart=0 < i == last)
        n = self.args.n_decoding_steps
        t = mx.arange(n, dtype=mx.float32) / n
        dtype = self.norm.weight.dtype  # the compute dtype, whatever is quantized
        emb = time_embedding(t, self.args.dim).astype(dtype)
        self._time_tokens = self.time_projection(emb)
        self._time_projections = self.first_projections(self._time_tokens)
        mx.eval(self._time_tokens, self._time_projections, self._semantic_mask)
        self._compiled = mx.compile(self.frame) if compile else None

    @property
    def time_tokens(self) -> mx.array:
        """``time_projection(temb(i / n))`` for the n Euler steps, ``[n, dim]``."""
        if self._time_tokens is None:
            raise RuntimeError("FlowHead.prepare() must run after the weights are loaded")
        return self._time_tokens

    def first_projections(self, tokens: mx.array) -> mx.array:
        """The first layer's queries, keys and values of ``tokens [..., dim]``, side by side."""
        first = self.layers[0]
        return first.attention.projections(first.attention_norm(tokens))

    def step_tokens(self, llm: mx.array, llm_projections: mx.array) -> tuple[mx.array, mx.array]:
        """What the Euler steps of a frame share, from its llm token ``[B, dim]`` and that
        token's :meth:`first_projections`: the time and llm tokens ``[n, 2B, 2, dim]`` of
        each step (cond rows, then uncond rows with the llm token zeroed) and their
        first-layer projections ``[n, 2B, 2, q+k+v]``.

        Only the ``x`` token's projections are new at each step: the time tokens' are the
        same every frame, the llm token's through a frame, and the zeroed token's are zeros.
        A step's first layer then projects a sixth of its rows (a product whose cost grows
        with its rows on a CPU) and builds its inputs in one concatenation.
        """
        return (
            self._step_tokens(self.time_tokens, llm),
            self._step_tokens(self._time_projections, llm_projections),
        )

    @staticmethod
    def _step_tokens(time: mx.array, llm: mx.array) -> mx.array:
        """``[n, 2B, 2, d]`` from time rows ``[n, d]`` and llm rows ``[B, d]``."""
        (n, d), b = time.shape, llm.shape[0]
        llm = mx.concatenate([llm, mx.zeros_like(llm)])
        return mx.stack(
            [mx.broadcast_to(time[:, None], (n, 2 * b, d)), mx.broadcast_to(llm, (n, 2 * b, d))],
            axis=2,
        )

    def semantic_code(self, h: mx.array) -> mx.array:
        """Greedy semantic code ``[B]`` (with the +2 offset; 1 = END_AUDIO) from ``h [B, dim]``."""
        return self._semantic(h)[0]

    def _semantic(self, h: mx.array) -> tuple[mx.array, mx.array]:
        """The semantic code ``[B]`` and whether ``h`` and its logits are finite ``[B]``
        (argmax over NaN logits still picks some valid-looking index)."""
        # The product in the compute dtype, then float32, as the PyTorch implementations do
        # (`semantic_codebook_output(h).float()`): SPEC's "in float32" is the logits' dtype.
        logits = self.semantic_codebook_output(h).astype(mx.float32)
        finite = mx.all(mx.isfinite(h), axis=-1) & mx.all(mx.isfinite(logits), axis=-1)
        return mx.argmax(logits + self._semantic_mask, axis=-1), finite

    def velocity(
        self,
        x: mx.array,
        step: int,
        tokens: tuple[mx.array, mx.array],
        x_token: tuple[mx.array, mx.array] | None = None,
    ) -> mx.array:
        """Velocities ``[2B, 36]`` at Euler step ``step`` for cond (first B rows) and uncond
        (last B rows); ``tokens`` from :meth:`step_tokens`; ``x_token``: the input token of
        ``x`` and its :meth:`first_projections`, when they are already made."""
        b = x.shape[0]
        seq, qkv = tokens
        if x_token is None:
            xin = self.input_projection(x.astype(seq.dtype))
            x_token = xin, self.first_projections(xin)
        # A slice, not ``seq[step]``: integer indexing of the first axis is a gather (a
        # copying kernel), a slice a view.
        seq = self._with_x(x_token[0], seq[step : step + 1].squeeze(0))
        qkv = self._with_x(x_token[1], qkv[step : step + 1].squeeze(0))
        # Only position 0 is read out: the last layer computes nothing else.
        if len(self.layers) == 1:
            out = self.layers[0].from_projections(seq, qkv, first_only=True)
        else:
            seq = self.layers[0].from_projections(seq, qkv)
            for layer in self.layers[1:-1]:
                seq = layer(seq)
            out = self.layers[-1].first_position(seq)
        out = self.acoustic_codebook_output(self.norm(out[:, 0]))
        return out.astype(mx.float32).reshape(2 * b, -1)

    @staticmethod
    def _with_x(x: mx.array, rest: mx.array) -> mx.array:
        """The step's tokens ``[2B, 3, d]``: ``x [B, d]`` (cond and uncond) before ``rest``."""
        x = mx.concatenate([x, x])[:, None]
        return mx.concatenate([x.astype(rest.dtype), rest], axis=1)

    def acoustic_codes(self, h: mx.array, noise: mx.array, cfg: mx.array) -> mx.array:
        """36 acoustic codes ``[B, 36]`` (values 2..levels+1) for hidden states ``h [B, dim]``.

        ``noise [B, 36]`` is the start point of the ODE (float32, used as it is: Mistral's
        flow reads no ``sigma_max``);
        ``cfg [B, 2]`` the guidance weights of the conditional and unconditional velocities
        (see :func:`cfg_weights`). The ODE state stays float32 whatever the compute dtype.
        """
        args = self.args
        n = args.n_decoding_steps
        b = h.shape[0]
        llm = self.llm_projection(h)
        x = noise.astype(mx.float32)
        xin = self.input_projection(x.astype(llm.dtype))
        # The first step's x token and the llm token projected as one product: as separate
        # ones, the first layer's weights would be read once more a frame.
        x_qkv, llm_qkv = mx.split(self.first_projections(mx.concatenate([xin, llm])), [b])
        tokens = self.step_tokens(llm, llm_qkv)
        for i in range(n):
            v = self.velocity(x, i, tokens, (xin, x_qkv) if i == 0 else None)
            x = x + (cfg[:, :1] * v[:b] + cfg[:, 1:] * v[b:]) * (1.0 / n)
        levels = args.acoustic_codebook_size - 1
        q = mx.round((mx.clip(x, -1.0, 1.0) + 1.0) / 2.0 * levels)
        # NaN or inf (damaged weights, float16 overflow) becomes code 1: never generated,
        # yet a row of the code embedding, so the next step stays in range until it is seen.
        q = mx.where(mx.isfinite(x), q, NOT_FINITE)
        return q.astype(mx.int32) + N_SPECIAL_AUDIO_CODES

    def frame(self, h: mx.array, noise: mx.array, cfg: mx.array) -> tuple[mx.array, mx.array]:
        """One frame: the semantic codes ``[B]`` and all codes ``[B, 37]`` (semantic first).

        The semantic code is returned on its own so that END can be checked as soon as the
        semantic head is done, while the flow-matching steps are still running; there it is
        :data:`NOT_FINITE` for a row of ``h`` (or of its semantic logits) holding NaN or inf
        (the codes stay in range).
        """
        semantic, finite = self._semantic(h)
        semantic = semantic.astype(mx.int32)
        codes = mx.concatenate([semantic[:, None], self.acoustic_codes(h, noise, cfg)], -1)
        return mx.where(finite, semantic, NOT_FINITE), codes

    def __call__(self, h: mx.array, noise: mx.array, cfg: mx.array) -> tuple[mx.array, mx.array]:
        """:meth:`frame`, compiled when :meth:`prepare` compiled it."""
        if self._compiled is not None:
            return self._compiled(h, noise, cfg)
        return self.frame(h, noise, cfg)


def cfg_weights(alphas: list[float]) -> mx.array:
    """Guidance weights ``[B, 2]``: ``v = a * v_cond + (1 - a) * v_uncond`` per sequence.

    ``1 - a`` is formed on the host in double precision, as a float argument would be.
    """
    return mx.array([[a, 1.0 - a] for a in alphas], dtype=mx.float32)
