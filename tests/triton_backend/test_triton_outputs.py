"""The triton backend's outputs past (log_probs, entropy) on the CPU interpreter: lse, sum_p2,
argmax, gather and top-k against float64 full logits and against the torch backend, gathered at
K = 1 on the labels bitwise the log-probs, top-k values bitwise the gathered ones at its ids,
ties by the lower id, batch invariance, determinism, and the custom ops under ``torch.compile``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton_backend_helpers import IGNORE, SMALL_TILES, make_case, rel_err

from fusedhead.protocol import HeadCall
from fusedhead.testing.outputs import reference_outputs
from fusedhead_triton import TritonBackend, TritonOptions

#: Backward blocks narrower than a tile and a stash tail off the tile grid ("low" memory).
MANY_BLOCKS: dict[str, Any] = {**SMALL_TILES, "backward_block_mib": 1e-4}
FIELDS = ("log_probs", "entropy", "lse", "sum_p2", "gathered")
TOPK = ("topk_ids", "topk_log_probs")
#: Relative error bounds (outputs, gradients) against float64 on the same input values.
TOL = {torch.float32: (2e-6, 1e-5), torch.float16: (2e-6, 2e-3)}


def _ids(labels: torch.Tensor, v: int, k: int, seed: int) -> torch.Tensor:
    """Random ids [N, K]: the label first, a repeated id, an ``ignore_index`` entry."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, v, (labels.shape[0], k), generator=g)
    ids[:, 0] = labels.clamp(min=0)
    if k > 2:
        ids[:, 1] = ids[:, 2]
    if k > 3:
        ids[:, -1] = IGNORE
    return ids


def _backend(name: str, options: dict[str, Any] | None) -> Any:
    if name == "torch":
        from fusedhead_torch import TorchBackend

        return TorchBackend()
    return TritonBackend(TritonOptions(**(options or {})))


def _run(
    backend: str, h0: torch.Tensor, w0: torch.Tensor, y: torch.Tensor, ids: torch.Tensor | None,
    options: dict[str, Any] | None = None, grads: bool = True, top_k: int = 0, **kw: Any,
) -> dict[str, Any]:  # fmt: skip
    """Every extra from the backend itself (no core in between), a random upstream gradient
    through each float one."""
    h = h0.clone().requires_grad_(grads)
    w = w0.clone().requires_grad_(grads)
    call = HeadCall.make(
        h, w, y, ignore_index=IGNORE, gather_ids=ids, extras=frozenset({"lse", "sum_p2", "argmax"}),
        top_k=top_k, **kw,
    )  # fmt: skip
    out = _backend(backend, options).forward(call)
    res: dict[str, Any] = {f: getattr(out, f) for f in (*FIELDS, *TOPK, "argmax")}
    if grads:
        g = torch.Generator().manual_seed(7)
        loss = sum(
            (res[f].double() * torch.randn(res[f].shape, generator=g, dtype=torch.float64)).sum()
            for f in (*FIELDS, "topk_log_probs")
            if res[f] is not None
        )
        loss.backward()
        res["d_hidden"], res["d_weight"] = h.grad, w.grad
    return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in res.items()}


