"""Text <-> token ids over an HF `tokenizer.json`, the ChatML chat format, and streaming detokenization."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from tokenizers import Tokenizer as Backend
from tokenizers import decoders

from specsplit.shared.errors import CheckpointError, InvalidRequest

# The default system turn a ChatML template writes when the first message is not a system one,
# spelled as a Jinja string literal inside the template (SmolLM2 has one; Qwen's have none).
_DEFAULT_SYSTEM = re.compile(r"'<\|im_start\|>system\n([^'{}]*)<\|im_end\|>\n'")


class Tokenizer:
    def __init__(self, backend: Backend, config: Mapping[str, Any], extra_eos_ids: Sequence[int] = ()) -> None:
        self.backend = backend
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token_id = self._special_id(config, "bos_token")
        eos = [self._special_id(config, "eos_token"), *extra_eos_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if i is not None))

    @staticmethod
    def from_dir(folder: Path | str) -> "Tokenizer":
        """tokenizer.json (+ tokenizer_config.json, config.json, generation_config.json when present)."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise CheckpointError(f"{folder}: no tokenizer.json")
        try:
            backend = Backend.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{folder / 'tokenizer.json'}: unreadable ({exc})") from None
        config = _read_json(folder / "tokenizer_config.json")
        model_files = ("config.json", "generation_config.json")
        extra = [i for name in model_files for i in _ids(_read_json(folder / name).get("eos_token_id"))]
        return Tokenizer(backend, config, extra)

    def _special_id(self, config: Mapping[str, Any], key: str) -> int | None:
        token = config.get(key)
        if isinstance(token, dict):  # the older AddedToken spelling
            token = token.get("content")
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of input text one token stands for (162 for SmolLM2's
        vocabulary, whose longest entry stands for 81), so a text of more than n * max_token_bytes
        bytes encodes to more than n tokens, which a server can tell before paying for the encode.

        A vocabulary entry's spelling is never shorter than the text it matches (byte-level "Ġ" is 2
        bytes for a 1-byte space, "<0x41>" 6 for 1); a normalizer can shrink text before it is matched,
        at most 4 to 1 (NFKC maps the 4-byte "𝐀" to "A"), so the bound is 4 times larger then."""
        longest = max(len(token.encode()) for token in self.backend.get_vocab(with_added_tokens=True))
        return longest * (1 if self.backend.normalizer is None else 4)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token markup in `text` (`<|im_start|>`) becomes its single id."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """ChatML, as SmolLM2's and Qwen's templates write it: `<|im_start|>{role}\\n{content}<|im_end|>\\n`."""
        if not self.chat_template or "<|im_start|>" not in self.chat_template:
            raise CheckpointError("this tokenizer has no ChatML chat template (the only chat format supported)")
        turns = [_checked(m) for m in messages]
        default_system = _DEFAULT_SYSTEM.search(self.chat_template)
        if default_system and (not turns or turns[0][0] != "system"):
            turns.insert(0, ("system", default_system.group(1)))
        text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def stream(self, skip_special_tokens: bool = False) -> "TextStream":
        return TextStream(self, skip_special_tokens)

    def output_stream(self) -> "TextStream":
        """Generated text as a reader sees it: special tokens (`<|im_end|>`) stay in the token ids, not the text."""
        return TextStream(self, skip_special_tokens=True)


class TextStream:
    """Text deltas of a token stream; a multi-byte character split across tokens comes out whole, once."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False, native: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        use_native = hasattr(decoders, "DecodeStream") if native is None else native
        self._native = decoders.DecodeStream(skip_special_tokens=skip_special_tokens) if use_native else None
        self._ids: list[int] = []
        self._prefix = 0  # ids before this are out; ids[_prefix:_read] give context for the next delta
        self._read = 0
        self._pending: list[int] = []  # ids pushed since the last non-empty delta

    def push(self, token_id: int) -> str:
        """The text `token_id` completes ('' while a character is still partial)."""
        self._pending.append(int(token_id))
        if self._native is not None:
            delta = self._native.step(self.tokenizer.backend, int(token_id)) or ""
        else:
            delta = self._push_python(int(token_id))
        if delta:
            self._pending.clear()
        return delta

    def flush(self) -> str:
        """What a plain decode shows for a trailing partial character (U+FFFD), once the stream ends."""
        pending, self._pending = self._pending, []
        return self.tokenizer.decode(pending, self.skip_special_tokens) if pending else ""

    def _push_python(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self.tokenizer.decode(self._ids[self._prefix:self._read], self.skip_special_tokens)
        after = self.tokenizer.decode(self._ids[self._prefix:], self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]


def _checked(message: Mapping[str, str]) -> tuple[str, str]:
    role = message.get("role") if isinstance(message, Mapping) else None
    content = message.get("content") if isinstance(message, Mapping) else None
    if not isinstance(role, str) or not role or not isinstance(content, str):
        raise InvalidRequest(f"a chat message needs a string 'role' and 'content', got {message!r}")
    return role, content


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
