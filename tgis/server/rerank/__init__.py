"""The rerank APIs of vLLM, Cohere and Jina (`/v1/rerank`, `/v2/rerank`) and vLLM's `/score`."""
