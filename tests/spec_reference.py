"""Voxtral TTS written again from ../shared/reference/SPEC.md alone, in float64 torch.

An oracle independent of both voxtral_mlx and mlx-audio: it reads Mistral's layout
(``consolidated.safetensors``, ``params.json``, a voice ``.pt``) directly, recomputes the
whole backbone over every position at each frame (no KV cache, no prefix cache, no prefill
in parts), and decodes the codec in one shot. Slow and simple on purpose; tests use it on
tiny configs, including the ones that the tiny default and mlx-audio hide (query width
unequal to the model width, a step count other than 7, prompts longer than a prefill part).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

D = torch.float64
AUDIO = 24  # the [AUDIO] id the voice rows replace
END = 1  # semantic code that ends the utterance
CODEC_WINDOWS = (2, 4, 8, 16)  # attention window per codec stage (SPEC §6.3)


def codec_windows(c: dict) -> list[int]:
    """Each decoder stage's attention window, as Mistral's codec sets it up: the window
    is halved (floor) at each strided encoder conv, then doubled at each strided decoder
    conv (the encoder's convs default to the decoder's, mirrored). (2, 4, 8, 16) for the
    real codec, whatever SPEC's list."""
    ints = lambda key, default: [int(v) for v in c.get(key, default).split(",")]  # noqa: E731
    dk, ds = ints("decoder_convs_kernels_str", ""), ints("decoder_convs_strides_str", "")
    ek = ints("encoder_convs_kernels_str", ",".join(map(str, dk[::-1])))
    es = ints("encoder_convs_strides_str", ",".join(map(str, ds[::-1])))
    half = c.get("half_attn_window_upon_downsampling", True)
    window = c["attn_sliding_window_size"]
    for i in range(len(es)):
        if (ek[i] != 1 or es[i] != 1 or i == len(es) - 1) and half and es[i] > 1:
            window //= 2
    out = []
    for s in range(len(ds)):
        out.append(window)
        if s + 1 < len(ds) and (dk[s + 1], ds[s + 1]) != (1, 1) and half and ds[s + 1] > 1:
            window *= 2
    return out


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


