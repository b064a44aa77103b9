"""What a run records: timed events of each stage and micro-batch, as data (drawn by
:mod:`pipepar.render`)."""
