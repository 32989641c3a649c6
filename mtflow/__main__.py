"""``python -m mtflow``: the same as the ``mtflow`` command."""
import sys

from mtflow.cli import main

sys.exit(main())
