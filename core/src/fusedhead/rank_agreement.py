"""A vocab-parallel call's ranks agree before the backend runs: one small gather, one host read.

Every rank of ``process_group`` must pass the same rows, hidden states, labels, temperature and
requests, over shards that tile the vocabulary, and each rank passes its own value checks. A rank
that differs or fails used to leave the others with wrong log-probs and no error (a label or
temperature bad on one rank only), waiting forever (one rank differentiating, or raising before
the backend's collectives), or aborted (row counts that differ in the backend's collective).
Each rank now gathers a fixed-size signature of its call (shapes, flags, integer checksums of
hidden, labels, temperature and gather ids, its backend's name, its shard, whether its value
checks and its own arguments passed), and every rank raises before any collective of the
backend: the rank at fault its own error, the others one naming that rank and what differs.

Checked eager calls only (``check_labels=True``, the default): ``check_labels=False`` and a
traced call read nothing, as their value checks do (docs/vocab-parallel.md).
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, NoReturn

import torch

from fusedhead.protocol import HeadCall
from fusedhead.shards import SHARD_FLOATS, check_shards, shard_slots
from fusedhead.value_checks import Pending

_I64 = torch.int64
#: The signature's fields, in order (after them, the rank's ``shard_slots``), and how an error
#: names each when ranks differ.
FIELDS = (
    ("refused", "refused its arguments"),
    ("checks", "failed its value checks"),
    ("rows", "rows (tokens)"),
    ("hidden_size", "hidden size H"),
    ("dtype", "dtype"),
    ("grad", "whether the call differentiates (hidden.requires_grad under grad mode)"),
    ("reduce", "reduce_hidden_grad"),
    ("outputs", "requested outputs (return_entropy, top_k, gather_ids, return_*)"),
    ("top_k", "top_k"),
    ("temperature", "temperature"),
    ("softcap", "softcap"),
    ("ignore_index", "ignore_index"),
    ("labels", "labels"),
    ("hidden", "hidden states"),
    ("gather_ids", "gather_ids"),
    ("backend", "backends (the same one must run on every rank)"),
)
_WIDTH = len(FIELDS) + SHARD_FLOATS
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
#: splitmix64's constants (as signed int64): a position's weight in the checksums.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _float_bits(x: float | None) -> int:
    return -1 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit patterns as integers of its width (contiguous)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: _I64}[t.element_size()])


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x >> k`` as unsigned 64-bit (torch's int64 shift is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _place(n: int, device: torch.device, start: int = 0) -> torch.Tensor:
    """Odd int64 weights of positions ``[start, start + n)``: splitmix64 of the position, so no
    small change of values cancels in a weighted sum. Weights affine in the position did: any
    change whose differences sum to 0 at their mean position (labels 5, 3, 7 rotated to 3, 7, 5;
    +1, -2, +1 in three bit patterns) left the checksum as it was."""
    x = (torch.arange(start, start + n, device=device, dtype=_I64) + 1) * _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return (x ^ _shr(x, 31)) | 1


def _rows_sum(values: torch.Tensor, scored: torch.Tensor, sign_zero: bool = False) -> torch.Tensor:
    """Position-weighted int64 sum (wrapping) of a ``[N, K]`` integer tensor over its scored
    rows: differs where one value, its column or its row does (a swap included). ``sign_zero``:
    the values are float bit patterns, and -0.0 counts as +0.0 (equal values, equal results)."""
    n, k = values.shape
    cols = _place(k, values.device)
    # 16-bit patterns times weights below 2**15 fit int32: half the temporaries' bytes.
    small = values.dtype == torch.int16
    if small:
        cols = cols % (1 << 15)
    step = max(1, (1 << 23) // max(k, 1))  # rows at once: temporaries of at most 2**23 values
    total = torch.zeros((), dtype=_I64, device=values.device)
    zero_bits = torch.iinfo(values.dtype).min  # -0.0's pattern, counted as +0.0's (0)
    for start in range(0, n, step):
        part = values[start : start + step]
        if sign_zero:
            part = torch.where(part == zero_bits, 0, part)
        wide = part.to(torch.int32 if small else _I64) * cols.to(torch.int32 if small else _I64)
        per_row = wide.sum(dim=1, dtype=_I64) * _place(part.shape[0], values.device, start)
        total += torch.where(scored[start : start + step], per_row, 0).sum()
    return total


def _ids_sum(ids: torch.Tensor) -> torch.Tensor:
    """Position-weighted sum of int64 ids (wrapping): differs where one id or its place does."""
    flat = ids.reshape(-1).to(_I64)
    return ((flat + 1) * _place(flat.numel(), flat.device)).sum()


def signature(
    call: HeadCall, dtype: torch.dtype, needs_grad: bool, pending: Pending | None, backend: str
) -> torch.Tensor:
    """This rank's int64 ``[_WIDTH]`` signature on the call's device."""
    dev = call.hidden.device
    zero = torch.zeros((), dtype=_I64, device=dev)
    temp = call.temperature
    outputs = ",".join(sorted(call.outputs))
    host = [
        0,
        0,
        call.hidden.shape[0],
        call.hidden.shape[1],
        _DTYPES.get(dtype, 0),
        int(needs_grad and call.hidden.requires_grad),
        # only a differentiated call reduces the hidden gradient: otherwise it may differ
        int(call.reduce_hidden_grad and needs_grad and call.hidden.requires_grad),
        zlib.crc32(outputs.encode()),
        call.top_k,
        _float_bits(temp) if isinstance(temp, float) else 0,
        _float_bits(call.softcap),
        call.ignore_index,
    ]
    failed = pending.any_failed() if pending is not None else None
    scored = call.labels != call.ignore_index  # an ignored row reaches nothing: not summed
    ids = call.gather_ids
    device_fields = [
        zero if failed is None else failed,
        _rows_sum(_bits(temp).unsqueeze(1), scored) if isinstance(temp, torch.Tensor) else zero,
        _ids_sum(call.labels),
        _rows_sum(_bits(call.hidden), scored, sign_zero=True),
        zero
        if ids is None
        else _rows_sum(ids.reshape(len(scored), ids.shape[-1]).to(_I64), scored),
    ]
    sums = torch.stack([f.to(_I64) for f in device_fields])
    out = torch.tensor(host, dtype=_I64, device=dev)
    out[1] = sums[0]
    out[9] = out[9] + sums[1]
    slots = shard_slots(call.vocab_start, call.weight.shape[0], call.vocab_size)
    tail = torch.tensor([int(s) for s in slots], dtype=_I64, device=dev)
    name = torch.tensor([zlib.crc32(backend.encode())], dtype=_I64, device=dev)
    return torch.cat([out, sums[2:], name, tail])


def refused_signature(device: torch.device) -> torch.Tensor:
    """The signature of a rank whose arguments were refused: ``refused`` set, the rest 0."""
    out = torch.zeros(_WIDTH, dtype=_I64, device=device)
    out[0] = 1
    return out


def agree(
    call: HeadCall, dtype: torch.dtype, needs_grad: bool, pending: Pending | None, backend: str
) -> None:
    """Gather every rank's signature and raise, on every rank, where they do not agree
    (``backend``: the name of the one that runs the call)."""
    import torch.distributed as dist

    group = call.process_group
    rows = gather(group, signature(call, dtype, needs_grad, pending, backend))
    check(rows, dist.get_rank(group), group, call, pending)


def refused(group: Any, hidden: object) -> None:
    """This rank's arguments were refused: tell the other ranks (which then raise too) before
    this rank raises its own error. Nothing where ``group`` is no usable process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if not isinstance(group, dist.ProcessGroup):
        return
    dev = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
    gather(group, refused_signature(dev))


