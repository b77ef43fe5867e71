"""Top-k, argmax, gather, lse, sum_p2 and the two-head KL on the torch backend, against float64.

The acceptance of issue 18 on the CPU: gather with K = 1 equals the label log-prob bitwise; top-k
agrees with ``torch.topk(log_softmax(z))`` (ids exactly, equal logits by the lower id, values
within the dtype's tolerance); the KL matches the float64 full-logits KL, forward and reverse,
with its student gradients.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from fusedhead import FusedHeadOutput, fused_head, fused_kl
from fusedhead.errors import CapabilityError
from fusedhead.testing.inputs import make_case
from fusedhead.testing.outputs import check_outputs, integer_case
from fusedhead.testing.target import Target
from fusedhead.testing.tolerances import Tolerances

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Small blocks and row chunks, so every output is merged over blocks and rows.
TILED = {"block_vocab": 96, "chunk_rows": 16}
LAYOUTS = [None, TILED, {**TILED, "skip_ignored_rows": False}]


def _case(n=40, h=32, v=611, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (scale / h**0.5)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    return hidden, weight, labels


def _z64(hidden, weight, temperature=1.0, softcap=None):
    z = hidden.double() @ weight.double().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = temperature.double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    return z / t


@pytest.mark.parametrize("options", LAYOUTS, ids=["default", "tiled", "tiled-all-rows"])
@pytest.mark.parametrize("k", [1, 7, 64, 100])
def test_topk_matches_torch_topk_of_log_softmax(options, k):
    hidden, weight, labels = _case()
    out = fused_head(hidden, weight, labels, temperature=0.7, top_k=k, options=options)
    logp = torch.log_softmax(_z64(hidden, weight, 0.7), -1)
    want = torch.topk(logp, k, dim=-1)
    valid = labels != -100
    assert out.topk_ids.dtype == torch.int64 and out.topk_ids.shape == (40, k)
    assert out.topk_log_probs.dtype == torch.float32
    assert torch.equal(out.topk_ids[valid], want.indices[valid])
    assert (out.topk_log_probs[valid].double() - want.values[valid]).abs().max() < 2e-5
    assert bool((out.topk_ids[~valid] == -1).all()) and bool(
        (out.topk_log_probs[~valid] == 0).all()
    )


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("options", LAYOUTS[:2], ids=["default", "tiled"])
def test_equal_logits_are_ranked_by_the_lower_id_across_blocks(dtype, options):
    case = integer_case(48, 16, 700, seed=3)  # small-integer logits: exact in every dtype
    h, w = case.hidden.to(DTYPES[dtype]), case.weight.to(DTYPES[dtype])
    out = fused_head(h, w, case.labels, top_k=33, return_argmax=True, options=options)
    z = _z64(h, w)
    ranked = torch.sort(z, dim=-1, descending=True, stable=True).indices[:, :33]
    valid = case.labels != -100
    assert torch.equal(out.topk_ids[valid], ranked[valid])
    assert torch.equal(out.argmax[valid], ranked[valid, 0])
    ties = (z.gather(1, ranked[:, :1]) == z).sum(-1)
    assert int(ties.max()) > 5, "the case must hold ties at the top"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("options", LAYOUTS, ids=["default", "tiled", "tiled-all-rows"])
@pytest.mark.parametrize(("softcap", "temperature"), [(None, 0.7), (5.0, 1.3), (None, "per-token")])
def test_gather_at_the_labels_is_the_label_log_prob_bitwise(dtype, options, softcap, temperature):
    hidden, weight, labels = _case(seed=1)
    h, w = hidden.to(DTYPES[dtype]), weight.to(DTYPES[dtype])
    temp = torch.linspace(0.2, 4.0, 40) if temperature == "per-token" else temperature
    ids = labels.clamp(min=0).unsqueeze(-1)
    kw = {"temperature": temp, "softcap": softcap, "options": options}
    out = fused_head(h, w, labels, gather_ids=ids, **kw)
    plain = fused_head(h, w, labels, **kw)
    assert torch.equal(out.gathered[:, 0], out.log_probs)
    assert torch.equal(out.gathered[:, 0], plain.log_probs)
    assert torch.equal(out.entropy, plain.entropy)


def test_gather_of_many_ids_matches_float64_values_and_gradients():
    target = Target.resolve("torch", TILED, "cpu", "fp32")
    case = make_case(64, 48, 1000, scale=4.0, seed=5)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 1000, (64, 300), generator=g)
    ids[:, 5] = ids[:, 4]  # a repeated id
    ids[:, -1] = -100  # an entry that gives 0
    got = check_outputs(target, case, ("gather",), label="K=300", gather_ids=ids)
    assert got["gathered"] is not None and bool((got["gathered"][:, -1] == 0).all())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_extra_at_once_matches_float64_3d(dtype):
    target = Target.resolve("torch", TILED, "cpu", dtype)
    case = make_case(48, 40, 777, scale=4.0, seed=7, lead=(3, 16), ignore_fraction=0.25)
    ids = torch.randint(0, 777, (3, 16, 11), generator=torch.Generator().manual_seed(8))
    got = check_outputs(
        target,
        case,
        ("lse", "sum_p2", "argmax", "topk", "gather"),
        label="3-D",
        k=9,
        gather_ids=ids,
        softcap=20.0,
    )
    assert got["topk_ids"].shape == (3, 16, 9) and got["gathered"].shape == (3, 16, 11)
    assert got["lse"].shape == (3, 16) and got["argmax"].dtype == torch.int64


def test_lse_and_sum_p2_values():
    hidden, weight, labels = _case(seed=9)
    out = fused_head(hidden, weight, labels, temperature=0.5, return_lse=True, return_sum_p2=True)
    z = _z64(hidden, weight, 0.5)
    valid = labels != -100
    p = torch.softmax(z, -1)
    # The kit's bound: a log-prob is off by at most 4 u_eff (1 + zmax + ln V); sum p^2 by twice
    # that relative to itself.
    bound = (
        Tolerances.for_case(
            dtype="fp32",
            logits_precision="fp32",
            entropy_precision="fp32",
            h=32,
            v=611,
            zmax=float(z[valid].abs().max()),
        ).log_probs.scale
        * 4
    )
    sum_p2 = (p * p).sum(-1)
    assert (out.lse[valid].double() - torch.logsumexp(z, -1)[valid]).abs().max() < bound
    assert ((out.sum_p2[valid].double() - sum_p2[valid]).abs() / sum_p2[valid]).max() < 2 * bound
    assert bool((out.lse[~valid] == 0).all()) and bool((out.sum_p2[~valid] == 0).all())


def test_existing_callers_are_unchanged():
    hidden, weight, labels = _case(seed=10)
    out = fused_head(hidden, weight, labels)
    lp, ent = out
    assert len(out) == 2 and isinstance(out, tuple)
    assert out.lse is None and out.topk_ids is None and out.gathered is None
    pair = FusedHeadOutput(lp, ent)
    assert pair == (lp, ent) and pair.argmax is None


def test_zero_rows_give_empty_extras():
    hidden, weight = torch.randn(0, 8), torch.randn(50, 8)
    labels = torch.zeros(0, dtype=torch.long)
    out = fused_head(
        hidden.requires_grad_(),
        weight,
        labels,
        top_k=4,
        gather_ids=torch.zeros(0, 3, dtype=torch.long),
        return_lse=True,
        return_argmax=True,
    )
    assert out.topk_ids.shape == (0, 4) and out.gathered.shape == (0, 3) and out.lse.shape == (0,)
    assert out.argmax.dtype == torch.int64


#: (student softcap, teacher softcap) of the KL tests: none, both, each alone.
KL_CAPS = [(None, None), (3.0, 2.0), (None, 1.5), (2.5, None)]


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("options", LAYOUTS, ids=["default", "tiled", "tiled-all-rows"])
@pytest.mark.parametrize("caps", KL_CAPS, ids=lambda c: f"softcap-{c[0]}-{c[1]}")
def test_kl_of_two_heads_matches_float64_with_student_gradients(direction, dtype, options, caps):
    dt = DTYPES[dtype]
    softcap, teacher_softcap = caps
    hidden, weight, labels = _case(seed=11)
    t_hidden = torch.randn(40, 20, generator=torch.Generator().manual_seed(12)).to(dt)
    t_weight = (torch.randn(611, 20, generator=torch.Generator().manual_seed(13)) * 0.6).to(dt)
    hs = hidden.to(dt).requires_grad_()
    ws = weight.to(dt).requires_grad_()
    th, tw = t_hidden.clone().requires_grad_(), t_weight.clone().requires_grad_()
    kl = fused_kl(
        hs,
        ws,
        th,
        tw,
        labels,
        direction=direction,
        temperature=0.8,
        teacher_temperature=1.6,
        options=options,
        softcap=softcap,
        teacher_softcap=teacher_softcap,
    )
    g = torch.randn(40, generator=torch.Generator().manual_seed(14))
    (kl * g).sum().backward()
    hd = hs.detach().double().requires_grad_()
    wd = ws.detach().double().requires_grad_()
    ls = torch.log_softmax(_z64(hd, wd, 0.8, softcap), -1)
    lt = torch.log_softmax(_z64(t_hidden, t_weight, 1.6, teacher_softcap), -1)
    ref = (
        (lt.exp() * (lt - ls)).sum(-1) if direction == "forward" else (ls.exp() * (ls - lt)).sum(-1)
    )
    ref = torch.where(labels != -100, ref, 0.0)
    (ref * g.double()).sum().backward()
    tol = 3e-5 if dtype == "fp32" else 3e-3
    assert kl.dtype == torch.float32 and kl.shape == (40,)
    assert (kl.double() - ref).abs().max() < tol * max(1.0, float(ref.detach().abs().max()))
    assert bool((kl[labels == -100] == 0).all())
    for got, want in ((hs.grad, hd.grad), (ws.grad, wd.grad)):
        rel = (got.double() - want).norm() / want.norm()
        assert rel < (1e-5 if dtype == "fp32" else 2e-2), rel
    assert th.grad is None and tw.grad is None  # the teacher is read, never differentiated
    assert bool((hs.grad[labels == -100] == 0).all())


def test_kl_without_labels_counts_every_row_and_is_zero_for_one_head():
    hidden, weight, _ = _case(seed=15)
    kl = fused_kl(
        hidden.reshape(4, 10, 32),
        weight,
        hidden.reshape(4, 10, 32),
        weight,
        temperature=0.9,
        teacher_temperature=0.9,
    )
    assert kl.shape == (4, 10)
    assert float(kl.abs().max()) < 1e-5
    kl = fused_kl(
        hidden,
        weight,
        hidden,
        weight,
        direction="reverse",
        temperature=0.5,
        teacher_temperature=2.0,
    )
    assert bool((kl > 0).all())


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"top_k": 0}, ValueError, ["top_k must be in [1, vocab_size=611]", "got 0"]),
        ({"top_k": 612}, ValueError, ["top_k", "got 612"]),
        ({"top_k": True}, TypeError, ["top_k must be an int", "bool"]),
        ({"top_k": 2.0}, TypeError, ["top_k must be an int", "float"]),
        (
            {"gather_ids": torch.zeros(40, 2)},
            TypeError,
            ["gather_ids must be an integer tensor", "float32"],
        ),
        (
            {"gather_ids": torch.zeros(40, dtype=torch.long)},
            ValueError,
            ["gather_ids must have the labels' shape (40,) plus", "(40,)"],
        ),
        ({"gather_ids": torch.zeros(40, 0, dtype=torch.long)}, ValueError, ["K >= 1", "(40, 0)"]),
        (
            {"gather_ids": torch.full((40, 3), 611)},
            ValueError,
            ["gather_ids must be in [0, 611)", "got 611"],
        ),
        ({"return_lse": 1}, TypeError, ["return_lse must be a bool", "int 1"]),
        ({"return_argmax": "yes"}, TypeError, ["return_argmax must be a bool"]),
    ],
)
def test_bad_arguments_name_the_argument_the_value_and_what_was_expected(kwargs, error, words):
    hidden, weight, labels = _case()
    with pytest.raises(error) as info:
        fused_head(hidden, weight, labels, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_out_of_range_ids_on_ignored_rows_and_unchecked_ids():
    hidden, weight, labels = _case()
    ids = torch.zeros(40, 2, dtype=torch.long)
    ids[labels == -100] = 10**6  # ignored rows: not checked, give 0
    out = fused_head(hidden, weight, labels, gather_ids=ids)
    assert bool((out.gathered[labels == -100] == 0).all())
    ids[3, 1] = -7
    out = fused_head(hidden, weight, labels, gather_ids=ids, check_labels=False)
    assert torch.isnan(out.gathered[3, 1]) and not torch.isnan(out.gathered[3, 0])


def test_with_gather_ids_labels_and_ids_are_checked_in_one_host_read(monkeypatch):
    """The labels' range check joins the ids' (one sync a step, not two); labels still first."""
    hidden, weight, labels = _case()
    ids = torch.zeros(40, 2, dtype=torch.long)
    reads = []
    real = torch.Tensor.tolist

    def counting(t):
        reads.append(t.numel())
        return real(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    fused_head(hidden, weight, labels, gather_ids=ids)
    assert reads == [2]  # one read of (labels bad, ids bad)
    bad_labels = labels.clone()
    bad_labels[5] = 611
    bad_ids = ids.clone()
    bad_ids[6, 1] = 611
    for y, g, words in (
        (bad_labels, ids, ["labels must be in [0, 611)", "got 611 at flat position 5"]),
        (labels, bad_ids, ["gather_ids must be in [0, 611)", "got 611 at flat row 6, position 1"]),
        (bad_labels, bad_ids, ["labels must be in [0, 611)"]),  # the labels are named first
    ):
        with pytest.raises(ValueError) as info:
            fused_head(hidden, weight, y, gather_ids=g)
        for word in words:
            assert word in str(info.value)
    out = fused_head(hidden, weight, bad_labels, gather_ids=bad_ids, check_labels=False)
    assert torch.isnan(out.log_probs[5]) and torch.isnan(out.gathered[6, 1])


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        (
            {"direction": "sideways"},
            ValueError,
            ["direction must be one of ['forward', 'reverse']", "'sideways'"],
        ),
        (
            {"teacher_weight": torch.randn(610, 20)},
            ValueError,
            ["teacher_weight must have the student's vocabulary V=611", "(610, 20)"],
        ),
        (
            {"teacher_hidden": torch.randn(39, 20)},
            ValueError,
            ["teacher_hidden must have hidden's leading shape (40,)", "(39,)"],
        ),
        (
            {"teacher_hidden": torch.randn(40, 19)},
            ValueError,
            ["teacher_hidden's last dimension must equal teacher_weight's H=20"],
        ),
        (
            {"teacher_hidden": torch.randn(40, 20).double()},
            TypeError,
            ["teacher_hidden must be float32, float16 or bfloat16", "float64"],
        ),
        (
            {"teacher_temperature": 0.0},
            ValueError,
            ["teacher_temperature must be a finite float > 0", "got 0.0"],
        ),
        ({"temperature": -1.0}, ValueError, ["temperature must be a finite float > 0", "-1.0"]),
        ({"softcap": 0.0}, ValueError, ["softcap must be a finite float > 0", "got 0.0"]),
        (
            {"teacher_softcap": -2.0},
            ValueError,
            ["teacher_softcap must be a finite float > 0", "got -2.0"],
        ),
        ({"softcap": float("inf")}, ValueError, ["softcap must be a finite float > 0", "inf"]),
        ({"teacher_softcap": "3"}, TypeError, ["teacher_softcap must be a float", "str '3'"]),
        ({"temperature": None}, TypeError, ["temperature must be a float or a tensor, got None"]),
        (
            {"labels": torch.zeros(39, dtype=torch.long)},
            ValueError,
            ["labels must have hidden's leading shape (40,)"],
        ),
    ],
)
def test_bad_kl_arguments_are_named(kwargs, error, words):
    hidden, weight, labels = _case()
    args = {
        "teacher_hidden": torch.randn(40, 20),
        "teacher_weight": torch.randn(611, 20),
        "labels": labels,
    }
    args.update(kwargs)
    direction = args.pop("direction", "forward")
    with pytest.raises(error) as info:
        fused_kl(
            hidden,
            weight,
            args.pop("teacher_hidden"),
            args.pop("teacher_weight"),
            args.pop("labels"),
            direction=direction,
            **args,
        )
    for word in words:
        assert word in str(info.value)


def test_kl_softcap_changes_the_kl_and_a_cap_far_above_the_logits_does_not():
    """Each head's softcap reaches its own logits: a tight cap moves the KL, a loose one does not."""
    hidden, weight, labels = _case(seed=16)
    t_hidden, t_weight, _ = _case(seed=17, h=20)
    plain = fused_kl(hidden, weight, t_hidden, t_weight, labels)
    for kw in ({"softcap": 1.0}, {"teacher_softcap": 1.0}):
        capped = fused_kl(hidden, weight, t_hidden, t_weight, labels, **kw)
        assert float((capped - plain).abs().max()) > 0.1, kw
    loose = fused_kl(hidden, weight, t_hidden, t_weight, labels, softcap=1e6, teacher_softcap=1e6)
    assert float((loose - plain).abs().max()) < 1e-5


