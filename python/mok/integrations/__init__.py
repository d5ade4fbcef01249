"""Integrations of mok with other libraries (import each explicitly: ``mok.integrations.transformers``)."""
