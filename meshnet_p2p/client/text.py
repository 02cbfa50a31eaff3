"""Text in and out of a generation, the same for the swarm's client and a local
route: the prompt tokenized (through the model's chat template when asked), and
generated tokens handed on as text, piece by piece (a token may end inside a
character: the stream decoder holds its bytes until the character is whole)."""

from __future__ import annotations

from typing import Callable


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    """``prompt``'s tokens; with ``chat``, of the prompt as a user's turn in the model's chat template."""
    return tokenizer.encode(tokenizer.chat_prompt(prompt) if chat else prompt)


class TextStream:
    """Hands each generated token on to ``on_text`` as text; :meth:`finish` hands on the rest.
    With ``on_text`` None it does nothing (``on_token`` is None: nothing to stream)."""

    def __init__(self, tokenizer, on_text: Callable[[str], None] | None) -> None:
        self.on_text = on_text
        self._decoder = tokenizer.stream_decoder() if on_text else None

    @property
    def on_token(self) -> Callable[[int], None] | None:
        return self._token if self.on_text else None

    def _token(self, token: int) -> None:
        self.on_text(self._decoder.feed(token))

    def finish(self) -> None:
        if self.on_text:
            self.on_text(self._decoder.flush())
