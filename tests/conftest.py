"""Shared test setup. ``tests`` is a package, so pytest puts the repository root on ``sys.path``
and tests can import ``tests.helpers``, ``tests.tiny_model`` and ``benchmarks.reference_loop``."""
import os

# Tests never reach a model hub.
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')
