"""A small Qwen-style tokenizer trained here, for the synthetic checkpoints (qwen_serving/checkpoint/synth.py).

Byte-level BPE with Qwen2's pre-tokenizer split, trained with the `tokenizers` library on text
generated below (fixed seed, so every checkpoint gets the same tokenizer and the same token ids).
Qwen's added tokens follow the trained vocabulary in Qwen's own order; as in Qwen, the
markup tags the parsers must see in decoded text (<think>, <tool_call>, ...) are not "special"
(skip_special_tokens keeps them), the turn and vision markers are.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
TRAINED_VOCAB = 3800  # BPE vocabulary before the added tokens
CORPUS_SEED = 20260
MODEL_MAX_LENGTH = 262144

# (content, special) in Qwen's order; ids are TRAINED_VOCAB-relative in the same order as Qwen's
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Qwen3.5's pre-tokenizer split (the one transformers' Qwen3_5Tokenizer rebuilds on load):
# contractions, letter(+mark) runs with one leading non-letter, single digits, punctuation
# runs, newlines, whitespace.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_WORDS = (
    "the of and to in is that it for was on are as with be at by this have from or one had not but "
    "what all were when we there can an your which their said if do will each about how up out them "
    "then she many some so these would other into has more her two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long little "
    "very after words called just where most know get through back much before go good new write our "
    "used me man too any day same right look think also around another came come work three word must "
    "because does part even place well such here take why things help put years different away again "
    "off went old number great tell men say small every found still between name should home big give "
    "air line set own under read last never us left end along while might next sound below saw "
    "something thought both few those always looked show large often together asked house world going "
    "want school important until form food keep children feet land side without boy once animals life "
    "enough took sometimes four head above kind began almost live page got earth need far hand high "
    "year mother light parts country father let night following picture being study second eyes soon "
    "model token server request memory cache layer weight kernel batch prompt answer question result "
    "function value parameter city weather search file path error test data value list string number"
).split()
_NAMES = ("get_weather", "search_web", "read_file", "run_tests", "send_email", "add", "lookup", "convert")
_KEYS = ("city", "query", "path", "unit", "limit", "to", "subject", "body", "a", "b", "lang", "id")
_UNICODE = ("café", "naïve", "über", "straße", "señor", "日本語", "中文", "привет", "λόγος", "😀", "→", "€")


_SYLLABLES = tuple(c + v for c in "bdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ar", "en", "is", "on"))


def _coined_words(rng: random.Random, count: int = 6000) -> list[str]:
    return ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(count)]


def _word(rng: random.Random, coined: list[str]) -> str:
    # half common English, half coined words, skewed so that low indices are far more frequent
    if rng.random() < 0.5:
        return rng.choice(_WORDS)
    return coined[int(len(coined) * rng.random() ** 3)]


def _sentence(rng: random.Random, coined: list[str]) -> str:
    words = [_word(rng, coined) for _ in range(rng.randint(4, 16))]
    if rng.random() < 0.2:
        words[rng.randrange(len(words))] = rng.choice(_UNICODE)
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".....?!:")


def _code(rng: random.Random, coined: list[str]) -> str:
    name, arg = rng.choice(_NAMES), rng.choice(_KEYS)
    lines = [
        f"def {name}({arg}, {rng.choice(_KEYS)}=None):",
        f'    """{_sentence(rng, coined)}"""',
        f"    for i in range({rng.randint(1, 64)}):",
        f"        {arg} = {arg} + i * {rng.randint(2, 9)}",
        f"    return {{'{rng.choice(_KEYS)}': {arg}, \"ok\": True}}",
    ]
    return "\n".join(lines[: rng.randint(2, len(lines))])


def _tool_markup(rng: random.Random, coined: list[str]) -> str:
    params = "".join(
        f"<parameter={rng.choice(_KEYS)}>\n{_word(rng, coined)}\n</parameter>\n" for _ in range(rng.randint(1, 3))
    )
    call = f"<tool_call>\n<function={rng.choice(_NAMES)}>\n{params}</function>\n</tool_call>"
    payload = json.dumps({rng.choice(_KEYS): rng.choice(_WORDS), "n": rng.randint(0, 500)})
    return rng.choice(
        (call, f"<tool_response>\n{payload}\n</tool_response>", f"<think>\n{_sentence(rng, coined)}\n</think>")
    )


def training_corpus(paragraphs: int = 3000, seed: int = CORPUS_SEED) -> list[str]:
    """Deterministic mixed text: prose, Python-like code, JSON, tool-call markup, some non-ASCII."""
    rng = random.Random(seed)
    coined = _coined_words(rng)
    makers = (_sentence, _sentence, _sentence, _code, _tool_markup)
    return ["\n".join(rng.choice(makers)(rng, coined) for _ in range(rng.randint(1, 6))) for _ in range(paragraphs)]


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TRAINED_VOCAB,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != TRAINED_VOCAB:
        raise RuntimeError(f"BPE training stopped at {tokenizer.get_vocab_size()} tokens, want {TRAINED_VOCAB}")
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
    return tokenizer


def special_token_ids() -> dict[str, int]:
    """Added-token content -> id (fixed by TRAINED_VOCAB and ADDED_TOKENS' order)."""
    return {content: TRAINED_VOCAB + i for i, (content, _) in enumerate(ADDED_TOKENS)}


def tokenizer_size() -> int:
    return TRAINED_VOCAB + len(ADDED_TOKENS)


def chat_template() -> str:
    return CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")


def write_tokenizer(out_dir: Path) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json into out_dir; returns the added-token ids."""
    tokenizer = train_tokenizer()
    ids = special_token_ids()
    for content, token_id in ids.items():
        if tokenizer.token_to_id(content) != token_id:
            raise RuntimeError(f"{content} got id {tokenizer.token_to_id(content)}, expected {token_id}")
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[content]): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for content, special in ADDED_TOKENS
        },
        "bos_token": None,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return ids
