"""GGUF files: their metadata as a typed value (metadata.py), the tokenizer and rope scaling it
implies (tokenizer.py, rope.py), and the conversion into a Hugging Face directory (convert.py)."""
