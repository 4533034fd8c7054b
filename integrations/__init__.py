"""Where the suite's variants plug into other software: not variants themselves, so not in
``variants/``. :mod:`integrations.transformers_backend` registers every variant as a Hugging Face
transformers attention implementation."""
