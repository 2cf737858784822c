"""text-embeddings-inference's API: /embed, /embed_all, /rerank and /predict, in its JSON."""
