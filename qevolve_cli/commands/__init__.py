"""One module per command. Command modules import heavy libraries (torch, transformers) lazily."""
