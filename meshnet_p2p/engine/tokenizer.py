"""Text <-> token ids with the model's own llama.cpp vocabulary.

Loaded vocab-only (no weights) from any file that carries the tokenizer: the
whole model, a head shard or a tail shard. Tokenization follows llama.cpp's
default for the model: special tokens added as its metadata says
(``add_bos_token`` etc.) and special-token text parsed. No chat template
unless asked for.
"""

from __future__ import annotations

import codecs
import ctypes

import llama_cpp

from meshnet_p2p.core.errors import MeshnetError
from .llama_native import ensure_backend, token_piece, tokenize


class TokenizerError(MeshnetError):
    pass


class Tokenizer:
    def __init__(self, path: str) -> None:
        ensure_backend()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = llama_cpp.llama_model_load_from_file(path.encode(), params)
        if not self._model:
            raise TokenizerError(f"cannot load a vocabulary from {path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        if self.n_vocab <= 1:
            raise TokenizerError(f"{path} has no vocabulary (a middle shard?); use the model or a head/tail shard")

    def encode(self, text: str) -> list[int]:
        return tokenize(self._vocab, text, add_special=True, parse_special=True)

    def piece(self, token: int) -> bytes:
        return token_piece(self._vocab, token)

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def chat_prompt(self, text: str) -> str:
        """One user message in the chat template, ready for the assistant's turn."""
        return self.apply_chat_template([{"role": "user", "content": text}])

    @property
    def has_chat_template(self) -> bool:
        """Whether the model carries a chat template (a base model, e.g. Gemma 3 270M, does not)."""
        return bool(llama_cpp.llama_model_chat_template(self._model, None))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Render messages with the model's chat template, ready for the assistant's turn."""
        tmpl = llama_cpp.llama_model_chat_template(self._model, None)
        if not tmpl:
            raise TokenizerError("the model has no chat template (a base model): send the prompt as is")
        arr = (llama_cpp.llama_chat_message * len(messages))()
        keep = []
        for i, m in enumerate(messages):
            role, content = m["role"].encode(), m["content"].encode()
            keep += [role, content]
            arr[i].role, arr[i].content = role, content
        size = 4096 + sum(len(k) for k in keep) * 2
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_chat_apply_template(tmpl, arr, len(messages), True, buf, size)
            if n < 0:
                raise TokenizerError("llama.cpp does not know this model's chat template")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n
        raise TokenizerError("chat template output did not fit")

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def close(self) -> None:
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class StreamDecoder:
    """Turns tokens into text as they arrive, holding back split UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self._dec.decode(self._tok.piece(token))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
