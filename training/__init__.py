"""Training, data, checkpoints and evaluation for kvjax models (built on `architectures` and `kvjax`)."""
