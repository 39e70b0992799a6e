"""Tokenizers behind one small interface: encode a chat prompt, decode ids, know the stop tokens.

`HFTokenizer` wraps a transformers tokenizer (its chat template included); `ByteTokenizer` is a
self-contained byte-level tokenizer for random-init test models (ids 0-255 are bytes, then bos, eos,
pad), so tests need no tokenizer files.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional, Protocol

# tokenizer_config.json classes that are the tokenizers library's generic backend: loaded directly
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


class Tokenizer(Protocol):
    eos_token_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_chat(self, user: str, system: Optional[str] = None) -> list[int]: ...

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """A whole conversation ([{"role", "content"}, ...]) through the chat template, ready for the
        assistant's turn; `encode_chat(user, system)` is the one-turn case of it."""
        ...

    def user_turn(self, system: Optional[str] = None) -> tuple[list[int], frozenset[int]]:
        """(ids of the chat template up to where a user message starts, ids that end a user turn):
        what a target is prompted with to write a user message itself (Magpie). `system`: the system
        message before it (None: the template's default), which steers what the user asks about."""
        ...


def _messages(user: str, system: Optional[str]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


class HFTokenizer:
    def __init__(self, tok, extra_eos: tuple[int, ...] = ()):
        self.tok = tok
        eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        self.eos_token_ids = frozenset(eos | set(extra_eos))
        self.plain_decode = _plain_decode(tok)

    @functools.cached_property
    def byte_pieces(self) -> Optional[list[bytes]]:
        """Each id's bytes, where `decode(ids)` is always their concatenation decoded as UTF-8 with
        replacement (a byte-level BPE: GPT-2's, Llama 3's, Qwen's), else None: what lets a stream
        detokenize a token at a time (engine/serve/detokenize.py)."""
        return _byte_level_pieces(self.tok) if self.plain_decode else None

    @classmethod
    def from_dir(cls, path: str, extra_eos: tuple[int, ...] = ()) -> "HFTokenizer":
        """The tokenizer saved in `path`. One of the generic backend (what the GGUF conversion writes) loads
        as that class directly: AutoTokenizer would first import the model's config classes, about 3 s of
        every run on a CPU. A model's own tokenizer class goes through AutoTokenizer."""
        stamp = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(Path(path).glob("*.json")))
        return cls(_backend(str(path), stamp), extra_eos)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        if self.plain_decode:  # the same text without transformers' wrapping: the server's streams decode often
            return self.tok.backend_tokenizer.decode(ids, skip_special_tokens=True)
        return self.tok.decode(ids, skip_special_tokens=True)

    def encode_chat(self, user: str, system: Optional[str] = None) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            return self.encode(user)
        return self.encode_messages(_messages(user, system))

    def encode_messages(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            return self.encode("\n".join(m["content"] for m in messages))
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tok.encode(text, add_special_tokens=False)

    def user_turn(self, system: Optional[str] = None) -> tuple[list[int], frozenset[int]]:
        sentinel = "\x00"
        text = self.tok.apply_chat_template(_messages(sentinel, system), add_generation_prompt=True, tokenize=False)
        prefix, suffix = text.split(sentinel, 1)
        end = self.tok.encode(suffix, add_special_tokens=False)[:1]  # e.g. <|im_end|>
        return self.tok.encode(prefix, add_special_tokens=False), frozenset(end) | self.eos_token_ids


def _plain_decode(tok) -> bool:
    """Whether transformers' decode of `tok` is the tokenizers library's (a fast tokenizer that overrides
    neither decode step and does not clean up spaces): its argument handling costs several times the
    decode of the token or two a stream decodes at a time."""
    from transformers import PreTrainedTokenizerFast

    base, cls = PreTrainedTokenizerFast, type(tok)
    return (
        isinstance(tok, base)
        and cls.decode is base.decode
        and cls._decode is base._decode
        and not tok.clean_up_tokenization_spaces
    )


def _gpt2_byte_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte in a token's text."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + n): b for n, b in enumerate(moved)}


def _byte_level_pieces(tok) -> Optional[list[bytes]]:
    """The bytes of every id under the tokenizers library's ByteLevel decoder (a token whose characters
    are all in the byte alphabet: their bytes; else its text's UTF-8; a special token: none, as decode
    skips it), checked id by id against the library's decode. None for another decoder, or a mismatch."""
    backend = tok.backend_tokenizer
    if type(backend.decoder).__name__ != "ByteLevel":
        return None
    chars, special = _gpt2_byte_chars(), {i for i, t in tok.added_tokens_decoder.items() if t.special}
    pieces = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.id_to_token(i) or ""
        mapped = [chars.get(c) for c in text]
        pieces.append(b"" if i in special else bytes(mapped) if None not in mapped else text.encode())
    alone = backend.decode_batch([[i] for i in range(len(pieces))], skip_special_tokens=True)
    if any(p.decode("utf-8", "replace") != a for p, a in zip(pieces, alone)):
        return None
    return pieces


class ByteTokenizer:
    BOS, EOS, PAD = 256, 257, 258
    vocab_size = 259
    byte_pieces = [bytes([i]) for i in range(256)] + [b""] * 3  # decode drops bos, eos and pad

    def __init__(self):
        self.eos_token_ids = frozenset({self.EOS})

    def encode(self, text: str) -> list[int]:
        return [self.BOS, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode_chat(self, user: str, system: Optional[str] = None) -> list[int]:
        return self.encode_messages(_messages(user, system))

    def encode_messages(self, messages: list[dict]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>")

    def user_turn(self, system: Optional[str] = None) -> tuple[list[int], frozenset[int]]:
        return self.encode(f"<system>{system}\n<user>" if system else "<user>"), frozenset({ord("\n"), self.EOS})


@functools.lru_cache(maxsize=8)
def _backend(path: str, stamp: tuple):
    """The transformers tokenizer saved in `path`, once per process while its files (`stamp`: their names,
    mtimes and sizes) are unchanged: a plan and the run after it, or many plans in one process, share it.
    Tokenizers are read-only once loaded."""
    config = Path(path) / "tokenizer_config.json"
    named = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if named in GENERIC_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
