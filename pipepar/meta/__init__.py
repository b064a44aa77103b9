"""pipepar.meta."""
