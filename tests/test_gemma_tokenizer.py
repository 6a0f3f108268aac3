"""Gemma's tokenizer built from a GGUF vocabulary (fsd_eagle.gemma_tokenizer), on a toy vocabulary written as
a real GGUF file: merges in the vocabulary's order, spaces, byte fallback, control and user-defined tokens."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from fsd_eagle.errors import ModelLoadError
from fsd_eagle.gemma_tokenizer import CONTROL, USER_DEFINED, derive_merges, read_gguf_vocab, write_gemma_tokenizer

NORMAL, BYTE = 1, 6
# Listed in merge-priority order, as a Gemma GGUF lists its vocabulary: "ab" before "abb" and "▁a".
VOCAB = ([("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", CONTROL),
          ("<start_of_turn>", CONTROL), ("<think>", USER_DEFINED), ("  ", USER_DEFINED)]
         + [(f"<0x{b:02X}>", BYTE) for b in range(256)]
         + [(t, NORMAL) for t in ("a", "b", "c", "\u2581", "ab", "abb", "\u2581a", "\u2581ab", "ba")])


def write_gguf(path: Path, vocab=VOCAB) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([k for _, k in vocab])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_merges_follow_the_vocabulary_order_longest_left_piece_first():
    tokens = ["a", "b", "c", "ab", "abc", "bc", "abcab"]
    assert derive_merges(tokens) == [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c"), ("abc", "ab")]
    # a token listed twice counts at its last position
    assert derive_merges(["a", "b", "ab", "c", "ab"]) == [("a", "b")]


@pytest.fixture
def tok(tmp_path) -> Tokenizer:
    gguf = write_gguf(tmp_path / "toy.gguf")
    assert read_gguf_vocab(gguf) == ([t for t, _ in VOCAB], [k for _, k in VOCAB])
    (tmp_path / "tokenizer.json").write_text("{}")  # replaced whole
    write_gemma_tokenizer(gguf, tmp_path)
    assert not (tmp_path / "tokenizer.json.tmp").exists()
    return Tokenizer.from_file(str(tmp_path / "tokenizer.json"))


def test_text_is_cut_by_the_merges_not_into_characters(tok):
    enc = tok.encode("abb ab")
    assert enc.tokens == ["<bos>", "abb", "\u2581ab"]
    assert enc.ids[0] == 2 and tok.decode(enc.ids) == "abb ab"
    # "ab" is listed before "ba", so its merge goes first: b|ab, not ba|b
    assert tok.encode("bab", add_special_tokens=False).tokens == ["b", "ab"]


def test_spaces_bytes_and_added_tokens(tok):
    assert tok.encode("a  b", add_special_tokens=False).tokens == ["a", "\u2581\u2581", "b"]  # respelled spaces
    assert tok.encode("d", add_special_tokens=False).tokens == ["<0x64>"]  # byte fallback
    enc = tok.encode("<start_of_turn>a<think>b", add_special_tokens=False)
    assert enc.tokens == ["<start_of_turn>", "a", "<think>", "b"]  # matched whole
    assert tok.decode(enc.ids) == "a<think>b"  # the control token is special, the user-defined one is not
    assert tok.get_vocab_size() == len(VOCAB)


def test_a_vocabulary_without_bos_is_refused(tmp_path):
    gguf = write_gguf(tmp_path / "nobos.gguf", [(t, k) for t, k in VOCAB if t != "<bos>"])
    with pytest.raises(ModelLoadError, match="no <bos> token"):
        write_gemma_tokenizer(gguf, tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()


def test_a_folder_whose_tokenizer_cuts_characters_is_refused(tmp_path):
    """The check after conversion: a tokenizer that cuts the pangram into characters (what transformers 5.17's
    own conversion of Gemma's GGUF gives) is a one-line ModelLoadError; word pieces pass."""
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fsd_eagle.gemma3 import PANGRAM, check_tokenizer

    letters = sorted(set(PANGRAM))
    chars = Tokenizer(models.WordLevel({c: i for i, c in enumerate(["<unk>"] + letters)}, unk_token="<unk>"))
    chars.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=chars, unk_token="<unk>").save_pretrained(tmp_path / "chars")
    with pytest.raises(ModelLoadError, match="cuts a 9-word sentence into 4[0-9] pieces"):
        check_tokenizer(tmp_path / "chars")
    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>"] + PANGRAM.split())}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(tmp_path / "words")
    check_tokenizer(tmp_path / "words")
