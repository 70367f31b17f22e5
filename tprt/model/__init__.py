"""The Llama model itself: its config and TP layout (`config`), RoPE (`rope`), the KV cache its
attention reads and writes (`kv_cache`) and the decoder (`llama`)."""
