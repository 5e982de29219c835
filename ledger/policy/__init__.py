"""Declarative policies: typed models, file loading, presets."""
