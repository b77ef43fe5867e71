"""verl: the actor's loss from its config through ``fused_ppo_loss``, against verl's own
``compute_policy_loss_vanilla`` + ``agg_loss`` (+ ``kl_penalty``) path as its ``ppo_loss`` runs
it, on a packed batch (``cu_seqlens``), every logged metric and the loss equal to 6 decimals over
two SGD steps, for each ``loss_agg_mode``."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("verl", reason="verl is not installed (bash scripts/trainers/verl.sh)")

from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty

from fusedhead.integrations import verl as fh_verl

V, H, T = 50, 16, 0.8
#: three packed sequences: (prompt, response) lengths
SEQS = [(3, 5), (2, 7), (4, 3)]


def _batch(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    total = sum(p + r for p, r in SEQS)
    ids = torch.randint(0, V, (1, total), generator=g)
    rolled = torch.roll(ids, -1, dims=-1)
    labels = torch.full_like(rolled, -100)
    spans, start = [], 0
    for p, r in SEQS:
        # positions p-1 .. p+r-2 predict the response tokens
        labels[0, start + p - 1 : start + p + r - 1] = rolled[0, start + p - 1 : start + p + r - 1]
        spans.append((start + p - 1, r))
        start += p + r
    cu = torch.tensor([0, *torch.tensor([p + r for p, r in SEQS]).cumsum(0).tolist()])
    adv = torch.zeros(1, total)
    for (s, r), a in zip(spans, torch.randn(len(SEQS), generator=g), strict=True):
        adv[0, s : s + r] = a
    return {"ids": ids, "labels": labels, "cu": cu, "spans": spans, "adv": adv, "g": g}


def _tol(value: float) -> float:
    """6 decimals; above 1 (sequence sums of entropies reach 17), 6 digits: fp32's ulp there."""
    return 1e-6 * max(1.0, abs(value))


def _padded(x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Packed ``[1, T]`` response values as verl's padded ``[B, R]`` (0 beyond each response)."""
    out = x.new_zeros(len(spans), max(r for _, r in spans))
    for i, (s, r) in enumerate(spans):
        out[i, :r] = x[0, s : s + r]
    return out


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        with torch.no_grad():
            self.lm_head.weight.normal_(0, 0.5)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(self.emb(ids)))


