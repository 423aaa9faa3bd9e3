"""Flax NNX modules for kvjax: mixers and the decoder stack built from a layer plan."""

from kvjax.architectures.decoder import Decoder

__all__ = ["Decoder"]
