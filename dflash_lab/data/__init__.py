"""Training data: demo corpus, conversation loading, capture shards (format, writer, reader),
the capture loop and anchor sampling. Kept import-light: import the submodules you need."""
