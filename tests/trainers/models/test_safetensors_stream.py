"""The streamed safetensors format against the safetensors library itself: what one writes the
other reads, bit for bit, whatever the chunking; bad streams are errors that say what is wrong."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from safetensors.numpy import load_file, save_file

from trainers.models import safetensors_stream as sts


def _tensors(seed=0):
  rng = np.random.default_rng(seed)
  return [
    ("model.embed_tokens.weight", rng.standard_normal((7, 5)).astype(ml_dtypes.bfloat16)),
    ("model.norm.weight", rng.standard_normal(5).astype(np.float32)),
    ("empty", np.zeros((0, 3), np.float32)),
    ("index", rng.integers(0, 2**32, 9, dtype=np.uint32)),
    ("scalar", np.array(3.5, np.float32)),
  ]


def _same(a: dict, b: dict):
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
    np.testing.assert_array_equal(a[k].reshape(-1).view(np.uint8), b[k].reshape(-1).view(np.uint8))


def test_our_bytes_are_the_librarys(tmp_path):
  tensors = _tensors()
  (tmp_path / "chunks.safetensors").write_bytes(sts.concat(sts.chunks(tensors, {"format": "pt"})))
  _same(load_file(tmp_path / "chunks.safetensors"), dict(tensors))
  save_file(dict(tensors), tmp_path / "lib.safetensors", metadata={"format": "pt"})
  _same(sts.read_file(str(tmp_path / "lib.safetensors")), dict(tensors))
  assert sts.write(str(tmp_path / "ours.safetensors"), tensors) == len(sts.concat(sts.chunks(tensors)))
  _same(sts.read_file(str(tmp_path / "ours.safetensors")), dict(tensors))


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(1, 97), min_size=1, max_size=40))
def test_any_chunking_reads_the_same(cuts):
  tensors = _tensors(1)
  raw = sts.concat(sts.chunks(tensors, {"k": "v"}))
  out, at, k = {}, 0, 0
  reader = sts.Reader(lambda *_: None, out.__setitem__)
  while at < len(raw):
    n = cuts[k % len(cuts)]
    reader.feed(raw[at : at + n])
    at, k = at + n, k + 1
  reader.close()
  _same(out, dict(tensors))
  assert reader.metadata == {"k": "v"}
  assert reader.names == [n for n, _ in tensors]


def test_destination_buffers_are_filled_in_place():
  tensors = _tensors(2)
  big = np.zeros((3, 7, 5), ml_dtypes.bfloat16)
  seen = []
  reader = sts.Reader(
    lambda name, dtype, shape: big[1] if name == "model.embed_tokens.weight" else None,
    lambda name, a: seen.append((name, a)),
  )
  reader.feed(sts.concat(sts.chunks(tensors)))
  reader.close()
  np.testing.assert_array_equal(big[1].view(np.uint16), tensors[0][1].view(np.uint16))
  assert not big[0].view(np.uint16).any() and not big[2].view(np.uint16).any()
  assert seen[0][1] is big[1] or np.shares_memory(seen[0][1], big)


def test_aligned_empty_is_aligned():
  for shape in [(3,), (5, 7), (0,)]:
    a = sts.aligned_empty(shape, ml_dtypes.bfloat16)
    assert a.shape == shape and a.dtype == ml_dtypes.bfloat16 and a.flags.c_contiguous
    assert a.size == 0 or a.ctypes.data % 64 == 0


def test_bad_streams_say_what_is_wrong():
  raw = sts.concat(sts.chunks(_tensors()))
  reader = sts.Reader(lambda *_: None, lambda *_: None)
  reader.feed(raw[:-3])
  with pytest.raises(ValueError, match=r"ended after .* data bytes \(in tensor 'scalar'\)"):
    reader.close()
  with pytest.raises(ValueError, match="bytes past the end"):
    sts.Reader(lambda *_: None, lambda *_: None).feed(raw + b"xx")
  with pytest.raises(ValueError, match="not a safetensors stream"):
    sts.Reader(lambda *_: None, lambda *_: None).feed(b"\xff" * 16)
  with pytest.raises(ValueError, match="ended in its header"):
    r = sts.Reader(lambda *_: None, lambda *_: None)
    r.feed(raw[:12])
    r.close()
  head = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}'
  with pytest.raises(ValueError, match="starts at byte 4, expected 0"):
    sts.Reader(lambda *_: None, lambda *_: None).feed(len(head).to_bytes(8, "little") + head)
  head = b'{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}'
  with pytest.raises(ValueError, match="do not hold F32"):
    sts.Reader(lambda *_: None, lambda *_: None).feed(len(head).to_bytes(8, "little") + head)
  with pytest.raises(ValueError, match="does not take"):
    sts.Reader(lambda *_: np.zeros(4, np.float32), lambda *_: None).feed(raw)
