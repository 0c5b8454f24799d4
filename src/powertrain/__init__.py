"""powertrain: communication- and memory-efficient distributed training for PyTorch.

Each concept has one home (docs/api-overview.md, "Public API"): ``powertrain.compress`` (compressors,
``make_compressor``), ``powertrain.powersgd`` (the reference-compatible PowerSGD API and its ``Config``),
``powertrain.ddp`` / ``powertrain.fsdp`` / ``powertrain.simple_fsdp`` (where compressors plug in),
``powertrain.rtp`` and ``powertrain.tp`` (tensor parallelism), ``powertrain.optim`` (optimizers),
``powertrain.checkpoint``.
"""

__version__ = "0.1.0"
