"""pipepar.hf."""
