"""Pass-key prompts: a random key hidden at an exact distance before the question, in a haystack of real
text, as one chat turn; and the rule that counts an answer. Shared by ``qsinkkv-eval recall`` and
``benchmarks/vllm_recall.py`` (the vLLM venv has the core only: this module imports nothing but the
standard library, and needs only a tokenizer).

    prompts = Passkey.of(tokenizer)                          # the turn's fixed pieces, tokenized once
    p = prompts.build(haystack_ids, distance, trial_rng(seed, distance, trial))  # -> Prompt
    correct(answer_text, p.key)

A prompt is, in token ids (each piece tokenized on its own, so every position is known exactly):

    head      the chat template up to the user's text, and the instruction
    lead      LEAD_TOKENS of the haystack (the sinks are ordinary text, never the key)
    key       "\\n\\nThe pass key is 12345. Remember it. 12345 is the pass key.\\n\\n" (the key stated twice)
    filler    the haystack, continuing where the lead stopped, as long as the distance asks
    tail      the question, the end of the user's turn, the assistant's header and "The pass key is"

``distance`` = tokens from the key's first token to the end of the prompt: ``len(ids) - key_pos``,
where ``ids[key_pos]`` is the token holding the first digit of the key's first statement. The last prompt token is at
distance 1; a cache of W recent tokens (no sinks in between) shows the key's first token to the
prompt's last query iff ``distance <= W``.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

LEAD_TOKENS = 64
DIGITS = 5
ANSWER_TOKENS = 8  # greedy tokens decoded after the prompt: a 5-digit key and its punctuation fit
INSTRUCTION = "A pass key is hidden in the text below. Remember it: you will be asked for it.\n\n"
KEY_SENTENCE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key?"
ANSWER_START = "The pass key is"
_PLACEHOLDER = "\x00QSINKKV-TEXT\x00"


@dataclass(frozen=True)
class Prompt:
    ids: list[int]    # the whole prompt
    key_pos: int      # index in ids of the key's first token
    key: str          # the DIGITS digits
    offset: int       # where the lead starts in the haystack

    @property
    def distance(self) -> int:
        return len(self.ids) - self.key_pos


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class Passkey:
    head: list[int]
    tail: list[int]
    tokenizer: object

    @classmethod
    def of(cls, tokenizer) -> Passkey:
        """The fixed pieces, as the tokenizer's chat template frames one user turn (plain text when the
        tokenizer has no template)."""
        if getattr(tokenizer, "chat_template", None):
            turn = tokenizer.apply_chat_template([{"role": "user", "content": _PLACEHOLDER}], tokenize=False,
                                                 add_generation_prompt=True)
            before, found, after = turn.partition(_PLACEHOLDER)
            if not found:
                raise ValueError("the tokenizer's chat template dropped the user's text")
        else:
            before, after = "", "\n"
        return cls(_ids(tokenizer, before + INSTRUCTION), _ids(tokenizer, QUESTION + after + ANSWER_START), tokenizer)

    def key_ids(self, key: str) -> tuple[list[int], int]:
        """The key sentence's tokens and the index of the one holding the key's first digit (found by decoding
        prefixes, so a tokenizer that merges the space with the digit is served as well)."""
        text = KEY_SENTENCE.format(key=key)
        ids, at = _ids(self.tokenizer, text), text.index(key)
        first = next(i for i in range(len(ids)) if len(self.tokenizer.decode(ids[:i + 1])) > at)
        if not self.tokenizer.decode(ids[first:]).lstrip().startswith(key) or \
                self.tokenizer.decode(ids[:first]).rstrip()[-1:].isdigit():
            raise ValueError(f"the tokenizer's tokens do not separate the key {key!r} from the words before it: "
                             "its position would not be exact")
        return ids, first

    def min_distance(self, key: str = "1" * DIGITS) -> int:
        """The shortest distance a prompt can have: the key sentence from its key on, then the tail."""
        ids, first = self.key_ids(key)
        return len(ids) - first + len(self.tail)

    def length(self, distance: int, key: str = "1" * DIGITS) -> int:
        """Tokens of a prompt at ``distance``."""
        return len(self.head) + LEAD_TOKENS + self.key_ids(key)[1] + distance

    def build(self, haystack: list[int], distance: int, rng: random.Random) -> Prompt:
        """A prompt with a fresh key at exactly ``distance`` (module doc), its haystack a random slice of
        ``haystack`` (token ids). Raises ValueError naming what is too short."""
        key = str(rng.randrange(10 ** (DIGITS - 1), 10 ** DIGITS))
        sentence, first = self.key_ids(key)
        lowest = len(sentence) - first + len(self.tail)
        if distance < lowest:
            raise ValueError(f"distance {distance} is shorter than the key and the question ({lowest} tokens)")
        filler = distance - lowest
        need = LEAD_TOKENS + filler
        if need > len(haystack):
            raise ValueError(f"distance {distance} needs {need:,} tokens of text, the text has {len(haystack):,}")
        offset = rng.randrange(0, len(haystack) - need + 1)
        lead, rest = haystack[offset:offset + LEAD_TOKENS], haystack[offset + LEAD_TOKENS:offset + need]
        ids = self.head + list(lead) + sentence + list(rest) + self.tail
        return Prompt(ids, len(self.head) + LEAD_TOKENS + first, key, offset)


def trial_rng(seed: int, distance: int, trial: int) -> random.Random:
    """The randomness of one trial: the same prompt for every configuration and every run of a seed, whatever
    else the run measures (a string seed is hashed the same in every process)."""
    return random.Random(f"qsinkkv-passkey:{seed}:{distance}:{trial}")


def correct(answer: str, key: str) -> bool:
    """The answer contains the key as a whole number (not inside a longer run of digits)."""
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", answer) is not None
