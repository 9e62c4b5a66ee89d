"""Fused projections and the compiled one-position backbone step: same numbers, same memory."""

from __future__ import annotations

import gc
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from voxtral_mlx.loader import load_model_dir
from voxtral_mlx.model.cache import BatchKVCache
from voxtral_mlx.model.layers import Float32QuantizedLinear, fuse_linears


def assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    """Bit-identical on the CPU (where these tests run in CI); on Metal, whose product
    kernels may be chosen by the matrix's width, within bfloat16 rounding."""
    if mx.default_device() == mx.cpu:
        np.testing.assert_array_equal(actual, expected)
    else:
        np.testing.assert_allclose(actual, expected, rtol=0, atol=2e-2 * np.abs(expected).max())


def _linears(kind: str, sizes: list[int], dim: int = 128) -> list[nn.Module]:
    mx.random.seed(0)
    layers = [nn.Linear(dim, n, bias=False) for n in sizes]
    if kind == "quantized":
        # Float32 activations: MLX's CPU kernel is off by several % with bf16 ones.
        layers = [
            Float32QuantizedLinear.from_quantized(nn.QuantizedLinear.from_linear(m, 64, 4))
            for m in layers
        ]
    mx.eval([m.parameters() for m in layers])
    return layers


@pytest.mark.parametrize("kind", ["plain", "quantized"])
def test_fused_projections_equal_the_separate_ones_and_take_no_memory(kind):
    parts = _linears(kind, [256, 64, 64])
    x = mx.random.normal((3, 5, 128))
    separate = [np.array(m(x)) for m in parts]
    params = [{k: np.array(v) for k, v in m.parameters().items()} for m in parts]
    held = sum(v.nbytes for m in parts for v in m.parameters().values())
    gc.collect()  # earlier models (cycles through their compiled steps) freed now, not midway
    mx.synchronize()
    before = mx.get_active_memory()
    fused = fuse_linears(parts)
    assert fused is not None
    # The parts' weights became views of the fused ones: nothing is held twice (a copy
    # would add all of their size; the allocator's rounding may differ by a little).
    assert mx.get_active_memory() - before < held / 10
    for out, want in zip(fused(x), separate):
        assert_same(np.array(out), want)
    for m, want, out in zip(parts, params, separate):  # the parts are unchanged
        assert {k: np.array(v) for k, v in m.parameters().items()}.keys() == want.keys()
        for k, v in m.parameters().items():
            np.testing.assert_array_equal(np.array(v), want[k])
        np.testing.assert_array_equal(np.array(m(x)), out)


def test_differently_quantized_projections_are_not_fused():
    mx.random.seed(0)
    four = nn.QuantizedLinear.from_linear(nn.Linear(128, 64, bias=False), 64, 4)
    eight = nn.QuantizedLinear.from_linear(nn.Linear(128, 64, bias=False), 64, 8)
    assert fuse_linears([four, eight]) is None
    assert fuse_linears([nn.Linear(128, 64, bias=False), four]) is None
    assert fuse_linears([four, nn.QuantizedLinear.from_linear(nn.Linear(128, 32), 64, 4)]) is None


@pytest.fixture(scope="module")
def models(tiny_checkpoint_bf16):
    """The published bf16 tiny model three times: as loaded (fused, compiled), fused but not
    compiled, and neither (each layer's projections computed separately)."""
    loaded = load_model_dir(tiny_checkpoint_bf16).model
    plain = load_model_dir(tiny_checkpoint_bf16).model
    plain.prepare(compile=False)
    return loaded, plain, _separate(load_model_dir(tiny_checkpoint_bf16).model)


def _separate(model):
    """``model`` computing each projection on its own, nothing compiled in the backbone."""
    for layer in model.layers:
        layer.attention._qkv = layer.feed_forward._w13 = layer._decode = None
    model._final_norm = model._embed = None
    return model


def _steps(model, frames: int = 6) -> np.ndarray:
    """Hidden states of two sequences of different prompt lengths decoded as one batch
    (a padding mask, per-row positions), fed the same codes."""
    dim = model.config.backbone.dim
    rng = np.random.default_rng(0)
    caches = []
    for length in (7, 12):
        cache = model.make_cache()
        model(mx.array(rng.standard_normal((1, length, dim)), model.compute_dtype), cache)
        caches.append([BatchKVCache.from_single(c) for c in cache])
    batch = caches[0]
    for mine, theirs in zip(batch, caches[1]):
        mine.merge(theirs)
    codes = rng.integers(2, 20, (frames, 2, model.config.num_codebooks))
    out = []
    for f in range(frames):
        h = model.step(mx.array(codes[f], mx.int32), batch)
        out.append(np.array(h.astype(mx.float32)))
    return np.stack(out)


def test_compiled_fused_decode_equals_the_plain_step(models):
    loaded, plain, separate = models
    assert loaded.layers[0]._decode is not None and plain.layers[0]._decode is None
    assert loaded.layers[0].attention._qkv is not None
    want = _steps(separate)
    assert_same(_steps(plain), want)
    assert_same(_steps(loaded), want)
    assert np.abs(want[0] - want[1]).max() > 0  # the steps do differ


def test_prepare_again_sees_changed_weights(tiny_checkpoint_bf16):
    """The compiled step captures the weights: after they change, prepare() rebuilds it (and
    the fused products) from the new ones."""
    separate = _separate(load_model_dir(tiny_checkpoint_bf16).model)
    model = load_model_dir(tiny_checkpoint_bf16).model
    before = _steps(model)
    for m in (model, separate):
        w3 = m.layers[0].feed_forward.w3
        w3.weight = w3.weight * 2
    model.prepare()
    after = _steps(model)
    assert np.abs(after - before).max() > 0
    assert_same(after, _steps(separate))


