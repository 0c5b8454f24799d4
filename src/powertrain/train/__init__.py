"""The ``powertrain`` command: train a real model on real data with N workers."""
