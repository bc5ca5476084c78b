"""Adapters for the frameworks users train with.

``graphed.integrations.lightning`` (PyTorch Lightning) and
``graphed.integrations.transformers`` (the Hugging Face ``Trainer``). Each
imports its framework only when it is imported itself, so graphed never
requires either."""
