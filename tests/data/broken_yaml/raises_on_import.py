"""A module that fails while importing (validate must report it, not crash)."""
raise RuntimeError('this module fails on import')
