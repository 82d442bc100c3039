"""Training prompts the target writes itself: given only the chat prefix of a user turn, it samples the question.

The target's own questions cost nothing to license and follow its own idea of a user, so they widen
the chat side of the pool far past the written and templated instructions. A share of rows starts
the question with an opener word ("How", "Write", ...) so the questions do not all begin alike.
Degenerate samples are dropped: unfinished (no end of turn within the budget), too short or long,
repetitive, or leaking chat markup; duplicates are dropped after normalising case and spaces.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

from specsplit.shared.tokenizer import Tokenizer
from specsplit.train_data import Prompt, is_heldout

SENTINEL = "\u2063QUESTION\u2063"
OPENERS = ("", "", "", "", "How", "What", "Why", "Write", "Explain", "Can you", "Give me", "Describe", "List",
           "Compare", "Help me", "I", "Create", "Solve", "Which", "Summarize", "Suggest", "Tell me", "Calculate",
           "Plan", "In Python,", "Is it", "What is the difference between", "Rewrite", "Find", "Imagine")
MIN_CHARS, MAX_CHARS = 16, 600

# (prompts as token ids, max new tokens, temperature) -> per row: generated ids, whether the turn ended.
Sampler = Callable[[Sequence[list[int]], int, float], list[tuple[list[int], bool]]]


def user_prefix(tokenizer: Tokenizer) -> str:
    """The chat template up to where the user's text goes."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], add_generation_prompt=False)
    return text[:text.index(SENTINEL)]


def clean_question(text: str) -> str | None:
    """The question as a training prompt, or None for a degenerate sample."""
    text = text.strip()
    words = text.split()
    if not MIN_CHARS <= len(text) <= MAX_CHARS or len(words) < 3:
        return None
    if len(set(words)) < 0.6 * len(words) or "<|" in text or "|>" in text:
        return None
    if sum(c.isalpha() for c in text) < 0.5 * len(text.replace(" ", "")):
        return None
    return text


def write_questions(sample: Sampler, tokenizer: Tokenizer, rows: int, batch: int, *, seed: int,
                    max_tokens: int = 64, temperature: float = 1.0, banned: frozenset[str] = frozenset(),
                    openers: Sequence[str] = OPENERS, deadline: Callable[[], bool] = lambda: False) -> list[Prompt]:
    """Up to `rows` sampled questions, `batch` at a time, deduplicated; none held out or in `banned`."""
    rng = random.Random(seed)
    prefix = user_prefix(tokenizer)
    seen: set[str] = {" ".join(t.lower().split()) for t in banned}
    out: list[Prompt] = []
    for start in range(0, rows, batch):
        if start and deadline():
            break
        chosen = [rng.choice(openers) for _ in range(min(batch, rows - start))]
        prompts = [tokenizer.encode(prefix + opener) for opener in chosen]
        for opener, (ids, ended) in zip(chosen, sample(prompts, max_tokens, temperature)):
            text = clean_question(opener + tokenizer.decode(ids)) if ended else None
            norm = " ".join(text.lower().split()) if text else ""
            if text and norm not in seen and not is_heldout(text):
                seen.add(norm)
                out.append(Prompt("chat", text, text))
    return out