def _reference(
    h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, ids: torch.Tensor,
    topk_ids: torch.Tensor | None = None, **kw: Any,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """float64 outputs and gradients under the same upstream gradients as ``_run``."""
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    tk = None if topk_ids is None else topk_ids.clamp(min=0)
    ref = reference_outputs(hd, wd, y, gather_ids=ids, ignore_index=IGNORE, topk_ids=tk, **kw)
    g = torch.Generator().manual_seed(7)
    names = (*FIELDS, "topk_log_probs") if tk is not None else FIELDS
    loss = sum(
        (ref[f] * torch.randn(ref[f].shape, generator=g, dtype=torch.float64)).sum() for f in names
    )
    loss.backward()
    out = {f: ref[f].detach() for f in names}
    out["d_hidden"], out["d_weight"] = hd.grad, wd.grad
    order = torch.sort(ref["logp"].detach(), dim=1, descending=True, stable=True).indices
    out["ranked"] = order  # equal values by the lower id
    valid = y != IGNORE
    out["argmax"] = torch.where(valid, ref["logp"].argmax(1), -1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    ("n", "h", "v", "k", "kw"),
    [
        (37, 48, 333, 9, {"temperature": 0.7}),
        (64, 40, 130, 1, {"temperature": 1.3, "softcap": 5.0}),
        (19, 33, 257, 256, {"temperature": 0.9}),  # K = 256, many ids per tile
        (50, 64, 300, 37, {"per_token": True}),
    ],
)
@pytest.mark.parametrize("options", [SMALL_TILES, MANY_BLOCKS], ids=["tiles", "blocks"])
def test_extras_match_float64_and_torch(dtype, n, h, v, k, kw, options) -> None:
    case = make_case(n, h, v, seed=n + k)
    kw = dict(kw)
    if kw.pop("per_token", False):
        kw["temperature"] = torch.linspace(0.4, 2.5, n)
    hid, w, y = case.hidden.to(dtype), case.weight.to(dtype), case.labels
    ids = _ids(y, v, k, seed=k)
    got = _run("triton", hid, w, y, ids, options, **kw)
    want = _reference(hid, w, y, ids, **kw)
    out_tol, grad_tol = TOL[dtype]
    for f in FIELDS:
        assert got[f].dtype == torch.float32
        assert rel_err(got[f], want[f]) <= out_tol, f
    for f in ("d_hidden", "d_weight"):
        assert got[f].dtype == dtype
        assert rel_err(got[f], want[f]) <= grad_tol, f
    valid = y != IGNORE
    assert torch.equal(got["argmax"][~valid], torch.full_like(y[~valid], -1))
    # Random logits: no ties, the float64 argmax itself.
    assert torch.equal(got["argmax"], want["argmax"])
    for f in ("lse", "sum_p2", "gathered"):
        assert bool((got[f][~valid] == 0).all()), f
    if k > 3:  # the ignore_index ids
        assert bool((got["gathered"][:, -1] == 0).all())
    assert torch.equal(got["gathered"][:, 0], got["log_probs"])  # the label, bitwise
    if dtype == torch.float32:
        ref = _run("torch", hid, w, y, ids, **kw)
        for f in (*FIELDS, "d_hidden", "d_weight"):
            assert rel_err(got[f], ref[f]) <= 2 * grad_tol, f
        assert torch.equal(got["argmax"], ref["argmax"])


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0.7},
        {"temperature": 1.3, "softcap": 5.0},
        {"temperature": torch.linspace(0.3, 3.0, 45)},
    ],
    ids=["scalar", "softcap", "per-token"],
)
def test_gather_at_the_labels_is_the_log_probs_bitwise(tma, kw) -> None:
    case = make_case(45, 40, 300, seed=3)
    y = case.labels
    be = TritonBackend(TritonOptions(**SMALL_TILES, tma=tma))
    ids = y.clamp(min=0).unsqueeze(1)
    with torch.no_grad():
        plain = be.forward(HeadCall.make(case.hidden.float(), case.weight.float(), y, **kw))
        out = be.forward(
            HeadCall.make(case.hidden.float(), case.weight.float(), y, gather_ids=ids, **kw)
        )
    assert out.gathered is not None
    assert torch.equal(out.gathered[:, 0], out.log_probs)
    assert torch.equal(out.log_probs, plain.log_probs)
    assert plain.entropy is not None and torch.equal(out.entropy, plain.entropy)


def test_argmax_ties_go_to_the_lowest_id_across_tiles() -> None:
    """Integer logits with the row max repeated in several tiles and inside one tile."""
    n, h, v = 24, 8, 200
    g = torch.Generator().manual_seed(5)
    hid = torch.randint(-2, 3, (n, h), generator=g).float()
    w = torch.randint(-2, 3, (v, h), generator=g).float()
    w[150] = w[20]  # same logits in tiles 0 and 2 (block_n 64)
    w[21] = w[20]
    hid[:, 0] = 0
    y = torch.randint(0, v, (n,), generator=g)
    be = TritonBackend(TritonOptions(**SMALL_TILES))
    with torch.no_grad():
        out = be.forward(HeadCall.make(hid, w, y, extras=frozenset({"argmax"})))
    z = hid.double() @ w.double().T
    want = torch.sort(z, dim=1, descending=True, stable=True).indices[:, 0]
    assert out.argmax is not None and torch.equal(out.argmax, want)
    tied = (z == z.max(1, keepdim=True).values).sum(1) > 1
    assert bool(tied.any())  # the case holds ties


