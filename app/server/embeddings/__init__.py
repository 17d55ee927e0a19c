"""OpenAI's embeddings API: its schemas, its reply, its route."""
