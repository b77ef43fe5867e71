"""Padding removal and restoration by flat indices, as flash-attn's ``bert_padding`` does it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

__all__ = ["index_first_axis", "pad_input", "rearrange", "unpad_input"]


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x[indices]`` along the first axis (differentiable)."""
    return x.index_select(0, indices)


def unpad_input(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    unused_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """``[B, S, ...]`` -> ``[nnz, ...]`` of the positions where ``attention_mask`` is set."""
    mask = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = rearrange(hidden_states, "b s ... -> (b s) ...")
    return index_first_axis(flat, indices), indices, cu_seqlens, int(seqlens.max()), used


def pad_input(
    hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int
) -> torch.Tensor:
    """``[nnz, ...]`` -> ``[B, S, ...]`` with zeros where nothing was kept (differentiable)."""
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    out = out.index_put((indices,), hidden_states)
    return rearrange(out, "(b s) ... -> b s ...", b=batch)
