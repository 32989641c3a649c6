"""One module per ``mtflow`` subcommand, each with ``add_parser(subparsers)`` (which sets
``func=main``) and ``main(args) -> int``. A command reads its flags, calls the library
(``mtflow.run`` and below) and raises :class:`mtflow.core.errors.UserError` for what the user
must fix; ``mtflow/cli.py`` prints that as one line. The library never imports a command."""