def gather(group: Any, mine: torch.Tensor) -> list[list[int]]:
    """Every rank's signature (``all_gather`` over ``group``), in one host read."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    return torch.stack(rows).tolist()  # type: ignore[no-any-return]


def check(
    rows: list[list[int]], rank: int, group: Any, call: HeadCall, pending: Pending | None
) -> None:
    """Raise on every rank if any rank refused its call, the shards do not tile the vocabulary,
    the ranks' calls differ, or a rank failed its value checks (that rank: its own error)."""
    refused = [r for r, row in enumerate(rows) if row[0]]
    if refused:
        _other_ranks(refused, "refused its arguments (its own error says why)")
    layout = torch.tensor([row[len(FIELDS) :] for row in rows], dtype=torch.float32)
    start, width, size = call.vocab_start, call.weight.shape[0], call.vocab_size
    check_shards(layout, rank, group, start, width, size)
    # A failed value check first: a value bad on one rank also makes the calls differ, and that
    # rank's own error names the value and its position where "different labels" would not.
    failed = [r for r, row in enumerate(rows) if row[1]]
    if rank in failed and pending is not None:
        pending.send()
        pending.settle()  # this rank's own error
    if failed:
        _other_ranks(failed, "failed its value checks (its own error names the value)")
    for i, (name, words) in enumerate(FIELDS[2:], start=2):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            _differ(name, words, values, rank)


_SHOWN = ("rows", "hidden_size", "grad", "reduce", "top_k", "ignore_index")


def _differ(name: str, words: str, values: list[int], rank: int) -> NoReturn:
    groups: dict[int, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    if name in _SHOWN:
        said = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
    else:
        said = "; ".join(f"ranks {rs} agree" for rs in groups.values() if len(rs) > 1) or (
            "no two ranks agree"
        )
        said = f"not the same on every rank ({said}; this rank is {rank})"
    raise ValueError(
        f"the ranks of process_group passed different {words}: {said}. A vocab-parallel call "
        "needs the same hidden, labels, temperature, softcap, ignore_index and requested outputs "
        "on every rank, and hidden.requires_grad alike (docs/vocab-parallel.md); no rank ran "
        "the head"
    )


def _other_ranks(ranks: list[int], what: str) -> NoReturn:
    which = ", ".join(str(r) for r in ranks)
    raise ValueError(
        f"rank {which} of process_group {what}; no rank ran the head (a vocab-parallel call "
        "runs on every rank or on none)"
    )
