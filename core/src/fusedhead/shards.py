"""Vocab-parallel shard bounds for backend authors: a rank's shard carried in a collective the
backend makes anyway, checked on every rank against ``vocab_size``, and the grid layout a
``degree_invariant`` backend gives its one-process bits on.

Public for backends (``fusedhead.validation`` re-exports these names for one release).
"""

from __future__ import annotations

from typing import Any

import torch

from fusedhead.errors import type_name

#: Each shard bound (vocab_start, width, vocab_size: int64) travels as ``_SHARD_CHUNKS`` chunks of
#: ``_SHARD_BITS`` bits, each exact in fp32 and summed only with zeros, so the bits come back whole.
_SHARD_BITS = 21
_SHARD_CHUNKS = 3
#: Floats a rank's shard takes in a collective (see ``shard_slots``).
SHARD_FLOATS = 3 * _SHARD_CHUNKS
#: Shard layouts verified on CUDA, by (group, vocab_start, width, vocab_size) (see
#: ``check_shards``). The group itself, held: by ``id`` a destroyed group's successor at the same
#: address would have passed as verified.
_VERIFIED_SHARDS: set[tuple[Any, int, int, int]] = set()


#: The bounds the slots carry exactly: non-negative ints below 2**63 (what int64 holds).
_SHARD_LIMIT = 1 << (_SHARD_BITS * _SHARD_CHUNKS)


def _bound(arg: str, value: object) -> int:
    """A shard bound as an int in ``[0, 2**63)``: a negative or larger one would come back from
    the slots as another number (-1 as 2**63 - 1), a float or bool is no bound."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg} must be an int, got {type_name(value)} {value!r}")
    if not 0 <= value < _SHARD_LIMIT:
        raise ValueError(f"{arg} must be an int in [0, 2**63), got {value}")
    return value


def shard_slots(start: int, width: int, size: int) -> list[float]:
    """This rank's shard ``[start, start + width)`` of ``size`` as ``SHARD_FLOATS`` floats, for a
    backend to carry in a collective it makes anyway (gathered, or summed in a one-hot slot)."""
    for arg, value in (("start", start), ("width", width), ("size", size)):
        _bound(arg, value)
    mask = (1 << _SHARD_BITS) - 1
    return [
        float((value >> (_SHARD_BITS * i)) & mask)
        for value in (start, width, size)
        for i in range(_SHARD_CHUNKS)
    ]


def _shard_ints(row: list[float]) -> tuple[int, int, int]:
    out = []
    for j in range(3):
        chunks = row[j * _SHARD_CHUNKS : (j + 1) * _SHARD_CHUNKS]
        out.append(sum(int(c) << (_SHARD_BITS * i) for i, c in enumerate(chunks)))
    return out[0], out[1], out[2]


def gathered_shards(layout: torch.Tensor) -> list[tuple[int, int, int]]:
    """Each rank's ``(vocab_start, width, vocab_size)`` from a gathered ``layout`` (one host read)."""
    if not isinstance(layout, torch.Tensor):
        raise TypeError(
            f"layout must be a torch.Tensor [world, {SHARD_FLOATS}], got {type(layout).__name__}"
        )
    if layout.numel() == 0 or layout.numel() % SHARD_FLOATS:
        raise ValueError(
            f"layout must hold {SHARD_FLOATS} floats per rank (shard_slots' row of each rank), got "
            f"shape {tuple(layout.shape)}"
        )
    return [_shard_ints(r) for r in layout.reshape(-1, SHARD_FLOATS).tolist()]


def shards_need_check(group: Any, start: int, width: int, size: int, device: torch.device) -> bool:
    """Whether ``check_shards`` should read this call's gathered layout: always on the CPU (the
    values are in host memory already); on CUDA, where reading them waits for the collective, the
    first time this rank sees (group, vocab_start, width, vocab_size)."""
    device = torch.device(device)  # a str names one too
    return device.type != "cuda" or (group, start, width, size) not in _VERIFIED_SHARDS


