"""Fidelity inside a pretrained model: each variant swapped into a real pretrained encoder (no
training), its embeddings compared with the unmodified model's, beside its cost.

``corpus`` (the deterministic English texts) -> ``encoder`` (the shipped model, offline) ->
``fidelity`` (the numbers) -> ``job`` (one record per variant and length).
"""