def test_head_kl_takes_the_student_temperature_and_softcap_from_its_config():
    """Before: ``FusedHead.kl`` took the config's ignore_index and check_labels but ran the
    student at temperature 1.0 without its softcap, whatever the config said (a Gemma-2 head
    configured with ``softcap: 30`` got an uncapped KL, silently)."""
    from fusedhead import FusedHead

    hidden, weight, labels = _case(seed=18)
    t_hidden, t_weight, _ = _case(seed=19, h=20)
    head = FusedHead(backend="torch", temperature=0.6, softcap=2.0)
    for direction in ("forward", "reverse"):
        got = head.kl(hidden, weight, t_hidden, t_weight, labels, direction=direction)
        want = fused_kl(hidden, weight, t_hidden, t_weight, labels, direction=direction,
                        temperature=0.6, softcap=2.0)  # fmt: skip
        assert torch.equal(got, want), direction
        # The call's own values still win, and the teacher keeps its own defaults (1.0, none).
        got = head.kl(hidden, weight, t_hidden, t_weight, labels, direction=direction,
                      temperature=1.5, softcap=1e6)  # fmt: skip
        want = fused_kl(hidden, weight, t_hidden, t_weight, labels, direction=direction,
                        temperature=1.5, softcap=1e6)  # fmt: skip
        assert torch.equal(got, want), direction


