"""Hugging Face ``config.json`` files as memplan model specs, torch-free.

``config`` (the translator: Llama-like field names, conventions, errors naming the key),
``families`` (each supported ``model_type``'s own fields, dispatched by ``spec_fields``).
"""
