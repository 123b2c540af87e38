"""Trainers behind one interface: they get per-token tensors and a loss function, not an algorithm."""
