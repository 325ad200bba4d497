"""`ballast data tokenize TEXT --out DIR`: a text file as the flat token files a job trains on (nanoGPT's layout,
docs/data.md), on the user's machine: bytes as tokens (a vocabulary of 256, no download), or a local Hugging Face
tokenizer directory's tokenizer.json. The last `--validation-fraction` of the tokens is held out for evaluation."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from rich.console import Console

console = Console()
err = Console(stderr=True)
BYTE_VOCAB = 256


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    t = sub.add_parser("tokenize", help="write a text file's tokens as train.bin and val.bin")
    t.add_argument("text", type=Path, help="a UTF-8 text file")
    t.add_argument("--out", type=Path, required=True, help="directory for train.bin and val.bin (under a data root)")
    t.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                   help="a local Hugging Face tokenizer directory (its tokenizer.json); default: bytes as tokens")
    t.add_argument("--validation-fraction", type=float, default=0.1,
                   help="the share of tokens held out for evaluation, from the end (default 0.1)")


def tokens_of(text: str, tokenizer: Path | None) -> tuple[np.ndarray, int]:
    """The text's token ids and the vocabulary they come from."""
    if tokenizer is None:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64), BYTE_VOCAB
    from tokenizers import Tokenizer  # a dependency of transformers: nothing is downloaded

    loaded = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    return np.asarray(loaded.encode(text).ids, dtype=np.int64), loaded.get_vocab_size()


def tokenize(text: Path, out: Path, tokenizer: Path | None, validation_fraction: float) -> dict[str, object]:
    if not 0 <= validation_fraction < 1:
        raise ValueError("--validation-fraction must be in [0, 1)")
    ids, vocab = tokens_of(text.read_text(encoding="utf-8"), tokenizer)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    held = int(len(ids) * validation_fraction)
    out.mkdir(parents=True, exist_ok=True)
    ids[:len(ids) - held].astype(dtype).tofile(out / "train.bin")
    if held:
        ids[len(ids) - held:].astype(dtype).tofile(out / "val.bin")
    return {"train": out / "train.bin", "validation": out / "val.bin" if held else None, "tokens": len(ids),
            "held_out": held, "vocab": vocab, "dtype": np.dtype(dtype).name}


def run(args: argparse.Namespace) -> int:
    try:
        done = tokenize(args.text, args.out, args.tokenizer, args.validation_fraction)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        err.print(f"[red]error[/red] {exc}")
        return 2
    console.print(f"{done['tokens']} tokens (vocabulary {done['vocab']}, {done['dtype']}): "
                  f"{done['tokens'] - done['held_out']} in {done['train']}, {done['held_out']} held out"
                  + (f" in {done['validation']}" if done["validation"] else ""))
    flags = f"--tokens {done['train']}" + (f" --validation-tokens {done['validation']}" if done["validation"] else "")
    if done["dtype"] != "uint16":
        flags += f" --token-dtype {done['dtype']}"
    console.print(f"train on them: ballast submit MODEL.yaml {flags} (the model's vocab_size at least {done['vocab']})")
    return 0