def test_kl_with_only_the_teacher_requiring_grad_does_not_require_grad():
    """Gradients reach the student only. Before: the torch backend's KL required grad when only
    the teacher did (the triton backend's did not), and its backward gave nothing to anyone."""
    hidden, weight, labels = _case(seed=20)
    t_hidden, t_weight, _ = _case(seed=21, h=20)
    t_hidden.requires_grad_(True)
    t_weight.requires_grad_(True)
    for direction in ("forward", "reverse"):
        kl = fused_kl(hidden, weight, t_hidden, t_weight, labels, direction=direction)
        assert not kl.requires_grad and kl.grad_fn is None, direction
        student = hidden.detach().requires_grad_(True)
        kl = fused_kl(student, weight, t_hidden, t_weight, labels, direction=direction)
        kl.sum().backward()
        assert student.grad is not None and t_hidden.grad is None and t_weight.grad is None


def test_kl_softcap_needs_a_backend_that_declares_softcap(output_backends):
    from fusedhead import registry

    class NoSoftcap(output_backends.OutputsRef):
        name = "outputs-no-softcap"

        def capabilities(self, device):
            return super().capabilities(device).model_copy(update={"softcap": False})

    registry.register_backend(NoSoftcap.name, NoSoftcap, replace=True)
    registry.refresh()
    try:
        hidden, weight, labels = _case()
        for arg in ("softcap", "teacher_softcap"):
            with pytest.raises(CapabilityError) as info:
                fused_kl(
                    hidden, weight, hidden, weight, labels, backend=NoSoftcap.name, **{arg: 2.0}
                )
            assert info.value.capability == "softcap" and arg in str(info.value)
        fused_kl(hidden, weight, hidden, weight, labels, backend=NoSoftcap.name)  # no cap: runs
    finally:
        registry.unregister_backend(NoSoftcap.name)
        registry.refresh()


