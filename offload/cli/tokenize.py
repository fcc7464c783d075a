"""`python -m offload tokenize --tokenizer DIR input.txt [more.txt ...] out.npy`: text to a token file.

Each input file is one document: its text (the file's bytes as UTF-8, invalid bytes replaced, newlines kept)
encoded with the user's Hugging Face tokenizer (transformers' `AutoTokenizer`, from a local directory:
nothing is downloaded), then the tokenizer's end-of-sequence id when it has one, so windows learn where
documents end. The ids are exactly `tokenizer(whole_text, add_special_tokens=False)["input_ids"]`, though
the text is read and encoded a chunk at a time (memory stays a few chunks, whatever the file's size): see
`encode_file`. The ids go to a raw file as they come and become `out.npy` (uint16 when the vocabulary
fits, else int32) by a rename at the end: a reader never sees half a file.
"""

from __future__ import annotations

import argparse
import codecs
import functools
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from offload.errors import OffloadConfigError

CHUNK_CHARS = 1 << 20  # characters per encode
OVERLAP_CHARS = 1 << 12  # first lookahead past a chunk; doubled while consecutive encodes disagree
READ_BYTES = 1 << 16


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
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:  # transformers' messages never name the directory
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OffloadConfigError(
            f"--tokenizer {directory!r} holds no tokenizer transformers can load ({reason}); pass the directory "
            "where tokenizer.save_pretrained(DIR) wrote tokenizer.json / tokenizer_config.json (a model's "
            "directory holds one only if its tokenizer was saved there too)") from None


def tokenize_files(tokenizer: Any, inputs: Sequence[str], out: str, eos: bool = True,
                   chunk: Optional[int] = None) -> int:
    """Encode every input into the token file `out`; returns the number of tokens. `tokenizer` is a loaded
    tokenizer or a directory; `chunk`: characters per encode (default CHUNK_CHARS; see `encode_file`)."""
    from tqdm import tqdm

    out = os.fspath(out)
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(os.fspath(tokenizer))
    for path in inputs:
        if os.path.isdir(path):
            raise OffloadConfigError(f"input {path!r} is a directory; give the text files themselves "
                                     f"(e.g. {os.path.join(path, '*.txt')}), each becomes one document")
        if not os.path.isfile(path):
            raise OffloadConfigError(f"input text file {path!r} does not exist")
    if not out.endswith(".npy"):
        raise OffloadConfigError(f"output {out!r} must end in .npy (token files are numpy arrays)")
    if not getattr(tokenizer, "is_fast", False):
        print(f"tokenize: {type(tokenizer).__name__} is a slow tokenizer (no offset mapping), so each file is "
              "encoded whole in memory; save a fast one (tokenizer.json) to stream", file=sys.stderr)
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= 65536 else np.int32
    raw = f"{out}.tmp-{os.getpid()}.raw"
    count = 0
    total = sum(os.path.getsize(p) for p in inputs)
    try:
        with open(raw, "wb") as sink, tqdm(total=total, unit="B", unit_scale=True, desc="tokenize") as bar:
            for path in inputs:
                for ids in encode_file(tokenizer, path, CHUNK_CHARS if chunk is None else chunk,
                                       progress=bar.update):
                    count += _append(sink, ids, dtype)
                if eos and tokenizer.eos_token_id is not None:
                    count += _append(sink, [tokenizer.eos_token_id], dtype)
        if count == 0:
            raise OffloadConfigError(f"the input text {list(inputs)} holds no tokens")
        _raw_to_npy(raw, out, dtype, count)
    finally:
        if os.path.exists(raw):
            os.remove(raw)
    return count


def _append(sink: Any, ids: Sequence[int], dtype: Any) -> int:
    array = np.asarray(ids, dtype=np.int64)
    sink.write(array.astype(dtype).tobytes())
    return int(array.size)


# [Note: streaming a tokenizer]
# An encode's first and last tokens can differ from the whole text's: a cut splits a word (or an added
# token such as a literal "<eos>"), and the start of an encode is special to many tokenizers (Metaspace
# prepends its word-start marker, ByteLevel's add_prefix_space a space, Llama 2's normalizer a marker).
# Away from both ends, a tokenizer's output depends only on the text nearby: for one that cuts text into
# words (pre-tokens) and encodes each alone, on the word; for one that encodes the text as one piece
# (Llama 2's BPE), on the few tokens around. So `encode_file` encodes overlapping windows and joins
# consecutive ones where they agree:
#   - `cur` encodes the text [cur.start, cur.end); its tokens from index `trust` on are the whole text's
#     (in the file's first window: all of them);
#   - `nxt` starts at a word boundary of `cur` in the lookahead [cur.end - width, limit), limit =
#     cur.end - width / 2, and runs `chunk + width` characters;
#   - the whole words of each encode that end by `limit` (a word reaching past it, or cut by the encode's
#     end, may be encoded differently whole) must share a common tail, same ids and offsets, of at least
#     MIN_AGREEING tokens; the join is at the earliest word start of that tail that both encodes see:
#     `cur`'s tokens before it, then `nxt`'s from it on. `width / 2` exceeds the longest token, so no one
#     token (nor, by the word rule, one word) spans the compared text: the two views of it differ in where
#     they were cut, and agreement means both are past their cuts' effects;
#   - when they do not agree (or no word boundary lies in the lookahead), `width` doubles, and `cur` is
#     re-encoded longer when the lookahead would reach back past `trust` (its checked tokens must then come
#     out the same): a word longer than a chunk is encoded whole.
# tests/test_tokenize.py holds it to tokenizer(whole_text) for sentencepiece-style (Metaspace, both prepend
# schemes; a prepending normalizer), byte-level and WordPiece tokenizers at chunks of a few characters.
MIN_AGREEING = 2


