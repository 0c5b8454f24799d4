"""Optimizers: Distributed Shampoo (in progress)."""
