"""powertrain: communication- and memory-efficient distributed training for PyTorch."""

from powertrain.comm import CommStats, Communicator
from powertrain.compress import Compressor, NonFiniteGradientError, PowerSGDCompressor
from powertrain.compress.powersgd import Config

__all__ = [
    "CommStats",
    "Communicator",
    "Compressor",
    "Config",
    "NonFiniteGradientError",
    "PowerSGDCompressor",
]
__version__ = "0.1.0"