def _verl_loss(
    config: Any,
    model: Tiny,
    b: dict[str, Any],
    old: torch.Tensor,
    ref: torch.Tensor,
    is_weights: torch.Tensor | None = None,
    global_batch_size: int | None = len(SEQS),
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl 0.9.1's ``ppo_loss`` on full logits: vanilla policy loss, entropy, KL loss
    (``global_batch_size=None``: one rank's own count, as ``agg_loss`` falls back to)."""
    logits = model.lm_head(model.hidden(b["ids"])) / T
    logp = torch.log_softmax(logits.float(), -1)
    lp = logp.gather(-1, b["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    spans = b["spans"]
    mask = _padded(torch.ones_like(lp), spans).bool()
    info = dict(
        dp_size=1,
        batch_num_tokens=None,
        global_batch_size=global_batch_size,
        loss_scale_factor=config.loss_scale_factor,
    )
    config.global_batch_info = info
    log_prob, entropy = _padded(lp, spans), _padded(ent, spans)
    pg, metrics = get_policy_loss_fn("vanilla")(
        old_log_prob=_padded(old, spans),
        log_prob=log_prob,
        advantages=_padded(b["adv"], spans),
        response_mask=mask,
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=None if is_weights is None else _padded(is_weights, spans),
    )
    metrics = dict(metrics)
    metrics["actor/pg_loss"] = float(pg)
    entropy_loss = agg_loss(
        loss_mat=entropy, loss_mask=mask, loss_agg_mode=config.loss_agg_mode, **info
    )
    loss = pg - config.entropy_coeff * entropy_loss
    metrics["actor/entropy_loss"] = float(entropy_loss)
    kld = kl_penalty(
        logprob=log_prob,
        ref_logprob=_padded(ref, spans),
        kl_penalty=config.kl_loss_type,
    )
    kl = agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=config.loss_agg_mode, **info)
    metrics["kl_loss"] = float(kl)
    metrics["kl_coef"] = config.kl_loss_coef
    return loss + kl * config.kl_loss_coef, metrics


def _config(mode: str) -> Any:
    return OmegaConf.create(
        dict(
            loss_agg_mode=mode,
            clip_ratio=0.2,
            clip_ratio_low=0.1,
            clip_ratio_high=0.15,
            clip_ratio_c=1.5,
            entropy_coeff=0.01,
            use_kl_loss=True,
            kl_loss_coef=0.05,
            kl_loss_type="low_var_kl",
            loss_scale_factor=None,
            policy_loss=dict(loss_mode="vanilla"),
        )
    )


#: Cases of the two-step comparison beyond the aggregations and KL types: verl's rollout
#: correction weights (truncated at 2, some zero as IcePop masks), and one rank's own sequence
#: count (no global_batch_size: fused_ppo_loss refused seq-mean-token-sum-norm there).
EXTRA = {
    "rollout IS weights": dict(is_weights=True),
    "local count": dict(global_batch_size=None),
    # verl's "no lower clip": the bound 1 - clip_ratio_low is 0 (or below), which no ratio is below
    "clip_ratio_low 1": dict(updates={"clip_ratio_low": 1.0}),
    "clip_ratio_low 1.5": dict(updates={"clip_ratio_low": 1.5}),
}


@pytest.mark.parametrize(
    ("mode", "kl_type", "extra"),
    [
        ("token-mean", "low_var_kl", "rollout IS weights"),
        ("seq-mean-token-sum-norm", "k3+", "rollout IS weights"),
        ("seq-mean-token-sum-norm", "low_var_kl", "local count"),
        ("seq-mean-token-mean", "abs", "local count"),
        ("token-mean", "low_var_kl", "clip_ratio_low 1"),
        ("seq-mean-token-sum", "k3+", "clip_ratio_low 1.5"),
    ],
)
def test_rollout_weights_and_local_counts_match_verls_loss(
    mode: str, kl_type: str, extra: str
) -> None:
    test_fused_ppo_loss_matches_verls_loss_over_two_steps(mode, kl_type, **EXTRA[extra])


@pytest.mark.parametrize(
    ("mode", "kl_type"),
    [
        ("token-mean", "low_var_kl"),
        ("seq-mean-token-mean", "low_var_kl"),
        ("seq-mean-token-sum", "low_var_kl"),
        ("seq-mean-token-sum-norm", "low_var_kl"),
        # verl's other estimators: abs, and the straight-through '+' forms (value, k2's gradient)
        ("token-mean", "abs"),
        ("token-mean", "k3+"),
        ("seq-mean-token-mean", "kl+"),
        ("token-mean", "mse+"),
        ("seq-mean-token-sum", "abs+"),
    ],
)
def test_fused_ppo_loss_matches_verls_loss_over_two_steps(
    mode: str,
    kl_type: str,
    is_weights: bool = False,
    global_batch_size: int | None = len(SEQS),
    updates: dict[str, Any] | None = None,
) -> None:
    config = _config(mode)
    config.kl_loss_type = kl_type
    for key, value in (updates or {}).items():
        config[key] = value
    theirs, ours = Tiny(), Tiny()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (theirs, ours)]
    clipped = 0.0
    for step in range(2):
        b = _batch(step)
        with torch.no_grad():  # the rollout's and the reference's log-probs: near the current ones
            logp = torch.log_softmax(theirs.lm_head(theirs.hidden(b["ids"])) / T, -1)
            lp = logp.gather(-1, b["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1)
            old = lp + 0.3 * torch.randn(lp.shape, generator=b["g"])
            ref = lp + 0.3 * torch.randn(lp.shape, generator=b["g"])
        weights = None
        if is_weights:
            weights = torch.exp(0.5 * torch.randn(lp.shape, generator=b["g"])).clamp(max=2.0)
            weights[weights < 0.6] = 0.0
        loss_v, metrics_v = _verl_loss(config, theirs, b, old, ref, weights, global_batch_size)
        horizon = max(r for _, r in SEQS)
        loss_f, metrics_f = fh_verl.fused_ppo_loss(
            config,
            ours.lm_head,
            ours.hidden(b["ids"]),
            b["labels"],
            old_log_probs=old,
            advantages=b["adv"],
            ref_log_prob=ref,
            cu_seqlens=b["cu"],
            head="torch",
            temperature=T,
            horizon=horizon,
            global_batch_size=global_batch_size,
            rollout_is_weights=weights,
        )
        assert set(metrics_v) == set(metrics_f)
        for key, value in metrics_v.items():
            assert abs(float(metrics_f[key]) - value) <= _tol(value), (
                step,
                key,
                float(metrics_f[key]),
                value,
            )
        assert abs(float(loss_f) - float(loss_v)) <= _tol(float(loss_v)), (
            step,
            float(loss_f),
            float(loss_v),
        )
        clipped += metrics_v["actor/pg_clipfrac"] + metrics_v["actor/pg_clipfrac_lower"]
        for opt, loss in zip(opts, (loss_v, loss_f), strict=True):
            opt.zero_grad()
            loss.backward()
        for (name, a), b_ in zip(theirs.named_parameters(), ours.parameters(), strict=True):
            assert b_.grad is not None and a.grad is not None
            err = float((a.grad - b_.grad).abs().max())
            assert err <= 1e-5 * max(1.0, float(a.grad.abs().max())), (step, name, err)
        for opt in opts:
            opt.step()
    assert clipped > 0, "the case must clip some tokens"


@pytest.mark.parametrize("count", [0, torch.tensor(0)], ids=["int", "tensor"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_a_global_batch_with_no_scored_token_is_a_zero_loss(mode: str, count: Any) -> None:
    """Rejection sampling can mask every response token of a mini-batch: verl's agg_loss divides
    by a global count of 0 (a NaN loss); fused_ppo_loss refused loss_normalizer=0. Now loss 0,
    zero gradients, finite metrics."""
    model, b = Tiny(), _batch(0)
    labels = torch.full_like(b["labels"], -100)
    hidden = model.hidden(b["ids"])
    zeros = torch.zeros(labels.shape)
    loss, metrics = fh_verl.fused_ppo_loss(
        _config(mode), model.lm_head, hidden, labels, old_log_probs=zeros, advantages=b["adv"],
        ref_log_prob=zeros, cu_seqlens=b["cu"], head="torch", temperature=T, horizon=7,
        dp_size=2, batch_num_tokens=count, global_batch_size=count,
    )  # fmt: skip
    loss.backward()
    assert float(loss) == 0.0
    assert model.lm_head.weight.grad is not None and not model.lm_head.weight.grad.any()
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in metrics.values())


def _with_weights(weights: torch.Tensor, b: dict[str, Any]) -> torch.Tensor:
    """fused_ppo_loss's loss on batch ``b`` with verl's rollout correction ``weights``."""
    model = Tiny()
    zeros = torch.zeros(b["labels"].shape)
    loss, _ = fh_verl.fused_ppo_loss(
        _config("token-mean"), model.lm_head, model.hidden(b["ids"]), b["labels"],
        old_log_probs=zeros, advantages=b["adv"], ref_log_prob=zeros, cu_seqlens=b["cu"],
        head="torch", temperature=T, horizon=7, rollout_is_weights=weights,
    )  # fmt: skip
    return loss


@pytest.mark.parametrize(
    ("bad", "shown"), [(float("nan"), "nan"), (-0.5, "-0.5"), (float("inf"), "inf")]
)
def test_a_rollout_weight_verl_could_not_have_made_is_refused_by_verls_name(
    bad: float, shown: str
) -> None:
    """verl's weights are exp(old - rollout) truncated, or 0 where masked: a NaN, negative or
    infinite one on a scored token is refused as ``rollout_is_weights``, where it was named as
    the fused loss's own TIS weight (NaN) or as a ``tis_cap`` the user never gave (inf)."""
    b = _batch(0)
    weights = torch.ones(b["labels"].shape)
    at = int((b["labels"][0] != -100).nonzero()[1])
    weights[0, at] = bad
    with pytest.raises(
        ValueError, match=rf"rollout_is_weights .* got {shown} at flat position {at} "
    ):
        _with_weights(weights, b)


def test_rollout_weights_on_unscored_tokens_are_not_read() -> None:
    b = _batch(0)
    weights = torch.full(b["labels"].shape, 0.5)
    clean = _with_weights(weights, b)
    weights[b["labels"] == -100] = float("nan")
    assert torch.equal(_with_weights(weights, b), clean)


def test_rollout_weights_of_another_shape_are_named() -> None:
    b = _batch(0)
    with pytest.raises(ValueError, match=r"rollout_is_weights must have the labels' shape"):
        _with_weights(torch.ones(1, 3), b)


@pytest.mark.parametrize(
    ("updates", "named"),
    [
        (dict(policy_loss=dict(loss_mode="gspo")), "loss_mode='gspo'"),
        (dict(policy_loss=dict(loss_mode="clip_cov")), "loss_mode='clip_cov'"),
        (dict(kl_loss_type="full"), "kl_loss_type='full'"),
        (dict(loss_agg_mode="seq-mean"), "loss_agg_mode='seq-mean'"),
    ],
)
def test_configs_that_do_not_map_are_refused_by_name(updates: dict[str, Any], named: str) -> None:
    config = OmegaConf.merge(_config("token-mean"), OmegaConf.create(updates))
    with pytest.raises(ValueError, match=named):
        fh_verl.policy_loss_kwargs(config)


def test_config_mapping() -> None:
    config = _config("token-sum")
    kw = fh_verl.policy_loss_kwargs(config, dp_size=4)
    assert kw == dict(
        clip_low=0.1,
        clip_high=0.15,
        dual_clip=1.5,
        entropy_coef=0.01,
        aggregation="token-mean",
        kl_coef=0.05,
        kl_estimator="k3",
        loss_normalizer=0.25,
    )
    config.loss_agg_mode = "token-mean"
    assert (
        fh_verl.policy_loss_kwargs(config, dp_size=2, batch_num_tokens=100)["loss_normalizer"] == 50
    )
    with pytest.raises(ValueError, match="batch_num_tokens"):
        fh_verl.policy_loss_kwargs(config, dp_size=2)


#: verl's options that map to a fused_policy_loss argument: (verl's option, fusedhead's name).
MAPPED = [
    ("clip_ratio_low", "clip_low"),
    ("clip_ratio_high", "clip_high"),
    ("clip_ratio_c", "dual_clip"),
    ("entropy_coeff", "entropy_coef"),
    ("kl_loss_coef", "kl_coef"),
    ("loss_scale_factor", "horizon"),
]
PROBES = [-1.0, 0.0, 0.5, 0.999, 1.0, 1.5, 3.0, float("inf"), float("nan"), 1e39, True, "0.2"]


def _with(option: str, value: Any, **more: Any) -> Any:
    updates = {option: value, **more}
    if option == "loss_scale_factor":  # read by the mode that divides by it
        updates["loss_agg_mode"] = "seq-mean-token-sum-norm"
    return OmegaConf.merge(_config("token-mean"), OmegaConf.create(updates))


@pytest.mark.parametrize(
    ("option", "value", "more", "named"),
    [
        ("clip_ratio_low", -0.1, {}, "clip_ratio_low must be a finite float >= 0"),
        ("clip_ratio_low", "0.2", {}, "clip_ratio_low must be a float"),
        ("clip_ratio", -0.1, {"clip_ratio_low": None}, "clip_ratio must be a finite float >= 0"),
        ("clip_ratio_high", -0.1, {}, "clip_ratio_high must be a finite float >= 0"),
        ("clip_ratio", -0.1, {"clip_ratio_high": None}, "clip_ratio must be a finite float >= 0"),
        ("clip_ratio_c", 0.5, {}, "clip_ratio_c must be a finite float > 1"),
        ("clip_ratio_c", 1.0, {}, "clip_ratio_c must be a finite float > 1"),
        ("entropy_coeff", float("nan"), {}, "entropy_coeff must be a finite float"),
        ("kl_loss_coef", -0.1, {}, "kl_loss_coef must be a finite float >= 0"),
        ("loss_scale_factor", 0, {}, "loss_scale_factor must be a length > 0"),
    ],
)
def test_a_value_out_of_range_is_named_by_its_verl_option(
    option: str, value: Any, more: dict[str, Any], named: str
) -> None:
    """verl's option names, never fusedhead's (clip_low, dual_clip, entropy_coef, kl_coef, ...),
    in the errors of the values verl's config maps to fused_policy_loss's arguments."""
    config = _with(option, value, **more)
    with pytest.raises((TypeError, ValueError)) as err:
        fh_verl.policy_loss_kwargs(config, horizon=8, global_batch_size=3)
    text = str(err.value)
    assert text.startswith(named), text
    assert f"got {value!r}" in text or f"got str {value!r}" in text
    for _, ours in MAPPED:
        assert re.search(rf"\b{ours}\b", text) is None, (ours, text)


def _core_accepts(argument: str, value: Any) -> bool:
    """Whether fused_policy_loss takes ``value`` for ``argument`` (the rest valid)."""
    import fusedhead

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(1, 4, H, generator=g), torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (1, 4), generator=g)
    extra: dict[str, Any] = {argument: value}
    if argument == "kl_coef":
        extra["ref_log_probs"] = torch.full((1, 4), -3.0)
    if argument == "horizon":
        extra["aggregation"] = "seq-mean-token-sum-norm"
    try:
        fusedhead.fused_policy_loss(
            hidden,
            weight,
            labels,
            old_log_probs=torch.full((1, 4), -3.0),
            advantages=torch.ones(1, 4),
            **extra,
        )
    except (TypeError, ValueError):
        return False
    return True


@pytest.mark.parametrize(("option", "argument"), MAPPED)
def test_verls_options_are_refused_exactly_where_fused_policy_loss_refuses_them(
    option: str, argument: str
) -> None:
    """The glue checks each mapped value under verl's name before the loss runs: it must refuse
    what the loss would refuse and take what it takes, no more, no less."""
    for value in PROBES:
        try:
            fh_verl.policy_loss_kwargs(_with(option, value), horizon=8, global_batch_size=3)
        except (TypeError, ValueError) as exc:
            assert str(exc).startswith(option), (option, value, str(exc))
            glue = False
        else:
            glue = True
        assert glue == _core_accepts(argument, value), (option, value, glue)


@pytest.mark.parametrize(
    ("kl_type", "suggested"),
    [
        ("lowvar_kl", "low_var_kl"),
        ("Low_Var_KL", "low_var_kl"),
        ("low_var_k1", "low_var_kl"),
        ("mes", "mse"),
    ],
)
def test_a_misspelt_kl_loss_type_gets_a_did_you_mean(kl_type: str, suggested: str) -> None:
    with pytest.raises(ValueError) as err:
        fh_verl.policy_loss_kwargs(_with("kl_loss_type", kl_type))
    text = str(err.value)
    assert text.startswith(f"kl_loss_type={kl_type!r} is not computed by fusedhead's fused loss")
    assert text.endswith(f"; did you mean {suggested!r}?"), text
    assert "full" not in text


def test_kl_loss_type_full_is_told_why_and_nothing_else() -> None:
    with pytest.raises(ValueError) as err:
        fh_verl.policy_loss_kwargs(_with("kl_loss_type", "full"))
    text = str(err.value)
    assert "'full' needs whole distributions" in text and "did you mean" not in text
    # verl 0.9.1's own kl_penalty raises NotImplementedError for 'full': no mode to send users to
    assert "NotImplementedError" in text and "vanilla" not in text


def test_a_keyword_fused_ppo_loss_does_not_take_says_where_it_goes() -> None:
    """Before: ``TypeError: policy_loss_kwargs() got an unexpected keyword argument``, naming
    an inner function; ``rollout_is_weights`` went the same way and is now a keyword."""
    model, b = Tiny(), _batch(0)
    with pytest.raises(TypeError, match=r"fused_ppo_loss\(\) .*'loss_scale_factor' \(read from"):
        fh_verl.fused_ppo_loss(
            _config("token-mean"), model.lm_head, model.hidden(b["ids"]), b["labels"],
            old_log_probs=torch.zeros(b["labels"].shape), advantages=b["adv"],
            loss_scale_factor=4,
        )  # fmt: skip
