"""Bad input to the policy loss, found by a battery of bad calls: each class refused by name, or
(where the call is valid) computed as the float64 reference computes it.

- An empty batch (N = 0: ``[0]``, ``[0, S]``, ``[B, 0]``) raised torch's ``amin(): Expected
  reduction dim ...`` RuntimeError from the ratio metrics; it is a loss of 0 with zero gradients.
- A ``loss_normalizer`` tensor was taken unread: 0, a negative count, NaN or Inf gave a NaN,
  negative or infinite loss silently (the float form refused them), a bool tensor counted as 1,
  and a complex one was refused as "a tensor of shape ()". Its dtype is checked, and its value by
  the call's one read of the labels' range.
- A per-token tensor of fewer dimensions than the labels (``[B]`` beside ``[B, S]``) broadcast
  along S in the reference (``reference_policy_loss``) and in ``lm_head_policy_loss``'s
  temperature, as it did in ``fused_policy_loss`` before.
- A ``loss_normalizer`` tensor on another device was moved there unchecked: on ``meta``, torch's
  NotImplementedError "Cannot copy out of meta tensor". The CPU or hidden's device, else refused.
- A label out of range told the caller to "pass check_labels=False", which ``fused_policy_loss``
  does not take; the message says where it is passed.
- ``reference_policy_loss`` computed an unknown ``aggregation`` or ``kl_estimator`` as another
  one, and let torch or an ``assert`` speak for bad shapes and missing partners.
- Beside packed labels (``cu_seqlens``), ``[1, 1]`` advantages were taken as "one value per
  sequence" and spread one value over every sequence; ``[k, 1]`` was told to pass ``(1, 1)``.
- A scalar past fp32's range (``clip_high=1e39``, ``entropy_coef=1e39``) raised torch's
  "value cannot be converted to type float without overflow"; ``kl_coef=1e39`` gave an inf loss,
  ``loss_normalizer=1e40`` a loss of 0 with every token treated as ignored (its weight, 1/inf,
  was 0, which marks an ignored token), and a normaliser near 2**126 did the same to the metrics.
- A ``loss_normalizer`` tensor that requires grad was taken (no gradient reaches it), where the
  per-token tensors are refused with a ``.detach()`` hint.
- verl's ``token-sum`` was offered ``token-mean`` as a did-you-mean, TRL's loss types and verl's
  ``full`` KL no word at all: each is told what it is here.
- A NaN or inf among the loss's per-token values on a scored row (a NaN advantage from a group
  whose rewards are all equal, an fp64 advantage past fp32's range) gave a NaN or infinite loss
  and gradients without a word, which an optimizer step then wrote into the weights. They are
  checked in the call's one read, ignored rows left free.
- verl's and TRL's keyword names (``entropy_coeff=``, ``beta=``, ``response_mask=``) got Python's
  "unexpected keyword argument", which does not say what they are here.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from policy_backends import POLICY_BACKENDS

import fusedhead
from fusedhead.integrations.lm_head import lm_head_policy_loss
from fusedhead.reference import reference_policy_loss

B, S, H, V = 3, 3, 8, 11  # B == S: a [B] tensor broadcast to [B, S] goes along S unnoticed


def _batch(b: int = B, s: int = S) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "hidden": torch.randn(b, s, H, generator=g),
        "weight": torch.randn(V, H, generator=g) / 3,
        "labels": torch.randint(0, V, (b, s), generator=g),
        "old_log_probs": -2.0 + 0.3 * torch.randn(b, s, generator=g),
        "advantages": torch.randn(b, s, generator=g),
    }


def _call(backend: str, batch: dict[str, torch.Tensor], **kw: Any) -> Any:
    args = {**batch, **kw}
    h, w, y = args.pop("hidden"), args.pop("weight"), args.pop("labels")
    return fusedhead.fused_policy_loss(h, w, y, backend=backend, **args)


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize("shape", [(0,), (0, S), (B, 0)], ids=["N0", "B0", "S0"])
@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_an_empty_batch_is_a_zero_loss_with_zero_gradients(backend, shape, aggregation):
    """Before: RuntimeError amin(): Expected reduction dim to be specified (ratio_min)."""
    hidden = torch.randn(*shape, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    out = fusedhead.fused_policy_loss(
        hidden,
        weight,
        torch.zeros(shape, dtype=torch.long),
        old_log_probs=torch.zeros(shape),
        advantages=torch.zeros(shape),
        aggregation=aggregation,
        backend=backend,
    )
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert out.log_probs.shape == shape and out.entropy.shape == shape
    # min and max over no token are their identities, so reductions across micro-batches hold
    assert out.ratio_min.item() == math.inf and out.ratio_max.item() == -math.inf
    assert out.clip_fraction.item() == out.approx_kl.item() == out.ratio_mean.item() == 0.0
    assert hidden.grad is not None and hidden.grad.shape == hidden.shape
    assert weight.grad is not None and torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize(
    "value",
    [0.0, -5.0, float("nan"), float("inf"), -float("inf"), 1e-40, 2.0**-33],
    ids=["zero", "negative", "nan", "inf", "-inf", "denormal", "under-the-floor"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_loss_normalizer_tensor_that_is_no_count_is_refused_with_its_value(value, dtype):
    """Before: taken unread; the loss came out NaN, negative or infinite."""
    with pytest.raises(
        ValueError, match=r"loss_normalizer must be a count > 0 .* got a tensor holding"
    ):
        _call("torch", _batch(), loss_normalizer=torch.tensor(value, dtype=dtype))


def test_counts_whose_token_weight_would_overflow_are_refused():
    """Before: loss_normalizer=1e-20 with horizon=1e-20 each passed its own check, and the token
    weight 1 / 1e-40 was inf in fp32: a loss of -inf and NaN gradients without a word."""
    norm = {"aggregation": "seq-mean-token-sum-norm"}
    for kw, arg in (
        ({"loss_normalizer": 1e-20, "horizon": 8.0}, "loss_normalizer"),
        ({"loss_normalizer": 4.0, "horizon": 1e-20}, "horizon"),
        ({"loss_normalizer": torch.tensor(1e-20), "horizon": 8.0}, "loss_normalizer"),
    ):
        with pytest.raises(ValueError, match=rf"^{arg} must be a .* at least 2\*\*-32"):
            _call("torch", _batch(), **norm, **kw)
        with pytest.raises(ValueError, match=rf"^{arg} must be a .* at least 2\*\*-32"):
            b = _batch()
            reference_policy_loss(
                b.pop("hidden"), b.pop("weight"), b.pop("labels"), **b, **norm, **kw
            )
    batch = _batch()
    batch["hidden"].requires_grad_()
    edge = _call("torch", batch, **norm, loss_normalizer=2.0**-32, horizon=2.0**-32)
    edge.loss.backward()
    assert torch.isfinite(edge.loss) and torch.isfinite(batch["hidden"].grad).all()


@pytest.mark.parametrize("value", [0.0, float("nan")], ids=["zero", "nan"])
def test_a_compiled_call_checks_its_loss_normalizer_tensor_as_its_labels(value):
    """Before: under torch.compile the labels were checked (a graph op) and a tensor
    normaliser's value was not: 0 or NaN gave a NaN loss and NaN gradients without a word."""
    torch._dynamo.reset()

    def step(norm: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = _call("torch", _batch(), loss_normalizer=norm).loss
        return loss

    compiled = torch.compile(step, backend="eager")
    assert torch.isfinite(compiled(torch.tensor(40.0)))
    with pytest.raises(
        ValueError, match=r"loss_normalizer must be a count > 0 .* got a tensor holding"
    ):
        compiled(torch.tensor(value))


@pytest.mark.parametrize(
    "value",
    [torch.tensor(True), torch.tensor(6 + 0j), torch.tensor([1 + 1j])],
    ids=["bool", "complex", "complex-1"],
)
def test_a_loss_normalizer_tensor_of_a_non_real_dtype_is_a_type_error_naming_it(value):
    """Before: a bool tensor counted as 1 (silently); a complex one was refused as 'a tensor of
    shape ()', which names no fault."""
    with pytest.raises(
        TypeError, match=rf"loss_normalizer must be .* got a tensor of dtype {value.dtype}"
    ):
        _call("torch", _batch(), loss_normalizer=value)


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor(6.0),
        torch.tensor(6),
        torch.tensor([[6.0]]),
        torch.tensor(6.0, dtype=torch.float64),
    ],
    ids=["f32", "int64", "one-element-2d", "f64"],
)
def test_a_loss_normalizer_tensor_that_is_a_count_matches_the_reference(value):
    batch = _batch()
    out = _call("torch", batch, loss_normalizer=value)
    ref = reference_policy_loss(
        batch["hidden"].double(),
        batch["weight"].double(),
        batch["labels"],
        old_log_probs=batch["old_log_probs"],
        advantages=batch["advantages"],
        loss_normalizer=6.0,
    )
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-6)


