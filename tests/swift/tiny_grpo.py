"""A tiny random Qwen2 (a BPE trained on the fly) and eight prompts: what the CPU GRPO step of
``tests/swift/test_grpo_e2e.py`` and docs/swift.md's "Verified on CPU" command train.

    python -m tests.swift.tiny_grpo DIR      # writes DIR/model and DIR/data.jsonl
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Tuple

from tests.tiny_model import make_model, make_tokenizer


def tiny_setup(directory: Path) -> Tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    model = directory / 'model'
    make_model(tok).save_pretrained(model)
    tok.save_pretrained(model)
    data = directory / 'data.jsonl'
    data.write_text(''.join(
        json.dumps({'messages': [{'role': 'user', 'content': f'What is {i} + 2?'}]}) + '\n' for i in range(8)))
    return model, data


if __name__ == '__main__':
    if len(sys.argv) != 2:
        sys.exit('usage: python -m tests.swift.tiny_grpo DIR')
    print(*tiny_setup(Path(sys.argv[1])))