def check_shards(
    layout: torch.Tensor, rank: int, group: Any, start: int, width: int, size: int
) -> None:
    """Every rank's shard (``layout [world, SHARD_FLOATS]``, each row ``shard_slots``' of that
    rank) against ``vocab_size``: all ranks give one vocab_size, and their shards, none
    overlapping another, cover ``[0, vocab_size)``. Each rank reads the same layout, so on a bad
    one every rank raises the same ``ValueError`` (naming its own shard too)."""
    shards = gathered_shards(layout)  # the one host read
    shown = ", ".join(f"rank {r}: [{a}, {a + w}) of {s}" for r, (a, w, s) in enumerate(shards))
    mine = f"this rank ({rank}) passed vocab_start={start}, {width} local rows, vocab_size={size}"
    sizes = {s for _, _, s in shards}
    if len(sizes) != 1:
        raise ValueError(
            f"vocab_size must be the same on every rank of process_group, got {sorted(sizes)} "
            f"({shown}); {mine}"
        )
    covered = 0
    gaps: list[str] = []
    for a, w, _ in sorted((a, w, s) for a, w, s in shards if w):
        if a < covered:
            raise ValueError(
                f"the vocabulary shards of process_group overlap at id {a} ({shown}): each id "
                f"must lie in exactly one rank's shard; {mine}"
            )
        if a > covered:
            gaps.append(f"[{covered}, {a})")
        covered = a + w
    if covered < size:
        gaps.append(f"[{covered}, {size})")
    if gaps:
        raise ValueError(
            f"vocab_size={size} is larger than the union of the shards of process_group, which "
            f"leaves the ids {', '.join(gaps)} in no shard ({shown}): pass the vocab_size the "
            f"shards cover, or shards that cover vocab_size; {mine}"
        )
    if layout.device.type == "cuda":
        _VERIFIED_SHARDS.add((group, start, width, size))


_SHARD_TENSORS: dict[tuple[Any, ...], torch.Tensor] = {}


def shard_slots_tensor(
    start: int, width: int, size: int, device: torch.device, world: int = 1, rank: int = 0
) -> torch.Tensor:
    """fp32 ``[world, SHARD_FLOATS]``: zeros but for row ``rank``, this rank's ``shard_slots``
    (``world=1``: the row alone, to gather). Made once per shard and device, never written to
    (a backend copies it into the buffer of its collective)."""
    key = (start, width, size, device, world, rank)
    t = _SHARD_TENSORS.get(key)
    if t is None:  # checked once per key: a bad one is never cached
        for arg, value, least in (("world", world, 1), ("rank", rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{arg} must be an int >= {least}, got {value!r}")
        if rank >= world:
            raise ValueError(f"rank must be in [0, world={world}), got {rank}")
    if t is None:
        t = torch.zeros((world, SHARD_FLOATS), dtype=torch.float32)
        t[rank] = torch.tensor(shard_slots(start, width, size), dtype=torch.float32)
        t = _SHARD_TENSORS[key] = t.to(device)
    return t


def grid_shards(vocab_size: int, world: int, grid: int) -> list[tuple[int, int]]:
    """``(vocab_start, rows)`` of each of ``world`` ranks: whole tiles of ``grid`` columns, as
    even as they go (the first ranks one tile more), the last shard ending at ``vocab_size``.

    Every shard starts on a multiple of ``grid``: a backend declaring ``degree_invariant`` with
    that ``vocab_grid`` gives the one-process bits on this layout (docs/vocab-parallel.md). Equal
    shards are this layout exactly when ``vocab_size / world`` is a multiple of ``grid``. Fewer
    tiles than ranks is a ``ValueError``: a rank would hold an empty shard, which ``fused_head``
    refuses (that rank by name, the others naming it).
    """
    for name, value, least in (
        ("vocab_size", vocab_size, 0),
        ("world", world, 1),
        ("grid", grid, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    tiles = -(-vocab_size // grid)
    if tiles < world:
        raise ValueError(
            f"vocab_size={vocab_size} is {tiles} tile(s) of grid={grid} columns for world={world} "
            f"ranks: every rank needs a tile (an empty shard is refused); use at most {tiles} "
            f"rank(s), or a grid of at most {max(vocab_size // world, 1)} columns"
        )
    base, extra = divmod(tiles, world)
    out: list[tuple[int, int]] = []
    start = 0
    for rank in range(world):
        stop = min(vocab_size, start + (base + (rank < extra)) * grid)
        out.append((start, stop - start))
        start = stop
    return out