def test_a_head_that_checks_no_labels_reads_no_loss_normalizer():
    """check_labels=False (CUDA-graph capture) reads no value, the normalizer's included."""
    head = fusedhead.FusedHead({"backend": "torch", "check_labels": False})
    b = _batch()
    args = (b["hidden"], b["weight"], b["labels"])
    kw = {"old_log_probs": b["old_log_probs"], "advantages": b["advantages"]}
    out = head.policy_loss(*args, **kw, loss_normalizer=torch.tensor(-1.0))
    one = head.policy_loss(*args, **kw, loss_normalizer=1.0)
    torch.testing.assert_close(out.loss, -one.loss)  # ran, its normalizer unread


@pytest.mark.parametrize(
    "arg", ["old_log_probs", "advantages", "ref_log_probs", "rollout_log_probs"]
)
@pytest.mark.parametrize("shape", [(B,), (S,), (1,) * 3], ids=["B", "S", "rank3"])
def test_the_reference_refuses_a_per_token_tensor_of_other_rank(arg, shape):
    """Before: reference_policy_loss broadcast [B] beside [B, S] along S (B == S: no error)."""
    b = _batch()
    kw: dict[str, Any] = {
        "old_log_probs": b["old_log_probs"],
        "advantages": b["advantages"],
        "ref_log_probs": b["old_log_probs"],
        "kl_coef": 0.1,
        "rollout_log_probs": b["old_log_probs"],
        "tis_cap": 2.0,
    }
    kw[arg] = torch.zeros(shape) if shape != (1,) * 3 else torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match=rf"{arg} must have the labels' shape \({B}, {S}\)"):
        reference_policy_loss(b["hidden"], b["weight"], b["labels"], **kw)