def test_load_reads_every_weight_before_the_steps_are_compiled(tiny_checkpoint_bf16):
    """A compiled step captures its weights: one still unread (lazily mapped, cast to the
    compute dtype) would be read and cast again at every call. So ``load`` reads them all:
    the memory they take is allocated once it returns."""
    gc.collect()  # earlier models (cycles through their compiled steps) freed now, not midway
    mx.synchronize()
    before = mx.get_active_memory()
    model = load_model_dir(tiny_checkpoint_bf16, dtype="float32").model
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert mx.get_active_memory() - before >= weights


def test_loading_holds_the_weights_once_while_fusing(tmp_path):
    """Fusing makes each layer's wq/wk/wv and w1/w3 anew, one group at a time: the separate
    ones must be let go as it goes, not kept by the loader until it returns (for the real
    model, over 4 GB more at the peak of a load)."""
    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint, make_params

    path = build_random_checkpoint(tmp_path / "m", make_params("tiny", n_layers=8, dim=256))
    gc.collect()  # earlier models (cycles through their compiled steps) freed now, not midway
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    model = load_model_dir(path).model
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    fusable = sum(
        lin.weight.nbytes
        for block in [*model.layers, *model.acoustic_transformer.layers]
        for lin in (
            block.attention.wq,
            block.attention.wk,
            block.attention.wv,
            block.feed_forward.w1,
            block.feed_forward.w3,
        )
    )
    assert mx.get_peak_memory() - before - weights < fusable / 2


def _every_row_velocity(head, x: mx.array, step: int, h: mx.array) -> mx.array:
    """A flow step computed plainly: every layer on all three tokens of both passes."""
    llm = head.llm_projection(h)
    xin = head.input_projection(x.astype(llm.dtype))
    tok = mx.broadcast_to(head.time_tokens[step], xin.shape)
    seq = mx.concatenate(
        [mx.stack([xin, tok, llm], axis=1), mx.stack([xin, tok, mx.zeros_like(llm)], axis=1)]
    )
    for layer in head.layers:
        seq = layer(seq)
    return head.acoustic_codebook_output(head.norm(seq[:, 0])).astype(mx.float32)


@pytest.mark.parametrize("flow_layers", [1, 2, 3])
def test_the_flow_steps_shortcuts_equal_every_layer_on_every_row(tmp_path, flow_layers):
    """The first layer's projections of the time and llm tokens made once, the zeroed
    token's taken as zeros, the last layer's queries at position 0 only: the velocities
    of computing everything at every step."""
    from voxtral_mlx.synthetic.checkpoint import build_random_checkpoint, make_params

    params = make_params("tiny", flow_layers=flow_layers)
    model = load_model_dir(build_random_checkpoint(tmp_path / "m", params)).model
    head = model.acoustic_transformer
    rng = np.random.default_rng(0)
    b = 3
    h = mx.array(rng.standard_normal((b, head.args.input_dim)), model.compute_dtype)
    x = mx.array(rng.standard_normal((b, head.args.n_acoustic_codebook)), mx.float32)
    llm = head.llm_projection(h)
    tokens = head.step_tokens(llm, head.first_projections(llm))
    for step in range(head.args.n_decoding_steps):
        want = np.array(_every_row_velocity(head, x, step, h))
        assert np.abs(want[:b] - want[b:]).max() > 0  # the passes do differ
        assert_same(np.array(head.velocity(x, step, tokens)), want)


def _graph_ops(arrays: list[mx.array], path) -> list[str]:
    """The primitives of the graph computing ``arrays`` (MLX's DOT export)."""
    mx.export_to_dot(str(path), *arrays)
    return re.findall(r'label ="(\w+)"', path.read_text())


def test_a_frame_and_its_polled_codes_copy_no_rows_by_gathering(tiny_checkpoint_bf16, tmp_path):
    """Integer indexing of an array's first axis is a gather in MLX, a copying kernel: a
    frame takes each Euler step's tokens, and the batch each sequence's codes, by slices
    (views)."""
    from voxtral_mlx.generate import FrameBatch, NoiseSource, Sequence, prefill
    from voxtral_mlx.model.flow import cfg_weights

    model = load_model_dir(tiny_checkpoint_bf16).model
    head = model.acoustic_transformer
    b = 2
    h = mx.random.normal((b, head.args.input_dim), key=mx.random.key(0)).astype(mx.bfloat16)
    noise = mx.random.normal((b, head.args.n_acoustic_codebook), key=mx.random.key(1))
    mx.eval(h, noise)
    ops = _graph_ops(list(head.frame(h, noise, cfg_weights([1.2, 1.5]))), tmp_path / "f.dot")
    assert ops.count("Matmul") >= head.args.n_decoding_steps  # the whole frame was read
    assert "Gather" not in ops

    width = head.args.n_acoustic_codebook
    batch = FrameBatch(model)
    for seed in range(b):
        seq = Sequence(NoiseSource(width, seed=seed), max_frames=3, cfg_alpha=1.2)
        prefill(model, seq, model.embed_text([1, 2, 3])[None], model.make_cache())
        batch.add(seq)
    batch.advance()
    produced = batch.poll()
    assert [codes.shape for _, codes in produced] == [(model.config.num_codebooks,)] * b
    for i, (_, codes) in enumerate(produced):
        assert "Gather" not in _graph_ops([codes], tmp_path / f"c{i}.dot")
