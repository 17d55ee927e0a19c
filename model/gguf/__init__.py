"""GGUF files: their metadata as a typed value (metadata.py), their tensors under Hugging Face
names (names.py) and served in place (tensors.py), the vocabulary, tokenizer and rope scaling
they imply (vocab.py, tokenizer.py, rope.py), and the conversion into a Hugging Face directory
(convert.py)."""
