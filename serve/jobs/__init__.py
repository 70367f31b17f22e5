"""Fine-tuning jobs while serving: the manager, the SQLite store, specs, admission, datasets, disk room."""
