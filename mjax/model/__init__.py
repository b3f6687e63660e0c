"""Flax model code: logical axis names only, never a Mesh."""

from mjax.model.transformer import Transformer

__all__ = ['Transformer']
