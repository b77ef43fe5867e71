"""The core's public calls inside ``torch.compile`` (CPU, the torch backend): the first call of a
process made compiled (cold: nothing resolved yet) and later ones (warm), with and without
``fullgraph=True``, with ``options=``; through ``fused_head``, ``FusedHead``, ``fused_kl``,
``FusedHead.kl``, ``get_fused_head`` and ``cached_head`` (what the integrations call per step).

The head cache is process-wide, so each cold case runs in a fresh interpreter. ``aot_eager``
(Dynamo and AOTAutograd, forward and backward) stands in for inductor except in one case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from pydantic import BaseModel, ConfigDict
from torch._dynamo.testing import CompileCounterWithBackend

import fusedhead
from fusedhead import FusedHead, api, fused_head, fused_kl, registry
from fusedhead import head as head_module
from fusedhead.api import cached_head, get_fused_head
from fusedhead.protocol import Capabilities, HeadCall, HeadOutput
from fusedhead.reference import reference_fused_head

#: Run in every fresh interpreter: inputs (every fifth row ignored), the compared runs.
PRELUDE = '''
import json, torch
from torch._dynamo.testing import CompileCounterWithBackend
import fusedhead
from fusedhead import FusedHead, FusedHeadConfig, api, fused_head, fused_kl
from fusedhead.api import cached_head, get_fused_head

g = torch.Generator().manual_seed(0)
N, H, V, HT = 20, 12, 96, 8
hidden = torch.randn(N, H, generator=g).requires_grad_()
weight = (torch.randn(V, H, generator=g) / H**0.5).requires_grad_()
labels = torch.randint(0, V, (N,), generator=g)
labels[::5] = -100
t_hidden, t_weight = torch.randn(N, HT, generator=g), torch.randn(V, HT, generator=g) / 3
ARGS = (hidden, weight, labels, t_hidden, t_weight)

def run(fn, grads=True):
    """fn's outputs by name and the gradients of their weighted sum in hidden and weight
    (``grads=False``: no autograd at all, and no gradients)."""
    if not grads:
        with torch.no_grad():
            return fn(*ARGS), ()
    out = fn(*ARGS)
    loss = sum((t.float() * (i + 1)).sum() for i, t in enumerate(out.values()) if t.requires_grad)
    return out, torch.autograd.grad(loss, (hidden, weight))

def same(got, want):
    """Compiled against eager: fp32 within rounding, ids exact, gradients too."""
    (out, grads), (out_e, grads_e) = got, want
    assert out.keys() == out_e.keys()
    for k, t in out.items():
        if t.is_floating_point():
            torch.testing.assert_close(t, out_e[k], msg=lambda m, k=k: f"{k}: {m}")
            assert bool(t[::5].eq(0).all()), k
        else:
            assert torch.equal(t, out_e[k]), k
    for a, b in zip(grads, grads_e):
        torch.testing.assert_close(a, b)
'''

#: One step through every public entry, the heads resolved by the step itself.
STEP = """
head = FusedHead(FusedHeadConfig(backend="torch", options={"chunk_rows": 8}))  # built, not called
assert not api._cache and not head._caps, "not cold"

def step(h, w, y, th, tw):
    a = fused_head(h, w, y, temperature=0.7)
    b = fused_head(h, w, y, options={"block_vocab": 16, "skip_ignored_rows": False}, top_k=2)
    c = head(h, w, y, return_entropy=False)
    d = fused_kl(h, w, th, tw, y, options={"block_vocab": 32})
    e = head.kl(h, w, th, tw, y, direction="reverse", temperature=0.9)
    f = cached_head({"backend": "torch", "temperature": 0.5})(h, w, y)
    k = get_fused_head("torch", {"chunk_rows": 4}).kl(h, w, th, tw, y)
    return {"a_lp": a.log_probs, "a_ent": a.entropy, "b_lp": b.log_probs,
            "b_ids": b.topk_ids, "c_lp": c.log_probs, "d": d, "e": e, "f_lp": f.log_probs,
            "k": k}
