"""The GGUF tensor table read past the metadata (``core/model/loader/gguf_file.py``) equals
``gguf.GGUFReader``'s: names, types, shapes, offsets and the bytes each view reads. A written file
with every kind of metadata value (a tokenizer's string arrays, nested arrays, a non-default
alignment), dense and block tensors; the embedded model's GGUF; and a big-endian file, which is
handed to ``GGUFReader``."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from llmkit.core.model.loader.gguf_file import GGUFTensors, gguf_tensors_of  # noqa: E402


def _same(path) -> None:
    want, got = gguf.GGUFReader(str(path)).tensors, gguf_tensors_of(path).tensors
    assert [t.name for t in got] == [t.name for t in want]
    for w, g in zip(want, got):
        assert (g.tensor_type, g.n_elements, g.n_bytes, g.data_offset) == (
            w.tensor_type, w.n_elements, w.n_bytes, w.data_offset,
        ), w.name  # fmt: skip
        assert list(g.shape) == list(w.shape), w.name
        assert g.data.shape == w.data.shape and g.data.dtype == w.data.dtype, w.name
        assert np.array_equal(g.data, w.data), w.name


def _write(path, endianess=None) -> None:
    kw = {} if endianess is None else {"endianess": endianess}
    w = gguf.GGUFWriter(str(path), "llama", **kw)
    w.add_uint32("general.alignment", 64)
    w.add_string("general.name", "tiny ünïcode")
    w.add_token_list(["<s>", "é", "hello", ""] * 50)  # a tokenizer: an array of strings
    w.add_array("tokenizer.ggml.scores", [0.5, -1.25] * 20)
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_bool("test.flag", True)
    w.add_float64("test.f64", 2.5)
    w.add_int64("test.i64", -7)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 6)).astype(np.float16))
    w.add_tensor("scalarish", np.arange(7, dtype=np.float32))
    q = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_kind_of_metadata_is_stepped_over(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write(path)
    assert isinstance(gguf_tensors_of(path), GGUFTensors)
    _same(path)
    assert gguf.GGUFReader(str(path)).alignment == 64


def test_the_embedded_models_gguf():
    from llmkit.core.model.loader.source import gguf_path_of

    path = gguf_path_of(None)
    if path is None:
        pytest.skip("the embedded model package is not installed")
    _same(path)


def test_a_big_endian_file_goes_to_gguf_reader(tmp_path):
    path = tmp_path / "be.gguf"
    _write(path, gguf.GGUFEndian.BIG)
    assert isinstance(gguf_tensors_of(path), gguf.GGUFReader)
