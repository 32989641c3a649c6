"""Shared test setup. ``tests`` is a package, so pytest puts the repository root on ``sys.path``
and tests can import ``tests.helpers``, ``tests.tiny_model`` and ``benchmarks.reference_loop``."""
import os

# Tests never reach a model hub.
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')

# openai-harmony's gpt-oss vocabulary, written by scripts/harmony_vocab.py (scripts/test.sh runs it): the
# package would otherwise try to download it (tests/declarative/test_family_parsers.py, the harmony cases)
_VOCAB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), '.extras', 'tiktoken')
if os.path.isfile(os.path.join(_VOCAB, 'o200k_base.tiktoken')):
    os.environ.setdefault('TIKTOKEN_ENCODINGS_BASE', _VOCAB)