@pytest.mark.parametrize("shape", [(B,), (S,)], ids=["B", "S"])
def test_lm_head_policy_loss_refuses_a_temperature_of_fewer_dimensions(shape):
    """Before: broadcast along S; the loss used each position's temperature of another row."""
    b = _batch()
    lin = torch.nn.Linear(H, V, bias=False)
    with pytest.raises(ValueError, match=r"temperature tensor of shape .* labels' number of dim"):
        lm_head_policy_loss(
            lin,
            b["hidden"],
            b["labels"],
            temperature=torch.tensor([0.5, 1.0, 2.0]).reshape(shape),
            old_log_probs=b["old_log_probs"],
            advantages=b["advantages"],
        )


def test_lm_head_policy_loss_per_sequence_temperature_matches_the_reference():
    b = _batch()
    lin = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        lin.weight.copy_(b["weight"])
    temp = torch.tensor([[0.5], [1.0], [2.0]])
    out = lm_head_policy_loss(
        lin,
        b["hidden"],
        b["labels"],
        temperature=temp,
        old_log_probs=b["old_log_probs"],
        advantages=b["advantages"],
    )
    ref = reference_policy_loss(
        b["hidden"].double(),
        b["weight"].double(),
        b["labels"],
        temperature=temp.double(),
        old_log_probs=b["old_log_probs"],
        advantages=b["advantages"],
    )
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-6)


# reference_policy_loss, the yardstick: an unknown aggregation was computed as seq-mean-token-sum
# and an unknown kl_estimator as k3 (no error), a per-token tensor of another shape raised torch's
# expand error, kl_coef without ref_log_probs or a half of TIS an AssertionError, a bad
# cu_seqlens gave a loss over wrong spans. Named as fused_policy_loss names them.


