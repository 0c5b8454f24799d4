"""Math layer: pure functions on tensors. Nothing in here knows about process groups."""
