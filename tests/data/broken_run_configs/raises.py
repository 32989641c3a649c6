raise RuntimeError("broken on import")