@pytest.mark.parametrize(
    ("kw", "error", "words"),
    [
        (
            {"aggregation": "tokenmean"},
            ValueError,
            r"aggregation must be one of .* got 'tokenmean'",
        ),
        (
            {"kl_estimator": "k4"},
            ValueError,
            r"kl_estimator must be one of .*'low_var_kl'.* got 'k4'",
        ),
        ({"kl_coef": 0.1}, ValueError, r"kl_coef=0.1 needs ref_log_probs"),
        (
            {"rollout_log_probs": torch.zeros(B, S)},
            ValueError,
            r"needs both rollout_log_probs and tis_cap",
        ),
        (
            {"tis_cap": 2.0},
            ValueError,
            r"needs both rollout_log_probs and tis_cap, got tis_cap alone",
        ),
        (
            {"advantages": torch.zeros(B, S + 1)},
            ValueError,
            r"advantages must have the labels' shape \(3, 3\) or \(3, 1\) .*, got \(3, 4\)",
        ),
        ({"advantages": [0.0] * 9}, TypeError, r"advantages must be a torch.Tensor, got list"),
    ],
    ids=[
        "aggregation",
        "kl_estimator",
        "kl-without-ref",
        "rollout-alone",
        "tis-cap-alone",
        "shape",
        "list",
    ],
)
def test_the_reference_names_a_bad_loss_argument(kw, error, words):
    b = _batch()
    args = {"old_log_probs": b["old_log_probs"], "advantages": b["advantages"], **kw}
    with pytest.raises(error, match=words):
        reference_policy_loss(b["hidden"], b["weight"], b["labels"], **args)


@pytest.mark.parametrize(
    "cu",
    [
        torch.tensor([0, 2, 8]),
        torch.tensor([1, 2, 9]),
        torch.tensor([0, 5, 2, 9]),
        torch.tensor([0.0, 9.0]),
        torch.tensor([[0, 9]]),
    ],
    ids=["short", "not-from-0", "decreasing", "float", "2-d"],
)
def test_the_reference_refuses_a_bad_cu_seqlens(cu):
    b = _batch()
    with pytest.raises(
        ValueError, match=r"cu_seqlens must be a 1-D integer tensor that starts at 0"
    ):
        reference_policy_loss(
            b["hidden"].reshape(1, -1, H),
            b["weight"],
            b["labels"].reshape(1, -1),
            old_log_probs=None,
            advantages=b["advantages"].reshape(1, -1),
            aggregation="seq-mean-token-mean",
            cu_seqlens=cu,
        )


def test_a_loss_normalizer_tensor_on_another_device_is_refused_by_name():
    """Before: NotImplementedError: Cannot copy out of meta tensor; no data!"""
    with pytest.raises(
        ValueError, match=r"loss_normalizer must be on hidden's device cpu, got meta"
    ):
        _call("torch", _batch(), loss_normalizer=torch.tensor(6.0, device="meta"))


def test_an_out_of_range_label_says_where_check_labels_false_is_passed():
    """Before: "pass check_labels=False", a TypeError in fused_policy_loss that takes none."""
    batch = _batch()
    batch["labels"][0, 1] = V
    with pytest.raises(ValueError, match=r"got 11 at flat position 1") as caught:
        _call("torch", batch)
    assert "FusedHead(check_labels=False)" in str(caught.value)
    head = fusedhead.FusedHead(backend="torch", check_labels=False)  # as the message says
    args = {k: v for k, v in batch.items() if k not in ("hidden", "weight", "labels")}
    out = head.policy_loss(batch["hidden"], batch["weight"], batch["labels"], **args)
    assert torch.isnan(out.log_probs[0, 1]) and torch.isnan(out.loss)


def _packed(b: int = 1, t: int = 12) -> dict[str, torch.Tensor]:
    batch = _batch(1, t)
    batch["advantages"] = torch.linspace(-1.0, 1.0, t)[None]
    return batch


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize("adv_shape", [(1, 1), (3, 1)], ids=["one-for-all", "per-sequence"])
def test_packed_labels_refuse_advantages_of_one_value_per_row(backend, adv_shape):
    """Before: [1, 1] spread one advantage over the three packed sequences."""
    batch = _packed()
    batch["advantages"] = torch.ones(adv_shape)
    cu = torch.tensor([0, 4, 8, 12])
    words = r"would not give one value per sequence.*repeat_interleave\(cu_seqlens.diff\(\)\)"
    with pytest.raises(
        ValueError, match=rf"advantages of shape {re.escape(str(adv_shape))}.*{words}"
    ):
        _call(backend, batch, cu_seqlens=cu, aggregation="seq-mean-token-mean")
    with pytest.raises(ValueError, match=words):
        reference_policy_loss(
            batch["hidden"],
            batch["weight"],
            batch["labels"],
            old_log_probs=None,
            advantages=batch["advantages"],
            cu_seqlens=cu,
        )


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize("adv_shape", [(B, 1), (B, S)], ids=["per-row", "per-token"])
def test_cu_seqlens_beside_padded_labels_is_named_before_the_advantages(backend, adv_shape):
    """Before: [B, 1] advantages were blamed first, with advice to repeat them per token, whose
    [1, T] result was then refused as not the labels' shape: the mistake was cu_seqlens."""
    batch = _batch()
    batch["advantages"] = torch.ones(adv_shape)
    with pytest.raises(ValueError) as info:
        _call(backend, batch, cu_seqlens=torch.tensor([0, S, 2 * S, 3 * S]))
    text = str(info.value)
    assert text.startswith("cu_seqlens describes a packed batch: labels must be [T] or [1, T]")
    assert f"got {(B, S)}" in text and "pass cu_seqlens=None" in text, text