def test_extras_are_batch_invariant_and_deterministic() -> None:
    case = make_case(70, 48, 333, seed=11)
    hid, w, y = case.hidden.float(), case.weight.float(), case.labels
    ids = _ids(y, 333, 13, seed=2)
    opts = {**SMALL_TILES, "tma": True}
    full = _run("triton", hid, w, y, ids, opts, grads=False, top_k=6)
    for rows in (torch.tensor([0]), torch.tensor([69]), torch.arange(5, 41)):
        part = _run("triton", hid[rows], w, y[rows], ids[rows], opts, grads=False, top_k=6)
        for f in (*FIELDS, *TOPK, "argmax"):
            assert torch.equal(part[f], full[f][rows]), f
    a = _run("triton", hid, w, y, ids, MANY_BLOCKS, top_k=6)
    b = _run("triton", hid, w, y, ids, MANY_BLOCKS, top_k=6)
    for f in (*FIELDS, *TOPK, "argmax", "d_hidden", "d_weight"):
        assert torch.equal(a[f], b[f]), f


def test_repeated_ids_each_get_their_gradient() -> None:
    """A row asking for one id K times: K times the gradient of one gather (and the values)."""
    case = make_case(20, 32, 150, seed=4, ignore_every=0)
    hid, w, y = case.hidden.float(), case.weight.float(), case.labels
    one = y.unsqueeze(1)
    many = one.expand(20, 6).contiguous()
    grads = []
    for ids, scale in ((one, 6.0), (many, 1.0)):
        h = hid.clone().requires_grad_()
        out = TritonBackend(TritonOptions(**SMALL_TILES)).forward(
            HeadCall.make(h, w, y, ignore_index=IGNORE, gather_ids=ids)
        )
        assert out.gathered is not None
        (out.gathered.sum() * scale).backward()
        grads.append(h.grad)
        assert bool((out.gathered == out.log_probs.unsqueeze(1)).all())
    assert rel_err(grads[1], grads[0]) <= 1e-6


def test_only_the_asked_gradients_enter() -> None:
    """A loss through lse alone is the gradient of lse (the other outputs' terms stay off)."""
    case = make_case(30, 40, 200, seed=8)
    hid, w, y = case.hidden.float(), case.weight.float(), case.labels
    h = hid.clone().requires_grad_()
    out = TritonBackend(TritonOptions(**SMALL_TILES)).forward(
        HeadCall.make(h, w, y, ignore_index=IGNORE, extras=frozenset({"lse"}))
    )
    assert out.lse is not None and out.sum_p2 is None and out.gathered is None
    out.lse.sum().backward()
    hd = hid.double().requires_grad_()
    ref = reference_outputs(hd, w.double(), y, ignore_index=IGNORE, temperature=1.0)
    ref["lse"].sum().backward()
    assert rel_err(h.grad, hd.grad) <= 1e-5


def _extras_fn(be: TritonBackend, ids: torch.Tensor):
    def head(h: torch.Tensor, w: torch.Tensor, lab: torch.Tensor) -> tuple[torch.Tensor, ...]:
        extras = frozenset({"lse", "sum_p2", "argmax"})
        call = HeadCall.make(h, w, lab, temperature=0.7, gather_ids=ids, extras=extras, top_k=4)
        out = be.forward(call)
        return (
            out.log_probs, out.entropy, out.lse, out.sum_p2, out.gathered, out.topk_log_probs,
            out.argmax, out.topk_ids,
        )  # fmt: skip

    return head


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_of_the_extras_matches_eager(backend: str) -> None:
    torch._dynamo.reset()
    be = TritonBackend(TritonOptions(**MANY_BLOCKS, tma=True))
    case = make_case(40, 64, 333, seed=9)
    hid, w, y = case.hidden.half(), case.weight.half(), case.labels
    ids = _ids(y, 333, 5, seed=1)

    def run(fn: Any) -> list[torch.Tensor]:
        h, ww = hid.clone().requires_grad_(), w.clone().requires_grad_()
        outs = fn(h, ww, y)
        g = torch.Generator().manual_seed(4)
        floats = outs[:6]
        torch.autograd.backward(list(floats), [torch.randn(t.shape, generator=g) for t in floats])
        return [t.detach() for t in outs] + [h.grad, ww.grad]

    eager = run(_extras_fn(be, ids))
    compiled = run(torch.compile(_extras_fn(be, ids), fullgraph=True, backend=backend))
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