def test_a_backend_without_the_outputs_is_refused_by_name(output_backends):
    from fusedhead import registry

    class Basic(output_backends.OutputsRef):  # declares log_probs and entropy only
        name = "outputs-basic"

        def capabilities(self, device):
            caps = super().capabilities(device)
            return caps.model_copy(
                update={"outputs": ("log_probs", "entropy"), "max_top_k": 0, "kl_directions": ()}
            )

    registry.register_backend(Basic.name, Basic, replace=True)
    registry.refresh()
    try:
        hidden, weight, labels = _case()
        for kwargs, name in (
            ({"top_k": 4}, "topk"),
            ({"gather_ids": labels.clamp(min=0).unsqueeze(-1)}, "gather"),
            ({"return_lse": True}, "lse"),
            ({"return_sum_p2": True}, "sum_p2"),
            ({"return_argmax": True}, "argmax"),
        ):
            with pytest.raises(CapabilityError) as info:
                fused_head(hidden, weight, labels, backend=Basic.name, **kwargs)
            assert f"['{name}']" in str(info.value) and Basic.name in str(info.value)
            assert info.value.capability == name
        with pytest.raises(CapabilityError, match="kl_directions"):
            fused_kl(hidden, weight, hidden, weight, backend=Basic.name)
    finally:
        registry.unregister_backend(Basic.name)
        registry.refresh()


