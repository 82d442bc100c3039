"""Questions the target writes itself: the prefix is the chat template up to the user's text, and
degenerate, unfinished, duplicate, held-out or banned samples never become training prompts."""

from __future__ import annotations

import pytest

from specsplit import self_prompts
from specsplit.shared.tokenizer import Tokenizer
from specsplit.train_data import is_heldout


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer.from_dir(smollm2_dir)


def test_the_prefix_is_the_template_up_to_the_users_text(tokenizer):
    prefix = self_prompts.user_prefix(tokenizer)
    full = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=False)
    assert full.startswith(prefix + "Hi there") and prefix.endswith("user\n")


@pytest.mark.parametrize("text,kept", [
    ("How do I sort a list of tuples by the second item?", True),
    ("  What is the capital of France, and why?  ", True),
    ("Why?", False),  # too short
    ("the the the the the the the the the", False),  # repetitive
    ("Tell me <|im_start|> about cats please", False),  # chat markup
    ("12345 6789 0000 1111 2222 3333", False),  # no words
    ("word " * 200, False),  # too long
])
def test_degenerate_questions_are_dropped(text, kept):
    assert (self_prompts.clean_question(text) is not None) == kept


def test_written_questions_are_finished_distinct_and_never_held_out(tokenizer):
    texts = ["Write a poem about the sea at night.", "write a poem about  the sea at night.",
             "How does a compiler turn code into machine instructions?", "An unfinished question about",
             "What is the best way to learn the guitar as an adult?"]
    texts += [f"What are {n} good names for a small orange cat?" for n in range(40)]
    held = next(t for t in texts[5:] if is_heldout(t))
    calls = []
    prefix = tokenizer.encode(self_prompts.user_prefix(tokenizer))

    def sample(rows, max_tokens, temperature):
        assert all(row == prefix for row in rows)
        calls.append(len(rows))
        out = [(tokenizer.encode(t), "unfinished" not in t) for t in texts[:len(rows)]]
        del texts[:len(rows)]
        return out

    got = self_prompts.write_questions(sample, tokenizer, rows=45, batch=20, seed=0, openers=("",), banned=frozenset(
        ["What is the best way to learn the guitar as an adult?"]))
    written = [p.text for p in got]
    assert calls == [20, 20, 5] and all(p.kind == "chat" and p.key == p.text for p in got)
    assert sum("poem" in t for t in written) == 1 and not any("unfinished" in t or "guitar" in t for t in written)
    assert held not in written and not any(is_heldout(t) for t in written)
    assert len(written) == len(set(written)) >= 30
