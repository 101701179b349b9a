"""Local models: :mod:`agentrl.models.builder` builds the tiny Qwen3-architecture model and its tokenizer
offline and finds models on disk.
"""
