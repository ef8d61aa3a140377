"""Examples shipped with loom: ``python -m loom.examples.char_gpt`` (or ``loom run -n 4 -m ...``)."""
