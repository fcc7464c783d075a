"""`python -m offload tokenize`: text to a token file the user's tokenizer decodes back to the text, the ids
exactly those of `tokenizer(whole_text)` however the text is cut into chunks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from offload.__main__ import main
from offload.cli.tokenize import tokenize_files
from offload.data import TokenWindows
from offload.errors import OffloadConfigError

pytest.importorskip("transformers", reason="tokenize uses transformers' AutoTokenizer (pip install transformers)")

TEXT = "the quick brown fox jumps over the lazy dog\nand the dog sleeps in the sun\n" * 40


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer with an EOS token, saved as save_pretrained saves one (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>").save_pretrained(directory)
    return directory


def test_tokenize_round_trips_each_file_with_eos(tokenizer_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setattr("offload.cli.tokenize.CHUNK_CHARS", 100)  # many chunks
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(TEXT)
    second.write_text("a second document\nwithout a final newline")
    out = tmp_path / "tokens.npy"
    assert main(["tokenize", "--tokenizer", str(tokenizer_dir), str(first), str(second), str(out)]) == 0
    tokens = np.load(out)
    assert tokens.dtype == np.uint16
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.eos_token_id
    ends = np.flatnonzero(tokens == eos)
    assert ends.tolist()[-1] == len(tokens) - 1 and len(ends) == 2
    assert tokenizer.decode(tokens[:ends[0]].tolist()) == TEXT
    assert tokenizer.decode(tokens[ends[0] + 1:ends[1]].tolist()) == "a second document\nwithout a final newline"
    with TokenWindows(out, 16, 2, backend="numpy") as windows:  # a token file offload.data reads
        assert next(windows).shape == (2, 17)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_tokenize_refuses_bad_input(tokenizer_dir, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text(TEXT)
    with pytest.raises(OffloadConfigError, match="does not exist"):
        tokenize_files(tokenizer_dir, [str(tmp_path / "missing.txt")], str(tmp_path / "t.npy"))
    with pytest.raises(OffloadConfigError, match="must end in .npy"):
        tokenize_files(tokenizer_dir, [str(text)], str(tmp_path / "t.bin"))
    with pytest.raises(OffloadConfigError, match="not a directory"):
        tokenize_files(str(tmp_path / "no-tokenizer"), [str(text)], str(tmp_path / "t.npy"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(OffloadConfigError, match="holds no tokens"):
        tokenize_files(tokenizer_dir, [str(tmp_path / "empty.txt")], str(tmp_path / "t.npy"), eos=False)
    assert not (tmp_path / "t.npy").exists()


# Texts that cut badly: a line longer than a chunk, no newline at all, multi-byte characters (accents, CJK,
# a 4-byte emoji, a combining mark), runs of spaces and tabs, leading and trailing whitespace.
HARD_TEXTS = {
    "long lines": ("the quick brown fox jumps over the lazy dog " * 12 + "\n") * 4,
    "no newlines": "and the dog sleeps in the sun while the fox runs " * 30,
    "unicode": "naïve café, ünïcödé 東京の空 🙂 emoji e\u0301te\u0301 — «quoted» " * 20,
    "spaces": "  two  spaces   three    four\t\ttabs \t mixed  \n\n   lead and trail   " * 20 + "   ",
}
TRAIN = "".join(HARD_TEXTS.values()) + TEXT


def _save(backend, directory, eos):
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos).save_pretrained(directory)
    return directory


def _bpe(pre_tokenizer, decoder, normalizer=None, byte_level=False):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None if byte_level else "<unk>"))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    if pre_tokenizer is not None:
        tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoder
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    tokenizer.train_from_iterator(TRAIN.splitlines(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<eos>"], show_progress=False, initial_alphabet=alphabet))
    return tokenizer


def _wordpiece():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(TRAIN.splitlines(), trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[UNK]", "[SEP]"], show_progress=False))
    return tokenizer


def _build(kind):
    from tokenizers import decoders, normalizers, pre_tokenizers

    if kind.startswith("metaspace"):  # sentencepiece-style: a word-start marker, added at the text's start
        scheme = kind.split("-")[1]
        return _bpe(pre_tokenizers.Metaspace(prepend_scheme=scheme), decoders.Metaspace(prepend_scheme=scheme)), "<eos>"
    if kind == "prepend normalizer":  # Llama 2's tokenizer.json: the normalizer prepends the marker, no pre-tokenizer
        normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        return _bpe(None, decoders.Metaspace(), normalizer), "<eos>"
    if kind == "byte level prefix space":  # GPT-2 style, with a space added before the text
        return _bpe(pre_tokenizers.ByteLevel(add_prefix_space=True), decoders.ByteLevel(), byte_level=True), "<eos>"
    if kind == "byte level":  # GPT-2 style
        return _bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), byte_level=True), "<eos>"
    return _wordpiece(), "[SEP]"


KINDS = ["metaspace-first", "metaspace-always", "prepend normalizer", "byte level", "byte level prefix space",
         "wordpiece"]


@pytest.fixture(scope="module", params=KINDS)
def any_tokenizer(request, tmp_path_factory):
    from transformers import AutoTokenizer

    backend, eos = _build(request.param)
    return AutoTokenizer.from_pretrained(_save(backend, tmp_path_factory.mktemp("tok"), eos))


@pytest.mark.parametrize("chunk", [23, 64, 257])
def test_ids_equal_the_whole_text_encoded_at_once(any_tokenizer, tmp_path, chunk):
    """Cut into chunks of a few characters (hundreds of cuts), each file's ids are exactly
    tokenizer(whole text), then EOS."""
    tokenizer = any_tokenizer
    paths = []
    for i, text in enumerate(HARD_TEXTS.values()):
        paths.append(tmp_path / f"{i}.txt")
        paths[-1].write_bytes(text.encode("utf-8"))
    out = tmp_path / "tokens.npy"
    count = tokenize_files(tokenizer, [str(p) for p in paths], str(out), chunk=chunk)
    want = []
    for text in HARD_TEXTS.values():
        want += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    got = np.load(out).tolist()
    assert count == len(want)
    assert got == want


def test_ids_decode_back_to_the_text(tmp_path):
    """Byte-level BPE is lossless: after many cuts the token file decodes to each file's text exactly."""
    from transformers import AutoTokenizer

    backend, eos = _build("byte level")
    tokenizer = AutoTokenizer.from_pretrained(_save(backend, tmp_path / "tok", eos))
    text = "".join(HARD_TEXTS.values())
    (tmp_path / "a.txt").write_bytes(text.encode("utf-8"))
    tokenize_files(tokenizer, [str(tmp_path / "a.txt")], str(tmp_path / "t.npy"), eos=False, chunk=31)
    assert tokenizer.decode(np.load(tmp_path / "t.npy").tolist()) == text


def test_tokenizer_directory_without_a_tokenizer_is_named(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))  # weights' config, no tokenizer
    for directory in (tmp_path / "empty", model_dir):
        directory.mkdir(exist_ok=True)
        with pytest.raises(OffloadConfigError, match=f"--tokenizer '{directory}' holds no tokenizer.*save_pretrained"):
            tokenize_files(str(directory), [str(tmp_path / "a.txt")], str(tmp_path / "t.npy"))


def test_input_directory_is_called_a_directory(tokenizer_dir, tmp_path):
    (tmp_path / "texts").mkdir()
    with pytest.raises(OffloadConfigError, match=r"input .*texts' is a directory.*give the text files themselves"):
        tokenize_files(tokenizer_dir, [str(tmp_path / "texts")], str(tmp_path / "t.npy"))
