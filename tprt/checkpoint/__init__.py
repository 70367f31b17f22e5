"""TP checkpoints on disk: the format and manifest (`format`), our safetensors reader and writer
(`safetensors_io`), loading a rank's shard into the model (`loading`), atomic file writes (`fsutil`)."""
