"""Tensors a backend cannot take as they are: sparse and nested tensors, and inference tensors
where a gradient is due, are refused by name before a backend sees them, instead of failing
inside it (``as_strided`` on SparseCPU, "NestedTensorImpl doesn't support sizes", autograd's
"Inference tensors cannot be saved for backward").
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fusedhead import fused_head, fused_kl, reference_fused_head


def head(h, w, y, **kw):
    return fused_head(h, w, y, backend="ref-test", **kw)


def nested(t: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # the prototype-stage warning
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([t[:2], t[2:]])


@pytest.mark.parametrize("arg", ["hidden", "weight", "labels"])
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "nested"])
def test_a_sparse_or_nested_tensor_is_refused_by_name(ref_backend, inputs, arg, layout):
    h, w, y = inputs()
    given = {"hidden": h.reshape(2, 3, -1), "weight": w, "labels": y.reshape(2, 3)}  # CSR: 2-D
    t = given[arg]
    if layout == "nested":
        given[arg] = nested(t)
    else:
        with warnings.catch_warnings():  # CSR's beta-state warning
            warnings.simplefilter("ignore")
            given[arg] = t.to_sparse() if layout == "sparse_coo" else t.to_sparse_csr()
    with pytest.raises(TypeError) as info:
        head(given["hidden"], given["weight"], given["labels"])
    text = str(info.value)
    assert f"{arg} must be a dense (torch.strided) tensor, got" in text
    assert ("a nested tensor" if layout == "nested" else f"layout torch.{layout}") in text
    assert not ref_backend.calls


@pytest.mark.parametrize("arg", ["gather_ids", "temperature"])
def test_sparse_extras_are_refused_by_name(ref_backend, inputs, arg):
    """Before: a per-token temperature said its shape (6,) must broadcast to (6,)."""
    h, w, y = inputs()
    value = y[:, None] if arg == "gather_ids" else torch.ones(len(y))
    with pytest.raises(TypeError) as info:
        head(h, w, y, **{arg: value.to_sparse()})
    assert f"{arg} must be a dense (torch.strided) tensor, got layout torch.sparse_coo" in str(
        info.value
    )


@pytest.mark.parametrize("arg", ["hidden", "weight", "teacher_hidden", "teacher_weight"])
def test_a_sparse_kl_tensor_is_refused_by_name(ref_backend, inputs, arg):
    h, w, y = inputs()
    given = {"hidden": h, "weight": w, "teacher_hidden": h * 2, "teacher_weight": w * 2}
    given[arg] = given[arg].to_sparse()
    with pytest.raises(TypeError, match=f"^{arg} must be a dense"):
        fused_kl(*given.values(), y, backend="ref-test")


def test_the_reference_refuses_a_sparse_tensor_too(inputs):
    h, w, y = inputs()
    with pytest.raises(TypeError, match=r"^weight must be a dense"):
        reference_fused_head(h, w.to_sparse(), y)


def inference(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


@pytest.mark.parametrize("arg", ["hidden", "weight"])
def test_an_inference_tensor_where_a_gradient_is_due_is_refused_by_name(ref_backend, inputs, arg):
    h, w, y = inputs()
    given = {"hidden": h.requires_grad_(), "weight": w.requires_grad_()}
    given[arg] = inference(given[arg].detach())
    with pytest.raises(ValueError) as info:
        head(given["hidden"], given["weight"], y)
    text = str(info.value)
    assert f"{arg} is an inference tensor" in text and f"{arg}.clone()" in text
    assert "torch.no_grad()" in text and not ref_backend.calls


def test_inference_tensors_run_where_no_gradient_is_due(ref_backend, inputs):
    h, w, y = inputs()
    want = head(h, w, y)
    got = head(inference(h), w.requires_grad_(False), y)  # nothing requires grad
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with torch.no_grad():
        got = head(inference(h), w.requires_grad_(), y)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the cast is a fresh tensor: it is saved
        out = head(inference(h), w, y)
    out.log_probs.sum().backward()
    assert w.grad is not None and bool(torch.isfinite(w.grad).all())


@pytest.mark.parametrize("arg", ["teacher_hidden", "teacher_weight", "hidden"])
def test_the_kl_refuses_an_inference_tensor_of_either_head_while_the_student_learns(inputs, arg):
    """A teacher run under torch.inference_mode() gave autograd's RuntimeError (both backends
    save the teacher for the student's backward); torch.no_grad() is the way, and it runs."""
    h, w, y = inputs()
    th, tw = inputs(h=5, seed=1)[:2]
    given = {"hidden": h, "weight": w.requires_grad_(), "teacher_hidden": th, "teacher_weight": tw}
    given[arg] = inference(given[arg])
    with pytest.raises(ValueError, match=f"^{arg} is an inference tensor"):
        fused_kl(*given.values(), y, backend="torch")
    with torch.no_grad():
        th, tw = th * 1, tw * 1  # what the teacher's forward gives under no_grad
    fused_kl(h, w, th, tw, y, backend="torch").sum().backward()
    assert w.grad is not None
