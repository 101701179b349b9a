"""Inference: the SGLang-compatible client, the embedded engine that serves the same API, launchers.

Modules import their heavy dependencies themselves; importing this package is free.
See docs/engine.md.
"""
