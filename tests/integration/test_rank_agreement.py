"""Vocab-parallel ranks agree before the backend runs, on 2 gloo CPU processes.

Found by a probe of the vocab-parallel path: a call that differed on one rank, or failed a
value check there, gave the other ranks wrong log-probs with no error (a label or a per-token
temperature bad on one rank), left them waiting in the backend's collectives (one rank
differentiating, or refusing its arguments), or aborted the process (row counts that differ in
the backend's collective); hidden sizes that differ were mixed silently. Every rank now raises.
"""

from __future__ import annotations

import pytest
import rank_agreement_worker as aw
import torch
from gloo_ranks import spawn_ranks

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module", params=["torch", "triton"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp(f"agree-{request.param}")
    return spawn_ranks("rank_agreement_worker", aw.WORLD, out, request.param)


DIFFER = [
    ("labels_differ", "different labels: not the same on every rank"),
    ("rows_differ", "different rows (tokens): rank 0: 6, rank 1: 4"),
    ("hidden_differs", "different hidden states"),
    ("temperature_differs", "different temperature"),
    ("token_temperature_differs", "different temperature"),
    ("entropy_on_one_rank", "different requested outputs"),
    ("grad_on_one_rank", "different whether the call differentiates"),
    ("rows_swapped", "different hidden states"),
    ("elements_swapped", "different hidden states"),
    ("token_temperature_permuted", "different temperature"),
]


@pytest.mark.parametrize("case,words", DIFFER, ids=[c for c, _ in DIFFER])
def test_a_call_that_differs_on_one_rank_is_refused_on_every_rank(ranks, case, words):
    said = [rank[case] for rank in ranks]
    for r, (kind, msg) in enumerate(said):
        assert kind == "ValueError", (r, kind, msg)
        assert words in msg and "no rank ran the head" in msg, (r, msg)


def test_a_rank_that_refuses_its_arguments_takes_every_rank_with_it(ranks):
    (kind0, msg0), (kind1, msg1) = ranks[0]["refused_on_one_rank"], ranks[1]["refused_on_one_rank"]
    assert kind1 == "TypeError" and "hidden must be float32, float16 or bfloat16" in msg1
    assert kind0 == "ValueError" and "rank 1 of process_group refused its arguments" in msg0


REFUSED_EARLY = [
    ("temperature_none_on_one_rank", "TypeError", "temperature must be a float or a tensor"),
    ("check_labels_not_bool_on_one_rank", "TypeError", "check_labels must be a bool"),
    ("unknown_backend_on_one_rank", "UnknownBackendError", "no-such-backend"),
    ("unknown_option_on_one_rank", "OptionsError", "no_such_option"),
]


@pytest.mark.parametrize("case,kind,words", REFUSED_EARLY, ids=[c for c, _, _ in REFUSED_EARLY])
def test_a_rank_refused_before_its_head_runs_takes_every_rank_with_it(ranks, case, kind, words):
    """Before: refused by the entry point or the backend's resolution, ahead of the agreement's
    gather, so rank 0 waited in it until the process group's timeout."""
    (kind0, msg0), (kind1, msg1) = ranks[0][case], ranks[1][case]
    assert kind1 == kind and words in msg1, (kind1, msg1)
    assert kind0 == "ValueError" and "rank 1 of process_group refused its arguments" in msg0


def test_another_backend_on_one_rank_is_refused_on_every_rank(ranks):
    """Before: it passed the agreement, and the backends' collectives of other sizes aborted
    the process (gloo: "Received data size doesn't match expected size")."""
    for r, (kind, msg) in enumerate(rank["other_backend_on_one_rank"] for rank in ranks):
        assert kind == "ValueError" and "different backends" in msg, (r, kind, msg)


def test_an_empty_batch_with_gather_ids_runs_on_every_rank(ranks):
    """Before: the agreement's signature reshaped 0 ids to [0, -1] and raised a RuntimeError."""
    said = [rank["empty_batch_with_gather_ids"] for rank in ranks]
    assert [kind for kind, _ in said] == ["ok", "ok"], said
    assert all(lp.shape == (0,) for _, lp in said)


@pytest.mark.parametrize("case", ["negative_zero_on_one_rank", "reduce_differs_without_a_gradient"])
def test_calls_that_compute_the_same_are_not_refused(ranks, case):
    """Before: -0.0 beside +0.0 in hidden ("different hidden states"), and reduce_hidden_grad
    differing where no rank differentiates, were refused on every rank."""
    (kind0, lp0), (kind1, lp1) = (rank[case] for rank in ranks)
    assert kind0 == kind1 == "ok", (lp0, lp1)
    assert torch.equal(lp0, lp1)


@pytest.mark.parametrize(
    ("case", "own"),
    [
        ("label_out_of_range_on_one_rank", f"labels must be in [0, {aw.V}) or ignore_index"),
        ("bad_token_temperature_on_one_rank", "got -1.0 (as fp32) at flat position 1"),
    ],
)
def test_a_check_failed_on_one_rank_is_that_ranks_own_error_and_named_on_the_others(
    ranks, case, own
):
    """Before: every rank said "different labels" (the bad value also made the calls differ), and
    the rank at fault never learnt which value or where."""
    (kind0, msg0), (kind1, msg1) = (rank[case] for rank in ranks)
    assert kind0 == kind1 == "ValueError", (msg0, msg1)
    assert "rank 1 of process_group failed its value checks" in msg0, msg0
    assert own in msg1 and "failed its value checks" not in msg1, msg1


def test_a_check_failed_on_every_rank_is_each_ranks_own_error(ranks):
    for kind, msg in (rank["label_out_of_range_on_every_rank"] for rank in ranks):
        assert kind == "ValueError" and f"labels must be in [0, {aw.V})" in msg, msg


def test_ranks_that_agree_give_the_one_process_log_probs(ranks):
    for rank in ranks:
        kind, lp = rank["agree"]
        assert kind == "ok"
        torch.testing.assert_close(lp, rank["one_process"], rtol=0, atol=4e-6)


@pytest.mark.parametrize("case", aw.CASES)
def test_the_ranks_are_still_in_step_after_each_case(ranks, case):
    for rank in ranks:
        torch.testing.assert_close(rank[f"{case}/then"], rank["one_process"], rtol=0, atol=4e-6)


@pytest.mark.parametrize(
    "case,row",
    [("ignored_row_differs", 3), ("token_temperature_differs_at_an_ignored_row", 1)],
)
def test_ignored_rows_may_differ_between_ranks(ranks, case, row):
    (kind0, lp0), (kind1, lp1) = (rank[case] for rank in ranks)
    assert kind0 == kind1 == "ok"
    assert torch.equal(lp0, lp1) and lp0[row] == 0


def test_a_modules_refused_bias_takes_every_rank_with_it(ranks):
    (kind0, msg0), (kind1, msg1) = (rank["module_bias_refused_on_one_rank"] for rank in ranks)
    assert kind1 == "ValueError" and "bias must have shape" in msg1, msg1
    assert kind0 == "ValueError" and "rank 1 of process_group refused its arguments" in msg0
