"""A Hugging Face tokenizer built in-process (no downloads), for tests, benchmarks and quickstarts.

    tok = make_tiny_tokenizer()                        # word-level, with a chat template
    tok = make_tiny_tokenizer(chat_template=False)     # plain text: BOS + words
    tok = make_tiny_tokenizer(kind="bpe", texts=corpus, vocab_size=4000)   # byte-level BPE

Word-level: one token per whitespace/punctuation-separated word, unknown words -> <unk>, so token
counts are easy to predict in tests. With `add_special_tokens=True` a `<s>` is prepended.
The chat template renders `<s>` then `<|role|> content </s>` per message, then `<|assistant|>`
for the generation prompt; each of these markers is a single token.
"""
from __future__ import annotations

from typing import Iterable, Optional

from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers, decoders
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DEFAULT_TEXTS = [
    "Natalia sold clips to 48 of her friends in April , and then she sold half as many in May .",
    "How many clips did Natalia sell altogether in April and May ?",
    "Let's think step by step and output the final answer after \"####\" .",
    "What is the value of x if 2 x + 3 = 7 ? The answer is 2 .",
    "hello world this is a tiny tokenizer for tests",
]


def make_tiny_tokenizer(texts: Optional[Iterable[str]] = None, chat_template: bool = True,
                        kind: str = "wordlevel", vocab_size: int = 2000) -> PreTrainedTokenizerFast:
    texts = list(texts if texts is not None else DEFAULT_TEXTS)
    if kind == "wordlevel":
        splitter = pre_tokenizers.Whitespace()
        words = sorted({w for t in texts for w, _ in splitter.pre_tokenize_str(t)})
        vocab = {tok: i for i, tok in enumerate(SPECIALS + [w for w in words if w not in SPECIALS])}
        core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        core.pre_tokenizer = splitter
    elif kind == "bpe":
        core = Tokenizer(models.BPE(unk_token=None))
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        core.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    else:
        raise ValueError(f"kind={kind!r}: 'wordlevel' or 'bpe'")
    bos = core.token_to_id("<s>")
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[4:]})
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok
