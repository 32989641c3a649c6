"""Tools for tool_parameters.yaml: each is called as ``fn(**arguments)``."""


def search(query: str, limit: int = 5) -> str:
    return f'{limit} results for {query}'


def lookup(key, **filters):
    return key
