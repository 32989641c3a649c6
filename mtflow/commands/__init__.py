"""One module per ``mtflow`` subcommand: ``add_parser(subparsers)`` sets ``func=main``."""
