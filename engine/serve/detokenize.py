"""Incremental detokenization with stop strings: token ids in, text deltas out, as a stream sees them.

    ts = TextStream(tokenizer, stop=["\\n\\n"])
    delta = ts.push(ids)     # text safe to send now ("" while a multi-byte character or a possible
                             # stop string is incomplete)
    ts.stopped               # a stop string appeared: the text is cut before it, generation should end
    delta = ts.finish()      # the rest, once generation ended

A byte-level tokenizer (`byte_pieces`: each id's bytes, decode being their UTF-8) decodes a token at
a time through an incremental UTF-8 decoder, which holds an incomplete character for the next token.
Any other re-reads a small window (the previous push's tokens as context, then the new ones), as
vLLM does, so a tokenizer whose pieces depend on their neighbours (leading spaces, byte fallback)
decodes the same as decoding everything at once, without the quadratic cost. Text ending in U+FFFD
is an incomplete UTF-8 sequence: it waits for the next token. Either way the text sent is the decode
of every id at once. With stop strings the last
`max(len(stop)) - 1` characters are held back, since they may be the start of one; the text sent
never contains a stop string.
"""

from __future__ import annotations

import codecs
from typing import Sequence

from engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded so far (cut at a stop string once one appeared)
        self.sent = 0  # characters of `text` handed out
        self.stopped = False
        self._prefix = self._read = 0  # window: ids[_prefix:_read] is context already in `text`
        self._pieces = getattr(tokenizer, "byte_pieces", None)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self._pieces is not None else None

    def _decode_new(self) -> str:
        if self._utf8 is not None:  # the new ids' bytes, an incomplete character held for the next
            new, pieces, n = self.ids[self._read :], self._pieces, len(self._pieces)
            self._read = len(self.ids)
            return self._utf8.decode(b"".join([pieces[i] if i < n else b"" for i in new]))  # unknown ids: none
        context = self.tok.decode(self.ids[self._prefix : self._read])
        full = self.tok.decode(self.ids[self._prefix :])
        if full.endswith(REPLACEMENT) or not full.startswith(context):
            return ""  # incomplete character (or a merge that rewrote the context): wait
        self._prefix, self._read = self._read, len(self.ids)
        return full[len(context) :]

    def _check_stop(self, start: int) -> None:
        for s in self.stop:
            at = self.text.find(s, max(0, start - len(s) + 1))
            if at != -1:
                self.text, self.stopped = self.text[:at], True
                return

    def push(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(ids)
        start = len(self.text)
        self.text += self._decode_new()
        self._check_stop(start)
        safe = len(self.text) if self.stopped else max(self.sent, len(self.text) - self.hold)
        return self._take(safe)

    def finish(self) -> str:
        """Everything not sent yet: the held-back tail and any incomplete character, decoded as is."""
        if not self.stopped:
            start = len(self.text)
            if self._utf8 is not None:
                tail = self._utf8.decode(b"", final=True)
            else:
                context = self.tok.decode(self.ids[self._prefix : self._read])
                tail = self.tok.decode(self.ids[self._prefix :])[len(context) :]
            self.text += tail
            self._prefix = self._read = len(self.ids)
            self._check_stop(start)
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        delta, self.sent = self.text[self.sent : upto], max(self.sent, upto)
        return delta