def test_a_single_packed_sequence_takes_its_one_advantage():
    batch = _packed()
    batch["advantages"] = torch.tensor([[0.5]])
    one = _call("torch", batch, cu_seqlens=torch.tensor([0, 12]))
    batch["advantages"] = torch.full((1, 12), 0.5)
    assert torch.equal(one.loss, _call("torch", batch, cu_seqlens=torch.tensor([0, 12])).loss)


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize(
    "aggregation", ["seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_a_mean_over_sequences_of_flat_labels_is_refused(backend, aggregation):
    """Flat [N] labels mark no sequences: they were taken as one, silently (a verl remove-padding
    batch without its cu_seqlens); [1, N] is one sequence by its shape, [T] with cu_seqlens packed."""
    flat = {k: v.flatten(0, 1) for k, v in _batch().items() if k != "weight"}  # hidden [N, H]
    flat["weight"] = _batch()["weight"]
    with pytest.raises(ValueError, match=r"^aggregation=.* flat labels \[9\] without cu_seqlens"):
        _call(backend, flat, aggregation=aggregation)
    with pytest.raises(ValueError, match=r"flat labels \[9\] without cu_seqlens"):
        reference_policy_loss(
            flat["hidden"], flat["weight"], flat["labels"], old_log_probs=flat["old_log_probs"],
            advantages=flat["advantages"], aggregation=aggregation,
        )  # fmt: skip
    one = {k: (v if k == "weight" else v.unsqueeze(0)) for k, v in flat.items()}
    cu = torch.tensor([0, S, 2 * S, 3 * S])
    packed = _call(backend, flat, aggregation=aggregation, cu_seqlens=cu)
    padded = _call(backend, _batch(), aggregation=aggregation)
    assert torch.allclose(packed.loss, padded.loss, rtol=1e-6, atol=1e-7)
    assert torch.isfinite(_call(backend, one, aggregation=aggregation).loss)
    assert torch.isfinite(_call(backend, flat, aggregation="token-mean").loss)


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize(
    "arg", ["clip_high", "dual_clip", "entropy_coef", "kl_coef", "tis_cap", "loss_normalizer"]
)
@pytest.mark.parametrize("value", [1e39, -1e39, 10**400], ids=["1e39", "-1e39", "huge-int"])
def test_a_scalar_past_fp32s_range_is_refused_by_name(backend, arg, value):
    """Before: torch's overflow RuntimeError (clip_high, entropy_coef), an inf loss (kl_coef), a
    loss of 0 (loss_normalizer)."""
    batch = _batch()
    kw: dict[str, Any] = {arg: value}
    if arg == "kl_coef":
        kw["ref_log_probs"] = batch["old_log_probs"]
    if arg == "tis_cap":
        kw["rollout_log_probs"] = batch["old_log_probs"]
    with pytest.raises(ValueError, match=rf"^{arg} must be"):
        _call(backend, batch, **kw)
    with pytest.raises(ValueError, match=rf"^{arg} must be"):
        reference_policy_loss(
            batch.pop("hidden"), batch.pop("weight"), batch.pop("labels"), **batch, **kw
        )


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize(
    "kw",
    [
        {"loss_normalizer": 2.0**126},
        {"loss_normalizer": torch.tensor(2.0**126)},
        {
            "aggregation": "seq-mean-token-sum-norm",
            "loss_normalizer": 2.0**126,
            "horizon": 2.0**126,
        },
        {"aggregation": "seq-mean-token-mean", "loss_normalizer": 2.0**126},
    ],
    ids=["token-mean", "tensor", "sum-norm", "seq-mean"],
)
def test_a_huge_normalizer_scales_the_loss_but_not_the_metrics(backend, kw):
    """Before: a weight that underflowed to 0 marked its token as ignored, to the metrics too."""
    batch = _batch()
    plain = _call(backend, batch)
    scaled = _call(backend, batch, **kw)
    assert abs(scaled.loss.item()) < 1e-30
    for metric in ("clip_fraction", "approx_kl", "ratio_mean", "ratio_min", "ratio_max"):
        assert torch.equal(getattr(scaled, metric), getattr(plain, metric)), metric


def test_a_loss_normalizer_that_requires_grad_is_refused():
    with pytest.raises(ValueError, match=r"loss_normalizer requires grad.*loss_normalizer.detach"):
        _call("torch", _batch(), loss_normalizer=torch.tensor(9.0, requires_grad=True))


@pytest.mark.parametrize(
    "arg,value,words",
    [
        (
            "aggregation",
            "token-sum",
            r"verl's token-sum is aggregation='token-mean' with loss_norm",
        ),
        ("aggregation", "token_sum", r"verl's token-sum is aggregation='token-mean'"),
        ("aggregation", "grpo", r"TRL's loss_type='grpo' is aggregation='seq-mean-token-mean'"),
        ("aggregation", "bnpo", r"TRL's loss_type='bnpo' is aggregation='token-mean'"),
        ("aggregation", "dapo", r"'dapo' is aggregation='token-mean' with loss_normalizer"),
        ("aggregation", "dr_grpo", r"'dr_grpo' is aggregation='seq-mean-token-sum-norm' with hor"),
        ("kl_estimator", "full", r"kl_loss_type='full' needs whole distributions"),
        ("aggregation", "cispo", r"another loss .*from fused_head's log-probs and entropy"),
        ("aggregation", "seq-mean", r"'seq-mean-token-sum', 'seq-mean-token-mean' and 'seq-"),
    ],
)
def test_another_trainers_name_is_told_what_it_is_here(arg, value, words):
    batch = _batch()
    extra = (
        {"ref_log_probs": batch["old_log_probs"], "kl_coef": 0.1} if arg == "kl_estimator" else {}
    )
    with pytest.raises(ValueError, match=rf"^{arg}={value!r} is not one of \[.*\]: .*{words}"):
        _call("torch", batch, **{arg: value}, **extra)


@pytest.mark.parametrize(
    "keyword,words",
    [
        ("entropy_coeff", r"'entropy_coeff' \(verl's name of entropy_coef\)"),
        ("clip_ratio_high", r"'clip_ratio_high' \(verl's name of clip_high\)"),
        ("loss_agg_mode", r"'loss_agg_mode' \(verl's name of aggregation\)"),
        ("beta", r"'beta' \(TRL's name of kl_coef\)"),
        (
            "num_items_in_batch",
            r"'num_items_in_batch' \(TRL's token count of a generation batch: pass "
            r"loss_normalizer=num_items_in_batch / num_processes \* gradient_accumulation_steps "
            r"/ steps_per_generation, as TRL's dapo divides in training",
        ),
        ("delta", r"'delta' \(TRL's two-sided clip: dual_clip=delta is the same loss"),
        ("vllm_importance_sampling_clip_max", r"\(TRL's name of tis_cap\)"),
        ("vllm_importance_sampling_cap", r"\(TRL's name of tis_cap\)"),
        ("response_mask", r"'response_mask' \(verl's mask: .*labels.masked_fill\(mask == 0"),
        ("entropy_cof", r"'entropy_cof' \(did you mean 'entropy_coef'\?\)"),
    ],
)
@pytest.mark.parametrize("entry", ["fused_policy_loss", "FusedHead.policy_loss"])
def test_another_trainers_keyword_is_told_its_name_here(entry, keyword, words):
    batch = _batch()
    h, w, y = batch.pop("hidden"), batch.pop("weight"), batch.pop("labels")
    call = (
        fusedhead.fused_policy_loss
        if entry == "fused_policy_loss"
        else fusedhead.FusedHead({"backend": "torch"}).policy_loss
    )
    with pytest.raises(
        TypeError, match=rf"^{re.escape(entry)}\(\) got unexpected keyword .*{words}"
    ):
        call(h, w, y, **batch, **{keyword: 0.1})


def test_every_unknown_keyword_is_named_with_the_known_ones():
    batch = _batch()
    with pytest.raises(TypeError) as err:
        _call("torch", batch, beta=0.1, kl_coeff=0.1)
    said = str(err.value)
    assert "keyword arguments: 'beta' (TRL's name of kl_coef); 'kl_coeff' (did you mean" in said
    assert said.endswith("softcap, temperature, tis_cap")
    assert _call("torch", batch, kl_coef=0.0).loss.isfinite()  # a known keyword passes through


#: The loss's per-token inputs.
_LOSS_VALUES = ("old_log_probs", "advantages", "ref_log_probs", "rollout_log_probs")


def _with_values(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with every per-token input of the loss: a reference and rollout log-probs."""
    return {
        **batch,
        "ref_log_probs": batch["old_log_probs"] - 0.1,
        "rollout_log_probs": batch["old_log_probs"] + 0.05,
    }


def _poisoned(arg: str, value: float) -> dict[str, torch.Tensor]:
    """A batch with every per-token input of the loss, ``value`` in ``arg`` at flat position 5
    (a scored row), and flat position 0 ignored."""
    batch = _with_values(_batch())
    batch["labels"][0, 0] = -100
    batch[arg] = batch[arg].clone()
    batch[arg][1, 2] = value
    return batch


_ALL_TERMS = {"kl_coef": 0.1, "tis_cap": 2.0}


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
@pytest.mark.parametrize("arg", _LOSS_VALUES[:3])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_non_finite_per_token_value_on_a_scored_row_is_refused_by_name(backend, arg, value):
    with pytest.raises(
        ValueError,
        match=rf"^{arg} must be finite on scored rows .* got {value} \(as fp32\) at flat "
        r"position 5 \(1 such value\(s\)\)",
    ):
        _call(backend, _poisoned(arg, value), **_ALL_TERMS)


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_a_nan_rollout_log_prob_is_refused_and_an_infinite_one_is_a_weight(backend):
    """+inf is a weight of 0 (verl's IcePop masks arrive so), -inf the cap: only NaN is no
    weight."""
    tis = re.escape("the TIS weight exp(old_log_probs - rollout_log_probs)")
    with pytest.raises(ValueError, match=rf"^{tis} must be finite .* got nan .* position 5 "):
        _call(backend, _poisoned("rollout_log_probs", math.nan), **_ALL_TERMS)
    for value in (math.inf, -math.inf):
        out = _call(backend, _poisoned("rollout_log_probs", value), **_ALL_TERMS)
        assert torch.isfinite(out.loss) and torch.isfinite(out.log_probs).all()


@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_non_finite_values_on_ignored_rows_are_left_free(backend):
    batch = _with_values(_batch())
    batch["labels"][1, 2] = -100
    clean = _call(backend, batch, **_ALL_TERMS)
    for arg in _LOSS_VALUES:
        batch[arg] = batch[arg].clone()
        batch[arg][1, 2] = math.nan
    out = _call(backend, batch, **_ALL_TERMS)
    assert torch.equal(out.loss, clean.loss)


def test_an_fp64_advantage_past_fp32s_range_is_refused_not_taken_as_inf():
    """Before: 1e300 became inf in the fp32 copy and the loss was -inf."""
    batch = _batch()
    batch["advantages"] = batch["advantages"].double()
    batch["advantages"][2, 0] = 1e300
    with pytest.raises(ValueError, match=r"^advantages must be finite .* got inf .* 3\.4e38"):
        _call("torch", batch)


def test_a_per_sequence_advantage_is_named_at_its_first_scored_token():
    batch = _batch()
    adv = torch.randn(B, 1)
    adv[1] = math.nan
    batch["advantages"] = adv
    with pytest.raises(ValueError, match=rf"got nan \(as fp32\) at flat position {S} \({S} such"):
        _call("torch", batch)


def test_a_compiled_call_checks_the_loss_values_as_eager_mode_does():
    torch._dynamo.reset()

    def step(adv: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = _call("torch", _batch(), advantages=adv).loss
        return loss

    compiled = torch.compile(step, backend="eager")
    assert torch.isfinite(compiled(torch.ones(B, S)))
    bad = torch.ones(B, S)
    bad[2, 1] = math.nan
    with pytest.raises(ValueError, match=r"^advantages must be finite .* at flat position 7 "):
        compiled(bad)


def test_a_head_that_checks_no_labels_reads_no_loss_value():
    """check_labels=False (CUDA-graph capture) reads nothing: the NaN reaches the loss."""
    head = fusedhead.FusedHead({"backend": "torch", "check_labels": False})
    b = _batch()
    adv = b["advantages"].clone()
    adv[0, 0] = math.nan
    out = head.policy_loss(
        b["hidden"], b["weight"], b["labels"], old_log_probs=b["old_log_probs"], advantages=adv
    )
    assert torch.isnan(out.loss)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_on_cuda_the_loss_values_are_checked_in_the_one_read(backend: str) -> None:
    """CUDA reads the flags behind an event after the checks are queued: the same error, and the
    same loss where the non-finite value is on an ignored row."""
    batch = {k: v.cuda() for k, v in _with_values(_batch()).items()}
    batch["hidden"], batch["weight"] = batch["hidden"].bfloat16(), batch["weight"].bfloat16()
    batch["advantages"][1, 2] = math.nan
    with pytest.raises(ValueError, match=r"^advantages must be finite .* got nan .* position 5 "):
        _call(backend, batch, **_ALL_TERMS)
    clean = {**batch, "advantages": batch["advantages"].nan_to_num(0.5)}
    for b in (batch, clean):
        b["labels"] = b["labels"].clone()
        b["labels"][1, 2] = -100
    assert torch.equal(
        _call(backend, batch, **_ALL_TERMS).loss, _call(backend, clean, **_ALL_TERMS).loss
    )


@pytest.mark.parametrize(
    "kw",
    [
        {"clip_low": torch.tensor(0.2)},
        {"entropy_coef": torch.tensor(0.01)},
        {"aggregation": "seq-mean-token-sum-norm", "horizon": torch.tensor(10)},
    ],
    ids=["clip_low", "entropy_coef", "horizon"],
)
def test_a_0d_tensor_for_a_python_number_says_how_to_pass_it(kw: dict[str, object]) -> None:
    """A trainer's scalar kept as a 0-d tensor: refused (reading it is a host sync the call does
    not hide), with the way to pass it."""
    h, w, labels = torch.randn(2, 3, 8), torch.randn(20, 8), torch.randint(0, 20, (2, 3))
    name = next(k for k in kw if k != "aggregation")
    with pytest.raises(TypeError, match=rf"^{name} must be a float .*pass value\.item\(\)"):
        fusedhead.fused_policy_loss(
            h, w, labels, old_log_probs=torch.zeros(2, 3), advantages=torch.ones(2, 1), **kw
        )


@pytest.mark.parametrize(
    "transform", ["grad over hidden", "vmap over hidden", "vmap over advantages"]
)
def test_torch_func_transforms_are_refused_before_the_backend_runs(
    transform: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transform's wrapped tensors are refused by name at the call, before the backend's
    forward (it crashed inside the core's result checks, or in an op with no batching rule)."""
    from fusedhead import policy_backend

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the backend ran")

    monkeypatch.setattr(policy_backend, "backend_result", never)
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(2, 5, 8, generator=gen), torch.randn(29, 8, generator=gen) / 3
    y = torch.randint(0, 29, (2, 5), generator=gen)
    old, adv = torch.full((2, 5), -3.0), torch.randn(2, 5, generator=gen)

    def loss(hidden: torch.Tensor, advantages: torch.Tensor = adv) -> torch.Tensor:
        out = fusedhead.fused_policy_loss(hidden, w, y, old_log_probs=old, advantages=advantages)
        return out.loss

    run, name = {
        "grad over hidden": (lambda: torch.func.grad(loss)(h), "hidden"),
        "vmap over hidden": (lambda: torch.func.vmap(loss)(h.expand(3, -1, -1, -1)), "hidden"),
        "vmap over advantages": (
            lambda: torch.func.vmap(lambda a: loss(h, a))(adv.expand(3, -1, -1)),
            "advantages",
        ),
    }[transform]
    with pytest.raises(RuntimeError, match=rf"torch\.func transforms .*: {name} is a transform's"):
        run()


@pytest.mark.parametrize("value", [0.0, 1e-31, -2.0])
def test_a_refused_tis_cap_is_told_the_bound_it_misses(value):
    """1e-31 was refused as "must be a finite float > 0", a bound it meets: the floor is 1e-30."""
    batch = _batch()
    kw = {"tis_cap": value, "rollout_log_probs": batch["old_log_probs"]}
    expected = rf"^tis_cap must be a finite float >= 1e-30 .*, got {value!r}$"
    with pytest.raises(ValueError, match=expected):
        _call("torch", batch, **kw)
    with pytest.raises(ValueError, match=expected):
        reference_policy_loss(
            batch.pop("hidden"), batch.pop("weight"), batch.pop("labels"), **batch, **kw
        )
