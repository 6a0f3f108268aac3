"""Gemma 3's tokenizer built from its GGUF file, the same on every transformers version.

A Gemma GGUF stores the sentencepiece vocabulary (``tokenizer.ggml.tokens``, in merge-priority order, and
``tokenizer.ggml.token_type``) but no merges. How transformers turns that into a fast tokenizer has changed
between releases: 5.17 builds a Unigram model from the file's scores, which for Gemma splits text into
single characters ("Hello" -> H, e, l, l, o: about 5x more tokens, and a model that answers garbage), while
later releases rebuild BPE merges from the order of the vocabulary. Conversion therefore writes the BPE
tokenizer itself, from the file alone:

- vocabulary: the file's tokens with their ids; a token made only of spaces is respelled with ``▁`` (the
  sentencepiece space), which is how text reaches the model after normalization;
- merges: every way to cut a token into two tokens of the vocabulary, tokens taken in file order (the file
  lists a token before the tokens it merges into), the cut with the longest left piece first;
- text handling as Gemma's: spaces become ``▁``, pieces split after each space, byte fallback for what the
  vocabulary lacks (``<0x..>``), ``<bos>`` prepended; decoding reverses it;
- added tokens: the file's control tokens (type 3) as special tokens, its user-defined ones (type 4) as plain
  added tokens, both matched whole and never normalized.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ModelLoadError

SPACE = "\u2581"
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
BOS, UNK = "<bos>", "<unk>"


def read_gguf_vocab(gguf: Path) -> tuple[list[str], list[int]]:
    """(tokens, token types) of a GGUF file's tokenizer, index = token id."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ModelLoadError(f"reading {gguf.name} needs the gguf package ({e})") from None
    fields = GGUFReader(str(gguf)).fields
    missing = [k for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type") if k not in fields]
    if missing:
        raise ModelLoadError(f"{gguf.name} has no {missing[0]}: not a sentencepiece GGUF")
    tokens = [str(t) for t in fields["tokenizer.ggml.tokens"].contents()]
    types = [int(t) for t in fields["tokenizer.ggml.token_type"].contents()]
    if len(tokens) != len(types):
        raise ModelLoadError(f"{gguf.name}: {len(tokens)} tokens but {len(types)} token types")
    return tokens, types


def respell_spaces(tokens: list[str]) -> list[str]:
    """Tokens of spaces only ("  ") as the normalized text spells them ("▁▁")."""
    return [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]


def derive_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary listed in merge-priority order: for each token (by its id; a
    token listed twice counts at its last id), each cut into a left and a right piece that are both
    tokens, longest left piece first."""
    ids = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token in sorted(ids, key=ids.__getitem__):
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                merges.append((left, right))
    return merges


def build_tokenizer(tokens: list[str], types: list[int]):
    """A ``tokenizers.Tokenizer`` (BPE with byte fallback) for Gemma's vocabulary; see the module docstring."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    spelled = respell_spaces(tokens)
    vocab = {t: i for i, t in enumerate(spelled)}
    for name in (BOS, UNK):
        if name not in vocab:
            raise ModelLoadError(f"the GGUF vocabulary has no {name} token: not a Gemma tokenizer")
    tok = Tokenizer(BPE(vocab, derive_merges(spelled), unk_token=UNK, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    bos = vocab[BOS]
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1",
                                                       special_tokens=[(BOS, bos)])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, kind in zip(tokens, types) if kind == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab])
    return tok


def write_gemma_tokenizer(gguf: Path, folder: Path) -> None:
    """Replace ``folder/tokenizer.json`` with the tokenizer built from ``gguf`` (written to a temporary
    file and renamed into place); the folder's tokenizer_config.json is kept."""
    tokens, types = read_gguf_vocab(gguf)
    tok = build_tokenizer(tokens, types)
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != len(tokens):
        raise ModelLoadError(f"the tokenizer built from {gguf.name} has {size} tokens, the file {len(tokens)}")
    tmp = folder / "tokenizer.json.tmp"
    tok.save(str(tmp))
    tmp.replace(folder / "tokenizer.json")