def test_vocab_parallel_and_top_k_limits_are_capabilities():
    from fusedhead.contract import gate_head
    from fusedhead.errors import CapabilityError
    from fusedhead.protocol import Capabilities, HeadCall

    caps = Capabilities(
        outputs=("log_probs", "entropy", "topk", "lse"), max_top_k=8, vocab_parallel=True
    )
    h, w, y = torch.randn(3, 4), torch.randn(20, 4), torch.zeros(3, dtype=torch.long)
    call = HeadCall.make(h, w, y, top_k=8)
    assert gate_head(call, caps, {}) is call
    with pytest.raises(CapabilityError, match=r"top_k=9") as info:
        gate_head(HeadCall.make(h, w, y, top_k=9), caps, {})
    assert info.value.capability == "max_top_k"
    group_call = HeadCall.make(h, w, y, top_k=4, extras=frozenset({"lse"}), process_group=object())
    with pytest.raises(CapabilityError, match=r"\['lse', 'topk'\]") as info:
        gate_head(group_call, caps, {})
    assert info.value.capability == "vocab_parallel_outputs"


def test_no_logits_of_size_n_by_v_are_held():
    """Peak resident memory of top-k + gather + backward stays far below one [N, V] fp32 buffer."""
    script = textwrap.dedent(
        """
        import resource, torch
        from fusedhead import fused_head
        torch.manual_seed(0)
        n, h, v, k = 1024, 64, 65536, 64
        hidden = torch.randn(n, h).requires_grad_()
        weight = (torch.randn(v, h) / 8).requires_grad_()
        labels = torch.randint(0, v, (n,))
        ids = torch.randint(0, v, (n, k))
        out = fused_head(hidden, weight, labels, top_k=1, gather_ids=ids[:, :1])  # warm up
        (out.log_probs.sum() + out.gathered.sum()).backward()
        hidden.grad = weight.grad = None
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = fused_head(hidden, weight, labels, top_k=k, gather_ids=ids, return_lse=True, return_sum_p2=True)
        (out.topk_log_probs.sum() + out.gathered.sum() + out.lse.sum() + out.sum_p2.sum()).backward()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) * 1024, n * v * 4)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    grown, logits = (int(x) for x in proc.stdout.split())
    assert grown < logits / 2, (
        f"peak grew by {grown / 2**20:.0f} MiB; [N, V] fp32 is {logits / 2**20:.0f} MiB"
    )


def test_block_topk_is_the_stable_descending_sort_on_tie_heavy_rows():
    """The per-block top-k (and its tie repair) against a stable sort, k below, at and above C."""
    from fusedhead_torch.outputs import block_topk, merge_topk

    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        rows, cols, k = (
            int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 6), (1, 40), (1, 45))
        )
        x = torch.randint(-3, 4, (rows, cols), generator=g).float()  # few values: many ties
        vals, ids = block_topk(x, k)
        want = torch.sort(x, dim=1, descending=True, stable=True)
        assert torch.equal(ids, want.indices[:, :k]) and torch.equal(vals, want.values[:, :k])
        # Two blocks merged give the ranking of the whole row.
        half = cols // 2
        if 0 < half < cols:
            left, right = block_topk(x[:, :half], k), block_topk(x[:, half:], k)
            merged = merge_topk(left, (right[0], right[1] + half), k)
            assert torch.equal(merged[1], want.indices[:, :k])