class SpecReference:
    def __init__(self, path: str | Path):
        path = Path(path)
        self.p = json.loads((path / "params.json").read_text())
        weights = load_file(str(path / "consolidated.safetensors"))
        self.w = {k: v.to(D) for k, v in weights.items()}
        self.audio = self.p["multimodal"]["audio_model_args"]
        self.flow = self.audio["acoustic_transformer_args"]
        self.codec = self.p["multimodal"]["audio_tokenizer_args"]

    def lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w[name].T

    def ffn(self, pre: str, x: torch.Tensor) -> torch.Tensor:
        gate = F.silu(self.lin(pre + "w1.weight", x)) * self.lin(pre + "w3.weight", x)
        return self.lin(pre + "w2.weight", gate)

    # -- backbone: interleaved RoPE, grouped-query causal attention, SwiGLU ------------

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim]; pairs (2i, 2i + 1) rotate together."""
        hd = x.shape[-1]
        freqs = 1.0 / self.p["rope_theta"] ** (torch.arange(0, hd, 2, dtype=D) / hd)
        angle = pos[:, None].to(D) * freqs[None]
        cos, sin = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def backbone(self, emb: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [T, dim] of every position."""
        p = self.p
        heads, kv, hd, eps = p["n_heads"], p["n_kv_heads"], p["head_dim"], p["norm_eps"]
        t = emb.shape[0]
        pos = torch.arange(t)
        mask = torch.full((t, t), -math.inf, dtype=D).triu(1)
        x = emb
        for i in range(p["n_layers"]):
            pre = f"layers.{i}."
            h = rms(x, self.w[pre + "attention_norm.weight"], eps)
            q = self.rope(self.lin(pre + "attention.wq.weight", h).view(t, heads, hd), pos)
            k = self.rope(self.lin(pre + "attention.wk.weight", h).view(t, kv, hd), pos)
            v = self.lin(pre + "attention.wv.weight", h).view(t, kv, hd)
            k, v = (a.repeat_interleave(heads // kv, dim=1) for a in (k, v))
            s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + mask
            o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, heads * hd)
            x = x + self.lin(pre + "attention.wo.weight", o)
            x = x + self.ffn(pre + "feed_forward.", rms(x, self.w[pre + "ffn_norm.weight"], eps))
        return rms(x, self.w["norm.weight"], eps)

    # -- semantic head and flow-matching head ------------------------------------------

    def semantic(self, h: torch.Tensor) -> int:
        logits = self.lin("acoustic_transformer.semantic_codebook_output.weight", h)
        logits[..., 0] = -math.inf
        logits[..., self.audio["semantic_codebook_size"] + 2 :] = -math.inf
        return int(logits.argmax(-1))

    def flow_layers(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, 3, dim]: bidirectional attention, no positions."""
        f = self.flow
        heads, kv, hd = f["n_heads"], f["n_kv_heads"], f["head_dim"]
        eps = f.get("norm_eps", 1e-5)  # Mistral's flow default, not the backbone's
        b, t, _ = x.shape
        for i in range(f["n_layers"]):
            pre = f"acoustic_transformer.layers.{i}."
            h = rms(x, self.w[pre + "attention_norm.weight"], eps)
            q = self.lin(pre + "attention.wq.weight", h).view(b, t, heads, hd)
            k = self.lin(pre + "attention.wk.weight", h).view(b, t, kv, hd)
            v = self.lin(pre + "attention.wv.weight", h).view(b, t, kv, hd)
            k, v = (a.repeat_interleave(heads // kv, dim=2) for a in (k, v))
            s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
            o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(b, t, heads * hd)
            x = x + self.lin(pre + "attention.wo.weight", o)
            x = x + self.ffn(pre + "feed_forward.", rms(x, self.w[pre + "ffn_norm.weight"], eps))
        return rms(x, self.w["acoustic_transformer.norm.weight"], eps)

    @staticmethod
    def time_embedding(t: float, dim: int) -> torch.Tensor:
        half = dim // 2
        freqs = torch.exp(-math.log(1e4) * torch.arange(half, dtype=D) / half)
        return torch.cat([torch.cos(t * freqs), torch.sin(t * freqs)])

    def acoustic(self, h: torch.Tensor, noise: torch.Tensor, alpha: float) -> torch.Tensor:
        """36 acoustic codes (with the +2 offset) by Euler steps t_i = i / n under CFG."""
        n = self.flow.get("n_decoding_steps", 7)
        dim = self.flow["dim"]
        x = noise.to(D)
        llm = self.lin("acoustic_transformer.llm_projection.weight", h)
        for i in range(n):
            tt = self.lin(
                "acoustic_transformer.time_projection.weight", self.time_embedding(i / n, dim)
            )
            xin = self.lin("acoustic_transformer.input_projection.weight", x)
            cond = torch.stack([xin, tt, llm])
            uncond = torch.stack([xin, tt, torch.zeros_like(llm)])
            out = self.flow_layers(torch.stack([cond, uncond]))[:, 0]
            v = self.lin("acoustic_transformer.acoustic_codebook_output.weight", out)
            x = x + (alpha * v[0] + (1 - alpha) * v[1]) / n
        return torch.round((x.clamp(-1, 1) + 1) / 2 * 20).long() + 2

    # -- the autoregressive loop ---------------------------------------------------------

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        sem = self.audio["semantic_codebook_size"]
        offsets = [0] + [sem + 2 + 23 * (k - 1) for k in range(1, 37)]
        table = self.w["mm_audio_embeddings.audio_codebook_embeddings.embeddings.weight"]
        return sum(table[int(c) + o] for c, o in zip(codes, offsets, strict=True))

    def prompt_embeddings(self, ids: list[int], voice: torch.Tensor) -> torch.Tensor:
        emb = self.w["mm_audio_embeddings.tok_embeddings.weight"][torch.tensor(ids)].clone()
        rows = [i for i, t in enumerate(ids) if t == AUDIO]
        assert len(rows) == voice.shape[0]
        emb[rows] = voice.to(D)  # replaced, not added
        return emb

    def generate(
        self, ids: list[int], voice: torch.Tensor, noise, max_frames: int, alpha: float = 1.2
    ) -> torch.Tensor:
        """Codes [frames, 37]; the hidden state of the last position predicts each frame."""
        emb = self.prompt_embeddings(ids, voice)
        frames = []
        for f in range(max_frames):
            h = self.backbone(emb)[-1]
            semantic = self.semantic(h)
            if semantic == END:
                break
            acoustic = self.acoustic(h, torch.as_tensor(noise[f]), alpha)
            codes = torch.cat([torch.tensor([semantic]), acoustic])
            frames.append(codes)
            emb = torch.cat([emb, self.embed_codes(codes)[None]])
        return torch.stack(frames) if frames else torch.zeros((0, 37), dtype=torch.long)

    # -- codec decoder, one shot ---------------------------------------------------------

    def weight_norm(self, pre: str) -> torch.Tensor:
        g = self.w[pre + ".parametrizations.weight.original0"]
        v = self.w[pre + ".parametrizations.weight.original1"]
        return g * v / v.pow(2).sum(dim=tuple(range(1, v.ndim)), keepdim=True).sqrt()

    def codec_layer(self, pre: str, x: torch.Tensor, window: int) -> torch.Tensor:
        c = self.codec
        heads, kv, hd = c["n_heads"], c["n_kv_heads"], c["head_dim"]
        t = x.shape[0]
        h = rms(x, self.w[pre + "attention_norm.weight"], c["norm_eps"])
        q = rms(
            self.lin(pre + "attention.wq.weight", h),
            self.w[pre + "attention.q_norm.weight"],
            c["qk_norm_eps"],
        ).view(t, heads, hd)
        k = rms(
            self.lin(pre + "attention.wk.weight", h),
            self.w[pre + "attention.k_norm.weight"],
            c["qk_norm_eps"],
        ).view(t, kv, hd)
        v = self.lin(pre + "attention.wv.weight", h).view(t, kv, hd)
        k, v = (a.repeat_interleave(heads // kv, dim=1) for a in (k, v))
        slopes = torch.tensor([2.0 ** (-8.0 / heads * i) for i in range(heads)], dtype=D)
        rel = (torch.arange(t)[None, :] - torch.arange(t)[:, None]).to(D)  # key - query
        bias = (slopes[:, None, None] * rel).masked_fill((rel > 0) | (rel < -window), -math.inf)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + bias
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, heads * hd)
        x = x + self.w[pre + "attention_scale"] * self.lin(pre + "attention.wo.weight", o)
        ffn = self.ffn(
            pre + "feed_forward.", rms(x, self.w[pre + "ffn_norm.weight"], c["norm_eps"])
        )
        return x + self.w[pre + "ffn_scale"] * ffn

    def decode(self, codes) -> torch.Tensor:
        c, tk = self.codec, "audio_tokenizer."
        codes = torch.as_tensor(codes).long() - 2
        usage = self.w[tk + "quantizer.semantic_codebook.cluster_usage"]
        book = self.w[tk + "quantizer.semantic_codebook.embedding_sum"]
        book = book / usage.clamp(min=1e-5)[:, None]
        x = torch.cat([book[codes[:, 0]], codes[:, 1:].to(D) * 2 / 20 - 1], dim=1)
        x = x.T[None]  # [1, channels, T], torch's layout
        kernels = [int(s) for s in c["decoder_convs_kernels_str"].split(",")]
        strides = [int(s) for s in c["decoder_convs_strides_str"].split(",")]
        lengths = [int(s) for s in c["decoder_transformer_lengths_str"].split(",")]
        windows = codec_windows(c)
        for s in range(len(strides)):
            w = self.weight_norm(f"{tk}decoder_blocks.{2 * s}.conv")
            if s == 0:  # later stages are ConvTranspose1d, even at stride 1
                x = F.conv1d(F.pad(x, (kernels[s] - 1, 0), mode="replicate"), w)
            else:
                y = F.conv_transpose1d(x, w, stride=strides[s])  # weight [in, out, k]
                x = y[..., : y.shape[-1] - (kernels[s] - strides[s])]
            xt = x[0].T
            for j in range(lengths[s]):
                pre = f"{tk}decoder_blocks.{2 * s + 1}.layers.{j}."
                xt = self.codec_layer(pre, xt, windows[s])
            x = xt.T[None]
        w = self.weight_norm(f"{tk}output_proj.conv")
        k = c["patch_proj_kernel_size"]
        x = F.conv1d(F.pad(x, (k - 1, 0), mode="reflect"), w)  # [1, samples per step, T']
        return x[0].T.reshape(-1)
