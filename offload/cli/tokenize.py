"""`python -m offload tokenize --tokenizer DIR input.txt [more.txt ...] out.npy`: text to a token file.

The text is read in chunks of whole lines and encoded with the user's Hugging Face tokenizer (transformers'
`AutoTokenizer`, from a local directory: nothing is downloaded). Each input file is one document: its tokens,
then the tokenizer's end-of-sequence id when it has one, so windows learn where documents end. The ids go to
a raw file as they come (memory stays one chunk, whatever the text's size) and become `out.npy` (uint16 when
the vocabulary fits, else int32) by a rename at the end: a reader never sees half a file.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Iterator, List, Optional, Sequence

import numpy as np

from offload.errors import OffloadConfigError

CHUNK_BYTES = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", required=True, help="a local directory with a Hugging Face tokenizer "
                        "(tokenizer.json / tokenizer_config.json, as save_pretrained writes them)")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="input text file(s), then the output .npy")
    parser.add_argument("--no-eos", action="store_true", help="do not end each input file with the EOS id")


def run(args: argparse.Namespace) -> int:
    if len(args.paths) < 2:
        raise OffloadConfigError("tokenize needs at least one input text file and then the output .npy path")
    *inputs, out = args.paths
    tokens = tokenize_files(args.tokenizer, inputs, out, eos=not args.no_eos)
    print(f"wrote {tokens} tokens to {out}")
    return 0


def load_tokenizer(directory: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise OffloadConfigError('tokenize needs transformers: pip install transformers  (or pip install "offload[hf]")'
                                 ) from None
    if not os.path.isdir(directory):
        raise OffloadConfigError(f"--tokenizer {directory!r} is not a directory; pass the local directory of a "
                                 "Hugging Face tokenizer (the model's directory usually holds one)")
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def tokenize_files(tokenizer: Any, inputs: Sequence[str], out: str, eos: bool = True) -> int:
    """Encode every input into the token file `out`; returns the number of tokens. `tokenizer` is a loaded
    tokenizer or a directory."""
    from tqdm import tqdm

    out = os.fspath(out)
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(os.fspath(tokenizer))
    for path in inputs:
        if not os.path.isfile(path):
            raise OffloadConfigError(f"input text file {path!r} does not exist")
    if not out.endswith(".npy"):
        raise OffloadConfigError(f"output {out!r} must end in .npy (token files are numpy arrays)")
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= 65536 else np.int32
    raw = f"{out}.tmp-{os.getpid()}.raw"
    count = 0
    total = sum(os.path.getsize(p) for p in inputs)
    try:
        with open(raw, "wb") as sink, tqdm(total=total, unit="B", unit_scale=True, desc="tokenize") as bar:
            for path in inputs:
                for text, nbytes in _chunks(path):
                    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                    count += _append(sink, ids, dtype)
                    bar.update(nbytes)
                if eos and tokenizer.eos_token_id is not None:
                    count += _append(sink, [tokenizer.eos_token_id], dtype)
        if count == 0:
            raise OffloadConfigError(f"the input text {list(inputs)} holds no tokens")
        _raw_to_npy(raw, out, dtype, count)
    finally:
        if os.path.exists(raw):
            os.remove(raw)
    return count


def _append(sink: Any, ids: List[int], dtype: Any) -> int:
    array = np.asarray(ids, dtype=np.int64)
    sink.write(array.astype(dtype).tobytes())
    return int(array.size)


def _chunks(path: str) -> Iterator[tuple]:
    """(text, its size in bytes) of about CHUNK_BYTES each, cut after a newline so no word is split."""
    with open(path, "rb") as f:
        rest = b""
        while True:
            block = f.read(CHUNK_BYTES)
            if not block:
                break
            block = rest + block
            cut = block.rfind(b"\n") + 1
            if cut == 0:
                rest = block
                continue
            rest = block[cut:]
            yield block[:cut].decode("utf-8", errors="replace"), cut
        if rest:
            yield rest.decode("utf-8", errors="replace"), len(rest)


def _raw_to_npy(raw: str, out: str, dtype: Any, count: int) -> None:
    tmp = f"{out}.tmp-{os.getpid()}.npy"
    target = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(count,))
    step = 16 << 20
    with open(raw, "rb") as f:
        for start in range(0, count, step):
            n = min(step, count - start)
            target[start:start + n] = np.frombuffer(f.read(n * np.dtype(dtype).itemsize), dtype=dtype)
    target.flush()
    del target
    os.replace(tmp, out)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m offload tokenize", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
