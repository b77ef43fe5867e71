"""Integer arguments take any integer a user holds: a NumPy integer (``np.int64`` from a config or
an array's ``.max()``) is the int it stands for, in every integer argument alike (``top_k``,
``ignore_index``, ``vocab_start``, ``vocab_size``, the config's ``ignore_index``, a backend's int
options), with the very outputs of the Python int; a bool, NumPy's too, is never an int.
"""

from __future__ import annotations

import pytest
import torch

from fusedhead import FusedHead, FusedHeadConfig, fused_head, fused_kl

np = pytest.importorskip("numpy")

N, H, V = 6, 8, 13


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / 3
    labels = torch.randint(0, V, (N,), generator=g)
    labels[1] = 4
    return hidden, weight, labels


def same(a: object, b: object) -> bool:
    return all(
        (x is None and y is None) or torch.equal(x, y)  # type: ignore[arg-type]
        for x, y in zip(a, b)  # type: ignore[call-overload]
    )


@pytest.mark.parametrize("to_numpy", [np.int64, np.int32, np.uint8])
def test_numpy_integers_give_the_outputs_of_python_ints(to_numpy):
    h, w, y = inputs()
    kwargs = {"top_k": 3, "ignore_index": 4, "vocab_start": 0, "vocab_size": V}
    want = fused_head(h, w, y, backend="torch", return_argmax=True, **kwargs)
    got = fused_head(
        h, w, y, backend="torch", return_argmax=True, **{k: to_numpy(v) for k, v in kwargs.items()}
    )
    assert same(got, want)
    assert torch.equal(got.topk_ids, want.topk_ids) and got.log_probs[1] == 0  # 4 is ignored
    head = FusedHead({"backend": "torch", "ignore_index": np.int64(4)})
    assert torch.equal(head(h, w, y, top_k=np.int64(3)).topk_ids, want.topk_ids)


def test_the_kl_takes_a_numpy_ignore_index():
    h, w, y = inputs()
    want = fused_kl(h, w, h, w * 2, y, ignore_index=4)
    got = fused_kl(h, w, h, w * 2, y, ignore_index=np.int64(4))
    assert torch.equal(got, want) and got[1] == 0


def test_the_config_and_backend_options_take_numpy_integers():
    config = FusedHeadConfig(ignore_index=np.int64(4), options={"chunk_rows": np.int64(2)})
    assert config.ignore_index == 4 and type(config.ignore_index) is int
    assert config.options == {"chunk_rows": 2}
    h, w, y = inputs()
    want = fused_head(h, w, y, ignore_index=4, options={"chunk_rows": 2})
    assert same(FusedHead(config)(h, w, y), want)


@pytest.mark.parametrize("arg", ["top_k", "ignore_index", "vocab_start", "vocab_size"])
@pytest.mark.parametrize("value", [np.bool_(True), True, np.float64(3.0), torch.tensor(3)])
def test_a_bool_float_or_tensor_is_still_no_int(arg, value):
    h, w, y = inputs()
    with pytest.raises(TypeError) as info:
        fused_head(h, w, y, backend="torch", **{arg: value})
    text = str(info.value)
    assert f"{arg} must be an int" in text and repr(value) in text


@pytest.mark.parametrize("value", [np.bool_(True), np.float32(2.0)])
def test_the_config_refuses_a_numpy_bool_or_float_as_ignore_index(value):
    with pytest.raises(TypeError, match=r"field 'ignore_index'.*expected int"):
        FusedHeadConfig(ignore_index=value)
