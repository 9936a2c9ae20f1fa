"""A GGUF metadata file with a tokenizer, for tiny random models that have none: what
``save_pretrained(..., format="gguf", source=...)`` copies so that llama.cpp can load the result.

The tokenizer is a SentencePiece ("llama") vocabulary llama.cpp accepts: ``<unk>``, ``<s>``,
``</s>``, the 256 byte tokens ``<0x00>``..``<0xFF>``, then plain filler tokens up to the model's
vocabulary size. The ids the tests feed are model ids; no text is tokenized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from nvfp4lab.checkpoint.formats.gguf import CONFIG_KEY

#: Ids and counts of the tokenizer below.
SPECIAL = ("<unk>", "<s>", "</s>")
MIN_VOCAB = len(SPECIAL) + 256


def tokenizer_tokens(vocab_size: int) -> tuple[list[str], list[int]]:
    """(tokens, llama.cpp token types) of a ``vocab_size``-entry SentencePiece vocabulary."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} < {MIN_VOCAB} (specials and byte tokens)")
    kind = gguf.TokenType
    tokens = [*SPECIAL, *(f"<0x{b:02X}>" for b in range(256))]
    types = [kind.UNKNOWN, kind.CONTROL, kind.CONTROL, *([kind.BYTE] * 256)]
    filler = vocab_size - len(tokens)
    tokens += [f"tok{i}" for i in range(filler)]
    types += [kind.NORMAL] * filler
    return tokens, [int(t) for t in types]


def with_tokenizer(model_file: Path, out: Path, vocab_size: int) -> Path:
    """A tensor-less GGUF file at ``out``: every key-value of ``model_file`` (a GGUF nvfp4lab
    wrote, its hyper-parameters) but nvfp4lab's config, plus the tokenizer above."""
    reader = gguf.GGUFReader(model_file)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(path=None, arch=arch)
    kind = gguf.GGUFValueType
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in (gguf.Keys.General.ARCHITECTURE, CONFIG_KEY):
            continue
        main = field.types[0]
        sub = field.types[-1] if main == kind.ARRAY else None
        value: Any = field.contents()
        writer.add_key_value(key, value, main, sub)
    tokens, types = tokenizer_tokens(vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.write_header_to_file(path=out)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return out