"""


def make_inputs(
    n: int = 6, h: int = 8, v: int = 11, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden, weight, labels (fp32, all scored)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(v, h, generator=g) / h**0.5
    return torch.randn(n, h, generator=g), weight, torch.randint(0, v, (n,), generator=g)


def _fresh(*scripts: str, timeout: float = 240) -> dict[str, Any]:
    """``PRELUDE`` and ``scripts`` in a new interpreter (nothing resolved yet); the JSON it
    prints last."""
    code = "".join(textwrap.dedent(s) for s in (PRELUDE, *scripts))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, f"the fresh interpreter failed:\n{proc.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# --- cold: the process's first call is the compiled one ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks-allowed"])
def test_cold_first_call_compiled(fullgraph: bool) -> None:
    """Every entry resolves its head inside the trace: one graph, no break, no retrace on the
    next calls (nor after eager calls, which find the same heads); the values are eager's
    (with the gradients under fullgraph; without autograd otherwise)."""
    out = _fresh(
        STEP,
        f"""
        cnt = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(step, fullgraph={fullgraph}, backend=cnt)
        grads = {fullgraph}  # the backward once is enough (it is what takes the time here)
        got = run(compiled, grads)
        keys = dict(api._cache)
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        want = run(step, grads)
        same(got, want)
        same(run(compiled, grads), want)
        print(json.dumps({{
            "frames": cnt.frame_count, "graphs": cnt.op_count > 0, "breaks": breaks,
            "shared": dict(api._cache) == keys, "heads": len(keys),
            "caps": sorted(str(k) for k in head._caps),
        }}))
        """,
    )
    assert out["frames"] == 1 and out["graphs"], out  # one graph, never retraced
    assert out["breaks"] == 0, out
    assert out["shared"], "eager calls after the compiled ones resolved other heads"
    # fused_head x2, fused_kl, cached_head (its mapping and its config), get_fused_head
    assert out["heads"] == 6, out
    assert out["caps"] == ["(device(type='cpu'), torch.float32)"], out


@pytest.mark.slow
def test_cold_inductor_and_refresh() -> None:
    """Inductor on a cold ``fused_head`` with options (forward: inductor's C++ build of the
    backward takes long here); ``fusedhead.refresh()`` drops the head, and the compiled function
    retraces once onto the new one."""
    out = _fresh(
        """
        opts = {"block_vocab": 32}
        def step(h, w, y, th, tw):
            o = fused_head(h, w, y, temperature=0.8, options=opts)
            return {"lp": o.log_probs, "ent": o.entropy}
        cnt = CompileCounterWithBackend("inductor")
        compiled = torch.compile(step, fullgraph=True, backend=cnt)
        got = run(compiled, grads=False)
        first = get_fused_head("torch", opts)
        same(got, run(step, grads=False))
        fusedhead.refresh()
        same(run(compiled, grads=False), run(step, grads=False))
        print(json.dumps({"frames": cnt.frame_count, "new": get_fused_head("torch", opts) is not first}))
        """
    )
    assert out == {"frames": 2, "new": True}


# --- warm: heads resolved before, in this process -------------------------------------------------


#: ``counter``: a function -> (its compiled form, the counter of the frames compiled).
Compiler = Callable[[Callable[..., Any]], tuple[Callable[..., Any], Any]]


@pytest.fixture
def counter() -> Iterator[Compiler]:
    """``torch.compile(fn, fullgraph=True)`` through a frame counter (aot_eager), Dynamo reset."""
    torch._dynamo.reset()

    def compile_counted(fn: Callable[..., Any]) -> tuple[Callable[..., Any], Any]:
        cnt = CompileCounterWithBackend("aot_eager")
        return torch.compile(fn, fullgraph=True, backend=cnt), cnt

    yield compile_counted
    torch._dynamo.reset()


def test_warm_options_trace_and_share_the_eager_head(counter: Compiler) -> None:
    """After eager calls, ``options=`` under fullgraph (the defect was json.dumps of the key):
    eager's values, the same cached head, no retrace; other options resolve their own head."""
    hidden, weight, labels = make_inputs(n=10, h=8, v=40)
    opts: dict[str, Any] = {"block_vocab": 8, "skip_ignored_rows": None}
    want = fused_head(hidden, weight, labels, options=opts, temperature=0.6)
    kl_want = fused_kl(hidden, weight, hidden * 2, weight, labels, options=opts)
    heads = dict(api._cache)

    def step(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[Any, ...]:
        o = fused_head(h, w, y, options=opts, temperature=0.6)
        return o.log_probs, o.entropy, fused_kl(h, w, h * 2, w, y, options=opts)

    compiled, cnt = counter(step)
    lp, ent, kl = compiled(hidden, weight, labels)
    torch.testing.assert_close(lp, want.log_probs)
    torch.testing.assert_close(ent, want.entropy)
    torch.testing.assert_close(kl, kl_want)
    assert dict(api._cache) == heads, "the compiled call resolved a head of its own"
    compiled(hidden, weight, labels)
    assert cnt.frame_count == 1
    before = set(api._cache)
    other = torch.compile(
        lambda h, w, y: fused_head(h, w, y, options={"block_vocab": 16}).log_probs,
        fullgraph=True,
        backend="aot_eager",
    )
    got = other(hidden, weight, labels)
    new = ("torch", api._options_key({"block_vocab": 16}))
    assert set(api._cache) - before == {new}  # its own head, resolved by its trace
    assert get_fused_head("torch", {"block_vocab": 16}) is api._cache[new]
    torch.testing.assert_close(got, fused_head(hidden, weight, labels).log_probs)


def test_warm_fused_head_object_and_its_kl(counter: Compiler) -> None:
    """A ``FusedHead`` built and called eagerly, then inside a compiled function (fullgraph):
    ``__call__`` with extras and ``kl`` give eager's values, one graph."""
    hidden, weight, labels = make_inputs(n=12, h=8, v=30, seed=3)
    t_hidden = torch.randn(12, 5)
    t_weight = torch.randn(30, 5)
    head = FusedHead(backend="torch", options={"chunk_rows": 4})

    def step(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        o = head(h, w, y, return_lse=True, top_k=3)
        kl = head.kl(h, w, t_hidden, t_weight, y, direction="reverse")
        assert o.lse is not None and o.topk_ids is not None
        return o.log_probs, o.lse, o.topk_ids, kl

    want = step(hidden, weight, labels)
    compiled, cnt = counter(step)
    got = compiled(hidden, weight, labels)
    for a, b in zip(got[:2] + got[3:], want[:2] + want[3:], strict=True):
        torch.testing.assert_close(a, b)
    assert torch.equal(got[2], want[2])
    compiled(hidden, weight, labels)
    assert cnt.frame_count == 1


# --- the options' cache key -----------------------------------------------------------------------


def test_options_key_keeps_what_json_told_apart() -> None:
    """Flat options key as a tuple that, like their JSON text, tells 1, 1.0 and True apart and
    ignores order; a mapping and a model with the same values share a key; nested values go
    through JSON."""
    key = api._options_key
    assert key(None) == () == key({})
    assert key({"a": 1, "b": None}) == key({"b": None, "a": 1})
    assert len({key({"a": 1}), key({"a": 1.0}), key({"a": True}), key({"a": "1"})}) == 4
    assert key({"a": [1, 2]}) == json.dumps({"a": [1, 2]}, sort_keys=True)
    assert isinstance(key({"a": float("nan")}), str)  # NaN equals nothing: JSON text instead
    model = get_fused_head("torch", {"block_vocab": 8}).options
    assert key(model) == key(model.model_dump(mode="json"))
    with pytest.raises(TypeError, match="options must be a mapping, got list"):
        key([("a", 1)])


def test_cached_head_keys_never_meet_a_backend_name() -> None:
    """``cached_head``'s own keys have three items: a backend named "mapping" is not its entry."""
    cached_head({})
    with pytest.raises(fusedhead.errors.UnknownBackendError, match="'mapping'"):
        fused_head(*make_inputs(), backend="mapping")


class ListOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    tags: tuple[str, ...] = ()


class ListBackend:
    """Full fp32 logits, with an option JSON holds as a list (no flat key)."""

    name: ClassVar[str] = "compile-list-test"
    Options: ClassVar[type[BaseModel]] = ListOptions
    plugin_api_version: ClassVar[int] = 2

    def __init__(self, options: ListOptions) -> None:
        self.options = options

    def capabilities(self, device: torch.device) -> Capabilities:
        return Capabilities(devices=("cpu",))

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        return None

    def forward(self, call: HeadCall) -> HeadOutput:
        lp, ent = reference_fused_head(
            call.hidden,
            call.weight,
            call.labels,
            temperature=call.temperature,
            ignore_index=call.ignore_index,
            return_entropy=call.return_entropy,
        )
        return HeadOutput(lp, ent)


@pytest.fixture
def list_backend() -> Iterator[None]:
    registry.register_backend(ListBackend.name, ListBackend, replace=True)
    registry.refresh()
    yield
    registry.unregister_backend(ListBackend.name)
    registry.refresh()


def test_json_keyed_options_under_fullgraph(list_backend: None, counter: Compiler) -> None:
    """Options only JSON can key (a list) resolve inside the trace and share eager's head."""
    hidden, weight, labels = make_inputs(seed=5)
    opts = {"tags": ["x", "y"]}

    def step(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return fused_head(h, w, y, backend=ListBackend.name, options=opts).log_probs

    got = counter(step)[0](hidden, weight, labels)
    head = api._cache[(ListBackend.name, json.dumps(opts, sort_keys=True))]
    assert get_fused_head(ListBackend.name, opts) is head
    torch.testing.assert_close(got, step(hidden, weight, labels))


# --- errors inside the trace ----------------------------------------------------------------------


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks-allowed"])
def test_resolution_errors_reach_the_user(fullgraph: bool) -> None:
    """An unknown backend or a bad option, found while Dynamo traces: its message, whole."""
    hidden, weight, labels = make_inputs()
    torch._dynamo.reset()

    def unknown(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return fused_head(h, w, y, backend="no-such-backend").log_probs

    def bad_option(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return fused_head(h, w, y, options={"block_vocab": -3}).log_probs

    for fn, message in (
        (unknown, r"unknown fusedhead backend 'no-such-backend'\. Installed: .*torch"),
        (bad_option, r"option 'block_vocab' = -3 \(int\): expected int > 0"),
    ):
        compiled = torch.compile(fn, fullgraph=fullgraph, backend="aot_eager")
        with pytest.raises(Exception, match=message):
            compiled(hidden, weight, labels)
    torch._dynamo.reset()


def test_graph_constants_carry_dynamos_own_mark() -> None:
    """The core marks its resolution steps as ``torch.compiler.assume_constant_result`` does
    (without importing Dynamo at import time): a torch that renames the mark fails here."""

    def probe() -> int:
        return 0

    torch.compiler.assume_constant_result(probe)  # type: ignore[no-untyped-call]
    marks = {k for k, v in vars(probe).items() if v is True}
    assert marks, "assume_constant_result no longer marks the function with an attribute"
    for fn in (api._key_in_trace, api._config_key_in_trace, head_module._prime_device):
        assert all(getattr(fn, m, False) is True for m in marks), fn.__name__
    assert all(getattr(FusedHead._prepare, m, False) is True for m in marks)