@dataclass
class _Encoded:
    """One encode of the text [start, end); offsets are absolute character positions in the file."""

    start: int
    end: int
    last: bool  # the text ran to the file's end
    ids: List[int]
    starts: np.ndarray
    ends: np.ndarray
    reach: np.ndarray  # reach[i]: the furthest end of tokens 0..i (offsets may overlap)
    joinable: np.ndarray  # joinable[i]: token i begins a word (a pre-token), so a join may be made there
    checked: int  # its tokens from the join on, ending by here, agreed with the encode before it (whole words)

    def tokens(self, lo: int, hi: int) -> List[Tuple[int, int, int]]:
        return list(zip(self.ids[lo:hi], self.starts[lo:hi].tolist(), self.ends[lo:hi].tolist()))

    def within(self, limit: int) -> int:
        """How many leading tokens end by `limit`."""
        return int(np.searchsorted(self.reach, limit, side="right"))

    def whole_words(self, limit: int) -> int:
        """How many leading tokens make whole words that end by `limit`: the word reaching past it, or to the
        encode's end short of the file's, may be cut."""
        n = self.within(limit)
        if n == len(self.ids) and self.last:
            return n
        starts = np.flatnonzero(self.joinable[:n + 1] if n < len(self.ids) else self.joinable[:n])
        return int(starts[-1]) if len(starts) else 0

    def first_trusted(self, trust: int) -> int:
        """Where the tokens from `trust` on begin: no join may be made before it."""
        return int(self.starts[trust]) if trust < len(self.ids) else self.start


class _Text:
    """A file's characters, decoded as they are asked for; only those from the last `drop_before` are kept."""

    def __init__(self, path: str, progress: Optional[Callable[[int], Any]]) -> None:
        self._file = open(path, "rb")
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._progress = progress
        self._text, self._first, self._eof = "", 0, False

    def read(self, start: int, length: int) -> Tuple[str, bool]:
        """The characters [start, start + length), fewer at the file's end; and whether they reach it."""
        while not self._eof and self._first + len(self._text) < start + length:
            block = self._file.read(max(READ_BYTES, start + length - self._first - len(self._text)))
            self._eof = not block
            self._text += self._decoder.decode(block, final=self._eof)
            if self._progress is not None and block:
                self._progress(len(block))
        text = self._text[start - self._first:start - self._first + length]
        return text, self._eof and start + len(text) == self._first + len(self._text)

    def drop_before(self, position: int) -> None:
        self._text = self._text[position - self._first:]
        self._first = position

    def close(self) -> None:
        self._file.close()


def encode_file(tokenizer: Any, path: str, chunk: int = CHUNK_CHARS, overlap: int = OVERLAP_CHARS,
                progress: Optional[Callable[[int], Any]] = None) -> Iterator[List[int]]:
    """The ids of `tokenizer(text, add_special_tokens=False)` for the whole text of `path`, in pieces, from
    encodes of about `chunk` characters joined where they agree ([Note: streaming a tokenizer]). A slow
    tokenizer (no offset mapping) encodes the text whole. `progress(n)` is called with each n bytes read."""
    if chunk < 1 or overlap < 2:
        raise OffloadConfigError(f"encode_file needs chunk >= 1 and overlap >= 2; got chunk={chunk}, overlap={overlap}")
    text = _Text(path, progress)
    try:
        if not getattr(tokenizer, "is_fast", False):
            whole, _ = text.read(0, os.path.getsize(path) + 1)  # characters <= bytes
            yield tokenizer(whole, add_special_tokens=False)["input_ids"]
            return
        encode = functools.partial(_encode, tokenizer, text, _splits_words(tokenizer))
        width = max(overlap, 2 * _longest_token(tokenizer) + 2)  # no one token spans the compared text
        cur, trust = encode(0, chunk + width, checked=0), 0
        while not cur.last:
            joined = _join(encode, cur, trust, width, chunk)
            if joined is None:  # no agreement within the lookahead: look further
                width *= 2
                if cur.end - width <= cur.first_trusted(trust):
                    cur, trust = _lengthen(encode, cur, trust, width, path)
                continue
            keep, nxt, nxt_trust = joined
            yield cur.ids[trust:keep]
            text.drop_before(nxt.start)
            cur, trust = nxt, nxt_trust
        yield cur.ids[trust:]
    finally:
        text.close()


