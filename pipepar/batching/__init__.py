"""pipepar.batching."""
