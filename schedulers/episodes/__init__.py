"""Episode files (scheduler YAMLs with ``roles:``, docs/multi-agent.md) and what they import."""
