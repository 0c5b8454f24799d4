"""Gradient compressors: one interface (:class:`Compressor`), each with its own error feedback."""

from powertrain.compress.base import Compressor, NonFiniteGradientError
from powertrain.compress.powersgd import Config, PowerSGDCompressor

__all__ = ["Compressor", "Config", "NonFiniteGradientError", "PowerSGDCompressor"]
