"""A tiny causal LM and tokenizer built locally for the trainer examples (no download).

Shared by the scripts in this folder. The tokenizer is a word-level fast tokenizer handed to the
trainer as an object: saved with ``save_pretrained`` and reloaded through ``AutoTokenizer``, a
``WordLevel`` model came back encoding every prompt to empty ids (and generation crashed), so
:func:`make_tokenizer` checks that its ids round-trip before anything uses it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch

WORDS = [f"w{i}" for i in range(40)]


def fusedhead_setting(text: str) -> str:
    """``--backend``: a fusedhead backend, ``NAME`` or ``fusedhead:NAME``, as the trainer's setting
    ``fusedhead:NAME`` (a bare ``torch`` there would select the trainer's own path)."""
    name = text.removeprefix("fusedhead:")
    if not re.fullmatch(r"[a-z0-9_-]+", name):
        raise argparse.ArgumentTypeError(
            f"must name a fusedhead backend such as 'torch' or 'fusedhead:triton', got {text!r}"
        )
    return f"fusedhead:{name}"


def add_backend_flag(parser: argparse.ArgumentParser, default: str = "torch") -> None:
    """The scripts' shared ``--backend NAME``."""
    parser.add_argument(
        "--backend",
        default=fusedhead_setting(default),
        type=fusedhead_setting,
        metavar="NAME",
        help="the fusedhead backend (NAME or fusedhead:NAME; default %(default)s), written into "
        "the trainer's setting as fusedhead:NAME",
    )


SPECIAL = ["[PAD]", "[EOS]", "[UNK]"]


def make_tokenizer() -> Any:
    """A word-level fast tokenizer over ``SPECIAL + WORDS``, checked to encode and decode."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]"
    )
    ids = tokenizer("w1 w2 w3")["input_ids"]
    if ids != [vocab["w1"], vocab["w2"], vocab["w3"]]:
        raise RuntimeError(f"the tiny tokenizer encodes 'w1 w2 w3' as {ids}, not three word ids")
    return tokenizer


def tiny_config(kind: str, vocab_size: int, **extra: Any) -> Any:
    """A 2-layer Llama or Qwen2 config (hidden 32, untied head), fp32."""
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[kind]
    return cls(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        **extra,
    )


def tiny_model(kind: str = "qwen2", vocab_size: int = 256, seed: int = 0, **extra: Any) -> Any:
    """A random tiny causal LM; its LM head scaled so that logits span a few units."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, vocab_size, **extra))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.3)
    return model


def save_tiny_llama(root: Path, tokenizer: Any, seed: int = 0) -> Path:
    """A tiny Llama for ``tokenizer`` saved under ``root`` (trainers load a model by path)."""
    model = tiny_model(
        "llama",
        len(tokenizer),
        seed,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    path = root / "tiny-llama"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def scaled_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """``max |ours - theirs|`` over ``max(1, max |theirs|)``: the figure each script prints and
    checks against 1e-5 (absolute for values up to 1, relative to larger ones, as gradients are)."""
    diff = (ours.detach().double() - theirs.detach().double()).abs().max()
    return float(diff) / max(1.0, float(theirs.detach().abs().max()))
