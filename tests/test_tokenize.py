"""`python -m offload tokenize`: text to a token file the user's tokenizer decodes back to the text."""

from __future__ import annotations

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

    monkeypatch.setattr("offload.cli.tokenize.CHUNK_BYTES", 100)  # many chunks, each cut after a newline
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