def test_extras_custom_ops_pass_opcheck() -> None:
    case = make_case(8, 32, 50, seed=0)
    hid, w, y = case.hidden.float(), case.weight.float(), case.labels
    key = TritonBackend(TritonOptions(**SMALL_TILES))._settings(torch.float32)[1]
    ids = _ids(y, 50, 4, seed=0)
    args = (hid.requires_grad_(), w.requires_grad_(), y, None, ids, 0, IGNORE, 1.0, None,
            True, True, True, 3, key)  # fmt: skip
    torch.library.opcheck(torch.ops.fusedhead_triton.head_outputs, args, test_utils=(
        "test_schema", "test_faketensor", "test_aot_dispatch_static",
    ))  # fmt: skip
    outs = torch.ops.fusedhead_triton.head_outputs(*args)
    g = torch.ones(8)
    bwd = (hid.detach(), w.detach(), y, None, ids, outs[1].detach(), outs[0].detach(),
           outs[2].detach(), outs[4].detach(), g, None, g, g, torch.ones(8, 4), 0, IGNORE, 1.0,
           None, 50, key, True, True)  # fmt: skip
    torch.library.opcheck(torch.ops.fusedhead_triton.head_outputs_backward, bwd,
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


def test_capabilities_declare_the_outputs() -> None:
    caps = TritonBackend().capabilities(torch.device("cuda"))
    for o in ("lse", "sum_p2", "argmax", "gather"):
        assert o in caps.outputs and o in caps.vocab_parallel_outputs
    assert "topk" in caps.outputs and "topk" not in caps.vocab_parallel_outputs
    assert caps.max_top_k >= 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    ("n", "h", "v", "k", "kw"),
    [
        (37, 48, 333, 8, {"temperature": 0.7}),
        (40, 32, 130, 1, {"temperature": 1.3, "softcap": 5.0}),
        (21, 40, 500, 32, {"per_token": True}),
    ],
)
def test_topk_matches_float64_and_its_gradient_is_the_gathers(dtype, n, h, v, k, kw) -> None:
    case = make_case(n, h, v, seed=n + 3 * k)
    kw = dict(kw)
    if kw.pop("per_token", False):
        kw["temperature"] = torch.linspace(0.4, 2.5, n)
    hid, w, y = case.hidden.to(dtype), case.weight.to(dtype), case.labels
    ids = _ids(y, v, 5, seed=k)
    got = _run("triton", hid, w, y, ids, MANY_BLOCKS, top_k=k, **kw)
    want = _reference(hid, w, y, ids, topk_ids=got["topk_ids"], **kw)
    valid = y != IGNORE
    # Random logits: the float64 ranking itself.
    assert torch.equal(got["topk_ids"][valid], want["ranked"][valid, :k])
    assert bool((got["topk_ids"][~valid] == -1).all())
    assert bool((got["topk_log_probs"][~valid] == 0).all())
    assert torch.equal(got["argmax"][valid], got["topk_ids"][valid, 0])
    out_tol, grad_tol = TOL[dtype]
    for f in (*FIELDS, "topk_log_probs"):
        assert rel_err(got[f], want[f]) <= out_tol, f
    for f in ("d_hidden", "d_weight"):
        assert rel_err(got[f], want[f]) <= grad_tol, f
    with torch.no_grad():
        be = TritonBackend(TritonOptions(**MANY_BLOCKS))
        at = torch.where(valid.unsqueeze(1), got["topk_ids"], 0)
        gathered = be.forward(HeadCall.make(hid, w, y, gather_ids=at, **kw)).gathered
        plain = be.forward(HeadCall.make(hid, w, y, **kw))
    assert gathered is not None and torch.equal(gathered, got["topk_log_probs"])
    assert torch.equal(plain.log_probs, got["log_probs"])


def test_topk_ties_go_to_the_lowest_ids_across_tiles() -> None:
    n, h, v, k = 24, 8, 300, 12
    g = torch.Generator().manual_seed(6)
    hid = torch.randint(-2, 3, (n, h), generator=g).float()
    w = torch.randint(-1, 2, (v, h), generator=g).float()  # many equal logits
    y = torch.randint(0, v, (n,), generator=g)
    with torch.no_grad():
        out = TritonBackend(TritonOptions(**SMALL_TILES)).forward(
            HeadCall.make(hid, w, y, top_k=k, extras=frozenset({"argmax"}))
        )
    z = hid.double() @ w.double().T
    want = torch.sort(z, dim=1, descending=True, stable=True).indices[:, :k]
    assert out.topk_ids is not None and torch.equal(out.topk_ids, want)
    assert out.argmax is not None and torch.equal(out.argmax, want[:, 0])
