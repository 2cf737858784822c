"""Pooling models: embeddings and scores from encoders and decoders, batched like generation.

`spec` reads what a model is for (sentence-transformers' modules and pooling config, else its
architecture); `model` runs a batch through it and pools each row; `runner` gathers requests
into batches on the model's thread.
"""
