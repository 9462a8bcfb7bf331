"""Checkpoint I/O: one file as ddp writes it or a sharded DCP directory, always written atomically."""
