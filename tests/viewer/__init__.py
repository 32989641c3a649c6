"""Tests of the trace viewer: files, terminal, HTML page (in a real browser), pytest plugin, graph SVG."""
