"""The local backend: in-process tables, sampling and checkpoints."""
