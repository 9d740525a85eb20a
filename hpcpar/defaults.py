"""Defaults that several layers share: the job schema, the engines' signatures and the benchmarks
refer to these names, so a default is stated once."""

BUCKET_MB = 25.0  # gradient all-reduce bucket size in MiB (PyTorch DDP's default)
MICRO_BATCHES = 1  # micro-batches per step of each dp replica (gradient accumulation or pipeline)
PIPELINE_SCHEDULE = "1f1b"
CHUNKS = 1  # model chunks per pipeline rank (interleaved schedule)
TEXT_CORPUS = "data/stdlib.h5"  # the built-in corpus (the standard library's source), prepared on first use there only
