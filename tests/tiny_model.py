"""Shared offline helpers: a real byte-level BPE tokenizer trained on the fly, and a tiny random
Qwen2 model built from a config, so tests exercise real tokenization and real generation without
a model hub.

``make_tokenizer()`` is cached (training takes ~0.1 s); it returns a
``transformers.PreTrainedTokenizerFast`` with Qwen-style special tokens and a ChatML chat template.
Byte-level BPE means every string round-trips (``decode(encode(s)) == s``), while merges make
``encode(a) + encode(b) != encode(a + b)`` common — which is exactly what the token-accounting
tests need.
"""
from __future__ import annotations

import functools
from typing import Any, List

SPECIAL_TOKENS: List[str] = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<tool_call>', '</tool_call>',
                             '<tool_response>', '</tool_response>', '<think>', '</think>']

_CORPUS = [
    'The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10 42 100 1000',
    'Thought: I need to compute this. Action: calculator Action Input: {"expression": "2 + 3 * 4"}',
    'Observation: 14. Final Answer: 14. The answer is \\boxed{14}. <answer>14</answer>',
    '{"name": "calculator", "arguments": {"expression": "(1 + 2) * 3"}} {"code": "print(1+1)"}',
    'user assistant system tool higher lower correct guess number between please answer with a',
    'But wait... It seems I made a mistake, let me check again. Is that right? Yes, no.',
    'def main():\n    print("hello world")\n    return 0\n',
]
LLAMA_SPECIAL_TOKENS: List[str] = ['<|end_of_text|>', '<|begin_of_text|>', '<|start_header_id|>', '<|end_header_id|>',
                                   '<|eot_id|>', '<think>', '</think>']
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.lru_cache(maxsize=None)
def make_tokenizer(vocab_size: int = 600, style: str = 'chatml') -> Any:
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) trained on a small built-in corpus.

    ``style='chatml'`` (Qwen2-like: ``<|im_start|>``/``<|im_end|>``, a ChatML template) or
    ``'llama'`` (Llama-3-like: header tokens, ``<|eot_id|>`` as EOS, the bundled ``llama3``
    template, ``<|begin_of_text|>`` as BOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS if style == 'chatml' else LLAMA_SPECIAL_TOKENS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    if style == 'llama':
        from mtflow.backends.conformance import bundled_template

        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token='<|eot_id|>',
            bos_token='<|begin_of_text|>',
            pad_token='<|end_of_text|>',
            additional_special_tokens=LLAMA_SPECIAL_TOKENS[2:4])
        fast.chat_template = bundled_template('llama3')
        return fast
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token='<|im_end|>',
        pad_token='<|endoftext|>',
        additional_special_tokens=SPECIAL_TOKENS[1:2])
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def make_model(tokenizer: Any = None, seed: int = 0, **config: Any) -> Any:
    """A tiny random Qwen2 causal LM (2 layers, hidden 32) sized to ``tokenizer``'s vocabulary."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = tokenizer or make_tokenizer()
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    cfg.update(config)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    model.eval()
    return model
