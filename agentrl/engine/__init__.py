"""Inference: SGLang-compatible client, the embedded engine that serves the same API, weight push, launchers.

Modules import their heavy dependencies themselves; importing this package is free.
See docs/architecture.md ("Inference").
"""