PROBE = "one two, three\nfour five"


def _splits_words(tokenizer: Any) -> bool:
    """Whether the tokenizer's pre-tokenizer cuts text into words, each encoded on its own (then a word's
    tokens can depend on all of it: WordPiece's [UNK] for a word over 100 characters, a Unigram's best
    split), or it encodes the whole text as one (Llama 2's and Gemma's BPE: then only the tokens nearby
    matter, and any token boundary may be a join)."""
    words = tokenizer(PROBE, add_special_tokens=False).word_ids()
    return len({w for w in words if w is not None}) > 1


def _longest_token(tokenizer: Any) -> int:
    """An upper bound on the characters of text one token covers (added tokens included): its vocabulary's
    longest string (byte-level and byte-fallback spellings are longer than the text, which is safe)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def _encode(tokenizer: Any, text: _Text, split_words: bool, start: int, length: int, checked: int) -> _Encoded:
    piece, last = text.read(start, length)
    encoding = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(encoding["offset_mapping"], dtype=np.int64).reshape(-1, 2) + start
    ends = offsets[:, 1]
    if split_words:
        words = np.array([-1 if w is None else w for w in encoding.word_ids()], dtype=np.int64)
        joinable = np.ones(len(words), dtype=bool)  # a token of no word (None) stands alone
        joinable[1:] = (words[1:] != words[:-1]) | (words[1:] < 0) | (words[:-1] < 0)
    else:
        joinable = np.ones(len(ends), dtype=bool)
    return _Encoded(start, start + len(piece), last, list(encoding["input_ids"]), offsets[:, 0], ends,
                    np.maximum.accumulate(ends) if len(ends) else ends, joinable, checked)


def _join(encode: Callable[..., _Encoded], cur: _Encoded, trust: int, width: int,
          chunk: int) -> Optional[Tuple[int, _Encoded, int]]:
    """(tokens of `cur` to keep, the next encode, its first token to keep), or None when the lookahead
    `width` holds no word boundary or the two encodes do not agree in it."""
    lo, limit = cur.end - width, cur.end - width // 2
    i = max(int(np.searchsorted(cur.reach, lo, side="left")) + 1, trust + 1)
    while i < len(cur.ids) and cur.reach[i - 1] < limit and (cur.reach[i - 1] > cur.starts[i] or not cur.joinable[i]):
        i += 1  # inside a word, or a token overlapping the one before
    if i >= len(cur.ids) or cur.reach[i - 1] >= limit:
        return None
    start = int(cur.reach[i - 1])
    nxt = encode(start, chunk + width, checked=0)
    mine_end, theirs_end = cur.whole_words(limit), nxt.whole_words(limit)
    mine = cur.tokens(int(np.searchsorted(cur.starts, start, side="left")), mine_end)
    theirs = nxt.tokens(0, theirs_end)
    agree = 0
    while agree < min(len(mine), len(theirs)) and mine[-1 - agree] == theirs[-1 - agree]:
        agree += 1
    for tail in range(agree, MIN_AGREEING - 1, -1):  # the earliest join both encodes see a word start at
        keep, first = mine_end - tail, theirs_end - tail
        if keep > 0 and cur.joinable[keep] and nxt.joinable[first]:
            nxt.checked = int(nxt.reach[theirs_end - 1])
            return keep, nxt, first
    return None


def _lengthen(encode: Callable[..., _Encoded], cur: _Encoded, trust: int, width: int,
              path: str) -> Tuple[_Encoded, int]:
    """`cur` encoded `width` characters further, and where its trusted tokens now begin; these must be the
    ones already checked against the encode before it."""
    longer = encode(cur.start, cur.end - cur.start + width, cur.checked)
    checked = cur.tokens(trust, cur.within(cur.checked))
    if not checked:  # the file's first encode: all of it is the text's
        return longer, trust
    first = cur.starts[trust]  # tokens may share a start (a prepended marker): try each
    for at in range(int(np.searchsorted(longer.starts, first, side="left")),
                    int(np.searchsorted(longer.starts, first, side="right")) + 1):
        if longer.tokens(at, at + len(checked)) == checked:
            return longer, at
    raise OffloadConfigError(
        f"the tokenizer's ids for {path!r} near character {cur.first_trusted(trust)} changed when more text "
        f"followed ({width} characters on): tokenize cannot encode this file in chunks; encode it whole "
        "(ids = tokenizer(text, add_special_tokens=False)['input_ids']) and save them with "
        "offload.data.write_tokens(path, ids)")


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
